#!/usr/bin/env python
"""bf16 training with and without --use-distributed-optimizer, and under --use-torch-fsdp2, side by side in one run:
the memory each rank holds for the weights, their gradients and the optimizer's state, beside the dry run's estimate
of it (angpt.training.memory_estimate), and the training step time.

    python benchmarks/sixteen_bit_optimizer.py [--family gptplus --hidden-size 256 --num-layers 4 --rounds 10]
    torchrun --nproc-per-node 2 benchmarks/sixteen_bit_optimizer.py [...] [--output docs/results/memory_dp2.json]

The first runs at data-parallel size 1, the second at 2 (each rank a micro-batch of its own: the same global
batch per rank). Without the distributed optimizer each rank keeps megatron-core's Float16OptimizerWithFloat16Params
whole: bf16 weights (2 bytes a parameter; anGPT's and nGPT's learnable scales stay fp32), fp32 gradients (4,
reduced in fp32 as Megatron-LM's) and an fp32 main copy and Adam's two moments (12). The distributed optimizer
divides the last 12 over the data-parallel ranks. FSDP2 divides all of it: 18 bytes over the ranks (its bf16
gradients, reduce-scattered in the weights' dtype, are freed once the optimizer has copied them into its fp32
gradients, which stay between steps); anGPT's and nGPT's fp32 scales are FSDP2 units of their own
(angpt.megatron_compat.fsdp2). The embeddings are untied, as FSDP2 needs.
Memory is counted from the tensors themselves, after a first
step (Adam's moments exist from then on), each storage once: the distributed optimizer's weights live in one
buffer, its fp32 scales' "main copies" are views of the weights; FSDP2's are this rank's shards, between steps
(what it gathers for a layer's forward and backward is transient, and not counted). The process's resident memory is
not reported: in one process the variant built first pays for torch's and the allocator's one-off growth (the same
108 MiB of tensors grew it by 216 MiB built first, by 68 MiB built second). The variants step in turn on the same
batch, so that machine noise hits all alike; the median step of each is reported, the slowest rank's, with the
ratio to the distributed optimizer's. On the CPU over gloo the step times say little of a GPU's (NCCL overlaps
FSDP2's gathers with compute).
"""

import argparse
import json
import os
import statistics
import sys

from angpt.megatron_compat import quiet_known_warnings

quiet_known_warnings()  # before megatron-core is imported

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from step_time import interleaved_step_times, random_batch  # noqa: E402

from angpt.config.sections import RunConfig  # noqa: E402
from angpt.training import distributed  # noqa: E402
from angpt.training.megatron_configs import ddp_config, transformer_config  # noqa: E402
from angpt.training.memory_estimate import bytes_per_parameter  # noqa: E402
from angpt.training.optimizer import build_optimizer  # noqa: E402
from angpt.training.step import build_model_chunks, train_step  # noqa: E402

# {name: (--use-distributed-optimizer, --use-torch-fsdp2)}
VARIANTS = {"distributed optimizer": (True, False), "without": (False, False), "fsdp2": (False, True)}


def storage_bytes(tensors, exclude: set) -> tuple[int, set]:
    """Bytes of the distinct storages of `tensors` (of this rank's shards of DTensors) not in `exclude`, and those
    storages."""
    seen = {}
    for tensor in tensors:
        storage = (tensor._local_tensor if isinstance(tensor, DTensor) else tensor).untyped_storage()
        if storage.data_ptr() not in exclude:
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values()), set(seen)


def memory(chunks, optimizer) -> dict[str, int]:
    """Bytes this rank holds for the weights, their gradients and the optimizer's state (main copies and moments)."""
    params = [param for chunk in chunks for param in chunk.parameters()]
    weights, counted = storage_bytes(params, set())
    # FSDP2's weights have no main_grad: the 16-bit optimizer frees their .grad once copied into its fp32 copies'.
    grads, grad_storages = storage_bytes([grad for param in params
                                          if (grad := getattr(param, "main_grad", param.grad)) is not None], counted)
    state = []
    for inner in optimizer.chained_optimizers:
        state += [param for group in inner.optimizer.param_groups for param in group["params"]]
        state += [param.grad for group in inner.optimizer.param_groups for param in group["params"]
                  if param.grad is not None]
        state += [value for values in inner.optimizer.state.values() for value in values.values()
                  if isinstance(value, torch.Tensor)]
    optimizer_state, _ = storage_bytes(state, counted | grad_storages)
    return {"weights": weights, "gradients": grads, "optimizer state": optimizer_state}


def build(args, use_distributed_optimizer: bool, use_torch_fsdp2: bool, batch: dict):
    config = RunConfig.from_flags(dict(
        model_family=args.family, lr=1e-3, train_iters=10 * args.rounds, num_layers=args.num_layers,
        hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads, bf16=True,
        use_distributed_optimizer=use_distributed_optimizer, use_torch_fsdp2=use_torch_fsdp2,
        tie_embeddings_and_output_weights=False, untie_embeddings_and_output_weights=True))
    distributed.set_random_seed(1234)
    chunks = build_model_chunks(transformer_config(config), args.vocab_size, args.seq_length, ddp_config(config))
    optimizer, scheduler = build_optimizer(chunks, config)
    b, s = batch["tokens"].shape
    train_step(iter([batch]), chunks, optimizer, scheduler, 1, b, s)
    return chunks, optimizer, scheduler


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", default="gptplus", choices=("angpt", "ngpt", "gptplus", "gpt"))
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--num-attention-heads", type=int, default=4)
    parser.add_argument("--seq-length", type=int, default=256)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--output", help="a JSON file of the table")
    args = parser.parse_args()

    distributed.initialize()  # without torchrun, a one-process group
    dp = parallel_state.get_data_parallel_world_size()
    batch = random_batch(args.micro_batch_size, args.seq_length, args.vocab_size)
    runs = {name: build(args, *flags, batch) for name, flags in VARIANTS.items()}
    held = {name: memory(chunks, optimizer) for name, (chunks, optimizer, _) in runs.items()}
    parameters = sum(param.numel() for chunk in runs["without"][0] for param in chunk.parameters())
    steps = interleaved_step_times(runs, batch, args.rounds)
    medians = {name: torch.tensor(statistics.median(times)) for name, times in steps.items()}
    for median in medians.values():  # the slowest rank's
        dist.all_reduce(median, op=dist.ReduceOp.MAX)
    if dist.get_rank() != 0:
        return
    print(f"{args.family} bf16, {parameters / 1e6:.2f}M parameters, d={args.hidden_size} layers={args.num_layers} "
          f"seq={args.seq_length} micro-batch={args.micro_batch_size} vocab={args.vocab_size}; data-parallel size "
          f"{dp}, {torch.get_num_threads()} threads a rank, {args.rounds} rounds")
    columns = [*held["without"], "total", "dry run", "measured/est", "bytes/param", "median step"]
    print(f"{'per rank':<22}" + "".join(f"{column:>16}" for column in columns))
    rows = {}
    for name, (distributed_optimizer, fsdp2) in VARIANTS.items():
        total = sum(held[name].values())
        estimate = parameters * bytes_per_parameter(True, distributed_optimizer, dp, fsdp2)
        rows[name] = dict(**{key: value / 2**20 for key, value in held[name].items()}, total=total / 2**20,
                          estimate=estimate / 2**20, measured_over_estimate=total / estimate,
                          bytes_per_parameter=total / parameters, median_step_ms=medians[name].item() * 1e3)
        units = ["MiB"] * 5 + ["", "", "ms"]
        print(f"{name:<22}" + "".join(f"{value:>13.2f}{unit:>3}" for value, unit in zip(rows[name].values(), units)))
    for name in rows:
        if name != "distributed optimizer":
            ratios = [rows[name][key] / rows["distributed optimizer"][key] for key in ("total", "median_step_ms")]
            print(f"{name} / distributed optimizer: memory {ratios[0]:.3f}, step time {ratios[1]:.3f}")
    if args.output:
        with open(args.output, "w") as file:
            json.dump(dict(command=" ".join(sys.argv), family=args.family, parameters=parameters, data_parallel=dp,
                           rows=rows), file, indent=1)
        print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
