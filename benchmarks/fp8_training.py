#!/usr/bin/env python
"""FP8 beside BF16 on a real corpus: loss curves and the amaxes behind the FP8 scales, per family (issue 14).

    python benchmarks/fp8_training.py --corpus data/shakespeare --output-dir runs/fp8 [--train-iters 300]

For each family (anGPT and GPT+ by default) the trainer (`angpt.pretrain`) runs twice on Transformer Engine's
layers from the same seed and data: BF16, and FP8 GEMMs (hybrid format, delayed scaling with an amax history
of 16 and its max, the settings Megatron-LM's FP8 runs use at a shorter window). Every --log-interval steps the
trainer logs, beside the loss, the absolute maximum behind each FP8 GEMM operand's scale, per layer and
module (angpt.telemetry.health: health/fp8_amax_{input,weight,grad_output}/...). The report (fp8_training.md and
.json in --output-dir, and fp8_training.png with matplotlib) gives per family: the final training and
validation losses of both runs and FP8's relative gap (the target: within 1%); and per operand over the
layers and logged steps: the range of the amaxes (the dynamic range one per-tensor scale must cover) and
the largest growth of one tensor's amax from one logged step to the next (under delayed scaling a tensor
whose amax outgrows its history's maximum saturates at the FP8 maximum until the history catches up).
anGPT's weights are bounded to the unit ball and its GEMM inputs are normalized, so one expects its
amaxes to be smaller, steadier and closer together than GPT+'s.

The corpus is a directory with train_text_document and valid_text_document (tools/preprocess_data.py; `make
quickstart` writes data/shakespeare). `--transformer-impl local --precisions bf16` runs on a CPU (the test).
"""

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from angpt.telemetry.metrics_reader import read_metrics  # noqa: E402

# The best lrs of the convergence benchmark's grid at 640 steps (docs/results.md).
LEARNING_RATES = {"angpt": 1e-2, "gptplus": 3e-3, "ngpt": 1e-2}
FP8_FLAGS = ["--fp8-format", "hybrid", "--fp8-recipe", "delayed", "--fp8-amax-history-len", "16",
             "--fp8-amax-compute-algo", "max"]
OPERANDS = ("input", "weight", "grad_output")
# Final losses: the mean of the last few logged training losses (each already a mean over --log-interval steps).
FINAL_LOGS = 5


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", default="data/shakespeare", help="holds train_text_document, valid_text_document")
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--families", nargs="+", choices=sorted(LEARNING_RATES), default=["angpt", "gptplus"])
    parser.add_argument("--precisions", nargs="+", choices=("bf16", "fp8"), default=["bf16", "fp8"])
    parser.add_argument("--transformer-impl", choices=("transformer_engine", "local"), default="transformer_engine")
    parser.add_argument("--train-iters", type=int, default=300)
    parser.add_argument("--num-layers", type=int, default=8)
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--num-attention-heads", type=int, default=8)
    parser.add_argument("--seq-length", type=int, default=512)
    parser.add_argument("--micro-batch-size", type=int, default=16)
    parser.add_argument("--log-interval", type=int, default=10)
    parser.add_argument("--eval-iters", type=int, default=10)
    parser.add_argument("--timeout", type=float, default=600, help="seconds per run")
    parser.add_argument("extra", nargs="*", help="after --: more angpt.pretrain flags for every run")
    args = parser.parse_args(argv)
    if "fp8" in args.precisions and args.transformer_impl != "transformer_engine":
        parser.error("--precisions fp8 needs --transformer-impl transformer_engine")
    for split in ("train", "valid"):
        if not os.path.exists(os.path.join(args.corpus, f"{split}_text_document.idx")):
            parser.error(f"--corpus {args.corpus}: no {split}_text_document.idx (see tools/preprocess_data.py)")
    return args


def pretrain_command(args, family: str, precision: str, run_dir: str) -> list[str]:
    command = [sys.executable, "-m", "angpt.pretrain", "--model-family", family, "--seed", "1234",
               "--num-layers", str(args.num_layers), "--hidden-size", str(args.hidden_size),
               "--num-attention-heads", str(args.num_attention_heads), "--seq-length", str(args.seq_length),
               "--micro-batch-size", str(args.micro_batch_size), "--global-batch-size", str(args.micro_batch_size),
               "--train-iters", str(args.train_iters), "--lr", str(LEARNING_RATES[family]),
               "--train-data-path", os.path.join(args.corpus, "train_text_document"),
               "--valid-data-path", os.path.join(args.corpus, "valid_text_document"),
               "--data-cache-path", os.path.join(run_dir, "cache"), "--eval-interval", str(args.train_iters),
               "--eval-iters", str(args.eval_iters), "--log-interval", str(args.log_interval),
               "--metrics-file", os.path.join(run_dir, "metrics.jsonl"), "--transformer-impl", args.transformer_impl]
    if args.transformer_impl == "transformer_engine":
        command.append("--bf16")  # FP8 needs BF16 weights and activations; BF16 is the comparison
    if precision == "fp8":
        command += FP8_FLAGS
    return command + list(args.extra)


def run(args, family: str, precision: str) -> str:
    """Trains one run (unless its metrics are complete already); returns its metrics.jsonl."""
    run_dir = os.path.join(args.output_dir, f"{family}-{precision}")
    metrics = os.path.join(run_dir, "metrics.jsonl")
    if os.path.exists(metrics) and any(r.get("kind") == "eval" for r in read_metrics(metrics, warn=False)):
        print(f"{family} {precision}: finished earlier, reused", flush=True)
        return metrics
    os.makedirs(run_dir, exist_ok=True)
    if os.path.exists(metrics):
        os.remove(metrics)  # an unfinished run starts again
    started = time.time()
    print(f"{family} {precision}: {args.train_iters} steps ...", flush=True)
    with open(os.path.join(run_dir, "log.txt"), "w") as log:
        done = subprocess.run(pretrain_command(args, family, precision, run_dir), stdout=log,
                              stderr=subprocess.STDOUT, cwd=ROOT, timeout=args.timeout,
                              env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [
                                  ROOT, os.environ.get("PYTHONPATH")]))})
    if done.returncode != 0:
        with open(os.path.join(run_dir, "log.txt")) as log:
            tail = log.read()[-3000:]
        raise RuntimeError(f"{family} {precision} failed (exit {done.returncode}); {run_dir}/log.txt ends:\n{tail}")
    print(f"{family} {precision}: done in {time.time() - started:.0f} s", flush=True)
    return metrics


def summarize(records: list[dict]) -> dict:
    """Losses, step time and the FP8 amax figures of one run's metrics records."""
    train = [r for r in records if r.get("kind") == "train"]
    evals = [r["lm_loss"] for r in records if r.get("kind") == "eval" and r.get("split") == "validation"]
    if not train:
        raise ValueError("no training records")
    final = train[-FINAL_LOGS:]
    summary = {
        "iterations": [r["iteration"] for r in train],
        "losses": [r["lm_loss"] for r in train],
        "final_train_loss": sum(r["lm_loss"] for r in final) / len(final),
        "final_valid_loss": evals[-1] if evals else None,
        "ms_per_step": statistics.median(r["ms_per_step"] for r in train[1:] or train),  # the first: warm-up
    }
    for operand in OPERANDS:
        prefix = f"health/fp8_amax_{operand}/"
        series: dict[str, list[float]] = {}
        for record in train:
            for name, value in record.items():
                if name.startswith(prefix) and math.isfinite(value) and value > 0:
                    series.setdefault(name[len(prefix):], []).append(value)
        if not series:
            continue
        values = [v for tensor in series.values() for v in tensor]
        growth = [b / a for tensor in series.values() for a, b in zip(tensor, tensor[1:])]
        summary[f"amax_{operand}"] = {
            "tensors": len(series),
            "min": min(values),
            "max": max(values),
            "range": max(values) / min(values),
            "final_range_over_layers": max(s[-1] for s in series.values()) / min(s[-1] for s in series.values()),
            "max_growth_between_logs": max(growth, default=None),
        }
    return summary


def report(runs: dict[tuple[str, str], dict]) -> tuple[dict, str]:
    """(JSON, Markdown) of the runs' summaries, keyed by (family, precision)."""
    families = sorted({family for family, _ in runs}, key=list(LEARNING_RATES).index)
    lines = ["| model | precision | final train loss | final val loss | FP8 vs BF16 (val) | ms/step |",
             "|---|---|---:|---:|---:|---:|"]
    table = {}
    for family in families:
        for precision in ("bf16", "fp8"):
            summary = runs.get((family, precision))
            if summary is None:
                continue
            gap = None
            bf16 = runs.get((family, "bf16"))
            if precision == "fp8" and bf16 and summary["final_valid_loss"] and bf16["final_valid_loss"]:
                gap = summary["final_valid_loss"] / bf16["final_valid_loss"] - 1
            summary = dict(summary, fp8_relative_gap=gap)
            table[f"{family}-{precision}"] = summary
            valid = summary["final_valid_loss"]
            lines.append(f"| {family} | {precision} | {summary['final_train_loss']:.4f} | "
                         f"{'-' if valid is None else f'{valid:.4f}'} | {'-' if gap is None else f'{gap:+.2%}'} | "
                         f"{summary['ms_per_step']:.1f} |")
    amax_lines = ["", "| model | operand | tensors | amax min-max | range | final range over layers | "
                  "largest growth between logs |", "|---|---|---:|---|---:|---:|---:|"]
    for family in families:
        summary = runs.get((family, "fp8"), {})
        for operand in OPERANDS:
            figures = summary.get(f"amax_{operand}")
            if figures:
                growth = figures["max_growth_between_logs"]
                amax_lines.append(f"| {family} | {operand} | {figures['tensors']} | {figures['min']:.3g}-"
                                  f"{figures['max']:.3g} | {figures['range']:.1f}x | "
                                  f"{figures['final_range_over_layers']:.1f}x | "
                                  f"{'-' if growth is None else f'{growth:.2f}x'} |")
    markdown = "\n".join(lines + (amax_lines if len(amax_lines) > 3 else [])) + "\n"
    return table, markdown


def plot(runs: dict[tuple[str, str], dict], path: str) -> None:
    try:
        import matplotlib  # noqa: PLC0415 (optional: the plot)

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        return
    figure, axis = plt.subplots(figsize=(7, 4))
    for (family, precision), summary in sorted(runs.items()):
        axis.plot(summary["iterations"], summary["losses"], label=f"{family} {precision}",
                  linestyle="-" if precision == "bf16" else "--")
    axis.set_xlabel("step")
    axis.set_ylabel("training loss")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main(argv=None) -> None:
    args = parse_args(argv)
    os.makedirs(args.output_dir, exist_ok=True)
    runs = {}
    for family in args.families:
        for precision in args.precisions:
            runs[(family, precision)] = summarize(read_metrics(run(args, family, precision)))
    table, markdown = report(runs)
    with open(os.path.join(args.output_dir, "fp8_training.json"), "w") as file:
        json.dump({"settings": vars(args), "runs": table}, file, indent=1)
    with open(os.path.join(args.output_dir, "fp8_training.md"), "w") as file:
        file.write(markdown)
    plot(runs, os.path.join(args.output_dir, "fp8_training.png"))
    print(markdown)


if __name__ == "__main__":
    try:
        main()
    except (RuntimeError, ValueError, subprocess.TimeoutExpired) as error:
        sys.exit(f"fp8_training.py: error: {error}")
