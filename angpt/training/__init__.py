"""How a run trains: the trainer and one step, the optimizer and schedule, distributed setup, the adapters
from flags to megatron-core configs, the dry run, checkpointing with its lock and digests, exits and fault
injection. It may import every folder below it (`config`, `data`, `kernels`, `models`, `megatron_compat`,
`telemetry`), and nothing imports it but `angpt.hf`, `angpt.pretrain`, tools, benchmarks and tests.
"""
