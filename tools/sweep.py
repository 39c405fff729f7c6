#!/usr/bin/env python
"""Sweeps for scaling laws: a grid of `angpt.pretrain` runs (model shape x tokens x lr x global batch)
from one YAML file, run here one after another (or a few at a time), or as a Slurm job array; then one
table of every run's final validation loss, N, D and C = 6ND for tools/fit_scaling_law.py.

    python tools/sweep.py run     examples/sweeps/cpu_scaling.yaml [--jobs 2 --threads 1]
    python tools/sweep.py slurm   examples/sweeps/cpu_scaling.yaml --partition gpu --time 04:00:00 \\
                                  --gpus-per-node 8 [--submit]
    python tools/sweep.py run-one examples/sweeps/cpu_scaling.yaml --index 3
    python tools/sweep.py collect examples/sweeps/cpu_scaling.yaml [--json results.json --csv results.csv]
    python tools/sweep.py list    examples/sweeps/cpu_scaling.yaml

The YAML file:

    name: cpu_scaling                    # optional; names the default output directory
    output_dir: runs/sweeps/cpu_scaling  # optional (default runs/sweeps/<name>); --output-dir overrides it
    checkpoints: false                   # optional: true gives each run --save/--load <run dir>/checkpoints
    eval_tokens: 65536                   # optional: validation tokens of every run's final evaluation, the
                                         # same samples whatever the batch (sets --eval-iters per run)
    base:                                # angpt.pretrain flags shared by every run (the --config names)
      model-family: angpt
      seq-length: 128
      micro-batch-size: 16
      train-data-path: data/shakespeare/train_text_document
      valid-data-path: data/shakespeare/valid_text_document
      eval-iters: 8
    grid:
      shapes:                            # num_layers, hidden_size, num_attention_heads (+ other model flags)
        - {num_layers: 2, hidden_size: 64, num_attention_heads: 1}
      tokens: [250k, 1M]                 # training tokens; train iters = round(tokens / (batch x seq length))
      lr: [3e-3, 1e-2]
      global_batch_size: [16, 32]

Every grid point is one run in <output_dir>/runs/<run id>/: run.json (its settings and command), log.txt
(the run's output), metrics.jsonl and status.json (finished or failed, exit code, final validation loss),
and the run's dataset indices in cache/ unless base: sets data-cache-path.
Relative paths in the YAML file are relative to the directory the sweep is started from, as for
`angpt.pretrain --config`. A run whose status.json says it finished with the same flags is skipped, so
`run` (and resubmitting the Slurm array) resumes a sweep. Run indices follow the grid's order (shapes, then
tokens, then lr, then batch) and are stable as long as the grid is not edited.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Callable, Optional

import yaml

from angpt.config.arguments import setting_value, settings_to_argv
from angpt.config.parser import flag_actions
from angpt.experiments.sweep_runner import STATUS_FILE, Job, interrupt_on_sigterm, read_json, run_jobs, write_json
from angpt.telemetry import metrics_reader

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))

TOP_KEYS = ("name", "output_dir", "checkpoints", "eval_tokens", "base", "grid")
GRID_KEYS = ("shapes", "tokens", "lr", "global_batch_size")
SHAPE_KEYS = ("num_layers", "hidden_size", "num_attention_heads")
# Model flags a shape may set besides its three required ones.
SHAPE_EXTRA_KEYS = ("num_query_groups", "ffn_hidden_size", "kv_channels")
# Flags the sweep sets for each run; base: may not set them.
SWEEP_OWNED = ("num_layers", "hidden_size", "num_attention_heads", "lr", "global_batch_size", "train_iters",
               "train_samples", "metrics_file", "save", "load", "config", *SHAPE_EXTRA_KEYS)


class SweepError(ValueError):
    """A bad sweep file: the message names the file and the key."""


# ---------------------------------------------------------------------------------------------------------
# The sweep file


@dataclass
class Run:
    index: int
    run_id: str
    shape: dict
    tokens_requested: float
    lr: float
    global_batch_size: int
    micro_batch_size: int
    seq_length: int
    train_iters: int
    eval_iters: Optional[int] = None  # from eval_tokens: (else base: eval-iters applies)

    @property
    def tokens(self) -> int:
        """Tokens the run actually trains on (a whole number of global batches)."""
        return self.train_iters * self.global_batch_size * self.seq_length

    def settings(self) -> dict:
        return dict(index=self.index, run_id=self.run_id, **self.shape, tokens_requested=self.tokens_requested,
                    tokens=self.tokens, lr=self.lr, global_batch_size=self.global_batch_size,
                    micro_batch_size=self.micro_batch_size, seq_length=self.seq_length,
                    train_iters=self.train_iters, eval_iters=self.eval_iters)


@dataclass
class Sweep:
    path: str
    name: str
    output_dir: str
    checkpoints: bool
    base: dict  # dest -> value, checked against angpt.pretrain's parser
    runs: list = field(default_factory=list)

    @property
    def model_family(self) -> str:
        return self.base.get("model_family", "angpt")

    def run_dir(self, run: Run) -> str:
        return os.path.join(self.output_dir, "runs", run.run_id)

    def base_argv(self) -> list[str]:
        return settings_to_argv(self.base)

    def command(self, run: Run, launcher: list[str]) -> list[str]:
        run_dir = self.run_dir(run)
        argv = [*launcher, *settings_to_argv({k: v for k, v in self.base.items() if k != "micro_batch_size"})]
        for key, value in run.shape.items():
            argv += [flag_name(key), str(value)]
        argv += ["--lr", format_number(run.lr), "--global-batch-size", str(run.global_batch_size),
                 "--micro-batch-size", str(run.micro_batch_size), "--train-iters", str(run.train_iters),
                 "--metrics-file", os.path.join(run_dir, "metrics.jsonl")]
        if run.eval_iters is not None:
            argv += ["--eval-iters", str(run.eval_iters)]
        if "data_cache_path" not in self.base:  # runs side by side must not write the same index files
            argv += ["--data-cache-path", os.path.join(run_dir, "cache")]
        if self.checkpoints:
            checkpoint_dir = os.path.join(run_dir, "checkpoints")
            argv += ["--save", checkpoint_dir, "--load", checkpoint_dir]
        return argv


def flag_name(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def format_number(value: float) -> str:
    return f"{value:g}"


def format_tokens(tokens: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if tokens >= scale:
            return f"{tokens / scale:.3g}{unit}"
    return f"{tokens:g}"


def parse_tokens(value, where: str) -> float:
    """250000, 2.5e5, "250k", "1.5M", "2G" or "2B" -> tokens."""
    if isinstance(value, bool):
        raise SweepError(f"{where}: expected a number of tokens, got {value!r}")
    if isinstance(value, (int, float)):
        number = float(value)
    elif isinstance(value, str):
        match = re.fullmatch(r"\s*([0-9.]+(?:[eE][+-]?[0-9]+)?)\s*([kKmMgGbBtT]?)\s*", value)
        if not match:
            raise SweepError(f"{where}: {value!r} is not a number of tokens (e.g. 250000, 2.5e5, 250k, 1.5M)")
        number = float(match.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "b": 1e9, "t": 1e12}[
            match.group(2).lower()]
    else:
        raise SweepError(f"{where}: expected a number of tokens, got {value!r}")
    if not number > 0:
        raise SweepError(f"{where}: tokens must be positive, got {value!r}")
    return number


def _number(value, where: str, kind=float, positive=True):
    if isinstance(value, bool):
        raise SweepError(f"{where}: expected a {kind.__name__}, got {value!r}")
    try:
        number = kind(value) if kind is float else value
        if kind is int and not isinstance(value, int):
            raise TypeError
    except (TypeError, ValueError):
        raise SweepError(f"{where}: expected a {kind.__name__}, got {value!r}") from None
    if positive and not number > 0:
        raise SweepError(f"{where}: must be positive, got {value!r}")
    return number


def _non_empty_list(grid: dict, key: str, where: str) -> list:
    values = grid.get(key)
    if values is None:
        raise SweepError(f"{where}: grid has no {key!r} (needs {', '.join(GRID_KEYS)})")
    if not isinstance(values, list):
        values = [values]
    if not values:
        raise SweepError(f"{where}: grid.{key} is empty")
    return values


def check_flag_value(dest: str, value, action, where: str):
    """A base: or shape value checked and converted as angpt.pretrain's parser would; errors name the key."""
    try:
        return setting_value(action, value)
    except ValueError as error:
        raise SweepError(f"{where}: {error}") from None


def load_sweep(path: str, output_dir: Optional[str] = None) -> Sweep:
    """Read and check a sweep file; a SweepError names the file and the key at fault."""
    try:
        with open(path) as file:
            data = yaml.safe_load(file)
    except OSError as error:
        raise SweepError(f"{path}: {error.strerror}") from None
    except yaml.YAMLError as error:
        raise SweepError(f"{path}: not valid YAML: {error}") from None
    if not isinstance(data, dict):
        raise SweepError(f"{path}: expected a mapping with keys {', '.join(TOP_KEYS)}")
    unknown = [key for key in data if key not in TOP_KEYS]
    if unknown:
        raise SweepError(f"{path}: unknown key {unknown[0]!r} (expected {', '.join(TOP_KEYS)})")

    name = data.get("name") or os.path.splitext(os.path.basename(path))[0]
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
        raise SweepError(f"{path}: name: {name!r} is not a simple name (letters, digits, _ . -)")
    out = output_dir or data.get("output_dir") or os.path.join("runs", "sweeps", name)
    if not isinstance(out, str):
        raise SweepError(f"{path}: output_dir: expected a path, got {out!r}")
    checkpoints = data.get("checkpoints", False)
    if not isinstance(checkpoints, bool):
        raise SweepError(f"{path}: checkpoints: expected true or false, got {checkpoints!r}")

    eval_tokens = data.get("eval_tokens")
    if eval_tokens is not None:
        eval_tokens = parse_tokens(eval_tokens, f"{path}: eval_tokens")

    actions = flag_actions()
    base_raw = data.get("base") or {}
    if not isinstance(base_raw, dict):
        raise SweepError(f"{path}: base: expected a mapping of angpt.pretrain flags to values")
    base = {}
    for key, value in base_raw.items():
        dest = str(key).lstrip("-").replace("-", "_")
        where = f"{path}: base.{key}"
        if dest in SWEEP_OWNED:
            raise SweepError(f"{where}: set by the sweep for each run (grid: or checkpoints:), not in base:")
        if dest not in actions or dest == "config":
            raise SweepError(f"{where}: unknown key (not a flag of angpt.pretrain)")
        base[dest] = check_flag_value(dest, value, actions[dest], where)
        if dest == "eval_iters" and eval_tokens is not None:
            raise SweepError(f"{where}: give either eval_tokens: (the same validation tokens for every batch "
                             "size) or base.eval-iters, not both")

    grid = data.get("grid")
    if grid is None:
        raise SweepError(f"{path}: no grid: (needs {', '.join(GRID_KEYS)})")
    if not isinstance(grid, dict):
        raise SweepError(f"{path}: grid: expected a mapping with keys {', '.join(GRID_KEYS)}")
    if not grid:
        raise SweepError(f"{path}: grid: is empty (needs {', '.join(GRID_KEYS)})")
    unknown = [key for key in grid if key not in GRID_KEYS]
    if unknown:
        raise SweepError(f"{path}: grid.{unknown[0]}: unknown key (expected {', '.join(GRID_KEYS)})")

    shapes = []
    for i, shape in enumerate(_non_empty_list(grid, "shapes", path)):
        where = f"{path}: grid.shapes[{i}]"
        if not isinstance(shape, dict):
            raise SweepError(f"{where}: expected a mapping with {', '.join(SHAPE_KEYS)}")
        checked = {}
        for key, value in shape.items():
            dest = str(key).lstrip("-").replace("-", "_")
            if dest not in SHAPE_KEYS + SHAPE_EXTRA_KEYS:
                raise SweepError(f"{where}.{key}: unknown key (expected {', '.join(SHAPE_KEYS + SHAPE_EXTRA_KEYS)})")
            checked[dest] = _number(value, f"{where}.{key}", int)
        missing = [key for key in SHAPE_KEYS if key not in checked]
        if missing:
            raise SweepError(f"{where}: missing {', '.join(missing)}")
        if "kv_channels" not in checked and checked["hidden_size"] % checked["num_attention_heads"]:
            raise SweepError(f"{where}: hidden_size {checked['hidden_size']} is not divisible by "
                             f"num_attention_heads {checked['num_attention_heads']} (or give kv_channels)")
        shapes.append({key: checked[key] for key in (*SHAPE_KEYS, *SHAPE_EXTRA_KEYS) if key in checked})
    tokens = [parse_tokens(v, f"{path}: grid.tokens[{i}]") for i, v in enumerate(_non_empty_list(grid, "tokens", path))]
    lrs = [_number(v, f"{path}: grid.lr[{i}]") for i, v in enumerate(_non_empty_list(grid, "lr", path))]
    batches = [_number(v, f"{path}: grid.global_batch_size[{i}]", int)
               for i, v in enumerate(_non_empty_list(grid, "global_batch_size", path))]
    for key, values in (("shapes", shapes), ("tokens", tokens), ("lr", lrs), ("global_batch_size", batches)):
        if len({json.dumps(v, sort_keys=True) for v in values}) != len(values):
            raise SweepError(f"{path}: grid.{key}: repeated values")

    seq_length = base.get("seq_length", actions["seq_length"].default)
    micro = base.get("micro_batch_size", actions["micro_batch_size"].default)
    runs = []
    for shape, token_budget, lr, batch in itertools.product(shapes, tokens, lrs, batches):
        micro_batch = min(micro, batch)
        if batch % micro_batch:
            raise SweepError(f"{path}: grid.global_batch_size {batch} is not a multiple of base.micro-batch-size "
                             f"{micro}")
        iters = max(1, round(token_budget / (batch * seq_length)))
        eval_iters = None
        if eval_tokens is not None:
            eval_iters = eval_tokens / (batch * seq_length)
            if not eval_iters.is_integer() or eval_iters < 1:
                raise SweepError(f"{path}: eval_tokens: {eval_tokens:g} is not a whole number of global batches "
                                 f"of {batch} x {seq_length} tokens (grid.global_batch_size {batch})")
            eval_iters = int(eval_iters)
        shape_id = f"L{shape['num_layers']}-d{shape['hidden_size']}-h{shape['num_attention_heads']}" + "".join(
            f"-{key}{shape[key]}" for key in SHAPE_EXTRA_KEYS if key in shape)
        run_id = f"{shape_id}_D{format_tokens(token_budget)}_lr{format_number(lr)}_b{batch}"
        runs.append(Run(len(runs), run_id, shape, token_budget, lr, batch, micro_batch, seq_length, iters,
                        eval_iters))
    return Sweep(path, name, out, checkpoints, base, runs)


# ---------------------------------------------------------------------------------------------------------
# Running


def launcher(nproc_per_node: int = 1, nnodes: int = 1, node_rank: int = 0, master_addr: Optional[str] = None,
             master_port: Optional[int] = None) -> list[str]:
    """One Python process for one device, torchrun for more."""
    if nproc_per_node <= 1 and nnodes <= 1:
        return [sys.executable, "-m", "angpt.pretrain"]
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc_per_node}"]
    if nnodes <= 1:
        command.append("--standalone")
    else:
        command += [f"--nnodes={nnodes}", f"--node-rank={node_rank}", f"--master-addr={master_addr}",
                    f"--master-port={master_port or 29500}"]
    return [*command, "-m", "angpt.pretrain"]


def read_metrics(path: str) -> list[dict]:
    """The run's current records (a resumed run's re-run steps replace the first run's); none before it ran."""
    return metrics_reader.read_metrics(path) if os.path.isfile(path) else []


def final_losses(records: list[dict], train_iters: int) -> dict:
    """The final validation loss (the last evaluation, if it is at train_iters) and the last train loss."""
    evals = [r for r in records if r.get("kind") == "eval" and r.get("split") == "validation"]
    trains = [r for r in records if r.get("kind") == "train"]
    last_eval = evals[-1] if evals else None
    return dict(
        valid_loss=last_eval["lm_loss"] if last_eval and last_eval.get("iteration") == train_iters else None,
        valid_iteration=last_eval["iteration"] if last_eval else None,
        train_loss=trains[-1]["lm_loss"] if trains else None,
        train_iteration=trains[-1]["iteration"] if trains else None,
    )


def describe(run: Run) -> str:
    shape = " ".join(f"{key}={value}" for key, value in run.shape.items())
    return (f"{shape} tokens={format_tokens(run.tokens)} ({run.train_iters} iters) lr={format_number(run.lr)} "
            f"batch={run.global_batch_size}")


def job(sweep: Sweep, run: Run, launch: list[str]) -> Job:
    """The run as a job of angpt.experiments.sweep_runner; the flags after the launcher identify it."""
    command = sweep.command(run, launch)
    run_dir = sweep.run_dir(run)
    os.makedirs(run_dir, exist_ok=True)
    write_json(os.path.join(run_dir, "run.json"), dict(sweep=sweep.name, config=sweep.path,
                                                        model_family=sweep.model_family, **run.settings(),
                                                        command=command))
    return Job(name=f"[{run.index + 1}/{len(sweep.runs)}] {run.run_id}", directory=run_dir, command=command,
               flags=command[len(launch):], description=describe(run),
               env={"PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)},
               # Without checkpoints a run starts from scratch, and its metrics file would be appended to.
               start_over=() if sweep.checkpoints else ("metrics.jsonl",))


def judge(sweep: Sweep) -> Callable:
    """Finished: a clean exit at train_iters; records the final losses."""
    train_iters = {sweep.run_dir(run): run.train_iters for run in sweep.runs}

    def judged(job: Job, returncode: int) -> dict:
        iters = train_iters[job.directory]
        losses = final_losses(read_metrics(os.path.join(job.directory, "metrics.jsonl")), iters)
        finished = returncode == 0 and losses["train_iteration"] == iters
        status = dict(status="finished" if finished else "failed", **losses,
                      summary=f"validation loss {_loss(losses['valid_loss'])} (train {_loss(losses['train_loss'])})")
        if returncode == 0 and not finished:
            status["reason"] = (f"exited cleanly at iteration {losses['train_iteration']} of {iters} "
                                "(a graceful exit: run it again to resume with checkpoints: true)")
        return status

    return judged


def run_sweep(sweep: Sweep, jobs: int = 1, threads: Optional[int] = None, stop_on_failure: bool = False,
              indices: Optional[list[int]] = None, force: bool = False, nproc_per_node: int = 1,
              out=None, launch: Optional[list[str]] = None) -> dict:
    """Run the sweep's runs here, `jobs` at a time; returns counts of finished, skipped and failed runs.
    `launch` replaces the command before the flags (default: `launcher(nproc_per_node)`)."""
    runs = [sweep.runs[i] for i in indices] if indices is not None else sweep.runs
    launch = launch or launcher(nproc_per_node)
    out = out or sys.stdout
    counts = run_jobs([job(sweep, run, launch) for run in runs], parallel=jobs, threads=threads,
                      judge=judge(sweep), stop_on_failure=stop_on_failure, force=force, out=out)
    print(f"sweep {sweep.name}: {counts['finished']} finished, {counts['skipped']} skipped (done before), "
          f"{counts['failed']} failed" + (f", {counts['not_started']} not started (--stop-on-failure)"
                                          if counts["not_started"] else "")
          + f" in {counts['seconds']:.0f} s; outputs in {sweep.output_dir}", file=out, flush=True)
    return counts


def _loss(value) -> str:
    return "n/a" if value is None else f"{value:.4f}"


# ---------------------------------------------------------------------------------------------------------
# Slurm


def slurm_script(sweep: Sweep, partition: Optional[str], time_limit: str, nodes: int, gpus_per_node: int,
                 cpus_per_task: Optional[int], account: Optional[str], max_parallel: Optional[int],
                 python: str = "python", extra_sbatch: tuple = ()) -> str:
    """An sbatch job array: task i runs `tools/sweep.py run-one --index i` (finished runs are skipped)."""
    last = len(sweep.runs) - 1
    array = f"0-{last}" + (f"%{max_parallel}" if max_parallel else "")
    config = os.path.abspath(sweep.path)
    output_dir = os.path.abspath(sweep.output_dir)
    lines = [
        "#!/bin/bash",
        f"# The {len(sweep.runs)} runs of sweep {sweep.name} ({os.path.relpath(sweep.path, ROOT)}) as a Slurm job",
        "# array: task i is grid point i (python tools/sweep.py list shows them). Written by",
        "# tools/sweep.py slurm; submit from the repository root with the Python environment active:",
        f"#   sbatch {os.path.relpath(os.path.join(output_dir, 'sweep.slurm'))}",
        "# Resubmitting reruns only the runs that have not finished. Then:",
        f"#   python tools/sweep.py collect {os.path.relpath(config)} --output-dir {os.path.relpath(output_dir)}",
        f"#SBATCH --job-name=sweep-{sweep.name}",
        f"#SBATCH --array={array}",
        f"#SBATCH --nodes={nodes}",
        "#SBATCH --ntasks-per-node=1",
    ]
    if gpus_per_node:
        lines.append(f"#SBATCH --gpus-per-node={gpus_per_node}")
    if cpus_per_task:
        lines.append(f"#SBATCH --cpus-per-task={cpus_per_task}")
    if partition:
        lines.append(f"#SBATCH --partition={partition}")
    if account:
        lines.append(f"#SBATCH --account={account}")
    lines += [
        f"#SBATCH --time={time_limit}",
        f"#SBATCH --output={os.path.join(output_dir, 'slurm', 'slurm-%A_%a.out')}",
        *[f"#SBATCH {option}" for option in extra_sbatch],
        "set -uo pipefail",
        'cd "${SLURM_SUBMIT_DIR:?submit with sbatch}"',
        "export MASTER_ADDR=$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | head -n 1)",
        "export MASTER_PORT=${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 20000))}",
        "export GPUS_PER_NODE=${SLURM_GPUS_ON_NODE:-%d}" % max(gpus_per_node, 1),
        'echo "sweep task $SLURM_ARRAY_TASK_ID of job $SLURM_ARRAY_JOB_ID on $SLURM_NNODES node(s)"',
        "srun --kill-on-bad-exit=1 bash -c '" + " ".join([
            f"exec {python} tools/sweep.py run-one {shlex.quote(config)} --index $SLURM_ARRAY_TASK_ID",
            f"--output-dir {shlex.quote(output_dir)} --nproc-per-node $GPUS_PER_NODE",
            "--nnodes $SLURM_NNODES --node-rank $SLURM_NODEID --master-addr $MASTER_ADDR --master-port $MASTER_PORT",
        ]) + "'",
    ]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------------------
# Collecting


def non_embedding_parameters(model_family: str, shape: dict) -> int:
    """N as in Kaplan et al.: the weights of the transformer layers' matmuls (qkv, attention output, the
    SwiGLU MLP), without the embedding, the output head and the vectors (norm gains, learnable scales).
    Counted from the model config by `angpt.telemetry.performance.model_flops_per_token` (6 FLOPs per weight and
    token for training), with the sequence length (attention scores) and the vocabulary set to 0."""
    # Here, so that the commands other than `collect` start without importing torch and megatron-core.
    from angpt.models import model_config  # noqa: PLC0415
    from angpt.telemetry import performance  # noqa: PLC0415

    config = model_config(model_family, **shape)
    return round(performance.model_flops_per_token(config, 0, 0) / 6)


def collect(sweep: Sweep) -> dict:
    """Every run of the grid: settings, status, final validation loss, N, D, C = 6ND."""
    parameters = {}
    records = []
    for run in sweep.runs:
        key = json.dumps(run.shape, sort_keys=True)
        if key not in parameters:
            parameters[key] = non_embedding_parameters(sweep.model_family, run.shape)
        run_dir = sweep.run_dir(run)
        status = read_json(os.path.join(run_dir, STATUS_FILE)) or {}
        losses = final_losses(read_metrics(os.path.join(run_dir, "metrics.jsonl")), run.train_iters)
        n = parameters[key]
        records.append(dict(
            index=run.index, run_id=run.run_id, status=status.get("status", "not run"),
            model_family=sweep.model_family, **run.shape, N=n, D=run.tokens, C=6.0 * n * run.tokens,
            lr=run.lr, global_batch_size=run.global_batch_size, seq_length=run.seq_length,
            train_iters=run.train_iters, valid_loss=losses["valid_loss"], train_loss=losses["train_loss"],
            seconds=status.get("seconds"), run_dir=run_dir,
        ))
    done = sum(r["status"] == "finished" and r["valid_loss"] is not None for r in records)
    return dict(sweep=sweep.name, config=sweep.path, model_family=sweep.model_family,
                seq_length=sweep.runs[0].seq_length, runs=len(records), finished=done,
                N_definition="non-embedding matmul weights (qkv, attention output, SwiGLU MLP) of all layers",
                C_definition="6 N D", records=records)


CSV_COLUMNS = ("index", "run_id", "status", "model_family", *SHAPE_KEYS, "N", "D", "C", "lr", "global_batch_size",
               "seq_length", "train_iters", "valid_loss", "train_loss", "seconds", "run_dir")


def write_csv(path: str, records: list[dict]) -> None:
    with open(path, "w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=CSV_COLUMNS, extrasaction="ignore")
        writer.writeheader()
        for record in records:
            writer.writerow({key: "" if record.get(key) is None else record.get(key) for key in CSV_COLUMNS})


# ---------------------------------------------------------------------------------------------------------
# Command line


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="tools/sweep.py", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)

    def common(sub):
        sub.add_argument("config", help="the sweep's YAML file")
        sub.add_argument("--output-dir", help="where the runs go (default: the file's output_dir, or "
                         "runs/sweeps/<name>)")
        return sub

    run = common(commands.add_parser("run", help="run the sweep here, skipping runs that finished"))
    run.add_argument("--jobs", type=int, default=1, help="runs at a time (default 1)")
    run.add_argument("--threads", type=int, help="OMP_NUM_THREADS of each run (e.g. 1 with --jobs 2 on 2 cores)")
    run.add_argument("--nproc-per-node", type=int, default=1, help="processes per run (torchrun when > 1)")
    run.add_argument("--only", type=int, nargs="+", metavar="INDEX", help="run only these grid points")
    run.add_argument("--stop-on-failure", action="store_true", help="stop starting runs after a failure")
    run.add_argument("--force", action="store_true", help="rerun runs that finished")

    one = common(commands.add_parser("run-one", help="run one grid point (a Slurm array task)"))
    one.add_argument("--index", type=int, required=True)
    one.add_argument("--nproc-per-node", type=int, default=1)
    one.add_argument("--nnodes", type=int, default=1)
    one.add_argument("--node-rank", type=int, default=0)
    one.add_argument("--master-addr")
    one.add_argument("--master-port", type=int)
    one.add_argument("--threads", type=int)
    one.add_argument("--force", action="store_true", help="rerun it if it finished")

    slurm = common(commands.add_parser("slurm", help="write (and --submit) an sbatch job array of the sweep"))
    slurm.add_argument("--partition")
    slurm.add_argument("--account")
    slurm.add_argument("--time", default="04:00:00", help="time limit of each run (default 04:00:00)")
    slurm.add_argument("--nodes", type=int, default=1, help="nodes per run (default 1)")
    slurm.add_argument("--gpus-per-node", type=int, default=8)
    slurm.add_argument("--cpus-per-task", type=int)
    slurm.add_argument("--max-parallel", type=int, help="array tasks at once (the %% of --array)")
    slurm.add_argument("--sbatch-option", action="append", default=[], metavar="OPTION",
                       help="another #SBATCH line, e.g. --sbatch-option=--qos=high (repeatable)")
    slurm.add_argument("--python", default="python", help="interpreter on the compute nodes (default python)")
    slurm.add_argument("--script", help="where to write it (default <output dir>/sweep.slurm)")
    slurm.add_argument("--submit", action="store_true", help="submit it with sbatch")

    gather = common(commands.add_parser("collect", help="one table of every run's final loss, N, D, C"))
    gather.add_argument("--json", help="default <output dir>/results.json")
    gather.add_argument("--csv", help="default <output dir>/results.csv")

    listing = common(commands.add_parser("list", help="print the grid points and their status"))
    del listing

    args = parser.parse_args(argv)
    try:
        sweep = load_sweep(args.config, args.output_dir)
    except SweepError as error:
        print(f"tools/sweep.py: {error}", file=sys.stderr)
        return 2
    try:
        return _command(args, sweep)
    except KeyboardInterrupt:
        print("tools/sweep.py: interrupted; the runs in flight were stopped and marked failed (run again to "
              "resume)", file=sys.stderr)
        return 130


def _command(args, sweep: Sweep) -> int:

    if args.command in ("run", "run-one"):
        interrupt_on_sigterm()
    if args.command == "run":
        counts = run_sweep(sweep, jobs=args.jobs, threads=args.threads, stop_on_failure=args.stop_on_failure,
                           indices=args.only, force=args.force, nproc_per_node=args.nproc_per_node)
        return 1 if counts["failed"] else 0
    if args.command == "run-one":
        if not 0 <= args.index < len(sweep.runs):
            print(f"tools/sweep.py: --index {args.index} is outside the grid's 0-{len(sweep.runs) - 1}",
                  file=sys.stderr)
            return 2
        run = sweep.runs[args.index]
        launch = launcher(args.nproc_per_node, args.nnodes, args.node_rank, args.master_addr, args.master_port)
        command = sweep.command(run, launch)
        if args.node_rank > 0:  # another node of a multi-node run: train, leave the records to node 0
            env = {**os.environ, "PYTHONPATH": ROOT, "PYTHONWARNINGS": "ignore"}
            return subprocess.call(command, env=env)
        counts = run_jobs([job(sweep, run, launch)], threads=args.threads, judge=judge(sweep), force=args.force)
        return 1 if counts["failed"] else 0
    if args.command == "slurm":
        script = slurm_script(sweep, args.partition, args.time, args.nodes, args.gpus_per_node, args.cpus_per_task,
                              args.account, args.max_parallel, args.python, tuple(args.sbatch_option))
        path = args.script or os.path.join(sweep.output_dir, "sweep.slurm")
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        os.makedirs(os.path.join(sweep.output_dir, "slurm"), exist_ok=True)
        with open(path, "w") as file:
            file.write(script)
        os.chmod(path, 0o755)
        print(f"wrote {path}: a job array of {len(sweep.runs)} runs")
        if args.submit:
            done = subprocess.run(["sbatch", path], capture_output=True, text=True)
            sys.stdout.write(done.stdout)
            sys.stderr.write(done.stderr)
            return done.returncode
        print(f"submit it with: sbatch {path}")
        return 0
    if args.command == "collect":
        results = collect(sweep)
        json_path = args.json or os.path.join(sweep.output_dir, "results.json")
        csv_path = args.csv or os.path.join(sweep.output_dir, "results.csv")
        for path in (json_path, csv_path):
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        write_json(json_path, results)
        write_csv(csv_path, results["records"])
        print(f"{results['finished']} of {results['runs']} runs finished with a validation loss; "
              f"wrote {json_path} and {csv_path}")
        return 0
    if args.command == "list":
        for run in sweep.runs:
            status = read_json(os.path.join(sweep.run_dir(run), STATUS_FILE)) or {}
            print(f"{run.index:4d} {run.run_id:40s} {describe(run)}  [{status.get('status', 'not run')}]")
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
