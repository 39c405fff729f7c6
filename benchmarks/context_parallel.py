#!/usr/bin/env python
"""Context parallelism (--context-parallel-size, all_gather on the local spec) against CP 1 on the CPU: the
largest loss and gradient differences of one step (fp32), and the step-time ratio, in one torchrun job.

    torchrun --nproc-per-node 4 benchmarks/context_parallel.py [--family angpt --seq-length 256 --rounds 3]

The world stays the same and so does the global batch (one sequence per process): CP 1 runs 4 data-parallel
ranks of 1 sequence, CP 2 two of 2 half-sequences, CP 4 one of 4 quarter-sequences, so every process computes
the same number of tokens and the ratio is what context parallelism costs (the all-gathered keys and values,
each chunk's attention, the extra collectives). Layouts take turns in blocks (1, 2, 4, 1, 2, 4, ...: the
process groups are rebuilt for each), so that machine noise hits all of them alike; the median step of each
is reported. Each block starts from the same weights and first takes one step on the same batch, whose loss
and gradients are compared with CP 1's. On a CPU this says little about a GPU, where the point of context
parallelism is the activation memory of long sequences and the all-gather overlaps with compute.
"""

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from angpt.config.sections import RunConfig
from angpt.models import model_config
from angpt.training import distributed
from angpt.training.optimizer import build_optimizer
from angpt.training.step import build_model_chunks, train_step

LAYOUTS = (1, 2, 4)


def global_batch(world: int, seq_length: int, vocab_size: int) -> list[dict]:
    """One sequence of random tokens per process, the same on every process."""
    tokens = torch.randint(0, vocab_size, (world, seq_length + 1), generator=torch.Generator().manual_seed(0))
    return [dict(tokens=tokens[i:i + 1, :-1], labels=tokens[i:i + 1, 1:], loss_mask=torch.ones(1, seq_length),
                 position_ids=torch.arange(seq_length).unsqueeze(0)) for i in range(world)]


def block(cp: int, args, init: dict | None, steps: int):
    """(weights at the start, loss and gradients of the first step, times of the next `steps` steps) at CP cp."""
    world = dist.get_world_size()
    distributed.initialize(context_parallel_size=cp, seed=1234)
    config = model_config(args.family, num_layers=args.num_layers, hidden_size=args.hidden_size,
                          num_attention_heads=args.num_attention_heads, context_parallel_size=cp,
                          cp_comm_type="all_gather")
    chunks = build_model_chunks(config, args.vocab_size, args.seq_length)
    model = chunks[0].module
    if init is None:
        init = {name: param.detach().clone() for name, param in model.named_parameters()}
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(init[name])
    optimizer, scheduler = build_optimizer(
        chunks, RunConfig.from_flags(dict(model_family=args.family, lr=1e-3, train_iters=steps + 1, clip_grad=0.0)))
    dp, dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    batch = global_batch(world, args.seq_length, args.vocab_size)[dp_rank::dp]
    merged = {key: torch.cat([sample[key] for sample in batch]) for key in batch[0]}
    b, s = merged["tokens"].shape

    loss, _, _ = train_step(iter([merged]), chunks, optimizer, scheduler, 1, b, s)
    grads = {name: param.main_grad.detach().clone() for name, param in model.named_parameters()}
    times = []
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        train_step(iter([merged]), chunks, optimizer, scheduler, 1, b, s)
        times.append(time.perf_counter() - start)
    parallel_state.destroy_model_parallel()
    return init, loss, grads, times


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", default="angpt", choices=("angpt", "gptplus", "ngpt"))
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--num-attention-heads", type=int, default=4)
    parser.add_argument("--seq-length", type=int, default=256)
    parser.add_argument("--vocab-size", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per block")
    args = parser.parse_args()
    distributed.initialize()  # joins the torchrun job
    parallel_state.destroy_model_parallel()
    world = dist.get_world_size()
    layouts = [cp for cp in LAYOUTS if world % cp == 0 and args.seq_length % (2 * cp) == 0]

    init, reference, differences, times = None, {}, {}, {cp: [] for cp in layouts}
    for round_ in range(args.rounds):
        for cp in layouts:
            init, loss, grads, block_times = block(cp, args, init, args.steps)
            times[cp] += block_times
            if round_ == 0:
                if cp == 1:
                    reference = dict(loss=loss, grads=grads)
                else:
                    differences[cp] = (
                        abs(loss - reference["loss"]),
                        max((grads[k] - reference["grads"][k]).abs().max().item() for k in grads),
                        max(reference["grads"][k].abs().max().item() for k in grads),
                    )
    if dist.get_rank() == 0:
        base = statistics.median(times[1])
        print(f"{args.family}: d={args.hidden_size} layers={args.num_layers} seq={args.seq_length} "
              f"vocab={args.vocab_size}, {world} processes, one sequence each, {args.rounds} rounds x "
              f"{args.steps} steps, {torch.get_num_threads()} threads per process; loss {reference['loss']:.6f}")
        print(f"{'layout':<14} {'median step':>12} {'vs CP 1':>8} {'|loss diff|':>12} {'max |grad diff|':>16} "
              f"{'(max |grad|)':>13}")
        for cp in layouts:
            median = statistics.median(times[cp])
            line = f"CP {cp} x DP {world // cp:<6} {median * 1e3:>10.1f}ms {median / base:>8.3f}"
            if cp in differences:
                loss_diff, grad_diff, grad_max = differences[cp]
                line += f" {loss_diff:>12.2e} {grad_diff:>16.2e} {grad_max:>13.2e}"
            print(line)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
