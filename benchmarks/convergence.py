#!/usr/bin/env python
"""Reproduce the paper at small scale on CPU: convergence of anGPT, GPT+ and nGPT, the ablations the paper
measured and its norm-health figures (docs/model.md, Ablations and What the paper reports), on the Shakespeare
corpus of the quickstart.

    python benchmarks/convergence.py --output-dir docs/results                 # full: about 30-40 min, 2 cores
    python benchmarks/convergence.py --output-dir /tmp/conv --quick            # tiny shape: a few minutes
    python benchmarks/convergence.py --output-dir /tmp/conv --quick --train-iters 2 --max-lrs 1 --seeds 2 \\
        --ablation-list plain_residual --step-time-rounds 1 --jobs 4 --corpus DIR  # what the test runs

What it does
1. Learning-rate grid: each family (anGPT, GPT+ with its warm-up and weight decay, nGPT; each with its own
   optimizer recipe of `angpt.training.optimizer.RECIPES`) at each lr of its grid, seed 0, the same tokens.
2. Seeds: the best lr of each family (lowest final validation loss on seed 0) with --seeds seeds in all.
3. Ablations (docs/model.md, Ablations): anGPT at its best lr with one `--angpt-*` switch changed, at seeds
   0..--ablation-seeds-1, each compared with anGPT's run of the same seed (mean, std and t interval over seeds).
4. Norm health (docs/model.md, What the paper reports): after training, each run's model reads the first
   --probe-batches validation batches and then the same number of batches of one token repeated (the most
   frequent token of those batches) under `angpt.telemetry.health.HealthProbe`; the per-layer mean residual-stream
   norms and their ratio (repeated / text, mean over layers) are kept; alpha's trajectory comes from the
   health scalars of the run's metrics.jsonl (every --log-interval steps).

Each run is a subprocess that does what `python -m angpt.pretrain ARGS --metrics-file ...` does (same flag
parser, same `angpt.training.trainer.Trainer`) and then the probe above on the trained model, in the same process,
so no checkpoint is written. Runs go --jobs at a time (OMP_NUM_THREADS = cores / jobs each). A run whose
status.json under --work-dir says it finished with the same flags is not run again
(angpt.experiments.sweep_runner, as for tools/sweep.py): an interrupted invocation resumes where it stopped.

--families runs some of the families only (their grid and seeds), e.g. GPT+ at a new lr: that report has no
speed-up, ablations or norm health, and benchmarks/speedup_horizon.py combines it with a report of the others
at the same settings. Every report's JSON keeps each run's validation curve for that.

The validation loss is evaluated every --eval-interval steps on the same first --eval-iters global batches
of the validation split (a fixed subset). Speed-up over GPT+: with L* = the final value of GPT+'s
seed-averaged validation curve, the step at which a curve first reaches L* is found by linear
interpolation between evaluations; speed-up = steps(GPT+ to L*) / steps(model to L*). Per-seed speed-ups
(seed s of the model against seed s of GPT+, each against that GPT+ seed's final loss) give the spread.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections import Counter

from angpt.experiments.sweep_runner import Job, run_jobs
from angpt.telemetry.metrics_reader import read_metrics

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
FAMILIES = ("angpt", "gptplus", "ngpt")
NAMES = {"angpt": "anGPT", "gptplus": "GPT+", "ngpt": "nGPT"}

# Shapes and budgets. Head dim 64 as in the paper (docs/model.md, Model shapes), f = 4d (the default).
MODES = {
    "full": dict(hidden_size=128, num_layers=4, num_attention_heads=2, seq_length=128, micro_batch_size=16,
                 global_batch_size=16, train_iters=160, eval_interval=10, eval_iters=3, log_interval=10,
                 probe_batches=2,
                 lrs={"angpt": (1e-2, 3e-2, 1e-1), "gptplus": (3e-3, 1e-2, 3e-2), "ngpt": (1e-2, 3e-2, 1e-1)}),
    "quick": dict(hidden_size=64, num_layers=2, num_attention_heads=1, seq_length=64, micro_batch_size=8,
                  global_batch_size=8, train_iters=40, eval_interval=5, eval_iters=2, log_interval=5,
                  probe_batches=1,
                  lrs={"angpt": (3e-3, 1e-2, 3e-2), "gptplus": (1e-3, 3e-3, 1e-2), "ngpt": (3e-3, 1e-2, 3e-2)}),
}

# name: (flags, what the paper reports (docs/model.md, Ablations), label)
ABLATIONS = {
    "constant_factors_off": (["--angpt-constant-factors", "one"], "+1.09%", "constant factors -> 1"),
    "all_factors_off": (["--angpt-constant-factors", "one", "--angpt-nu-alpha", "one"], "+3%",
                        "all factors -> 1 incl. nu(alpha)"),
    "nu_alpha_off": (["--angpt-nu-alpha", "one"], "about +3%", "nu(alpha) -> 1 only"),
    "exact_norm": (["--angpt-constant-factors", "exact", "--angpt-nu-alpha", "exact"],
                   "+0.4% (+30% step time)", "every factor exact 1/norm(x)"),
    "constant_factors_x0.5": (["--angpt-constant-factor-multiplier", "0.5"], "+0.34%", "constant factors x0.5"),
    "constant_factors_x2": (["--angpt-constant-factor-multiplier", "2"], "+0.12%", "constant factors x2"),
    "nu_alpha_x0.5": (["--angpt-nu-alpha-multiplier", "0.5"], "collapses", "nu(alpha) x0.5"),
    "nu_alpha_x2": (["--angpt-nu-alpha-multiplier", "2"], "collapses", "nu(alpha) x2"),
    "plain_residual": (["--angpt-residual", "plain"], "+1.89%", "plain residual instead of LERP"),
}
PAPER_GPTPLUS = "+1.46%"  # GPT+ instead of anGPT
PAPER = {
    "speedup": {"angpt": 1.40, "ngpt": 1.29},
    "ood_ratio": {"angpt": 1.5, "gptplus": 3.4},
    "alpha": "rises from about 0.05 to 0.12-0.25",
    "residual_norms": "anGPT moderate (up to about 2.9); GPT+ grows with depth",
}


# ---------------------------------------------------------------------------------------------------------
# The worker: one training run and its probe, in its own process. torch and angpt are imported in these
# functions, which only the runs' processes call: the coordinator starts without them.


def worker(result_path: str, argv: list[str], probe_batches: int, watch=None) -> None:
    """What `angpt.pretrain.main(argv)` does, then the norm probe on the trained model; writes result_path.
    `watch(trainer)`, when given, runs before training and returns a callable whose dict joins the result
    (benchmarks/race.py's digest of the training tokens)."""
    import torch  # noqa: PLC0415 (runs only)
    import torch.distributed as dist  # noqa: PLC0415 (runs only)

    from angpt.config.arguments import parse_args  # noqa: PLC0415 (runs only)
    from angpt.training.trainer import Trainer  # noqa: PLC0415 (runs only)

    config = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("angpt").setLevel(logging.INFO)
    start = time.perf_counter()
    trainer = Trainer(config)
    watched = watch(trainer) if watch else dict
    code = trainer.run()
    seconds = time.perf_counter() - start
    try:
        probe = probe_norms(trainer, probe_batches)
    except Exception as error:  # a collapsed model may not survive the probe; the run's figures still count
        probe = {"error": repr(error)}
    dist.barrier()
    dist.destroy_process_group()
    result = {"exit_code": code, "train_seconds": seconds, "threads": torch.get_num_threads(), "probe": probe,
              "vocab_size": trainer.vocabulary.vocab_size, "padded_vocab_size": trainer.vocab_size, **watched()}
    with open(result_path + ".tmp", "w") as file:
        json.dump(result, file)
    os.replace(result_path + ".tmp", result_path)


def probe_norms(trainer, num_batches: int) -> dict:
    """Per-layer mean residual-stream norms on validation text and on one token repeated."""
    import torch  # noqa: PLC0415 (runs only)

    from angpt.data.gpt_datasets import micro_batches  # noqa: PLC0415 (runs only)
    from angpt.telemetry.health import HealthProbe  # noqa: PLC0415 (runs only)
    from angpt.training.step import on_device  # noqa: PLC0415 (runs only)

    training = trainer.run_config.training
    model = trainer.chunks[0]
    model.eval()
    probe = HealthProbe(trainer.chunks)
    batches = [on_device(b) for i in range(num_batches)
               for b in micro_batches(trainer.data.valid, i * training.global_batch_size, training.global_batch_size,
                                      training.micro_batch_size, 0, 1)]
    token = Counter(torch.cat([b["tokens"].flatten() for b in batches]).tolist()).most_common(1)[0][0]

    def norms(inputs) -> list[float]:
        with torch.no_grad(), probe.capture():
            for batch in inputs:
                model(batch["tokens"], batch["position_ids"], None)
        summary = probe.summary()
        keys = sorted(k for k in summary if k.startswith("health/residual_norm/"))
        return [summary[k] for k in keys]

    text = norms(batches)
    repeated = norms([{**b, "tokens": torch.full_like(b["tokens"], token)} for b in batches])
    ratio = statistics.fmean(repeated) / statistics.fmean(text)
    return {"token": token, "residual_norms_text": text, "residual_norms_repeated": repeated,
            "ood_ratio": ratio}


def step_times(result_path: str, rounds: int, configs: dict) -> None:
    """Median training-step time of each configuration {name: pretrain argv}, built side by side in one
    process and stepped in turn by benchmarks/step_time.py's interleaved_step_times. Writes {name: ms}."""
    import torch  # noqa: PLC0415 (runs only)
    from step_time import interleaved_step_times, random_batch  # noqa: PLC0415 (runs only; imports torch)

    from angpt.config.arguments import parse_args  # noqa: PLC0415 (runs only)
    from angpt.data.gpt_datasets import dataset_vocabulary  # noqa: PLC0415 (runs only)
    from angpt.training import distributed  # noqa: PLC0415 (runs only)
    from angpt.training.megatron_configs import transformer_config  # noqa: PLC0415 (runs only)
    from angpt.training.optimizer import build_optimizer  # noqa: PLC0415 (runs only)
    from angpt.training.step import build_model_chunks  # noqa: PLC0415 (runs only)

    distributed.initialize()
    built = {}
    for name, argv in configs.items():
        config = parse_args(argv)
        # The vocabulary of the runs: that of their corpus, padded as the trainer pads it.
        vocab_size = config.padded_vocab_size(dataset_vocabulary(config.data).vocab_size)
        chunks = build_model_chunks(transformer_config(config), vocab_size, config.model.seq_length)
        # The runs' flags set the family, lr and length only: the optimizer of their run.
        built[name] = (chunks, *build_optimizer(chunks, config))
    times = interleaved_step_times(built, random_batch(config.training.micro_batch_size, config.model.seq_length,
                                                       vocab_size), rounds)
    with open(result_path, "w") as file:
        json.dump({"ms": {n: 1000 * statistics.median(t) for n, t in times.items()}, "rounds": rounds,
                   "threads": torch.get_num_threads()}, file)


# ---------------------------------------------------------------------------------------------------------
# Runs


class Run:
    worker_script = os.path.abspath(__file__)  # the script whose `_worker` command runs it

    def __init__(self, name: str, family: str, lr: float, seed: int, flags: list[str], settings: dict,
                 options):
        self.name, self.family, self.lr, self.seed, self.flags = name, family, lr, seed, flags
        self.dir = os.path.join(options.work_dir, name)
        self.metrics = os.path.join(self.dir, "metrics.jsonl")
        self.result = os.path.join(self.dir, "result.json")
        s = settings
        corpus = options.corpus
        self.argv = [
            "--model-family", family, "--num-layers", str(s["num_layers"]), "--hidden-size", str(s["hidden_size"]),
            "--num-attention-heads", str(s["num_attention_heads"]), "--seq-length", str(s["seq_length"]),
            "--micro-batch-size", str(s["micro_batch_size"]), "--global-batch-size", str(s["global_batch_size"]),
            "--train-iters", str(s["train_iters"]), "--lr", repr(lr), "--seed", str(seed),
            "--train-data-path", f"{corpus}/train_text_document", "--valid-data-path", f"{corpus}/valid_text_document",
            "--data-cache-path", os.path.join(self.dir, "cache"),
            "--eval-interval", str(s["eval_interval"]), "--eval-iters", str(s["eval_iters"]),
            "--log-interval", str(s["log_interval"]), "--metrics-file", self.metrics, *flags,
        ]
        path = [p for p in (options.code, ROOT, os.environ.get("PYTHONPATH")) if p]
        self.job = Job(name=name, directory=self.dir, description=f"{family}, lr {lr:g}, seed {seed}",
                       flags=[str(s["probe_batches"]), *self.argv],
                       command=[sys.executable, self.worker_script, "_worker", self.result,
                                str(s["probe_batches"]), "--", *self.argv],
                       env={"PYTHONPATH": os.pathsep.join(path)}, cwd=ROOT,
                       # No checkpoints: an interrupted attempt starts again from scratch.
                       start_over=("metrics.jsonl", "result.json", "cache"))
        os.makedirs(self.dir, exist_ok=True)
        with open(os.path.join(self.dir, "command.txt"), "w") as file:
            file.write("python -m angpt.pretrain " + " ".join(self.argv) + "\n")

    def done(self) -> bool:
        return self.job.is_finished()

    def load(self) -> dict:
        """Everything the report needs from this run's files."""
        with open(self.result) as file:
            result = json.load(file)
        records = read_metrics(self.metrics)
        evals = [(r["iteration"], r["lm_loss"]) for r in records if r["kind"] == "eval"
                 and r.get("split") == "validation"]
        train = [r for r in records if r["kind"] == "train"]
        ms = [r["ms_per_step"] for r in train[1:] or train if r.get("ms_per_step")]
        alpha = {}
        for r in train:
            for kind in ("attention", "mlp"):
                values = [v for k, v in r.items() if k.startswith(f"health/alpha_{kind}/") and v is not None]
                if values:
                    alpha.setdefault(kind, []).append((r["iteration"], statistics.fmean(values)))
        final = evals[-1][1] if evals else None
        if final is not None and not math.isfinite(final):
            final = None
        return {
            "name": self.name, "family": self.family, "lr": self.lr, "seed": self.seed, "flags": self.flags,
            "exit_code": result["exit_code"], "train_seconds": result["train_seconds"],
            "vocab_size": result.get("vocab_size"),  # absent from the results of older versions
            "curve": evals, "final_val_loss": final, "first_train_loss": train[0]["lm_loss"] if train else None,
            "skipped_steps": sum(r.get("skipped", 0) or 0 for r in train),
            "ms_per_step": statistics.median(ms) if ms else None, "alpha": alpha, "probe": result["probe"],
            "command": "python -m angpt.pretrain " + " ".join(self.argv),
        }


LOAD_FILE = None  # where the load averages seen by an invocation go, so that --report-only finds them


def record_load(loads: list) -> None:
    loads.append(os.getloadavg()[0])
    if LOAD_FILE:
        with open(LOAD_FILE, "a") as file:
            file.write(f"{time.time():.0f} {loads[-1]:.2f}\n")


def judge(job: Job, returncode: int) -> dict:
    """Finished: a clean exit that wrote result.json (the worker writes it last)."""
    return {"status": "finished" if returncode == 0 and os.path.isfile(os.path.join(job.directory, "result.json"))
            else "failed"}


def run_all(runs: list[Run], jobs: int, loads: list) -> None:
    """Run what is not done yet, `jobs` at a time (cores / jobs threads each), printing progress; stops at
    the first failure."""
    counts = run_jobs([r.job for r in runs], parallel=jobs, threads=max(1, (os.cpu_count() or 1) // jobs),
                      judge=judge, stop_on_failure=True, on_progress=lambda: record_load(loads))
    if counts["failed"]:
        raise SystemExit(f"run {counts['failed_runs'][0]} failed (its log is above)")


# ---------------------------------------------------------------------------------------------------------
# Analysis


def steps_to_reach(curve: list, target: float):
    """The first step at which the curve (step, loss) reaches `target`, linear between evaluations."""
    previous = None
    for step, loss in curve:
        if loss is not None and math.isfinite(loss) and loss <= target:
            if previous is None:
                return float(step)
            (s0, l0) = previous
            return s0 + (step - s0) * (l0 - target) / (l0 - loss) if l0 != loss else float(step)
        previous = (step, loss) if loss is not None and math.isfinite(loss) else previous
    return None


def mean_curve(curves: list[list]) -> list:
    steps = [s for s, _ in curves[0]]
    return [(s, statistics.fmean(c[i][1] for c in curves)) for i, s in enumerate(steps)]


def spread(values: list[float]) -> dict:
    values = [v for v in values if v is not None]
    if not values:
        return {"mean": None, "std": None, "min": None, "max": None, "n": 0}
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "min": min(values), "max": max(values), "n": len(values)}


def paired_change(runs: list[dict], reference_by_seed: dict, level: float = 0.95) -> dict:
    """The relative change of the final validation loss of `runs` against the reference run of the same seed
    (same initialization stream and data order), per seed; its mean and std over seeds and the Student t
    interval of the mean at `level`. sign: "+" or "-" when the interval excludes 0, "inside noise" when it
    does not, None with one seed (no interval)."""
    by_seed = {}
    for run in runs:
        ref = reference_by_seed.get(run["seed"])
        if ref and run["final_val_loss"] is not None and ref["final_val_loss"] is not None:
            by_seed[run["seed"]] = run["final_val_loss"] / ref["final_val_loss"] - 1
    stats = spread(list(by_seed.values()))
    interval, sign = None, None
    if stats["n"] >= 2:
        from scipy.stats import t  # noqa: PLC0415 (optional: scipy, as matplotlib for the plots)

        half = t.ppf(0.5 + level / 2, stats["n"] - 1) * stats["std"] / math.sqrt(stats["n"])
        interval = [stats["mean"] - half, stats["mean"] + half]
        sign = "+" if interval[0] > 0 else "-" if interval[1] < 0 else "inside noise"
    return {"by_seed": by_seed, **stats, "interval": interval, "level": level, "sign": sign}


def loss_key(run: dict) -> float:
    return run["final_val_loss"] if run["final_val_loss"] is not None else math.inf


def speedup_over_gptplus(gpt_curve: list, curve: list, gpt_runs: list[dict], runs: list[dict]) -> dict:
    """A model's speed-up over GPT+ (the two seed-mean validation curves): steps GPT+ needs to reach its own
    final loss L*, over the steps the model needs to reach L*; per seed, run s against GPT+'s run s (runs with
    their curves; none: no per-seed figures)."""
    target = gpt_curve[-1][1]
    base_steps, steps = steps_to_reach(gpt_curve, target), steps_to_reach(curve, target)
    per_seed = []
    gpt_by_seed = {r["seed"]: r for r in gpt_runs}
    for r in runs:
        g = gpt_by_seed.get(r["seed"])
        if g is None or not g["curve"]:
            continue
        gs = steps_to_reach(g["curve"], g["curve"][-1][1])
        ms = steps_to_reach(r["curve"], g["curve"][-1][1])
        per_seed.append(gs / ms if gs and ms else None)
    # Not reached: the other way round, with the model's own final loss as the target (then < 1).
    own = curve[-1][1]
    own_steps, gpt_steps_to_own = steps_to_reach(curve, own), steps_to_reach(gpt_curve, own)
    return {"target_loss": target, "gptplus_steps": base_steps, "steps": steps,
            "speedup": base_steps / steps if base_steps and steps else None,
            "own_final_loss": own, "gptplus_steps_to_own_final": gpt_steps_to_own, "steps_to_own_final": own_steps,
            "speedup_at_own_final": gpt_steps_to_own / own_steps if gpt_steps_to_own and own_steps else None,
            "per_seed": per_seed, "per_seed_spread": spread(per_seed), "reached": steps is not None}


def family_summary(grid_runs: list[dict], seed_runs: list[dict]) -> dict:
    """One family's lr grid (seed 0), its best lr and its runs at that lr over seeds."""
    return {"best_lr": min(grid_runs, key=loss_key)["lr"],
            "final_val_loss": spread([r["final_val_loss"] for r in seed_runs]),
            "finals_by_seed": {r["seed"]: r["final_val_loss"] for r in seed_runs},
            "ms_per_step": spread([r["ms_per_step"] for r in seed_runs]),
            "grid": [{"lr": r["lr"], "final_val_loss": r["final_val_loss"]} for r in grid_runs],
            "mean_curve": mean_curve([r["curve"] for r in seed_runs])}


def common_report(grid: dict, seeds: dict, settings: dict, options, loads: list, wall: float,
                  extra_runs: list[dict] = ()) -> dict:
    """What every report has: the settings, the families run (grid and seeds) and each run with its
    validation curve, so that a later report (benchmarks/speedup_horizon.py) can combine runs of several."""
    runs = [*[x for f in grid for x in grid[f]], *[x for f in seeds for x in seeds[f]], *extra_runs]
    return {
        "mode": options.mode_name, "settings": {k: v for k, v in settings.items() if k != "lrs"},
        "lr_grid": {f: list(settings["lrs"][f]) for f in grid},
        "tokens_per_run": settings["train_iters"] * settings["global_batch_size"] * settings["seq_length"],
        "validation_tokens_per_eval": settings["eval_iters"] * settings["global_batch_size"] * settings["seq_length"],
        "seeds": sorted({r["seed"] for f in seeds for r in seeds[f]}), "jobs": options.jobs,
        "seeds_by_family": {f: sorted(r["seed"] for r in seeds[f]) for f in seeds},
        "code_commit": options.commit, "corpus": options.corpus, "vocab_size": runs[0]["vocab_size"],
        "load_average": spread(loads), "wall_seconds": wall,
        "families": {f: family_summary(grid[f], seeds[f]) for f in seeds}, "paper": PAPER,
        "runs": list({r["name"]: {k: r[k] for k in ("name", "family", "lr", "seed", "final_val_loss", "ms_per_step",
                                                  "train_seconds", "exit_code", "command", "curve")}
                      for r in runs}.values()),
    }


def analyse(grid: dict, seeds: dict, ablations: dict, settings: dict, options, loads: list, wall: float) -> dict:
    report = common_report(grid, seeds, settings, options, loads, wall,
                           [x for runs in ablations.values() for x in runs])
    families = report["families"]
    speedups = {f: speedup_over_gptplus(families["gptplus"]["mean_curve"], families[f]["mean_curve"],
                                        seeds["gptplus"], seeds[f]) for f in ("angpt", "ngpt")}
    reference = next(r for r in seeds["angpt"] if r["seed"] == 0)
    angpt_by_seed = {r["seed"]: r for r in seeds["angpt"]}
    ablation_seeds = list(range(options.ablation_seeds))
    references = [angpt_by_seed[s] for s in ablation_seeds if s in angpt_by_seed]
    reference_final = spread([r["final_val_loss"] for r in references])["mean"]
    abl_rows = []
    gpt_instead = [r for r in seeds["gptplus"] if r["seed"] in ablation_seeds]
    for name, runs in [*ablations.items(), ("gptplus_instead", gpt_instead)]:
        flags, paper, label = ABLATIONS.get(name, ([], PAPER_GPTPLUS, "GPT+ instead of anGPT (at its best lr)"))
        finals = [r["final_val_loss"] for r in runs]
        # Collapsed (any seed): no finite loss, stopped on NaNs, or lost more than half of anGPT's progress
        # from the first logged training loss.
        collapsed = False
        for run in runs:
            first, ref, final = run["first_train_loss"], angpt_by_seed[run["seed"]]["final_val_loss"], \
                run["final_val_loss"]
            collapsed |= final is None or run["exit_code"] != 0 or (
                first is not None and ref is not None and first > ref and final - ref > 0.5 * (first - ref))
        change = paired_change(runs, angpt_by_seed)
        ms = [r["ms_per_step"] for r in runs if r["ms_per_step"]]
        ms_per_step = statistics.median(ms) if ms else None
        abl_rows.append({
            "name": name, "label": label, "flags": flags, "paper": paper, "seeds": [r["seed"] for r in runs],
            "final_val_loss": spread(finals)["mean"] if None not in finals else None,
            "relative_change": change["mean"], "relative_change_paired": change,
            "step_time_relative": ms_per_step / reference["ms_per_step"]
            if ms_per_step and reference["ms_per_step"] else None,
            "ms_per_step": ms_per_step, "skipped_steps": sum(r["skipped_steps"] for r in runs),
            "collapsed": collapsed, "curve": runs[0]["curve"] if runs else [],
        })
    seed_noise = families["angpt"]["final_val_loss"]
    health = {}
    for f in FAMILIES:
        r = next(r for r in seeds[f] if r["seed"] == 0)
        health[f] = {"residual_norms_text": r["probe"].get("residual_norms_text"),
                     "residual_norms_repeated": r["probe"].get("residual_norms_repeated"),
                     "ood_ratio": r["probe"].get("ood_ratio"), "repeated_token": r["probe"].get("token"),
                     "ood_ratio_by_seed": {s["seed"]: s["probe"].get("ood_ratio") for s in seeds[f]},
                     "ood_ratio_spread": spread([s["probe"].get("ood_ratio") for s in seeds[f]]),
                     "alpha": r["alpha"]}
    return {
        **report,
        "speedup": speedups, "speedup_method": (
            "L* = final value of GPT+'s seed-mean validation curve (fixed validation subset, every "
            f"{settings['eval_interval']} steps); steps to reach L* by linear interpolation between evaluations; "
            "speed-up = steps(GPT+) / steps(model); per seed: seed s against GPT+ seed s's own final loss"),
        "ablations": {"reference": {"lr": reference["lr"], "seeds": [r["seed"] for r in references],
                                    "final_val_loss": reference_final,
                                    "ms_per_step": reference["ms_per_step"],
                                    "seed_std_relative": (seed_noise["std"] / seed_noise["mean"])
                                    if seed_noise["mean"] else None},
                      "rows": abl_rows},
        "norm_health": health,
    }


# ---------------------------------------------------------------------------------------------------------
# Output


def clean(value):
    """NaN and Inf as None, so that the JSON is valid."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [clean(v) for v in value]
    return value


def fmt(value, spec=".4f", none="n/a", suffix=""):
    return none if value is None else format(value, spec) + suffix


def interval_level(rows: list[dict]) -> float:
    """The confidence level of the ablation rows' paired intervals (paired_change's default without rows)."""
    return next((r["relative_change_paired"]["level"] for r in rows), 0.95)


def markdown(report: dict) -> str:
    s = report["settings"]
    load = report["load_average"]
    lines = [
        f"# Small-scale reproduction ({report['mode']} mode)", "",
        f"Shape: d={s['hidden_size']}, {s['num_layers']} layers, {s['num_attention_heads']} heads (head dim "
        f"{s['hidden_size'] // s['num_attention_heads']}), context {s['seq_length']}, global batch "
        f"{s['global_batch_size']}, {s['train_iters']} steps = {report['tokens_per_run']} tokens per run; "
        f"corpus {report['corpus']}, vocabulary {fmt(report.get('vocab_size'), 'd', 'not recorded')}. "
        f"Validation: the same {report['validation_tokens_per_eval']} tokens every "
        f"{s['eval_interval']} steps. Seeds {report['seeds']}; {report['jobs']} runs at a time; wall "
        f"{report['wall_seconds'] / 60:.1f} min; 1-min load average during the runs "
        f"{fmt(load['mean'], '.2f')} (min {fmt(load['min'], '.2f')}, max {fmt(load['max'], '.2f')}).", "",
        *([f"Not finished when this report was written (left out): {', '.join(report['not_finished'])}.", ""]
          if report.get("not_finished") else []),
        "## Convergence", "",
        "| model | best lr (grid) | final val loss (mean ± std over seeds) | min-max | ms/step (median) "
        "| speed-up over GPT+ | paper |",
        "|---|---|---|---|---|---|---|",
    ]
    for f in report["families"]:
        fam = report["families"][f]
        v = fam["final_val_loss"]
        grid = ", ".join(f"{g['lr']:g}: {fmt(g['final_val_loss'], '.3f')}" for g in fam["grid"])
        if "speedup" not in report:
            sp, paper = "n/a", "-"
        elif f == "gptplus":
            sp, paper = "1 (reference)", "1"
        else:
            su = report["speedup"][f]
            reached = (f"{su['speedup']:.2f}x" if su["speedup"] else
                       f"L* not reached; {fmt(su['speedup_at_own_final'], '.2f')}x at its own final loss")
            spread = su["per_seed_spread"]
            sp = f"{reached} (per seed {fmt(spread['mean'], '.2f')} ± {fmt(spread['std'], '.2f')})"
            paper = f"{PAPER['speedup'][f]:.2f}x"
        lines.append(f"| {NAMES[f]} | {fam['best_lr']:g} ({grid}) | {fmt(v['mean'])} ± {fmt(v['std'])} "
                     f"(n={v['n']}) | {fmt(v['min'])}-{fmt(v['max'])} | {fmt(fam['ms_per_step']['mean'], '.1f')} | "
                     f"{sp} | {paper} |")
    if "speedup" not in report:
        return "\n".join([*lines, "", f"This report has {', '.join(NAMES[f] for f in report['families'])} "
                           "only (--families): no speed-up, ablations or norm health. benchmarks/speedup_horizon.py "
                           "combines it with a report of the other families at the same shape and horizon.", ""])
    su = report["speedup"]["angpt"]
    lines += ["", f"Speed-up: {report['speedup_method']}. L* = {su['target_loss']:.4f}, reached by GPT+ at step "
              f"{fmt(su['gptplus_steps'], '.1f')}, by anGPT at {fmt(su['steps'], '.1f')}, by nGPT at "
              f"{fmt(report['speedup']['ngpt']['steps'], '.1f')} ('n/a': not within the budget)."
              + ("" if all(report["speedup"][f]["reached"] for f in ("angpt", "ngpt")) else
                 " A model that does not reach L* is measured the other way round: speed-up = steps GPT+ needs to "
                 "reach the model's final loss / steps the model needs to reach it (GPT+: "
                 + ", ".join(f"{NAMES[f]}'s {report['speedup'][f]['own_final_loss']:.4f} at step "
                             f"{fmt(report['speedup'][f]['gptplus_steps_to_own_final'], '.1f')}"
                             for f in ("angpt", "ngpt") if not report["speedup"][f]["reached"]) + ")."), "",
              "![convergence](convergence.png)", "",
              "## Ablations (docs/model.md, Ablations)", ""]
    ref = report["ablations"]["reference"]
    seed_std = 100 * ref["seed_std_relative"] if ref["seed_std_relative"] is not None else None
    rounds = (report["ablations"].get("step_times_interleaved") or {}).get("rounds", "n/a")
    seeds = ref["seeds"]
    level = interval_level(report["ablations"]["rows"])
    lines += [f"anGPT at its best lr {ref['lr']:g}, seeds {seeds} "
              + ("(one seed per ablation to fit the time budget)" if len(seeds) == 1 else
                 "(each ablation at each of these seeds)")
              + f": val loss {fmt(ref['final_val_loss'])} (mean), {fmt(ref['ms_per_step'], '.1f')} ms/step. "
              f"Seed-to-seed std of anGPT's final loss: {fmt(seed_std, '.2f')}% of the mean. The change of an "
              "ablation is paired: its run against anGPT's run of the same seed"
              + (" (one seed: no interval, changes within the seed-to-seed std are noise)" if len(seeds) == 1 else
                 f", then the mean ± std over seeds and the {100 * level:g}% Student t interval of that mean; the "
                 "sign is stated only when the interval excludes 0, else 'inside noise'") + ". Step "
              "times are medians of runs that shared the CPU with another run and other work: rough. The "
              + ("side-by-side column times every model in one process, one step of each in turn on one random "
                 f"batch (as benchmarks/step_time.py does), median of {rounds} rounds after a warm-up round: load "
                 "hits all alike." if rounds != "n/a" else
                 "side-by-side timing was not run for this report (--step-time-rounds 0)."), "",
              f"| ablation | flags | val loss | change vs anGPT (mean ± std) | {100 * level:g}% interval | sign | "
              "paper | step time vs anGPT (in the run) | (side by side) | collapsed |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for row in report["ablations"]["rows"]:
        paired = row["relative_change_paired"]
        change = fmt(100 * paired["mean"] if paired["mean"] is not None else None, "+.2f")
        if paired["n"] > 1:
            change += f"% ± {100 * paired['std']:.2g}"  # two significant digits: a paired std can be 0.005%
        interval = (f"{100 * paired['interval'][0]:+.2f}% to {100 * paired['interval'][1]:+.2f}%"
                    if paired["interval"] else "n/a")
        lines.append(f"| {row['label']} | `{' '.join(row['flags']) or '--model-family gptplus'}` | "
                     f"{fmt(row['final_val_loss'])} | {change}% (n={paired['n']}) | {interval} | "
                     f"{paired['sign'] or 'n/a'} | {row['paper']} | "
                     f"{fmt(row['step_time_relative'], '.3f', suffix='x')} | "
                     f"{fmt(row.get('step_time_relative_interleaved'), '.3f', suffix='x')} | "
                     f"{'yes' if row['collapsed'] else 'no'} |")
    lines += ["", "![ablations](ablations.png)", "", "## Norm health (docs/model.md, What the paper reports)", "",
              "Mean residual-stream norm after each layer (validation text), per trained model (seed 0); the "
              "out-of-distribution test feeds the same number of sequences of one token repeated.", "",
              "| model | residual norm per layer (text) | (one token repeated) | OOD ratio seed 0 "
              "| OOD ratio over seeds | paper |",
              "|---|---|---|---|---|---|"]
    for f in FAMILIES:
        h = report["norm_health"][f]
        text = ", ".join(f"{v:.2f}" for v in h["residual_norms_text"] or [])
        rep = ", ".join(f"{v:.2f}" for v in h["residual_norms_repeated"] or [])
        sp = h["ood_ratio_spread"]
        paper = f"x{PAPER['ood_ratio'][f]}" if f in PAPER["ood_ratio"] else "-"
        lines.append(f"| {NAMES[f]} | {text} | {rep} | x{fmt(h['ood_ratio'], '.2f')} | "
                     f"x{fmt(sp['mean'], '.2f')} ± {fmt(sp['std'], '.2f')} | {paper} |")
    lines += [""]
    for f in ("angpt", "ngpt"):
        alpha = report["norm_health"][f]["alpha"]
        for kind, traj in alpha.items():
            if traj:
                lines.append(f"- {NAMES[f]} mean alpha_{kind[0].upper()} (over layers and units): "
                             f"{traj[0][1]:.4f} at step {traj[0][0]} -> {traj[-1][1]:.4f} at step {traj[-1][0]} "
                             f"(max {max(v for _, v in traj):.4f}).")
    lines += [f"- Paper: alpha {PAPER['alpha']}; residual norms: {PAPER['residual_norms']}.", "",
              "![norm health](norm_health.png)", ""]
    return "\n".join(lines)


def plots(report: dict, seeds: dict, output_dir: str, prefix: str) -> list[str]:
    import matplotlib  # noqa: PLC0415 (optional: matplotlib)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415 (optional, and after choosing the Agg back end)

    colors = {"angpt": "tab:blue", "gptplus": "tab:orange", "ngpt": "tab:green"}
    paths = []
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for f in FAMILIES:
        for r in seeds[f]:
            ax.plot(*zip(*r["curve"]), color=colors[f], alpha=0.25, lw=0.8)
        ax.plot(*zip(*report["families"][f]["mean_curve"]), color=colors[f], lw=2,
                label=f"{NAMES[f]} (lr {report['families'][f]['best_lr']:g})")
        grid = report["families"][f]["grid"]
        ax2.plot([g["lr"] for g in grid], [g["final_val_loss"] if g["final_val_loss"] is not None else float("nan")
                                          for g in grid], "o-", color=colors[f], label=NAMES[f])
    target = report["speedup"]["angpt"]["target_loss"]
    ax.axhline(target, color="gray", ls=":", lw=1, label="GPT+ final (L*)")
    for f in ("angpt", "ngpt"):
        steps = report["speedup"][f]["steps"]
        if steps:
            ax.plot([steps], [target], "x", color=colors[f], ms=9)
    curves = [loss for f in FAMILIES for _, loss in report["families"][f]["mean_curve"]]
    low = min(curves)
    ax.set_ylim(low - 0.1, min(max(curves), low + 3))
    ax.set(xlabel="step", ylabel="validation loss", title="validation loss (thin: seeds, thick: mean)")
    ax.legend()
    ax2.set(xscale="log", xlabel="learning rate", ylabel="final validation loss (seed 0)", title="lr grid")
    ax2.legend()
    fig.tight_layout()
    paths.append(os.path.join(output_dir, f"{prefix}.png"))
    fig.savefig(paths[-1], dpi=90)
    plt.close(fig)

    rows = report["ablations"]["rows"]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.5), gridspec_kw={"width_ratios": [1.2, 1]})
    labels = [r["label"] for r in rows]
    values = [100 * r["relative_change"] if r["relative_change"] is not None else float("nan") for r in rows]
    # Error bars: the t interval of the paired mean, the one the table's sign is read from.
    errors = [100 * (r["relative_change_paired"]["interval"][1] - r["relative_change_paired"]["mean"])
              if r["relative_change_paired"]["interval"] else 0 for r in rows]
    ax.barh(range(len(rows)), values, xerr=errors, color=["tab:red" if r["collapsed"] else "tab:blue" for r in rows])
    for i, r in enumerate(rows):
        ax.text(0, i, f"  paper {r['paper']}", va="center", fontsize=7)
    ax.set_yticks(range(len(rows)), labels, fontsize=7)
    ax.invert_yaxis()
    level = interval_level(rows)
    ax.set(xlabel=f"change of final validation loss vs anGPT (%; bars: {100 * level:g}% t interval over seeds)",
           title="ablations (red: collapsed)")
    ax.axvline(0, color="k", lw=0.8)
    for r in rows:
        if r["curve"]:
            ax2.plot(*zip(*r["curve"]), lw=0.9, label=r["label"])
    ref = next(x for x in seeds["angpt"] if x["seed"] == 0)
    ax2.plot(*zip(*ref["curve"]), color="k", lw=2, label="anGPT")
    finite = [loss for r in rows for _, loss in r["curve"] if loss is not None and math.isfinite(loss)]
    if finite:
        ax2.set_ylim(min(finite) - 0.1, min(max(finite), min(finite) + 3))
    ax2.set(xlabel="step", ylabel="validation loss")
    ax2.legend(fontsize=6)
    fig.tight_layout()
    paths.append(os.path.join(output_dir, "ablations.png" if prefix == "convergence" else f"{prefix}_ablations.png"))
    fig.savefig(paths[-1], dpi=90, bbox_inches="tight")
    plt.close(fig)

    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for f in FAMILIES:
        h = report["norm_health"][f]
        if h["residual_norms_text"]:
            layers = range(1, len(h["residual_norms_text"]) + 1)
            axes[0].plot(layers, h["residual_norms_text"], "o-", color=colors[f], label=f"{NAMES[f]} text")
            axes[0].plot(layers, h["residual_norms_repeated"], "s--", color=colors[f], alpha=0.6,
                         label=f"{NAMES[f]} one token repeated")
        for kind, style in (("attention", "-"), ("mlp", "--")):
            traj = h["alpha"].get(kind)
            if traj:
                axes[1].plot(*zip(*traj), style, color=colors[f], label=f"{NAMES[f]} alpha_{kind[0].upper()}")
    axes[0].set(xlabel="layer", ylabel="mean ||h|| after the layer (log scale)", yscale="log",
                title="residual-stream norms (Fig. 1 analog)")
    axes[0].legend(fontsize=7)
    axes[1].set(xlabel="step", ylabel="mean alpha", title="alpha during training")
    axes[1].legend(fontsize=7)
    names = [f for f in FAMILIES if report["norm_health"][f]["ood_ratio"] is not None]
    axes[2].bar([NAMES[f] for f in names], [report["norm_health"][f]["ood_ratio_spread"]["mean"] for f in names],
                yerr=[report["norm_health"][f]["ood_ratio_spread"]["std"] for f in names],
                color=[colors[f] for f in names], label="measured (mean ± std over seeds)")
    for i, f in enumerate(names):
        if f in PAPER["ood_ratio"]:
            axes[2].plot([i], [PAPER["ood_ratio"][f]], "k*", ms=12, label="paper" if i == 0 else None)
    axes[2].set(ylabel="mean norm: repeated token / text", title="out-of-distribution input")
    axes[2].legend(fontsize=7)
    fig.tight_layout()
    paths.append(os.path.join(output_dir,
                              "norm_health.png" if prefix == "convergence" else f"{prefix}_norm_health.png"))
    fig.savefig(paths[-1], dpi=90)
    plt.close(fig)
    return paths


# ---------------------------------------------------------------------------------------------------------


def ensure_corpus(corpus: str) -> None:
    """The quickstart's data steps (examples/quickstart.sh), each skipped when its output exists; none
    when both indexed datasets exist (however they were made)."""
    datasets = [f"{corpus}/{split}_text_document.{ext}" for split in ("train", "valid") for ext in ("bin", "idx")]
    if all(os.path.isfile(os.path.join(ROOT, path)) for path in datasets):  # an absolute path stays as it is
        return
    steps = [
        (f"{corpus}/train.jsonl", ["tools/fetch_example_corpus.py", "--output-dir", corpus]),
        (f"{corpus}/tokenizer/tokenizer.json", ["tools/train_tokenizer.py", "--input", f"{corpus}/train.jsonl",
                                                "--vocab-size", "8192", "--output-dir", f"{corpus}/tokenizer"]),
    ]
    for split in ("train", "valid"):
        steps.append((f"{corpus}/{split}_text_document.idx", [
            "tools/preprocess_data.py", "--input", f"{corpus}/{split}.jsonl", "--output-prefix", f"{corpus}/{split}",
            "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", f"{corpus}/tokenizer", "--append-eod",
            "--workers", "2"]))
    for output, command in steps:
        if not os.path.isfile(os.path.join(ROOT, output) if not os.path.isabs(output) else output):
            print(f"data: {' '.join(command)}", flush=True)
            subprocess.run([sys.executable, *command], cwd=ROOT, check=True)


def snapshot_code(work_dir: str) -> tuple[str, str]:
    """A copy of the committed `angpt` package (git HEAD, plus the built extensions of the working tree)
    under work_dir/code, which the runs import: other work may edit the tree during a long invocation.
    Reused when it exists, so a resumed invocation runs the same code. Returns (directory, commit)."""
    code = os.path.join(work_dir, "code")
    marker = os.path.join(code, "COMMIT")
    if not os.path.isfile(marker):
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, check=True, capture_output=True,
                                text=True).stdout.strip()
        shutil.rmtree(code, ignore_errors=True)
        os.makedirs(code)
        archive = subprocess.run(["git", "archive", commit, "angpt"], cwd=ROOT, check=True, capture_output=True)
        subprocess.run(["tar", "-x", "-C", code], input=archive.stdout, check=True)
        for folder, _, files in os.walk(os.path.join(ROOT, "angpt")):
            for name in files:
                if name.endswith(".so"):
                    relative = os.path.relpath(os.path.join(folder, name), ROOT)
                    os.makedirs(os.path.dirname(os.path.join(code, relative)), exist_ok=True)
                    shutil.copy2(os.path.join(ROOT, relative), os.path.join(code, relative))
        with open(marker, "w") as file:
            file.write(commit + "\n")
    with open(marker) as file:
        return code, file.read().strip()


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output-dir", required=True, help="where the PNGs, Markdown and JSON go")
    parser.add_argument("--work-dir", help="run directories (default: runs/convergence-<mode>)")
    parser.add_argument("--quick", action="store_true", help="tiny shape and budget (a few minutes)")
    parser.add_argument("--train-iters", type=int, help="override the mode's steps per run")
    parser.add_argument("--seeds", type=int, default=3, help="seeds at each family's best lr (seed 0 included)")
    parser.add_argument("--max-lrs", type=int, help="use only this many lrs of each grid (the middle ones)")
    parser.add_argument("--lrs", action="append", metavar="FAMILY=LR[,LR...]",
                        help="this family's lr grid instead of the mode's (repeatable), e.g. gptplus=0.003,0.001")
    parser.add_argument("--families", default=",".join(FAMILIES),
                        help="comma-separated families to run (default: all); with a subset the report has no "
                        "speed-up or ablations: benchmarks/speedup_horizon.py combines it with another report")
    parser.add_argument("--ablations", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--ablation-list", help="comma-separated subset of: " + ", ".join(ABLATIONS))
    parser.add_argument("--ablation-seeds", type=int, default=1,
                        help="run each ablation at seeds 0..N-1, each against anGPT's run of the same seed "
                             "(at most --seeds)")
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time (each gets cores / jobs threads)")
    parser.add_argument("--corpus", default="data/shakespeare",
                        help="directory of the indexed datasets train_text_document and valid_text_document; "
                        "the quickstart's Shakespeare corpus is fetched and prepared there when missing")
    parser.add_argument("--snapshot", action=argparse.BooleanOptionalAction, default=True,
                        help="run a copy of the committed angpt package (default), not the working tree")
    parser.add_argument("--grid-extensions", type=int, default=1,
                        help="how many times a best lr at the edge of its grid extends the grid")
    parser.add_argument("--stop-after-grid", action="store_true", help="run (and extend) the lr grid only")
    parser.add_argument("--step-time-rounds", type=int, default=5,
                        help="after the runs, time anGPT, GPT+ and each ablation side by side in one process, "
                        "this many steps each, in turn (0: skip)")
    parser.add_argument("--report-only", action="store_true",
                        help="start no run: report on the finished ones (unfinished ones are left out and named)")
    parser.add_argument("--prefix", default="convergence", help="file name stem of the Markdown, JSON and main PNG")
    options = parser.parse_args(argv)
    options.mode_name = "quick" if options.quick else "full"
    # Absolute: the run's flags hold paths under it, and a finished run is found again by its flags.
    default = f"convergence-{options.mode_name}" + (f"-{options.train_iters}it" if options.train_iters else "")
    options.work_dir = os.path.abspath(options.work_dir or os.path.join(ROOT, "runs", default))
    return options


def main(argv=None) -> None:
    options = parse_args(argv)
    settings = dict(MODES[options.mode_name])
    settings["lrs"] = dict(settings["lrs"])
    if options.train_iters:
        settings["train_iters"] = options.train_iters
        for key in ("eval_interval", "log_interval"):  # at least two points on each curve
            settings[key] = min(settings[key], max(1, options.train_iters // 2))
    if options.max_lrs:
        for f in FAMILIES:
            lrs = settings["lrs"][f]
            first = max(0, (len(lrs) - options.max_lrs) // 2)
            settings["lrs"][f] = lrs[first:first + options.max_lrs]
    for item in options.lrs or []:
        family, _, values = item.partition("=")
        try:
            settings["lrs"][family] = tuple(float(value) for value in values.split(","))
        except ValueError:
            raise SystemExit(f"--lrs {item}: expected FAMILY=LR[,LR...]") from None
        if family not in FAMILIES or not all(lr > 0 for lr in settings["lrs"][family]):
            raise SystemExit(f"--lrs {item}: FAMILY is one of {', '.join(FAMILIES)}, each LR positive")
    families = tuple(f for f in FAMILIES if f in options.families.split(","))
    unknown = set(options.families.split(",")) - set(FAMILIES)
    if unknown or not families:
        raise SystemExit(f"--families {options.families}: a comma-separated subset of {', '.join(FAMILIES)}")
    ablation_names = list(ABLATIONS) if options.ablations else []
    if options.ablation_list:
        ablation_names = [a for a in options.ablation_list.split(",") if a]
        unknown = set(ablation_names) - set(ABLATIONS)
        if unknown:
            raise SystemExit(f"unknown ablations {sorted(unknown)}; known: {', '.join(ABLATIONS)}")
    if ablation_names and "angpt" not in families:
        raise SystemExit("ablations are anGPT runs compared with anGPT's: add angpt to --families or pass "
                         "--no-ablations")
    if not 1 <= options.ablation_seeds <= options.seeds:
        raise SystemExit(f"--ablation-seeds {options.ablation_seeds}: between 1 and --seeds ({options.seeds}), "
                         "since each ablation run is compared with anGPT's run of the same seed")
    os.makedirs(options.output_dir, exist_ok=True)
    os.makedirs(options.work_dir, exist_ok=True)
    ensure_corpus(options.corpus)
    options.code, options.commit = snapshot_code(options.work_dir) if options.snapshot else (None, None)
    global LOAD_FILE
    LOAD_FILE = os.path.join(options.work_dir, "load_average.txt")
    loads = []
    if not options.report_only:
        record_load(loads)
    print(f"{options.mode_name} mode: {settings}; work dir {options.work_dir}; {options.jobs} runs at a time",
          flush=True)

    def make(name, family, lr, seed, flags=()):
        return Run(name, family, lr, seed, list(flags), settings, options)

    grid_runs = {f: [make(f"{f}_lr{lr:g}_seed0", f, lr, 0) for lr in settings["lrs"][f]] for f in families}
    print(f"1/3 lr grid: {sum(map(len, grid_runs.values()))} runs", flush=True)
    if not options.report_only:
        run_all([r for f in families for r in grid_runs[f]], options.jobs, loads)
    # A best lr at the edge of its grid: one more lr beyond that edge (same ratio), --grid-extensions times.
    for _ in range(options.grid_extensions):
        added = []
        for f in families:
            done = sorted((r for r in grid_runs[f] if r.done()), key=lambda r: r.lr)
            if len(done) < 2:
                continue
            best_run = min(done, key=lambda r: loss_key(r.load()))
            if best_run is done[0]:
                lr = float(f"{done[0].lr ** 2 / done[1].lr:.2g}")
            elif best_run is done[-1]:
                lr = float(f"{done[-1].lr ** 2 / done[-2].lr:.2g}")
            else:
                continue
            added.append(make(f"{f}_lr{lr:g}_seed0", f, lr, 0))
            grid_runs[f].append(added[-1])
            print(f"{NAMES[f]}: best lr {best_run.lr:g} at the edge of the grid; adding lr {lr:g}", flush=True)
        if not added or options.report_only:
            break
        run_all(added, options.jobs, loads)
    for f in families:
        grid_runs[f].sort(key=lambda r: r.lr)
    grid = {f: [r.load() for r in grid_runs[f] if r.done()] for f in families}
    if options.stop_after_grid:
        return
    if not all(grid.values()):
        raise SystemExit("no finished lr-grid run of " + ", ".join(f for f in families if not grid[f]))
    best = {f: min(grid[f], key=loss_key)["lr"] for f in families}
    print("best lr: " + ", ".join(f"{NAMES[f]} {best[f]:g}" for f in families), flush=True)

    seed_runs = {f: [make(f"{f}_lr{best[f]:g}_seed{s}", f, best[f], s) for s in range(1, options.seeds)]
                 for f in families}
    ablation_runs = {a: [make(f"ablation_{a}_lr{best['angpt']:g}_seed{s}", "angpt", best["angpt"], s,
                              ABLATIONS[a][0]) for s in range(options.ablation_seeds)] for a in ablation_names}
    # anGPT's seeds (the ablations' references) first, then one ablation at a time, then the other families'
    # seeds: a run stopped early (--report-only) still has whole ablations to report.
    pending = [*seed_runs.get("angpt", []), *(r for runs in ablation_runs.values() for r in runs),
               *(r for f in families if f != "angpt" for r in seed_runs[f])]
    print(f"2/3 seeds and 3/3 ablations: {len(pending)} runs", flush=True)
    if not options.report_only:
        run_all(pending, options.jobs, loads)
    missing = [r.name for r in pending if not r.done()]
    if missing:
        print(f"--report-only: {len(missing)} runs not finished, left out of the report: {', '.join(missing)}")
    seeds = {f: [next(r for r in grid[f] if r["lr"] == best[f]), *[r.load() for r in seed_runs[f] if r.done()]]
             for f in families}
    # Wall clock of the runs: first start to last finish (over resumed invocations, gaps included).
    done = [r for r in [*[x for f in families for x in grid_runs[f]], *pending] if r.done()]
    wall = (max(os.path.getmtime(r.result) for r in done)
            - min(os.path.getmtime(r.result) - r.job.status()["seconds"] for r in done))
    if os.path.isfile(LOAD_FILE):
        loads = [float(line.split()[1]) for line in open(LOAD_FILE) if len(line.split()) == 2]
    if families != FAMILIES:
        report = common_report(grid, seeds, settings, options, loads, wall)
        report["not_finished"] = missing
        write_report(report, [], options)
        return
    ablations = {a: [r.load() for r in runs] for a, runs in ablation_runs.items() if all(r.done() for r in runs)}
    interleaved = None
    if options.step_time_rounds and ablations:
        path = os.path.join(options.work_dir, f"step_times_{options.step_time_rounds}.json")
        if not os.path.isfile(path) and not options.report_only:
            configs = {"anGPT": next(r for r in grid_runs["angpt"] if r.lr == best["angpt"]).argv,
                       "GPT+": next(r for r in grid_runs["gptplus"] if r.lr == best["gptplus"]).argv,
                       **{a: ablation_runs[a][0].argv for a in ablations}}
            print(f"step times: {len(configs)} models side by side, {options.step_time_rounds} rounds", flush=True)
            env = {**os.environ, "PYTHONWARNINGS": "ignore",
                   "PYTHONPATH": os.pathsep.join(p for p in (options.code, ROOT) if p)}
            subprocess.run([sys.executable, os.path.abspath(__file__), "_step_times", path,
                            str(options.step_time_rounds), json.dumps(configs)], check=True, cwd=ROOT, env=env,
                           stdout=subprocess.DEVNULL)
        if os.path.isfile(path):
            with open(path) as file:
                interleaved = json.load(file)
    report = analyse(grid, seeds, ablations, settings, options, loads, wall)
    report["not_finished"] = missing
    report["ablations"]["step_times_interleaved"] = interleaved
    if interleaved:
        ms = interleaved["ms"]
        for row in report["ablations"]["rows"]:
            key = "GPT+" if row["name"] == "gptplus_instead" else row["name"]
            row["step_time_relative_interleaved"] = ms[key] / ms["anGPT"] if key in ms else None
    report["ablations"]["not_run"] = [a for a in ablation_names if a not in ablations]
    write_report(report, plots(report, seeds, options.output_dir, options.prefix), options)


def write_report(report: dict, plot_paths: list[str], options) -> None:
    """The report as Markdown (printed too) and JSON under --output-dir, file names from --prefix."""
    md = markdown(report)
    if options.prefix != "convergence":
        md = md.replace("(ablations.png)", f"({options.prefix}_ablations.png)").replace(
            "(norm_health.png)", f"({options.prefix}_norm_health.png)").replace(
            "(convergence.png)", f"({options.prefix}.png)")
    stem = os.path.join(options.output_dir, options.prefix)
    with open(stem + ".json", "w") as file:
        json.dump(clean(report), file, indent=1, allow_nan=False)
    with open(stem + ".md", "w") as file:
        file.write(md)
    print()
    print(md)
    print("wrote " + ", ".join([*plot_paths, stem + ".json", stem + ".md"]))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_step_times":
        step_times(sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4]))
    elif len(sys.argv) > 1 and sys.argv[1] == "_worker":
        worker(sys.argv[2], sys.argv[5:], int(sys.argv[3]))
    else:
        main()
