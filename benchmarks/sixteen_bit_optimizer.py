#!/usr/bin/env python
"""bf16 training with and without --use-distributed-optimizer, side by side in one run: the memory each rank
holds for the weights, their gradients and the optimizer's state, and the training step time.

    python benchmarks/sixteen_bit_optimizer.py [--family angpt --hidden-size 256 --num-layers 4 --rounds 10]
    torchrun --nproc-per-node 2 benchmarks/sixteen_bit_optimizer.py [...]

The first runs at data-parallel size 1, the second at 2 (each rank a micro-batch of its own: the same global
batch per rank). Without the distributed optimizer each rank keeps megatron-core's Float16OptimizerWithFloat16Params
whole: bf16 weights (2 bytes a parameter; anGPT's and nGPT's learnable scales stay fp32), fp32 gradients (4,
reduced in fp32 as Megatron-LM's) and an fp32 main copy and Adam's two moments (12). The distributed optimizer
divides the last 12 over the data-parallel ranks. Memory is counted from the tensors themselves, after a first
step (Adam's moments exist from then on), each storage once: the distributed optimizer's weights live in one
buffer, its fp32 scales' "main copies" are views of the weights. The process's resident memory is not reported: in
one process the variant built first pays for torch's and the allocator's one-off growth (the same 108 MiB of
tensors grew it by 216 MiB built first, by 68 MiB built second). Both variants step in turn (one with, one without,
...) on the same batch, so that machine noise hits both alike; the median step of each is reported, the slowest
rank's, with the ratio without / with.
"""

import argparse
import os
import statistics
import sys

from angpt.megatron_compat import quiet_known_warnings

quiet_known_warnings()  # before megatron-core is imported

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from megatron.core import parallel_state  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from step_time import interleaved_step_times, random_batch  # noqa: E402

from angpt.config.sections import RunConfig  # noqa: E402
from angpt.training import distributed  # noqa: E402
from angpt.training.megatron_configs import ddp_config, transformer_config  # noqa: E402
from angpt.training.optimizer import build_optimizer  # noqa: E402
from angpt.training.step import build_model_chunks, train_step  # noqa: E402

VARIANTS = {"distributed optimizer": True, "without": False}


def storage_bytes(tensors, exclude: set) -> tuple[int, set]:
    """Bytes of the distinct storages of `tensors` not in `exclude`, and those storages."""
    seen = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in exclude:
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values()), set(seen)


def memory(chunks, optimizer) -> dict[str, int]:
    """Bytes this rank holds for the weights, their gradients and the optimizer's state (main copies and moments)."""
    params = [param for chunk in chunks for param in chunk.parameters()]
    weights, counted = storage_bytes(params, set())
    grads, grad_storages = storage_bytes([param.main_grad for param in params], counted)
    state = []
    for inner in optimizer.chained_optimizers:
        state += [param for group in inner.optimizer.param_groups for param in group["params"]]
        state += [value for values in inner.optimizer.state.values() for value in values.values()
                  if isinstance(value, torch.Tensor)]
    optimizer_state, _ = storage_bytes(state, counted | grad_storages)
    return {"weights": weights, "gradients": grads, "optimizer state": optimizer_state}


def build(args, use_distributed_optimizer: bool, batch: dict):
    config = RunConfig.from_flags(dict(
        model_family=args.family, lr=1e-3, train_iters=10 * args.rounds, num_layers=args.num_layers,
        hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads, bf16=True,
        use_distributed_optimizer=use_distributed_optimizer))
    distributed.set_random_seed(1234)
    chunks = build_model_chunks(transformer_config(config), args.vocab_size, args.seq_length, ddp_config(config))
    optimizer, scheduler = build_optimizer(chunks, config)
    b, s = batch["tokens"].shape
    train_step(iter([batch]), chunks, optimizer, scheduler, 1, b, s)
    return chunks, optimizer, scheduler


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", default="angpt", choices=("angpt", "ngpt", "gptplus"))
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--num-attention-heads", type=int, default=4)
    parser.add_argument("--seq-length", type=int, default=256)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()

    distributed.initialize()  # without torchrun, a one-process group
    dp = parallel_state.get_data_parallel_world_size()
    batch = random_batch(args.micro_batch_size, args.seq_length, args.vocab_size)
    runs = {name: build(args, use_distributed_optimizer, batch) for name, use_distributed_optimizer in VARIANTS.items()}
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
    columns = [*held["without"], "total", "bytes/param", "median step"]
    print(f"{'per rank':<22}" + "".join(f"{column:>16}" for column in columns))

    def figures(name):
        total = sum(held[name].values())
        return [*(value / 2**20 for value in held[name].values()), total / 2**20, total / parameters,
                medians[name].item() * 1e3]

    units = ["MiB"] * 4 + ["", "ms"]
    for name in VARIANTS:
        print(f"{name:<22}" + "".join(f"{value:>13.2f}{unit:>3}" for value, unit in zip(figures(name), units)))
    ratios = [a / b for a, b in zip(figures("without"), figures("distributed optimizer"))]
    print(f"{'without / with':<22}" + "".join(f"{ratio:>16.3f}" for ratio in ratios))


if __name__ == "__main__":
    main()
