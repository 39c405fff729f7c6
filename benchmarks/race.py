#!/usr/bin/env python
"""The convergence race at real width (issue 50, docs/race.md): GPT+, anGPT and nGPT at GPT-2 small's shape
(d=768, 12 layers, 12 heads of 64, context 1024, the padded vocabulary of the corpus's 32768-token BPE), each
with its family's recipe, on the same tokens in the same order, validated on held-out text at fixed token
counts. It reports each family's validation curve and final loss, and the tokens and the training
wall-clock anGPT and nGPT need to reach GPT+'s final loss; JSON, Markdown and a plot.

    bash benchmarks/gpu_checks.sh --race                # the GPU machine: everything in one call (docs/race.md)
    python benchmarks/race.py --corpus /tmp/race-data --output-dir OUT --time-budget 420  # GPU, sized to 420 s
    python benchmarks/race.py --corpus DIR --output-dir OUT --tiny --train-tokens 12288   # CPU, a tiny shape

Runs: one after another (so that each one's wall-clock is its own), each a process doing what
`python -m angpt.pretrain` does (benchmarks/convergence.py's runs: same flags, same trainer) with BF16, the
fused kernels and the compiled chains (all defaults on a GPU), `--seed 0` for every family: megatron-core's
GPTDataset then gives every family the same samples in the same order. Each run hashes the tokens of every
training batch as the trainer hands them to the step (sha256); the report shows the three digests, and the
race fails if they differ.

Recipes (angpt.training.optimizer.RECIPES, the family's defaults): anGPT Adam without weight decay, no
warm-up, cosine to 0.1 lr; nGPT the same to 0; GPT+ AdamW with weight decay 0.1, warm-up over 1% of the
steps, cosine to 0.1 lr. Learning rates: the paper gives none for this size (only that lr and batch were
tuned), so they are transferred from our CPU tuning at d=128 (docs/results.md, 2560 steps: anGPT 0.01, nGPT
0.01, GPT+ 0.001 and 0.003 indistinguishable over 3 seeds, so their geometric mean 0.0017) by lr ~ 1/sqrt(d):
with Adam, a unit-norm row of d entries moves by about lr * sqrt(d) of its norm per step, so this keeps each
update's relative size. d=768: anGPT and nGPT 0.0041, GPT+ 0.00071 (GPT-3's published lr for its 125M model is
0.0006). `--lr FAMILY=LR` overrides. The batch (32 x 1024 tokens) is not transferred: the CPU's was 16 x 128.

Validation: every train-iters / --evals steps, on the same first --eval-iters global batches of the held-out
split. Reaching GPT+'s final loss L*: on each curve of (tokens, loss), the first point at or below L*,
linearly interpolated between evaluations (benchmarks/convergence.py's steps_to_reach, on tokens); the
wall-clock at that point is interpolated the same way on the run's cumulative training time (the steps' own
time as the trainer logs it, the first window's compilation included, evaluations excluded), and also given
at the run's steady throughput (tokens to L* / the median tokens/s of its windows after the first).

The token budget (--time-budget S, what the GPU runner passes): every model is built and stepped first, side
by side in one process (benchmarks/convergence.py's step_times on random tokens: it also warms
torch.compile's cache for the runs), giving each family's tokens/s at this shape; then

    T = 0.9 * (S - elapsed - 3 * --startup-s - evaluations - --report-s) / sum over families of 1 / tokens/s,

rounded down to whole steps and capped by the corpus's train tokens (one epoch at most). Before any
measurement, from the H200's figures (docs/results/gpu/throughput.json: 0.5B at the global batch of
128 x 2048, BF16: GPT+ 140.4k, anGPT 127.3k, nGPT 127.4k tokens/s) scaled by the model FLOPs per token
(angpt.telemetry.performance.model_flops_per_token: 3.03 GFLOP at 0.5B and context 2048, 0.887 at this
shape with the 32768 vocabulary: x3.41) and by 0.75 for the narrower matmuls (an assumption the probe
replaces): GPT+ about 360k, anGPT and nGPT about 325k tokens/s. Of the runner's 540 s, about 60 go to the
wheels, the kernels' build and tokenizing the corpus, 40 to the probe, 75 to the three runs' starts, 20 to
evaluations and the report and 45 to the runner's margin: about 300 s train, so
T = 0.9 * 300 / (1/360k + 2/325k) = about 30M tokens (about 920 steps of 32 x 1024), 0.18 tokens per
parameter (164M with the untied head). docs/race.md has the table.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import statistics
import subprocess
import sys
import time

from convergence import NAMES, ROOT, Run, clean, fmt, judge, speedup_over_gptplus, step_times, worker

from angpt.experiments.sweep_runner import run_jobs
from angpt.telemetry.metrics_reader import read_metrics

FAMILIES = ("gptplus", "angpt", "ngpt")  # GPT+ first: its final loss is the target
CPU_LR = {"angpt": 0.01, "ngpt": 0.01, "gptplus": math.sqrt(0.001 * 0.003)}  # d=128, 2560 steps (docs/results.md)
CPU_WIDTH = 128
SHAPES = {
    "gpu": dict(hidden_size=768, num_layers=12, num_attention_heads=12, seq_length=1024, micro_batch_size=32,
                global_batch_size=32, eval_iters=8, evals=16, bf16=True, startup_s=25.0),
    "tiny": dict(hidden_size=64, num_layers=2, num_attention_heads=2, seq_length=64, micro_batch_size=8,
                 global_batch_size=8, eval_iters=2, evals=4, bf16=False, startup_s=15.0),
}


def transferred_lr(family: str, hidden_size: int) -> float:
    """The CPU-tuned lr at d=128 moved to hidden_size by lr ~ 1/sqrt(d), two significant digits."""
    return float(f"{CPU_LR[family] * math.sqrt(CPU_WIDTH / hidden_size):.2g}")


# ---------------------------------------------------------------------------------------------------------
# The arithmetic


def interpolate(points: list, x: float):
    """y at x on the polyline of (x, y) points (x increasing), linear between them; None outside."""
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x0 <= x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0) if x1 != x0 else y0
    return points[0][1] if points and x == points[0][0] else None


def reach(gptplus: dict, family: dict) -> dict:
    """Tokens and training seconds a family's run needs to reach GPT+'s final loss, against GPT+'s own; each
    argument has `curve` [(tokens, loss)], `seconds` [(tokens, cumulative training seconds)] and
    `tokens_per_s` (steady)."""
    speedup = speedup_over_gptplus(gptplus["curve"], family["curve"], [], [])
    tokens, base = speedup["steps"], speedup["gptplus_steps"]
    seconds = interpolate(family["seconds"], tokens) if tokens is not None else None
    base_seconds = interpolate(gptplus["seconds"], base) if base is not None else None
    steady = tokens / family["tokens_per_s"] if tokens is not None and family["tokens_per_s"] else None
    base_steady = base / gptplus["tokens_per_s"] if base is not None and gptplus["tokens_per_s"] else None
    return {"target_loss": speedup["target_loss"], "reached": speedup["reached"],
            "tokens": tokens, "gptplus_tokens": base, "tokens_speedup": speedup["speedup"],
            "seconds": seconds, "gptplus_seconds": base_seconds,
            "seconds_speedup": base_seconds / seconds if seconds and base_seconds else None,
            "seconds_steady": steady, "gptplus_seconds_steady": base_steady,
            "seconds_steady_speedup": base_steady / steady if steady and base_steady else None,
            "own_final_loss": speedup["own_final_loss"],
            "gptplus_tokens_to_own_final": speedup["gptplus_steps_to_own_final"],
            "tokens_to_own_final": speedup["steps_to_own_final"],
            "tokens_speedup_at_own_final": speedup["speedup_at_own_final"]}


def affordable_steps(budget_s: float, elapsed_s: float, step_ms: dict, tokens_per_step: int, startup_s: float,
                     evals: int, eval_iters: int, report_s: float, safety: float = 0.9) -> tuple:
    """(steps, the sum) that fit the time left: T = safety * (budget - elapsed - startups - evaluations - report)
    / sum over families of 1 / tokens/s, in whole steps. An evaluation of a global batch is counted as a third
    of a training step (a forward without backward)."""
    evaluations = sum(evals * eval_iters * ms / 3000 for ms in step_ms.values())
    left = budget_s - elapsed_s - len(step_ms) * startup_s - evaluations - report_s
    seconds_per_token = sum(ms / 1000 / tokens_per_step for ms in step_ms.values())
    return max(0, int(safety * left / seconds_per_token) // tokens_per_step), {
        "budget_s": budget_s, "elapsed_s": elapsed_s, "startup_s": startup_s, "evaluations_s": evaluations,
        "report_s": report_s, "train_s": left, "safety": safety}


def seconds_curve(records: list, tokens_per_step: int) -> list:
    """[(tokens, cumulative training seconds)] at each logged iteration, from the windows' ms per step."""
    points, seconds, last = [(0, 0.0)], 0.0, 0
    for r in records:
        if r["kind"] == "train" and r.get("ms_per_step") is not None:
            seconds += r["ms_per_step"] / 1000 * (r["iteration"] - last)
            last = r["iteration"]
            points.append((last * tokens_per_step, seconds))
    return points


# ---------------------------------------------------------------------------------------------------------
# The runs


class RaceRun(Run):
    worker_script = os.path.abspath(__file__)


def token_digest(trainer):
    """Hash every training batch's tokens as the trainer hands them to the step; returns the result's part."""
    from angpt.training.faults import Hooks  # noqa: PLC0415 (runs only: imports torch)

    digest, counted = hashlib.sha256(), [0]
    inner = trainer.hooks

    class Digest(Hooks):
        def step(self, iteration, exit_received):
            return inner.step(iteration, exit_received)

        def batches(self, iteration, batches):
            for batch in batches:
                digest.update(batch["tokens"].cpu().numpy().tobytes())
                counted[0] += batch["tokens"].numel()
            return inner.batches(iteration, batches)

    trainer.hooks = Digest()
    return lambda: {"token_digest": digest.hexdigest(), "tokens_seen": counted[0]}


def load(run: RaceRun, tokens_per_step: int) -> dict:
    base = run.load()
    records = read_metrics(run.metrics)
    train = [r for r in records if r["kind"] == "train" and r.get("tokens_per_s_per_device")]
    with open(run.result) as file:
        result = json.load(file)
    steady = [r["tokens_per_s_per_device"] for r in train[1:]] or [r["tokens_per_s_per_device"] for r in train]
    seconds = seconds_curve(records, tokens_per_step)
    return {"family": run.family, "lr": run.lr, "exit_code": base["exit_code"],
            "curve": [(step * tokens_per_step, loss) for step, loss in base["curve"]],
            "final_val_loss": base["final_val_loss"], "seconds": seconds, "train_seconds": seconds[-1][1],
            "process_seconds": base["train_seconds"], "tokens_per_s": statistics.median(steady) if steady else None,
            "ms_per_step": base["ms_per_step"], "skipped_steps": base["skipped_steps"],
            "token_digest": result.get("token_digest"), "tokens_seen": result.get("tokens_seen"),
            "residual_norms": base["probe"].get("residual_norms_text"), "command": base["command"]}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", required=True, help="directory with train_text_document and "
                        "valid_text_document (tools/race_corpus.py --prepare ... --output-dir DIR)")
    parser.add_argument("--output-dir", required=True, help="race.json, race.md and race.png go here")
    parser.add_argument("--work-dir", help="run directories (default OUTPUT_DIR/runs)")
    parser.add_argument("--tiny", action="store_true", help="the CPU's shape: " + str(SHAPES["tiny"]))
    for key in ("hidden_size", "num_layers", "num_attention_heads", "seq_length", "micro_batch_size",
                "global_batch_size", "eval_iters", "evals"):
        parser.add_argument("--" + key.replace("_", "-"), type=int, help=f"default {SHAPES['gpu'][key]} "
                            f"({SHAPES['tiny'][key]} with --tiny)")
    parser.add_argument("--bf16", action=argparse.BooleanOptionalAction, help="default on (off with --tiny)")
    size = parser.add_mutually_exclusive_group(required=True)
    size.add_argument("--train-tokens", type=int, help="tokens per family (rounded down to whole steps)")
    size.add_argument("--time-budget", type=float, metavar="S",
                      help="seconds for the whole race from now: measure each family's step, then train the "
                      "tokens that fit")
    parser.add_argument("--max-train-tokens", type=int, help="cap --time-budget's choice")
    parser.add_argument("--startup-s", type=float, help="--time-budget's allowance for each run's start "
                        f"(default {SHAPES['gpu']['startup_s']:g}; {SHAPES['tiny']['startup_s']:g} with --tiny)")
    parser.add_argument("--report-s", type=float, default=10.0, help="--time-budget's allowance for the report")
    parser.add_argument("--probe-rounds", type=int, default=5, help="timed steps of each family for --time-budget")
    parser.add_argument("--lr", action="append", default=[], metavar="FAMILY=LR",
                        help="this family's lr instead of the transferred one (repeatable)")
    parser.add_argument("--seed", type=int, default=0)
    options = parser.parse_args(argv)
    shape = dict(SHAPES["tiny" if options.tiny else "gpu"])
    for key in shape:
        if getattr(options, key, None) is not None:
            shape[key] = getattr(options, key)
    options.shape = shape
    options.lrs = {f: transferred_lr(f, shape["hidden_size"]) for f in FAMILIES}
    for item in options.lr:
        family, _, value = item.partition("=")
        try:
            options.lrs[family] = float(value)
        except ValueError:
            family = None
        if family not in FAMILIES or not options.lrs[family] > 0:
            parser.error(f"--lr {item}: FAMILY=LR with FAMILY one of {', '.join(FAMILIES)} and LR positive")
    options.corpus = os.path.abspath(options.corpus)
    options.output_dir = os.path.abspath(options.output_dir)
    options.work_dir = os.path.abspath(options.work_dir or os.path.join(options.output_dir, "runs"))
    options.code = None  # the runs import the tree as it is (no snapshot: one invocation, minutes)
    return options


def main(argv=None) -> None:
    start = time.perf_counter()
    options = parse_args(argv)
    shape = options.shape
    for split in ("train", "valid"):
        if not os.path.isfile(os.path.join(options.corpus, f"{split}_text_document.idx")):
            raise SystemExit(f"race.py: no {options.corpus}/{split}_text_document (python tools/race_corpus.py "
                             f"--prepare CORPUS --output-dir {options.corpus})")
    with open(os.path.join(options.corpus, "train_text_document.json")) as file:
        corpus_train_tokens = json.load(file)["tokens"]
    tokens_per_step = shape["global_batch_size"] * shape["seq_length"]
    # One epoch at most: a sample is seq_length + 1 tokens.
    max_steps = corpus_train_tokens // (shape["seq_length"] + 1) // shape["global_batch_size"]
    os.makedirs(options.output_dir, exist_ok=True)
    flags = ["--bf16"] if shape["bf16"] else []

    def runs(train_iters: int) -> dict:
        interval = max(1, train_iters // shape["evals"])
        settings = {**{k: shape[k] for k in ("hidden_size", "num_layers", "num_attention_heads", "seq_length",
                                             "micro_batch_size", "global_batch_size", "eval_iters")},
                    "train_iters": train_iters, "eval_interval": interval, "log_interval": interval,
                    "probe_batches": 1}
        return {f: RaceRun(f, f, options.lrs[f], options.seed, flags, settings, options) for f in FAMILIES}

    sizing = {"corpus_train_tokens": corpus_train_tokens, "max_steps_one_epoch": max_steps}
    if options.time_budget is not None:
        probe = os.path.join(options.work_dir, "probe.json")
        configs = {f: run.argv for f, run in runs(100).items()}
        print(f"probe: each family built and stepped {options.probe_rounds} times side by side", flush=True)
        done = subprocess.run([sys.executable, os.path.abspath(__file__), "_probe", probe, str(options.probe_rounds),
                               json.dumps(configs)], cwd=ROOT, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                   p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)})
        if done.returncode:
            raise SystemExit(f"race.py: the probe of the step times failed (exit {done.returncode}; its log is above)")
        with open(probe) as file:
            step_ms = json.load(file)["ms"]
        steps, budget = affordable_steps(options.time_budget, time.perf_counter() - start, step_ms, tokens_per_step,
                                         options.startup_s or shape["startup_s"], shape["evals"], shape["eval_iters"],
                                         options.report_s)
        sizing.update(budget, probe_ms_per_step=step_ms, probe_tokens_per_s={
            f: tokens_per_step / (ms / 1000) for f, ms in step_ms.items()}, affordable_steps=steps)
        if options.max_train_tokens:
            steps = min(steps, options.max_train_tokens // tokens_per_step)
    else:
        steps = options.train_tokens // tokens_per_step
    steps = min(steps, max_steps)
    if steps < 2:
        raise SystemExit(f"race.py: {steps} steps fit ({json.dumps(clean(sizing))}): no race")
    sizing["steps"] = steps
    race = runs(steps)
    print(f"race: {steps} steps of {tokens_per_step} tokens = {steps * tokens_per_step:,} tokens per family "
          f"({steps * tokens_per_step / corpus_train_tokens:.2f} of the corpus's train tokens), lrs "
          + ", ".join(f"{NAMES[f]} {options.lrs[f]:g}" for f in FAMILIES), flush=True)
    # A failed run (a crash; a diverged one finishes with its exit code) does not stop the others: one GPU
    # call is all there is, and the report says what finished.
    run_jobs([r.job for r in race.values()], parallel=1, threads=os.cpu_count(), judge=judge)
    families = {f: load(race[f], tokens_per_step) for f in FAMILIES if race[f].done()}
    failed = [f for f in FAMILIES if f not in families]
    digests = {f: families[f]["token_digest"] for f in families}
    report = {
        "shape": shape, "lrs": options.lrs, "lr_rule": f"CPU-tuned lr at d={CPU_WIDTH} x sqrt({CPU_WIDTH} / d)",
        "seed": options.seed, "corpus": options.corpus, "tokens_per_step": tokens_per_step,
        "train_tokens": steps * tokens_per_step, "sizing": sizing, "families": families, "failed": failed,
        "same_tokens": len(set(digests.values())) == 1 and None not in digests.values(),
        "reach": {f: reach(families["gptplus"], families[f]) for f in ("angpt", "ngpt")
                  if "gptplus" in families and f in families},
        "wall_seconds": time.perf_counter() - start,
    }
    if families:
        with open(race[next(iter(families))].result) as file:
            report["padded_vocab_size"] = json.load(file)["padded_vocab_size"]
        write(report, options.output_dir)
    if failed:
        raise SystemExit(f"race.py: the runs of {', '.join(NAMES[f] for f in failed)} failed (their logs are above)")
    if not report["same_tokens"]:
        raise SystemExit(f"race.py: the families trained on different tokens: {digests}")


# ---------------------------------------------------------------------------------------------------------
# Output


def markdown(report: dict) -> str:
    s, fams, reach_ = report["shape"], report["families"], report["reach"]
    lines = [
        "# The race: GPT+, anGPT and nGPT at d={hidden_size}".format(**s), "",
        f"d={s['hidden_size']}, {s['num_layers']} layers, {s['num_attention_heads']} heads, context "
        f"{s['seq_length']}, padded vocabulary {report['padded_vocab_size']}, {'BF16' if s['bf16'] else 'FP32'}; "
        f"{report['sizing']['steps']} steps of {s['global_batch_size']} x {s['seq_length']} = "
        f"{report['train_tokens']:,} tokens per family, the same tokens in the same order: "
        f"{'yes' if report['same_tokens'] else 'NO'} (sha256 of every training batch's tokens, "
        f"{next(iter(fams.values()))['token_digest'][:16]}...); seed {report['seed']}, one run per family. "
        f"Validation: the same {s['eval_iters']} global batches of held-out text "
        f"({s['eval_iters'] * report['tokens_per_step']:,} tokens) at {len(next(iter(fams.values()))['curve'])} token "
        f"counts. Learning rates: {report['lr_rule']}.", "",
        "| model | lr | final val loss | tokens/s (steady) | training s | tokens to GPT+'s final loss | vs GPT+ "
        "| training s to it | vs GPT+ (measured; at steady tokens/s) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for f in FAMILIES:
        fam = fams.get(f)
        if fam is None:
            lines.append(f"| {NAMES[f]} | {report['lrs'][f]:g} | failed: runs/{f}/ has its log | | | | | | |")
            continue
        r = reach_.get(f) or next(iter(reach_.values()), None)
        if r is None:
            cells = ["-", "-", "-", "-"]
        elif f == "gptplus":
            cells = [fmt(r["gptplus_tokens"], ",.0f"), "1", fmt(r["gptplus_seconds"], ".1f"), "1"]
        else:
            if r["reached"]:
                cells = [fmt(r["tokens"], ",.0f"), fmt(r["tokens_speedup"], ".2f", suffix="x"),
                         fmt(r["seconds"], ".1f"), f"{fmt(r['seconds_speedup'], '.2f', suffix='x')}; "
                         f"{fmt(r['seconds_steady_speedup'], '.2f', suffix='x')}"]
            else:
                cells = ["not reached", f"{fmt(r['tokens_speedup_at_own_final'], '.2f', suffix='x')} at its own "
                         "final loss", "-", "-"]
        lines.append(f"| {NAMES[f]} | {fam['lr']:g} | {fmt(fam['final_val_loss'])} | "
                     f"{fmt(fam['tokens_per_s'], ',.0f')} | {fmt(fam['train_seconds'], '.1f')} | " + " | ".join(cells)
                     + " |")
    target = fmt(fams["gptplus"]["final_val_loss"]) if "gptplus" in fams else "n/a (GPT+ failed)"
    lines += ["", f"L* = GPT+'s final validation loss, {target}. Tokens to L*: the first evaluation at "
              "or below it, linearly interpolated from the one before; training seconds: the run's cumulative step "
              "time (compilation in the first window included, evaluations excluded) at those tokens; 'at steady "
              "tokens/s': tokens to L* over the run's median throughput after its first window. A model that does "
              "not reach L* is compared the other way round (GPT+'s tokens to the model's final loss over the "
              "model's).", "",
              f"Tokens per parameter: {report['train_tokens'] / report['parameters']:.2f} "
              f"({report['parameters'] / 1e6:.1f}M parameters, GPT+); one seed: no spread is measured.", "",
              "![validation loss](race.png)", ""]
    return "\n".join(lines)


def parameters(shape: dict, vocab: int) -> int:
    """GPT+'s parameter count: embedding and untied head, 4 d^2 attention and 3 x 4 d^2 SwiGLU per layer."""
    d = shape["hidden_size"]
    return 2 * vocab * d + shape["num_layers"] * 16 * d * d


def plot(report: dict, path: str) -> None:
    import matplotlib  # noqa: PLC0415 (optional: the plot)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415 (after choosing the Agg back end)

    colors = {"angpt": "tab:blue", "gptplus": "tab:orange", "ngpt": "tab:green"}
    figure, (by_tokens, by_time) = plt.subplots(1, 2, figsize=(11, 4))
    gptplus = report["families"].get("gptplus")
    target = gptplus["final_val_loss"] if gptplus else None
    for f, fam in report["families"].items():
        tokens = [t / 1e6 for t, _ in fam["curve"]]
        losses = [loss for _, loss in fam["curve"]]
        seconds = [interpolate(fam["seconds"], t) for t, _ in fam["curve"]]
        label = f"{NAMES[f]} (lr {fam['lr']:g})"
        by_tokens.plot(tokens, losses, "o-", ms=3, color=colors[f], label=label)
        by_time.plot(seconds, losses, "o-", ms=3, color=colors[f], label=label)
        r = report["reach"].get(f)
        if r and r["reached"]:
            by_tokens.plot([r["tokens"] / 1e6], [target], "x", ms=10, color=colors[f])
            if r["seconds"] is not None:
                by_time.plot([r["seconds"]], [target], "x", ms=10, color=colors[f])
    finite = [loss for fam in report["families"].values() for _, loss in fam["curve"] if math.isfinite(loss)]
    for axis, label in ((by_tokens, "training tokens (millions)"), (by_time, "training seconds")):
        if target is not None:
            axis.axhline(target, color="gray", ls=":", lw=1, label="GPT+'s final loss (L*)")
        axis.set(xlabel=label, ylabel="validation loss", ylim=(min(finite) - 0.1, min(max(finite), min(finite) + 3)))
        axis.legend(fontsize=8)
    s = report["shape"]
    figure.suptitle(f"d={s['hidden_size']}, {s['num_layers']} layers, {report['train_tokens']:,} tokens, "
                    f"seed {report['seed']}", fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def write(report: dict, output_dir: str) -> None:
    report["parameters"] = parameters(report["shape"], report["padded_vocab_size"])
    stem = os.path.join(output_dir, "race")
    with open(stem + ".json", "w") as file:
        json.dump(clean(report), file, indent=1, allow_nan=False)
    text = markdown(report)
    with open(stem + ".md", "w") as file:
        file.write(text)
    plot(report, stem + ".png")
    print()
    print(text)
    print(f"wrote {stem}.json, {stem}.md, {stem}.png")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_probe":
        step_times(sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4]))
    elif len(sys.argv) > 1 and sys.argv[1] == "_worker":
        worker(sys.argv[2], sys.argv[5:], int(sys.argv[3]), watch=token_digest)
    else:
        main()
