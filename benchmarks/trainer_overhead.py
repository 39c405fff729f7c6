#!/usr/bin/env python
"""The trainer's overhead over a bare PyTorch loop, then anGPT and nGPT against GPT+, in one process.

    python benchmarks/trainer_overhead.py [--model-family angpt --hidden-size 256 --num-layers 4
        --seq-length 256 --micro-batch-size 4 --num-microbatches 1 --repeats 10] [--skip-families]

1. Trainer versus bare loop, the same model, batch and optimizer math on a gloo world of one:
   - trainer: `build_model_chunks` + `build_optimizer` + `train_step`, the path `angpt.pretrain` takes
     (megatron-core's DDP and forward-backward schedule, its optimizer with grad clipping and the
     post-step weight projection as an optimizer hook, the lr scheduler, the NaN/Inf check);
   - bare loop: the same family and shape built by `build_model` without DDP, started from the trainer's
     weights, `torch.optim.AdamW` with the same lr, betas and eps and no weight decay, then
     `clip_grad_norm_` to the same 1.0, `step()` and the same `project_parameters_`.
   Both take one step on the same fixed in-memory batch per repeat, alternating which goes first
   (A B, B A, ...); the headline is the median of the per-repeat ratios (each pair ran under the same
   load), next to the ratios of the medians and of the minima. Both losses after the first update are
   printed, to show that the two do the same arithmetic and the ratio is the trainer's cost alone.
2. Data loading as the trainer does it, from megatron-core's mock GPTDataset: `--num-workers` DataLoader workers
   reading ahead (Megatron-LM's --num-workers) against reads in the training process (0), each followed by the
   trainer's step, interleaved as above; the micro-batches are the same in both.
3. The three families at that shape through the trainer path, as ratios to GPT+ next to the paper's
   (anGPT +2.75%, nGPT +9.6% on 4x A100): `benchmarks/step_time.py`, run here with the same shape.
4. The run diagnostics (`--diagnostics-only` runs this part alone), each against the trainer's step with none of
   them, interleaved as above on the same model: at their defaults (megatron-core's Timers at level 0 in the
   configs, the straggler timer off: what every run pays), megatron-core's timers at levels 1 and 2 (with their
   gather over the ranks at every step, the cost of --log-interval 1), --log-straggler (its timer and gather at
   every step), and the PyTorch profiler's range (--profile --use-pytorch-profiler); then what a logged iteration
   adds with --log-params-norm and --log-num-zeros-in-grad, and the per-step cost of the off paths alone (the
   straggler timer's context, a timer above the level, --hang-timeout-minutes' re-arming), timed a million times.
5. megatron-core's rerun state machine (angpt/training/rerun.py) through the trainer path, with the flags of
   each row (their DDP grad checks and loss checks), interleaved as above, as ratios to --rerun-mode disabled:
   its default (validate_results: NaN/Inf checks of each micro-batch loss and the local grads, one all-reduce
   and one RNG state a step), all its checks on, and report_stats (every step run twice). No check fails.

On this 2-core CPU the defaults take about two minutes.
"""

import argparse
import contextlib
import functools
import logging
import os
import statistics
import sys
import time
import timeit

import step_time  # the sibling benchmarks/step_time.py (this script's directory is on sys.path)
import torch
import torch.distributed as dist
from megatron.core import parallel_state, rerun_state_machine
from megatron.core import timers as megatron_timers
from megatron.core.timers import Timers
from megatron.core.utils import get_model_config

from angpt.config.arguments import parse_args as parse_pretrain_args
from angpt.config.sections import DataSection, RunConfig
from angpt.data.gpt_datasets import TrainingBatches, build_datasets, dataset_vocabulary
from angpt.models import WEIGHT_CONSTRAINTS, build_model, model_config
from angpt.models.bounding import project_parameters_
from angpt.telemetry.hang_watchdog import HangWatchdog
from angpt.telemetry.health import params_l2_norm
from angpt.telemetry.stragglers import FORWARD_TIMER, ForwardTimer, StragglerReport
from angpt.telemetry.timers import per_step_ms
from angpt.training import distributed, rerun
from angpt.training.megatron_configs import ddp_config
from angpt.training.optimizer import build_optimizer
from angpt.training.step import build_model_chunks, train_step


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-family", choices=("angpt", "gptplus", "ngpt"), default="angpt",
                        help="family of the trainer-versus-bare-loop comparison")
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--num-attention-heads", type=int, default=4)
    parser.add_argument("--seq-length", type=int, default=256)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--num-microbatches", type=int, default=1, help="gradient accumulation per step")
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--repeats", type=int, default=10, help="timed steps of each (after one warm-up)")
    parser.add_argument("--num-workers", type=int, default=2, help="DataLoader workers of part 2, against 0")
    parser.add_argument("--skip-families", action="store_true", help="only parts 1, 2 and 4")
    parser.add_argument("--diagnostics-only", action="store_true", help="only part 4 (the run diagnostics)")
    parser.add_argument("--diagnostics-repeats", type=int, default=20, help="timed steps of each diagnostic")
    return parser.parse_args()


def optimizer_flags(args) -> RunConfig:
    """The optimizer of both paths: no warm-up (GPT+'s recipe has one) and many iterations, so that the lr stays
    at --lr for the few steps measured here, as in the bare loop; no weight decay in either."""
    return RunConfig.from_flags(dict(model_family=args.model_family, lr=args.lr, train_iters=1_000_000,
                                     weight_decay=0.0, lr_warmup_iters=0))


def fixed_batches(args) -> list[dict]:
    """`--num-microbatches` micro-batches of random tokens, the same for every step of both paths."""
    b, s = args.micro_batch_size, args.seq_length
    generator = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(args.num_microbatches):
        tokens = torch.randint(0, args.vocab_size, (b, s + 1), generator=generator)
        batches.append(dict(tokens=tokens[:, :-1], labels=tokens[:, 1:], loss_mask=torch.ones(b, s),
                            position_ids=torch.arange(s).unsqueeze(0).expand(b, -1)))
    return batches


class TrainerPath:
    """What `angpt.training.trainer.Trainer.train_one_step` runs, without data loading and logging."""

    def __init__(self, args, config):
        self.args = args
        self.chunks = build_model_chunks(config, args.vocab_size, args.seq_length)
        self.optimizer, self.scheduler = build_optimizer(self.chunks, optimizer_flags(args))

    def step(self, batches, timers=None) -> float:
        loss, _, _ = train_step(iter(batches), self.chunks, self.optimizer, self.scheduler, len(batches),
                                self.args.micro_batch_size, self.args.seq_length, timers=timers)
        return loss

    def use_timers(self, timers) -> None:
        """megatron-core's Timers in the configs of the model and the optimizer, as the trainer sets them."""
        for config in [get_model_config(self.chunks[0]),
                       *(inner.config for inner in getattr(self.optimizer, "chained_optimizers", [self.optimizer]))]:
            config.timers = timers


class BarePath:
    """The same model and update in plain PyTorch: forward, backward, clip, AdamW, projection."""

    def __init__(self, args, config, weights: dict, clip_grad: float, betas: tuple, eps: float):
        self.model = build_model(config, args.vocab_size, args.seq_length)
        self.model.load_state_dict(weights)
        self.constraint = WEIGHT_CONSTRAINTS[args.model_family]
        self.clip_grad = clip_grad
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=args.lr, betas=betas, eps=eps,
                                           weight_decay=0.0)

    def step(self, batches) -> float:
        self.optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for batch in batches:
            per_token = self.model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
            mask = batch["loss_mask"]
            loss = (per_token.float() * mask).sum() / mask.sum()
            (loss / len(batches)).backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip_grad)
        self.optimizer.step()
        if self.constraint is not None:
            project_parameters_([self.model], self.constraint)
        return total / len(batches)


def measure_overhead(args) -> None:
    shape = dict(num_layers=args.num_layers, hidden_size=args.hidden_size,
                 num_attention_heads=args.num_attention_heads)
    trainer = TrainerPath(args, model_config(args.model_family, **shape))
    adam = trainer.optimizer.config
    bare = BarePath(args, model_config(args.model_family, **shape), trainer.chunks[0].module.state_dict(),
                    adam.clip_grad, (adam.adam_beta1, adam.adam_beta2), adam.adam_eps)
    paths = {"bare PyTorch loop": bare, "trainer (train_step)": trainer}
    batches = fixed_batches(args)

    times = {name: [] for name in paths}
    losses = {name: [] for name in paths}
    for repeat in range(args.repeats + 1):  # repeat 0 warms up
        order = list(paths) if repeat % 2 == 0 else list(reversed(paths))
        for name in order:
            start = time.perf_counter()
            losses[name].append(paths[name].step(batches))
            elapsed = time.perf_counter() - start
            if repeat:
                times[name].append(elapsed)

    b, s = args.micro_batch_size, args.seq_length
    print(f"trainer overhead: {args.model_family} d={args.hidden_size} layers={args.num_layers} "
          f"heads={args.num_attention_heads} seq={s} micro-batch={b} x {args.num_microbatches} "
          f"vocab={args.vocab_size}, {args.repeats} repeats interleaved, {torch.get_num_threads()} threads, "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    base = statistics.median(times["bare PyTorch loop"])
    print(f"{'path':<22} {'median step':>12} {'min':>9} {'max':>9} {'vs bare':>8}")
    for name, samples in times.items():
        median = statistics.median(samples)
        print(f"{name:<22} {median * 1e3:>10.1f}ms {min(samples) * 1e3:>7.1f}ms {max(samples) * 1e3:>7.1f}ms "
              f"{median / base:>8.3f}")
    trainer_losses, bare_losses = losses["trainer (train_step)"], losses["bare PyTorch loop"]
    print(f"same math: loss at step 1 trainer {trainer_losses[0]:.6f} bare {bare_losses[0]:.6f}; "
          f"after the first update trainer {trainer_losses[1]:.6f} bare {bare_losses[1]:.6f}")
    # Each repeat times the two back to back, so their ratio sees the same load on a shared machine.
    paired = [t / b for t, b in zip(times["trainer (train_step)"], times["bare PyTorch loop"])]
    ratio_of_minima = min(times["trainer (train_step)"]) / min(times["bare PyTorch loop"])
    print(f"trainer / bare loop: {statistics.median(paired):.3f} (median of {len(paired)} paired ratios; "
          f"ratio of medians {statistics.median(times['trainer (train_step)']) / base:.3f}, "
          f"of minima {ratio_of_minima:.3f})")
    spread = max(max(t) / min(t) for t in times.values())
    if spread > 1.5:
        print(f"noisy: the slowest step took {spread:.1f}x the fastest of the same path; rerun on a quieter machine")


def measure_data_loading(args) -> None:
    """Part 2: --num-workers against reads in this process, each batch then trained on."""
    config = model_config(args.model_family, num_layers=args.num_layers, hidden_size=args.hidden_size,
                          num_attention_heads=args.num_attention_heads)
    trainer = TrainerPath(args, config)
    data = DataSection(mock_data=True, vocab_size=args.vocab_size)
    samples = (args.repeats + 1) * 2 * args.num_microbatches * args.micro_batch_size
    train, _, _ = build_datasets(data, dataset_vocabulary(data), args.seq_length, 1234, [samples, 0, 0])
    loaders = {f"{workers} workers": TrainingBatches(train, 0, args.micro_batch_size, 0, 1, workers, args.vocab_size)
               for workers in (0, args.num_workers)}
    times = {name: [] for name in loaders}
    for repeat in range(args.repeats + 1):  # repeat 0 warms up (and starts the workers)
        for name in list(loaders) if repeat % 2 == 0 else list(reversed(loaders)):
            start = time.perf_counter()
            trainer.step(loaders[name].take(args.num_microbatches))
            if repeat:
                times[name].append(time.perf_counter() - start)
    for loader in loaders.values():
        loader.close()
    inline, ahead = times.values()
    paired = [a / i for a, i in zip(ahead, inline)]
    print(f"\ndata loading (mock GPTDataset, micro-batch {args.micro_batch_size} x {args.num_microbatches}), "
          f"step including the reads: 0 workers {statistics.median(inline) * 1e3:.1f} ms, {args.num_workers} "
          f"workers {statistics.median(ahead) * 1e3:.1f} ms; {args.num_workers} workers / 0: "
          f"{statistics.median(paired):.3f} (median of {len(paired)} paired ratios)")


class Diagnostic:
    """One way of running the trainer's step: `before` sets it up, `after` runs what it adds after the step."""

    def __init__(self, name, timers=None, straggler=False, profiler=False):
        self.name, self.level, self.straggler, self.profiler = name, timers, straggler, profiler
        self.timers = None if timers is None else Timers(timers, "minmax")
        self.report = None

    def step(self, trainer, batches) -> None:
        trainer.use_timers(self.timers)
        FORWARD_TIMER.enabled = self.straggler
        if self.straggler and self.report is None:
            self.report = StragglerReport(1, 0, 0, 1, 65535, enabled=True)
        if self.profiler:
            with torch.profiler.profile(record_shapes=True, with_stack=True):
                trainer.step(batches, self.timers)
        else:
            trainer.step(batches, self.timers)
        if self.level:
            per_step_ms(self.timers, 1)  # the gather of every --log-interval, here at every step
        if self.straggler:
            self.report.gather(1)
        FORWARD_TIMER.enabled = False


@contextlib.contextmanager
def time_inside(methods):
    """The CPU time of this thread spent inside `methods` ([(class, name)]) while the block runs, in seconds, by
    the name of the outermost one called (calls nested in one another counted once), in the dict it yields."""
    spent, depth = {}, [0]

    def timed(method):
        @functools.wraps(method)
        def wrapper(*args, **kwargs):
            depth[0] += 1
            start = time.thread_time()
            try:
                return method(*args, **kwargs)
            finally:
                depth[0] -= 1
                if not depth[0]:
                    spent[method.__name__] = spent.get(method.__name__, 0.0) + time.thread_time() - start
        return wrapper

    originals = [(owner, name, getattr(owner, name)) for owner, name in methods]
    for owner, name, method in originals:
        setattr(owner, name, timed(method))
    try:
        yield spent
    finally:
        for owner, name, method in originals:
            setattr(owner, name, method)


def per_call_us(statement, number: int = 1_000_000) -> float:
    """CPU microseconds of this thread per call, the least of 3 repeats."""
    return min(timeit.repeat(statement, number=number, repeat=3, timer=time.thread_time)) / number * 1e6


def measure_diagnostics(args) -> None:
    """Part 4: each diagnostic's cost, off and on, as the median of paired ratios to the step without any."""
    config = model_config(args.model_family, num_layers=args.num_layers, hidden_size=args.hidden_size,
                          num_attention_heads=args.num_attention_heads)
    trainer = TrainerPath(args, config)
    batches = fixed_batches(args)
    diagnostics = [Diagnostic("none"), Diagnostic("defaults (all off)", timers=0),
                   Diagnostic("--timing-log-level 1", timers=1), Diagnostic("--timing-log-level 2", timers=2),
                   Diagnostic("--log-straggler", timers=0, straggler=True),
                   Diagnostic("PyTorch profiler range", timers=0, profiler=True)]
    # One torch thread, and the CPU time of this (the training) thread as well as the wall time: on a shared
    # machine the wall time is mostly the wait for a core, the CPU time the work done.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    cpu = {diagnostic.name: [] for diagnostic in diagnostics}
    wall = {diagnostic.name: [] for diagnostic in diagnostics}
    for repeat in range(args.diagnostics_repeats + 1):  # repeat 0 warms up
        # Each in turn, the order rotated every repeat, so that none always follows the same one.
        shift = repeat % len(diagnostics)
        for diagnostic in diagnostics[shift:] + diagnostics[:shift]:
            start, start_cpu = time.perf_counter(), time.thread_time()
            diagnostic.step(trainer, batches)
            if repeat:
                cpu[diagnostic.name].append(time.thread_time() - start_cpu)
                wall[diagnostic.name].append(time.perf_counter() - start)
    # Then the time spent inside each diagnostic's own code during a step, measured directly (the paired ratios
    # above cannot resolve 1% on a shared machine): megatron-core's Timer.start/stop (their barriers included),
    # the lookup of each timer and the gather over the ranks; the straggler timer's context and its gather.
    inside = {}
    for diagnostic in diagnostics[2:5]:
        with time_inside([(megatron_timers.Timer, "start"), (megatron_timers.Timer, "stop"),
                          (megatron_timers.Timers, "__call__"), (megatron_timers.Timers, "_get_elapsed_time_all_ranks"),
                          (ForwardTimer, "__enter__"),
                          (ForwardTimer, "__exit__"), (StragglerReport, "gather")]) as spent:
            for _ in range(args.diagnostics_repeats):
                diagnostic.step(trainer, batches)
        gather = spent.pop("_get_elapsed_time_all_ranks", 0.0) + spent.pop("gather", 0.0)
        inside[diagnostic.name] = (sum(spent.values()) / args.diagnostics_repeats, gather / args.diagnostics_repeats)
    trainer.use_timers(None)
    FORWARD_TIMER.close()
    step_ms = statistics.median(cpu["none"]) * 1e3
    print(f"\nrun diagnostics: {args.model_family} d={args.hidden_size} layers={args.num_layers} "
          f"seq={args.seq_length} micro-batch={args.micro_batch_size} x {args.num_microbatches}, one torch thread, "
          f"{args.diagnostics_repeats} repeats interleaved, load average {os.getloadavg()[0]:.1f} on "
          f"{os.cpu_count()} CPUs; vs none: the median of the paired ratios (10th-90th percentile)")
    print(f"{'diagnostic':<26} {'CPU ms':>8} {'vs none':>8} {'(10-90%)':>13} {'wall ms':>9} {'vs none':>8}")
    for name in cpu:
        ratios = []
        for times in (cpu, wall):
            paired = sorted(t / b for t, b in zip(times[name], times["none"]))
            ratios.append((statistics.median(paired), paired[len(paired) // 10], paired[-1 - len(paired) // 10]))
        (cpu_ratio, low, high), (wall_ratio, _, _) = ratios
        print(f"{name:<26} {statistics.median(cpu[name]) * 1e3:>8.1f} {cpu_ratio:>8.4f} {low:>6.3f}-{high:.3f} "
              f"{statistics.median(wall[name]) * 1e3:>9.1f} {wall_ratio:>8.4f}")
    for name, (seconds, gather) in inside.items():
        print(f"inside {name}'s code: {seconds * 1e3:.3f} ms CPU a step ({100 * seconds * 1e3 / step_ms:.3f}% of "
              f"a step), and its gather over the ranks {gather * 1e3:.3f} ms a logged iteration "
              f"({100 * gather * 1e3 / step_ms:.3f}%)")
    # What a logged iteration adds, and the off paths alone (per call, then per step at this shape).
    norm_ms = per_call_us(lambda: params_l2_norm(trainer.chunks), number=5) / 1e3
    zeros_ms = per_call_us(trainer.optimizer.count_zeros, number=5) / 1e3
    print(f"per logged iteration: --log-params-norm {norm_ms:.2f} ms ({100 * norm_ms / step_ms:.2f}% of a step), "
          f"--log-num-zeros-in-grad {zeros_ms:.2f} ms ({100 * zeros_ms / step_ms:.2f}%)")
    off_timers = Timers(0, "minmax")
    timer_us = per_call_us(lambda: off_timers("forward-backward", log_level=1).start())
    context_us = per_call_us(lambda: FORWARD_TIMER.__enter__() and FORWARD_TIMER.__exit__(None, None, None))
    watchdog = HangWatchdog(600, "rank 0")
    rearm_us = per_call_us(lambda: watchdog.arm(1), number=100_000)
    watchdog.close()
    torch.set_num_threads(threads)
    micro = args.num_microbatches
    print(f"off paths: a timer above the level {timer_us:.3f} us a call; the straggler timer's context (off) "
          f"{context_us:.3f} us a micro-batch ({100 * context_us * micro / (step_ms * 1e3):.5f}% of a step); "
          f"--hang-timeout-minutes' re-arming {rearm_us:.2f} us an iteration "
          f"({100 * rearm_us / (step_ms * 1e3):.5f}%)")


RERUN_ROWS = {
    "--rerun-mode disabled": ["--rerun-mode", "disabled"],
    "default (validate_results)": [],
    "+ spiky loss, large grads": ["--check-for-spiky-loss", "--check-for-large-grads"],
    "--rerun-mode report_stats": ["--rerun-mode", "report_stats"],
}


def measure_rerun_machine(args) -> None:
    """Part 5: the rerun state machine's modes and checks, each row on its own model (its DDP checks its grads)."""
    logging.getLogger("megatron.core.rerun_state_machine").setLevel(logging.ERROR)  # set_mode warns each step
    shape = ["--num-layers", str(args.num_layers), "--hidden-size", str(args.hidden_size), "--num-attention-heads",
             str(args.num_attention_heads), "--seq-length", str(args.seq_length), "--micro-batch-size",
             str(args.micro_batch_size), "--global-batch-size", str(args.micro_batch_size * args.num_microbatches),
             "--mock-data", "--vocab-size", str(args.vocab_size), "--train-iters", "1", "--model-family",
             args.model_family]
    config = model_config(args.model_family, num_layers=args.num_layers, hidden_size=args.hidden_size,
                          num_attention_heads=args.num_attention_heads)
    rows = {}
    for name, flags in RERUN_ROWS.items():
        run_config = parse_pretrain_args([*shape, *flags], world_size=1)
        chunks = build_model_chunks(config, args.vocab_size, args.seq_length, ddp_config(run_config))
        optimizer, scheduler = build_optimizer(chunks, optimizer_flags(args))
        rows[name] = (chunks, optimizer, scheduler, rerun.checks(run_config.rerun),
                      rerun.MODES[run_config.rerun.rerun_mode])
    rerun.initialize(run_config.rerun, 0)
    machine = rerun_state_machine.get_rerun_state_machine()
    batches = fixed_batches(args)
    times = {name: [] for name in rows}
    for repeat in range(args.repeats + 1):  # repeat 0 warms up (and the machine checks from its second step)
        for name in list(rows) if repeat % 2 == 0 else list(reversed(rows)):
            chunks, optimizer, scheduler, checks, mode = rows[name]
            machine.set_mode(mode)
            start = time.perf_counter()
            train_step(iter(batches), chunks, optimizer, scheduler, len(batches), args.micro_batch_size,
                       args.seq_length, checks=checks)
            if repeat:
                times[name].append(time.perf_counter() - start)
    base = times["--rerun-mode disabled"]
    print(f"\nrerun state machine ({args.num_microbatches} micro-batches a step), {args.repeats} repeats interleaved:")
    print(f"{'flags':<28} {'median step':>12} {'vs disabled':>12} {'machine alone':>14}")
    for name, samples in times.items():
        paired = statistics.median(t / b for t, b in zip(samples, base))
        _, _, _, checks, mode = rows[name]
        print(f"{name:<28} {statistics.median(samples) * 1e3:>10.1f}ms {paired:>12.3f} "
              f"{machine_alone(machine, mode, checks, args.num_microbatches) * 1e6:>12.0f}us")
    rerun_state_machine.destroy_rerun_state_machine()


def machine_alone(machine, mode, checks, micro_batches: int, steps: int = 200) -> float:
    """Seconds a step that the machine's bookkeeping and loss checks take without a model (the median of
    `steps`): its loop, the replayable iterators and the checks of `micro_batches` finite losses. The grad checks
    (a norm of each DDP bucket) are in the rows' steps, not here."""
    machine.set_mode(mode)
    loss, durations = torch.tensor(3.0), []
    for _ in range(steps):
        start = time.perf_counter()
        iterator = rerun.replayable(iter(range(micro_batches)))
        while machine.should_run_forward_backward(iterator):
            for _ in range(micro_batches):
                next(iterator)
                rerun.validate_loss(loss, checks)
        rerun.exit_if_asked()
        durations.append(time.perf_counter() - start)
    return statistics.median(durations)


def main():
    args = parse_args()
    distributed.initialize()  # a gloo (or NCCL) world of one process without torchrun
    try:
        if not args.diagnostics_only:
            measure_overhead(args)
            measure_data_loading(args)
            measure_rerun_machine(args)
        measure_diagnostics(args)
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
    if args.skip_families or args.diagnostics_only:
        return
    # The families through the trainer path: step_time.py measures exactly that; run it at this shape.
    print()
    argv = sys.argv
    sys.argv = [step_time.__file__, "--hidden-size", str(args.hidden_size), "--num-layers", str(args.num_layers),
                "--num-attention-heads", str(args.num_attention_heads), "--seq-length", str(args.seq_length),
                "--micro-batch-size", str(args.micro_batch_size), "--vocab-size", str(args.vocab_size),
                "--rounds", str(args.repeats)]
    try:
        step_time.main()
    finally:
        sys.argv = argv


if __name__ == "__main__":
    main()
