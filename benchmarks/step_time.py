#!/usr/bin/env python
"""Training step time of anGPT and nGPT relative to GPT+, measured side by side in one process.

    python benchmarks/step_time.py [--hidden-size 256 --num-layers 4 --seq-length 256 --rounds 10] [--compiled]

With --compiled, every model runs the GPU's code path (the fused chains and RoPE compiled, here for the CPU) and each
family's launches per training step are counted first (angpt.telemetry.launch_count: compiled kernels and aten
operations, forward, backward, optimizer step and projection), with those anGPT launches beyond GPT+'s: on a
GPU each launch is host time, so at small shapes (--hidden-size 64 --seq-length 16) the step times below are
mostly host time too.

Families alternate step by step (GPT+, anGPT, nGPT, GPT+, ...) so that machine noise hits all of them
alike; the median step of each is reported, with the time of the post-step weight projection alone.
The paper reports anGPT at +2.75% and nGPT at +9.6% over GPT+ on 4x A100 (docs/model.md, What the paper
reports); on a CPU the elementwise work weighs more against the matmuls, so expect larger ratios here.
"""

import argparse
import contextlib
import statistics
import time

import torch
import torch.distributed as dist

from angpt import kernels
from angpt.config.sections import RunConfig
from angpt.models import WEIGHT_CONSTRAINTS, model_config
from angpt.models.bounding import project_parameters_
from angpt.telemetry.launch_count import compiled_kernels_profiled, kernel_launches
from angpt.training import distributed
from angpt.training.optimizer import build_optimizer
from angpt.training.step import build_model_chunks, train_step

FAMILIES = ("gptplus", "angpt", "ngpt")


def random_batch(micro_batch_size: int, seq_length: int, vocab_size: int) -> dict:
    """One fixed batch of random tokens (every model steps on the same one)."""
    b, s = micro_batch_size, seq_length
    tokens = torch.randint(0, vocab_size, (b, s + 1), generator=torch.Generator().manual_seed(0))
    return dict(tokens=tokens[:, :-1], labels=tokens[:, 1:], loss_mask=torch.ones(b, s),
                position_ids=torch.arange(s).unsqueeze(0).expand(b, -1))


def interleaved_step_times(models: dict, batch: dict, rounds: int, after_step=None) -> dict:
    """Seconds of each training step of each model {name: (chunks, optimizer, scheduler)}, stepped in turn
    (a, b, c, a, b, c, ...) on `batch` so that machine noise hits all of them alike; the first round warms
    up and is not counted. `after_step(name, chunks, counted)` runs after each step, outside the timing."""
    b, s = batch["tokens"].shape
    times = {name: [] for name in models}
    for round_ in range(rounds + 1):
        for name, (chunks, optimizer, scheduler) in models.items():
            start = time.perf_counter()
            train_step(iter([batch]), chunks, optimizer, scheduler, 1, b, s)
            if round_:
                times[name].append(time.perf_counter() - start)
            if after_step:
                after_step(name, chunks, counted=bool(round_))
    return times


def print_launches(runs: dict, batch: dict, project) -> None:
    """Each family's launches in one training step and projection, compiled (after a step that compiles)."""
    b, s = batch["tokens"].shape
    launches = {}
    with compiled_kernels_profiled():
        for name, (chunks, optimizer, scheduler) in runs.items():
            def step():
                train_step(iter([batch]), chunks, optimizer, scheduler, 1, b, s)
                project(name, chunks, counted=False)

            step()
            launches[name] = kernel_launches(step)
    print("launches per training step, compiled: " + ", ".join(
        f"{name} {sum(counts.values())} ({counts['compiled kernel']} compiled kernels)"
        for name, counts in launches.items()))
    beyond = launches["angpt"] - launches["gptplus"]
    print("anGPT's beyond GPT+'s:", ", ".join(f"{name} +{count}" for name, count in beyond.most_common()) or "none")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--num-attention-heads", type=int, default=4)
    parser.add_argument("--seq-length", type=int, default=256)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--compiled", action="store_true",
                        help="the GPU's code path (compiled chains), with each family's launches per step")
    args = parser.parse_args()

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{distributed.free_port()}", rank=0, world_size=1)
    distributed.initialize()

    b, s, v = args.micro_batch_size, args.seq_length, args.vocab_size
    runs = {}
    for family in FAMILIES:
        config = model_config(family, num_layers=args.num_layers, hidden_size=args.hidden_size,
                              num_attention_heads=args.num_attention_heads, apply_rope_fusion=args.compiled)
        chunks = build_model_chunks(config, v, s)
        optimizer, scheduler = build_optimizer(
            chunks, RunConfig.from_flags(dict(model_family=family, lr=1e-3, train_iters=10 * args.rounds)))
        runs[family] = (chunks, optimizer, scheduler)

    projections = {family: [] for family in FAMILIES if WEIGHT_CONSTRAINTS[family]}

    def project(family, chunks, counted):
        if family in projections:
            start = time.perf_counter()
            project_parameters_(chunks, WEIGHT_CONSTRAINTS[family])
            if counted:
                projections[family].append(time.perf_counter() - start)

    batch = random_batch(b, s, v)
    if args.compiled:
        print_launches(runs, batch, project)
    with kernels.compiled_everywhere() if args.compiled else contextlib.nullcontext():
        steps = interleaved_step_times(runs, batch, args.rounds, after_step=project)
    base = statistics.median(steps["gptplus"])
    print(f"d={args.hidden_size} layers={args.num_layers} seq={s} batch={b} vocab={v}, "
          f"{args.rounds} rounds, {torch.get_num_threads()} threads")
    print(f"{'family':<8} {'median step':>12} {'vs GPT+':>8} {'projection':>11} {'of step':>8}")
    for family in FAMILIES:
        median = statistics.median(steps[family])
        line = f"{family:<8} {median * 1e3:>10.1f}ms {median / base:>8.3f}"
        if family in projections:
            projection = statistics.median(projections[family])
            line += f" {projection * 1e3:>9.2f}ms {projection / median:>8.1%}"
        print(line)
    print("paper (4x A100, 0.5B): anGPT 1.0275, nGPT 1.096 vs GPT+")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
