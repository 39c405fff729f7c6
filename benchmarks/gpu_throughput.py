#!/usr/bin/env python
"""Tokens per second per GPU, model FLOPs utilisation, peak memory and how busy the GPU is, for the 0.5B and
1B shapes on one GPU, per micro-batch size, for one micro-batch per step and for a global batch.

    python benchmarks/gpu_throughput.py [--shapes 0.5b 1b] [--families gptplus angpt ngpt]
        [--precisions bf16 fp8] [--micro-batch-size 4 8 16] [--global-batch-size 128] [--steps 10]
        [--kernels on off] [--variant NAME=PRETRAIN_FLAGS ...] [--json out.json] [--markdown out.md]

Each model is built as `angpt.pretrain` builds it from its flags (BF16 with the distributed optimizer,
megatron-core's DDP and schedule, the family's optimizer and post-step weight projection, context 2048,
GPT-2's vocabulary padded to 50304, core attention through FlashAttention) and trained on a fixed random
batch. One model per (shape, family, precision, variant) is measured at every micro-batch size in turn:
steps of one micro-batch, then (with --global-batch-size) optimizer steps over the global batch, the
micro-batches accumulated as the trainer does. All of it runs in one process, so that families and variants
compare on one GPU state (two machines gave the same GPT+ run 116.5 and 141.6 ms). The fused kernels
(nu-scaled SwiGLU, bounded-weight projection) are switched on and off step by step in the same model
(`--kernels`). A variant adds `angpt.pretrain` flags to every model it builds (`--variant
fused="--cross-entropy-loss-fusion"`); the default is one variant without extra flags. FP8 rows (Transformer
Engine, `--transformer-impl transformer_engine --fp8-format ... --fp8-recipe ...`) appear when Transformer
Engine is importable.

MFU counts model FLOPs analytically (`angpt.telemetry.performance.model_flops_per_token`, Megatron-LM's count) against
the GPU's dense BF16 peak (989 TFLOP/s on H100/H200 SXM), also for FP8 rows, as Megatron-LM reports it. The
measured rate of an 8192^3 BF16 matmul on the same GPU is printed first as the practical ceiling.

`--profile-steps N` (default 2) profiles N one-micro-batch steps of each model and micro-batch size (first
kernel setting) with torch.profiler: the GPU's busy time per step (the union of its kernels, copies and
memsets) against the unprofiled median step, and the device operations launched per step. On a CPU
(`--device cpu`, for smoke tests: `--shapes tiny`) the outermost ATen operators stand in for kernels and there is
no MFU or peak memory.
"""

import argparse
import contextlib
import functools
import gc
import itertools
import json
import shlex
import statistics
import sys
import time
import traceback

import torch
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallelConfig
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from angpt import kernels
from angpt.config.arguments import parse_args as parse_pretrain_args
from angpt.config.arguments import settings_to_argv
from angpt.megatron_compat import patches
from angpt.models.attention import clear_attention_backend_environment
from angpt.telemetry.performance import model_flops_per_token, peak_flops_per_device
from angpt.training import distributed
from angpt.training.megatron_configs import transformer_config
from angpt.training.optimizer import build_optimizer
from angpt.training.step import build_model_chunks, train_step

# The paper's shapes (docs/model.md, Model shapes: head dim 64, f = 4d); "tiny" smoke-tests this script on a CPU.
SHAPES = {"tiny": dict(num_layers=2, hidden_size=64, num_attention_heads=4),
          "0.5b": dict(num_layers=24, hidden_size=1024, num_attention_heads=16),
          "1b": dict(num_layers=36, hidden_size=1280, num_attention_heads=20)}
GPT2_VOCAB = 50257
KERNEL_SETTINGS = {"on": contextlib.nullcontext, "off": kernels.reference_only}
# Where a row's step comes from: the keys rows of one comparison share (the family aside).
COMPARISON_KEYS = ("shape", "precision", "variant", "kernels", "micro_batch_size", "global_batch_size")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                        help="auto: CUDA when available; cpu runs the code paths without timings that mean much")
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=["0.5b", "1b"])
    parser.add_argument("--families", nargs="+", choices=("gptplus", "angpt", "ngpt"),
                        default=["gptplus", "angpt", "ngpt"])
    parser.add_argument("--precisions", nargs="+", choices=("bf16", "fp8"), default=["bf16", "fp8"])
    parser.add_argument("--fp8-format", default="hybrid")
    parser.add_argument("--fp8-recipe", default="delayed")
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--vocab-size", type=int, default=GPT2_VOCAB, help="before padding to 128")
    parser.add_argument("--micro-batch-size", type=int, nargs="+", default=[4],
                        help="one or more, each measured on the same model, smallest first")
    parser.add_argument("--global-batch-size", type=int,
                        help="also time optimizer steps over this many sequences (gradient accumulation) at "
                        "each micro-batch size that divides it")
    parser.add_argument("--global-micro-batch-size", type=int, nargs="+",
                        help="the micro-batch sizes of the global batch (default: every --micro-batch-size)")
    parser.add_argument("--global-steps", type=int, default=2, help="timed global-batch steps (after the "
                        "one-micro-batch steps at that size, which warm it up)")
    parser.add_argument("--kernels", nargs="+", choices=tuple(KERNEL_SETTINGS), default=list(KERNEL_SETTINGS),
                        help="fused kernels on and/or off, alternating step by step in the same model")
    parser.add_argument("--variant", action="append", metavar="NAME=FLAGS",
                        help="angpt.pretrain flags for the models of a variant (repeatable; measured in order)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps of each kernel setting")
    parser.add_argument("--steps", type=int, default=10, help="timed steps of each kernel setting")
    parser.add_argument("--profile-steps", type=int, default=2,
                        help="one-micro-batch steps profiled per model and micro-batch size (0: none)")
    parser.add_argument("--attention-backend", choices=("auto", "flash", "unfused"), default="auto",
                        help="core attention (auto: FlashAttention on the GPU)")
    parser.add_argument("--profile", help="append the kernels of each profile by time to this file")
    parser.add_argument("--json", "--output", dest="json", help="write the rows here")
    parser.add_argument("--markdown", help="write the table here")
    args = parser.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device")
    if args.device == "cpu" and torch.cuda.is_available():
        parser.error("--device cpu: this machine has CUDA (hide it with CUDA_VISIBLE_DEVICES=)")
    args.device = torch.device(args.device)
    args.micro_batch_size = sorted(set(args.micro_batch_size))
    args.global_micro_batch_size = sorted(set(args.global_micro_batch_size or args.micro_batch_size))
    if args.global_batch_size and not set(args.global_micro_batch_size) <= set(args.micro_batch_size):
        parser.error("--global-micro-batch-size: each must be one of --micro-batch-size")
    args.variants = {}
    for variant in args.variant or ["default="]:
        name, separator, flags = variant.partition("=")
        if not separator or not name or name in args.variants:
            parser.error(f"--variant {variant!r}: expected a new NAME=FLAGS")
        args.variants[name] = shlex.split(flags)
    return args


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def matmul_tflops(size: int = 8192, repeats: int = 10) -> float:
    """Measured BF16 matmul rate on random data (events around `repeats` products after 3 warm-ups)."""
    a, b = (torch.randn(size, size, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        a @ b
    end.record()
    torch.cuda.synchronize()
    return 2 * size**3 * repeats / (start.elapsed_time(end) / 1e3) / 1e12


def pretrain_flags(args, shape: str, family: str, precision: str, extra: list[str]) -> list[str]:
    micro_batch_size = str(args.micro_batch_size[0])  # the model does not depend on it
    flags = ["--model-family", family, "--mock-data", "--vocab-size", str(args.vocab_size), "--bf16",
             "--use-distributed-optimizer", "--seq-length", str(args.seq_length),
             "--micro-batch-size", micro_batch_size, "--global-batch-size", micro_batch_size,
             "--train-iters", "1000", "--lr", "1e-3", "--attention-backend", args.attention_backend]
    flags += settings_to_argv(SHAPES[shape])
    if precision == "fp8":
        flags += ["--transformer-impl", "transformer_engine", "--fp8-format", args.fp8_format,
                  "--fp8-recipe", args.fp8_recipe]
    return flags + extra


def build(flags: list[str]):
    """Model chunks, optimizer and scheduler as the trainer builds them from these flags."""
    clear_attention_backend_environment()  # this script builds several models
    run_config = parse_pretrain_args(flags, world_size=1)
    config = transformer_config(run_config)
    # Each model from the same seed; RNG states that CUDA graphs can capture where the flags ask for them.
    distributed.set_random_seed(run_config.training.seed, cuda_graphs=config.cuda_graph_impl == "local")
    vocab_size = run_config.padded_vocab_size(run_config.data.vocab_size)
    parallel = run_config.parallel
    chunks = build_model_chunks(config, vocab_size, run_config.model.seq_length, DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=parallel.use_distributed_optimizer,
        overlap_grad_reduce=parallel.overlap_grad_reduce, overlap_param_gather=parallel.overlap_param_gather))
    # Every optimizer setting the flags have, as the trainer passes them.
    optimizer, scheduler = build_optimizer(chunks, run_config)
    return config, vocab_size, chunks, optimizer, scheduler


def random_batch(micro_batch_size: int, seq_length: int, vocab_size: int, device: torch.device) -> dict:
    b, s = micro_batch_size, seq_length
    tokens = torch.randint(0, vocab_size, (b, s + 1), generator=torch.Generator().manual_seed(0)).to(device)
    return dict(tokens=tokens[:, :-1], labels=tokens[:, 1:], loss_mask=torch.ones(b, s, device=device),
                position_ids=torch.arange(s, device=device).unsqueeze(0).expand(b, -1))


def timed_steps(step, settings: list[str], warmup: int, steps: int, device: torch.device) -> dict:
    """{setting: (seconds of each timed step, last loss, peak GiB or None)}, the kernel settings alternating
    step by step; peak memory counts every step, warm-up included."""
    times, losses, peaks = ({name: [] for name in settings} for _ in range(3))
    for index in range(warmup + steps):
        for name in settings:
            synchronize(device)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
            with KERNEL_SETTINGS[name]():
                loss = step()[0]
            synchronize(device)
            if device.type == "cuda":
                peaks[name].append(torch.cuda.max_memory_allocated() / 2**30)
            if index >= warmup:
                times[name].append(time.perf_counter() - start)
                losses[name].append(loss)
    return {name: (times[name], losses[name][-1], max(peaks[name], default=None)) for name in settings}


def device_events(profiler, device: torch.device) -> list:
    """The profiled work on `device`: kernels, copies and memsets on a GPU; on a CPU the outermost ATen
    operators (those that Python or autograd called, not the ones they call)."""
    if device.type == "cuda":
        return [e for e in profiler.events() if e.device_type == DeviceType.CUDA]
    return [e for e in profiler.events() if e.name.startswith("aten::")
            and not (e.cpu_parent is not None and e.cpu_parent.name.startswith("aten::"))]


def busy_microseconds(events) -> float:
    """The union of the events' time ranges (kernels on several streams overlap)."""
    busy, end = 0.0, float("-inf")
    for start, stop in sorted((e.time_range.start, e.time_range.end) for e in events):
        if stop > end:
            busy += stop - max(start, end)
            end = stop
    return busy


def profile_steps(step, steps: int, device: torch.device, title: str, path) -> dict:
    """Profile `steps` steps: device busy ms and operations per step; with `path`, append the top operations
    by time and the share of matmuls, attention and everything else (elementwise, norms, optimizer)."""
    # Device activity alone on a GPU: host events would multiply the events to process several times.
    activities = [ProfilerActivity.CUDA if device.type == "cuda" else ProfilerActivity.CPU]
    with profile(activities=activities) as profiler:
        for _ in range(steps):
            step()
        synchronize(device)
    events = device_events(profiler, device)
    result = dict(device_ms_per_step=busy_microseconds(events) / steps / 1e3, device_ops_per_step=len(events) / steps)
    if path:
        by_name = {}
        for event in events:
            total, count = by_name.get(event.name, (0.0, 0))
            by_name[event.name] = (total + event.time_range.elapsed_us(), count + 1)
        total = sum(t for t, _ in by_name.values()) or 1.0
        groups = {"matmul": ("gemm", "nvjet", "cutlass", "xmma", "cublas", "aten::mm", "aten::addmm", "aten::bmm"),
                  "attention": ("flash", "fmha", "attention")}
        shares = {name: 0.0 for name in (*groups, "other")}
        for name, (time_us, _) in by_name.items():
            group = next((g for g, keys in groups.items() if any(k in name.lower() for k in keys)), "other")
            shares[group] += time_us / total
        with open(path, "a") as f:
            f.write(f"== {title}: busy {result['device_ms_per_step']:.1f} ms/step, "
                    f"{result['device_ops_per_step']:.0f} operations/step; "
                    + ", ".join(f"{g} {share:.1%}" for g, share in shares.items()) + "\n")
            for name, (time_us, count) in sorted(by_name.items(), key=lambda item: -item[1][0])[:25]:
                f.write(f"{time_us / total:7.2%} {time_us / steps / 1e3:8.2f} ms x{count // steps:<5} {name[:150]}\n")
    return result


def measure(args, shape: str, family: str, precision: str, variant: str, peak_flops, skipped: list) -> list[dict]:
    """The rows of one model at each micro-batch size (smallest first; the larger ones are skipped after an
    out-of-memory error)."""
    device = args.device
    if device.type == "cuda":
        torch.cuda.empty_cache()
    config, vocab_size, chunks, optimizer, scheduler = build(
        pretrain_flags(args, shape, family, precision, args.variants[variant]))
    s = args.seq_length
    flops_per_token = model_flops_per_token(config, s, vocab_size)
    parameters = sum(p.numel() for c in chunks for p in c.parameters())
    title = f"{shape} {family} {precision} {variant}"
    rows = []

    def add_rows(results: dict, micro_batch_size: int, micro_batches: int, profiled: dict) -> None:
        tokens_per_step = micro_batch_size * micro_batches * s
        for name, (samples, loss, peak_memory) in results.items():
            seconds = statistics.median(samples)
            tokens_per_s = tokens_per_step / seconds
            row = dict(shape=shape, family=family, precision=precision, variant=variant, kernels=name,
                       micro_batch_size=micro_batch_size, global_batch_size=micro_batch_size * micro_batches,
                       num_microbatches=micro_batches, parameters=parameters, ms_per_step=seconds * 1e3,
                       tokens_per_s_per_gpu=tokens_per_s,
                       mfu=flops_per_token * tokens_per_s / peak_flops if peak_flops else None,
                       peak_memory_gib=peak_memory, loss_last=loss, step_spread=max(samples) / min(samples),
                       timed_steps=len(samples))
            if profiled and name == args.kernels[0]:
                row.update(profiled, device_busy_fraction=profiled["device_ms_per_step"] / (seconds * 1e3))
            rows.append(row)
            print(f"{title} kernels {name} micro-batch {micro_batch_size} x{micro_batches}: "
                  f"{row['ms_per_step']:.1f} ms/step {tokens_per_s:.0f} tok/s/GPU MFU {fmt(row['mfu'], '.3f')} "
                  f"peak {fmt(peak_memory, '.1f')} GiB busy {fmt(row.get('device_busy_fraction'), '.2f')} "
                  f"ops/step {fmt(row.get('device_ops_per_step'), '.0f')} loss {loss:.3f} "
                  f"(slowest/fastest step {row['step_spread']:.2f})", flush=True)

    for micro_batch_size in args.micro_batch_size:
        patches.delete_cuda_graphs(chunks)  # CUDA graphs are captured for one micro-batch shape
        data = itertools.repeat(random_batch(micro_batch_size, s, args.vocab_size, device))
        step = functools.partial(train_step, data, chunks, optimizer, scheduler, 1, micro_batch_size, s)
        try:
            results = timed_steps(step, args.kernels, args.warmup, args.steps, device)
            profiled = {}
            if args.profile_steps > 0:
                with KERNEL_SETTINGS[args.kernels[0]]():
                    profiled = profile_steps(step, args.profile_steps, device,
                                             f"{title} kernels {args.kernels[0]} micro-batch {micro_batch_size}",
                                             args.profile)
            add_rows(results, micro_batch_size, 1, profiled)
            wants_global = args.global_batch_size and micro_batch_size in args.global_micro_batch_size
            if wants_global and args.global_batch_size % micro_batch_size == 0:
                micro_batches = args.global_batch_size // micro_batch_size
                global_step = functools.partial(train_step, data, chunks, optimizer, scheduler, micro_batches,
                                                micro_batch_size, s)
                results = timed_steps(global_step, args.kernels, 0, args.global_steps, device)
                add_rows(results, micro_batch_size, micro_batches, {})
            elif wants_global:
                skipped.append(f"{title} global batch {args.global_batch_size}: not a multiple of micro-batch "
                               f"{micro_batch_size}")
        except torch.cuda.OutOfMemoryError as error:
            skipped.append(f"{title} micro-batch {micro_batch_size} and larger: out of memory ({error})"
                           .splitlines()[0])
            break
    patches.delete_cuda_graphs(chunks)
    del chunks, optimizer, scheduler, step
    gc.collect()
    return rows


def fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def add_ratios(rows: list[dict]) -> None:
    """vs_gptplus: a row's step time over GPT+'s in the same comparison (None without a GPT+ row)."""
    for row in rows:
        base = next((r for r in rows if r["family"] == "gptplus"
                     and all(r[key] == row[key] for key in COMPARISON_KEYS)), None)
        row["vs_gptplus"] = row["ms_per_step"] / base["ms_per_step"] if base else None


def markdown_table(rows: list[dict]) -> str:
    lines = ["| shape | family | precision | variant | fused kernels | micro-batch | global batch | ms/step | "
             "tokens/s/GPU | MFU | vs GPT+ | peak memory (GiB) | GPU busy | kernels/step |",
             "|---|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        cells = [row["shape"], row["family"], row["precision"], row["variant"], row["kernels"],
                 row["micro_batch_size"], row["global_batch_size"], f"{row['ms_per_step']:.1f}",
                 f"{row['tokens_per_s_per_gpu']:.0f}", fmt(row["mfu"], ".3f"), fmt(row["vs_gptplus"], ".3f"),
                 fmt(row["peak_memory_gib"], ".1f"), fmt(row.get("device_busy_fraction"), ".2f"),
                 fmt(row.get("device_ops_per_step"), ".0f")]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines)


def transformer_engine_missing() -> str:
    try:
        import transformer_engine.pytorch  # noqa: F401, PLC0415 (optional: Transformer Engine)
    except Exception as error:  # ImportError, or TE's own errors when its libraries do not load
        return f"Transformer Engine is not importable ({type(error).__name__}: {error})".splitlines()[0]
    return ""


def main(argv=None):
    args = parse_args(argv)
    owns_groups = not parallel_state.model_parallel_is_initialized()  # a test may have built them
    if owns_groups:
        distributed.initialize()
    # A variant's flags are checked before anything is measured, so that a typo fails in seconds.
    for variant, extra in args.variants.items():
        flags = parse_pretrain_args(pretrain_flags(args, args.shapes[0], args.families[0], "bf16", extra), world_size=1)
        if flags.fusion.cuda_graph_impl != "none" and len(args.kernels) > 1:
            sys.exit(f"gpu_throughput.py: --variant {variant}: CUDA graphs replay the kernels they captured, so "
                     "--kernels cannot alternate in it; give one --kernels setting")
    on_cuda = args.device.type == "cuda"
    name = torch.cuda.get_device_name() if on_cuda else "CPU"
    peak = peak_flops_per_device(torch.bfloat16) if on_cuda else None
    ceiling = matmul_tflops() if on_cuda else None
    peak_tflops = peak / 1e12 if peak else None
    print(f"{name}: dense BF16 peak {fmt(peak_tflops, '.0f')} TFLOP/s (datasheet); measured 8192^3 BF16 matmul "
          f"{fmt(ceiling, '.0f')} TFLOP/s; fused kernels "
          f"{'available' if kernels.extension(args.device) else 'NOT available'}; torch {torch.__version__}",
          flush=True)
    meta = dict(device=name, torch=torch.__version__, peak_bf16_tflops=peak_tflops, matmul_bf16_tflops=ceiling,
                micro_batch_sizes=args.micro_batch_size, global_batch_size=args.global_batch_size,
                global_micro_batch_sizes=args.global_micro_batch_size, seq_length=args.seq_length,
                attention_backend=args.attention_backend, steps=args.steps, global_steps=args.global_steps,
                profile_steps=args.profile_steps,
                variants={variant: shlex.join(flags) for variant, flags in args.variants.items()},
                argv=sys.argv[1:] if argv is None else list(argv))
    rows, skipped, failed = [], [], False
    te_missing = transformer_engine_missing()
    for shape, precision in itertools.product(args.shapes, args.precisions):
        if precision == "fp8" and te_missing:
            skipped.append(f"{shape} fp8: {te_missing}")
            continue
        for variant, family in itertools.product(args.variants, args.families):
            what = f"{shape} {family} {precision} {variant}"
            try:
                rows.extend(measure(args, shape, family, precision, variant, peak, skipped))
            except torch.cuda.OutOfMemoryError as error:  # building the model or its optimizer
                skipped.append(f"{what}: out of memory ({error})".splitlines()[0])
            except Exception as error:  # one failing model or variant leaves the others measured
                traceback.print_exc()
                skipped.append(f"{what}: FAILED ({type(error).__name__}: {error})".splitlines()[0])
                failed = True
            # After each model, so that a run stopped by a time limit keeps what it measured.
            write_outputs(args, meta, rows, skipped)
    if owns_groups:
        parallel_state.destroy_model_parallel()
    summary = write_outputs(args, meta, rows, skipped)
    print(f"\n{name}, {args.seq_length} tokens per sequence, attention {args.attention_backend}, median of "
          f"{args.steps} one-micro-batch steps and {args.global_steps} global-batch steps; MFU against "
          f"{fmt(peak_tflops, '.0f')} TFLOP/s dense BF16, matmul ceiling {fmt(ceiling, '.0f')} TFLOP/s; GPU busy: "
          f"device time of {args.profile_steps} profiled steps over the unprofiled median step\n{summary}")
    if failed:
        sys.exit("gpu_throughput.py: some models failed (see 'not measured')")
    return rows


def write_outputs(args, meta: dict, rows: list[dict], skipped: list[str]) -> str:
    """Write the rows (with their ratios to GPT+) as JSON and Markdown where asked; returns the Markdown."""
    add_ratios(rows)
    summary = "\n".join([markdown_table(rows)] + [f"\nnot measured: {line}" for line in skipped])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(meta, rows=rows, not_measured=skipped), f, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(summary + "\n")
    return summary


if __name__ == "__main__":
    main()
