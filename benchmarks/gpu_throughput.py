#!/usr/bin/env python
"""Tokens per second per GPU and model FLOPs utilisation of the 0.5B and 1B shapes on one GPU.

    python benchmarks/gpu_throughput.py [--shapes 0.5b 1b] [--families gptplus angpt ngpt]
        [--precisions bf16 fp8] [--micro-batch-size 4] [--steps 10] [--json out.json] [--markdown out.md]

Each model is built as `angpt.pretrain` builds it from its flags (BF16 with the distributed optimizer,
megatron-core's DDP and schedule, the family's optimizer and post-step weight projection, context 2048,
GPT-2's vocabulary padded to 50304, core attention through FlashAttention) and trained on a fixed random
batch. The fused kernels (nu-scaled SwiGLU, bounded-weight projection) are switched on and off step by step
in the same model, so both see the same GPU state; FP8 rows (Transformer Engine, `--transformer-impl
transformer_engine --fp8-format ... --fp8-recipe ...`) appear when Transformer Engine is importable.

MFU counts model FLOPs analytically (`angpt.performance.model_flops_per_token`, Megatron-LM's count) against
the GPU's dense BF16 peak (989 TFLOP/s on H100/H200 SXM), also for FP8 rows, as Megatron-LM reports it. The
measured rate of an 8192^3 BF16 matmul on the same GPU is printed first as the practical ceiling.
"""

import argparse
import contextlib
import functools
import gc
import itertools
import json
import statistics
import sys
import time

import torch
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallelConfig
from torch.profiler import ProfilerActivity, profile

from angpt import distributed, kernels
from angpt.arguments import parse_args as parse_pretrain_args
from angpt.arguments import settings_to_argv
from angpt.config_from_args import model_config_from_args, padded_vocab_size
from angpt.models.attention import clear_attention_backend_environment
from angpt.optimizer import build_optimizer
from angpt.performance import model_flops_per_token, peak_flops_per_device
from angpt.step import build_model_chunks, train_step

# The paper's shapes (docs/model.md, Model shapes: head dim 64, f = 4d).
SHAPES = {"0.5b": dict(num_layers=24, hidden_size=1024, num_attention_heads=16),
          "1b": dict(num_layers=36, hidden_size=1280, num_attention_heads=20)}
GPT2_VOCAB = 50257


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=["0.5b", "1b"])
    parser.add_argument("--families", nargs="+", choices=("gptplus", "angpt", "ngpt"),
                        default=["gptplus", "angpt", "ngpt"])
    parser.add_argument("--precisions", nargs="+", choices=("bf16", "fp8"), default=["bf16", "fp8"])
    parser.add_argument("--fp8-format", default="hybrid")
    parser.add_argument("--fp8-recipe", default="delayed")
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps of each kernel setting")
    parser.add_argument("--steps", type=int, default=10, help="timed steps of each kernel setting")
    parser.add_argument("--attention-backend", choices=("auto", "flash", "unfused"), default="auto",
                        help="core attention (auto: FlashAttention on the GPU)")
    parser.add_argument("--profile", help="also profile 2 steps of each model (kernels on) and append the GPU "
                        "kernels by time to this file")
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--markdown", help="write the table here")
    return parser.parse_args()


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


def pretrain_flags(args, shape: str, family: str, precision: str) -> list[str]:
    flags = ["--model-family", family, "--mock-data", "--vocab-size", str(GPT2_VOCAB), "--bf16",
             "--use-distributed-optimizer", "--seq-length", str(args.seq_length),
             "--micro-batch-size", str(args.micro_batch_size),
             "--global-batch-size", str(args.micro_batch_size), "--train-iters", "1000", "--lr", "1e-3",
             "--attention-backend", args.attention_backend]
    flags += settings_to_argv(SHAPES[shape])
    if precision == "fp8":
        flags += ["--transformer-impl", "transformer_engine", "--fp8-format", args.fp8_format,
                  "--fp8-recipe", args.fp8_recipe]
    return flags


def build(flags: list[str]):
    """Model chunks, optimizer and scheduler as the trainer builds them from these flags."""
    clear_attention_backend_environment()  # this script builds several models
    pretrain_args = parse_pretrain_args(flags, world_size=1)
    config = model_config_from_args(pretrain_args)
    vocab_size = padded_vocab_size(GPT2_VOCAB, pretrain_args.make_vocab_size_divisible_by, 1)
    chunks = build_model_chunks(config, vocab_size, pretrain_args.seq_length,
                                DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True))
    optimizer, scheduler = build_optimizer(chunks, pretrain_args.model_family, lr=pretrain_args.lr,
                                           train_iters=pretrain_args.train_iters, use_distributed_optimizer=True,
                                           bf16=True)
    return config, vocab_size, chunks, optimizer, scheduler


def measure(args, shape: str, family: str, precision: str, peak_bf16: float) -> list[dict]:
    torch.cuda.empty_cache()
    config, vocab_size, chunks, optimizer, scheduler = build(pretrain_flags(args, shape, family, precision))
    b, s = args.micro_batch_size, args.seq_length
    tokens = torch.randint(0, GPT2_VOCAB, (b, s + 1), device="cuda", generator=None)
    batch = dict(tokens=tokens[:, :-1], labels=tokens[:, 1:], loss_mask=torch.ones(b, s, device="cuda"),
                 position_ids=torch.arange(s, device="cuda").unsqueeze(0).expand(b, -1))
    settings = {"on": contextlib.nullcontext, "off": kernels.reference_only}
    step_once = functools.partial(train_step, itertools.repeat(batch), chunks, optimizer, scheduler, 1, b, s)
    times = {name: [] for name in settings}
    losses = {name: [] for name in settings}
    peak_memory = dict.fromkeys(settings, 0.0)
    for step in range(args.warmup + args.steps):
        for name, context in settings.items():
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
            with context():
                loss = step_once()[0]
            torch.cuda.synchronize()
            peak_memory[name] = max(peak_memory[name], torch.cuda.max_memory_allocated() / 2**30)
            if step >= args.warmup:
                times[name].append(time.perf_counter() - start)
                losses[name].append(loss)
    if args.profile:
        profile_steps(args.profile, f"{shape} {family} {precision}, kernels on", step_once)
    flops_per_token = model_flops_per_token(config, s, vocab_size)
    parameters = sum(p.numel() for c in chunks for p in c.parameters())
    rows = []
    for name, samples in times.items():
        seconds = statistics.median(samples)
        tokens_per_s = b * s / seconds
        rows.append(dict(shape=shape, family=family, precision=precision, kernels=name, parameters=parameters,
                         ms_per_step=seconds * 1e3, tokens_per_s_per_gpu=tokens_per_s,
                         mfu=flops_per_token * tokens_per_s / peak_bf16 if peak_bf16 else None,
                         peak_memory_gib=peak_memory[name], loss_last=losses[name][-1],
                         step_spread=max(samples) / min(samples)))
    del chunks, optimizer, scheduler, step_once
    gc.collect()
    return rows


def profile_steps(path: str, title: str, step) -> None:
    """Append the GPU kernels of 2 profiled steps, by total time, and the share of matmuls, attention and
    everything else (elementwise, norms, reductions, optimizer) to `path`."""
    with profile(activities=[ProfilerActivity.CUDA]) as profiler:
        for _ in range(2):
            step()
        torch.cuda.synchronize()
    events = [e for e in profiler.key_averages() if e.device_type.name == "CUDA" and e.self_device_time_total > 0]
    total = sum(e.self_device_time_total for e in events)
    groups = {"matmul": ("gemm", "nvjet", "cutlass", "xmma", "cublas"), "attention": ("flash", "fmha", "attention")}
    shares = {name: 0.0 for name in (*groups, "other")}
    for event in events:
        name = event.key.lower()
        group = next((g for g, keys in groups.items() if any(k in name for k in keys)), "other")
        shares[group] += event.self_device_time_total / total
    with open(path, "a") as f:
        f.write(f"== {title}: GPU time per step {total / 2e3:.1f} ms; "
                + ", ".join(f"{g} {share:.1%}" for g, share in shares.items()) + "\n")
        for event in sorted(events, key=lambda e: -e.self_device_time_total)[:25]:
            f.write(f"{event.self_device_time_total / total:7.2%} {event.self_device_time_total / 2e3:8.2f} ms "
                    f"x{event.count // 2:<5} {event.key[:150]}\n")
    print(f"profiled {title}: " + ", ".join(f"{g} {share:.1%}" for g, share in shares.items()), flush=True)


def transformer_engine_missing() -> str:
    try:
        import transformer_engine.pytorch  # noqa: F401, PLC0415 (optional: Transformer Engine)
    except Exception as error:  # ImportError, or TE's own errors when its libraries do not load
        return f"Transformer Engine is not importable ({type(error).__name__}: {error})".splitlines()[0]
    return ""


def main():
    args = parse_args()
    if not torch.cuda.is_available():
        sys.exit("gpu_throughput.py needs a CUDA device")
    distributed.initialize()
    name = torch.cuda.get_device_name()
    peak = peak_flops_per_device(torch.bfloat16)
    ceiling = matmul_tflops()
    peak_tflops = peak / 1e12 if peak else float("nan")
    print(f"{name}: dense BF16 peak {peak_tflops:.0f} TFLOP/s (datasheet); measured "
          f"8192^3 BF16 matmul {ceiling:.0f} TFLOP/s = MFU ceiling {ceiling / peak_tflops:.3f}; "
          f"fused kernels {'built with CUDA' if kernels.extension(torch.device('cuda')) else 'NOT available'}; "
          f"torch {torch.__version__}", flush=True)
    rows, skipped = [], []
    te_missing = transformer_engine_missing()
    for shape in args.shapes:
        for precision in args.precisions:
            if precision == "fp8" and te_missing:
                skipped.append(f"{shape} fp8: {te_missing}")
                continue
            for family in args.families:
                try:
                    measured = measure(args, shape, family, precision, peak)
                except torch.cuda.OutOfMemoryError as error:
                    skipped.append(f"{shape} {family} {precision}: out of memory ({error})".splitlines()[0])
                    continue
                for row in measured:
                    print(f"{shape:>4} {family:<8} {precision:<4} kernels {row['kernels']:<3} "
                          f"{row['ms_per_step']:8.1f} ms/step {row['tokens_per_s_per_gpu']:9.0f} tok/s/GPU "
                          f"MFU {row['mfu']:.3f} peak mem {row['peak_memory_gib']:.1f} GiB "
                          f"loss {row['loss_last']:.3f} (slowest/fastest step {row['step_spread']:.2f})", flush=True)
                rows.extend(measured)
    parallel_state.destroy_model_parallel()

    header = ("| shape | family | precision | fused kernels | ms/step | tokens/s/GPU | MFU | vs GPT+ | peak memory |\n"
              "|---|---|---|---|---:|---:|---:|---:|---:|")
    lines = [header]
    for row in rows:
        base = next((r for r in rows if r["shape"] == row["shape"] and r["precision"] == row["precision"]
                     and r["kernels"] == row["kernels"] and r["family"] == "gptplus"), None)
        ratio = f"{row['ms_per_step'] / base['ms_per_step']:.3f}" if base else "-"
        lines.append(f"| {row['shape']} | {row['family']} | {row['precision']} | {row['kernels']} | "
                     f"{row['ms_per_step']:.1f} | {row['tokens_per_s_per_gpu']:.0f} | {row['mfu']:.3f} | {ratio} | "
                     f"{row['peak_memory_gib']:.1f} GiB |")
    summary = "\n".join(lines + [f"\nnot measured: {line}" for line in skipped])
    print(f"\n{name}, micro-batch {args.micro_batch_size} x {args.seq_length} tokens, attention "
          f"{args.attention_backend}, median of {args.steps} steps; MFU against {peak_tflops:.0f} TFLOP/s dense "
          f"BF16, matmul ceiling {ceiling:.0f} TFLOP/s\n{summary}")
    meta = dict(device=name, torch=torch.__version__, peak_bf16_tflops=peak / 1e12 if peak else None,
                matmul_bf16_tflops=ceiling, micro_batch_size=args.micro_batch_size, seq_length=args.seq_length,
                attention_backend=args.attention_backend, steps=args.steps)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(meta, rows=rows, not_measured=skipped), f, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(summary + "\n")


if __name__ == "__main__":
    main()
