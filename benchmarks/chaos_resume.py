#!/usr/bin/env python
"""A chaos soak: a small 2-process torchrun job killed at random moments, resumed after each kill, must end
with the checkpoint and the losses of an uninterrupted run, leaving no process behind.

    python benchmarks/chaos_resume.py --kills 50 [--seed 0] [--iterations 12] [--report docs/results.md]

Each kill picks a target (one rank, all ranks, torchrun, or everything of the job, as `scancel` signals it),
a signal (SIGKILL, or SIGTERM, which asks for a save and a clean exit) and a moment: during a step; during a
synchronous save or an async save (a fault slows the save for a signal to arrive in it); or during the start,
the checkpoint's load included. SIGTERM to a process that has not yet installed its handler kills it, as it
would in a real job. After each kill the job is started again with `--load` equal to `--save`; after the
last, it runs to the end. A run that reaches its end is compared, tensor for tensor, in its final
checkpoint with an uninterrupted run's, and in the losses of its iterations (the last record of each in
metrics.jsonl) with that run's; the kills go on with a new run.

It reports the kills by kind, the resumes, the iterations trained again, the differences (target 0), the
processes still alive 10 s after a job ended (orphans, target 0), the jobs that did not end within 120 s of
a kill (hangs, target 0), and the wall-clock time. Exit status 1 if anything differs or stayed behind.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import queue
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import psutil

from angpt.megatron_compat import quiet_known_warnings
from angpt.training import faults

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
MODEL = ["--model-family", "angpt", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "1e-2", "--mock-data",
         "--vocab-size", "256", "--log-interval", "1", "--eval-iters", "0", "--use-distributed-optimizer"]
SAVE_INTERVAL = 2
TARGETS = ("one rank", "all ranks", "torchrun", "everything")
MOMENTS = ("step", "sync save", "async save", "start and load")
SIGNALS = (signal.SIGKILL, signal.SIGTERM)
SLOW_SAVE_SECONDS = 1.0  # how long the fault holds a save open for the kill
JOB_END_TIMEOUT = 120
ORPHAN_GRACE = 10


@dataclass
class Kill:
    target: str
    signum: signal.Signals
    moment: str

    def __str__(self) -> str:
        return f"{self.signum.name} to {self.target} during {self.moment}"


@dataclass
class Soak:
    kills: list = field(default_factory=list)
    resumes: int = 0
    trained: int = 0  # iterations trained, over every launch
    orphans: list = field(default_factory=list)
    hangs: list = field(default_factory=list)
    differences: list = field(default_factory=list)
    runs: int = 0  # killed and resumed to their end, each compared with the uninterrupted run


class Job:
    """One torchrun launch: its output read line by line, every process of its tree remembered."""

    def __init__(self, save: str, iterations: int, async_save: bool, env: dict):
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                   "-m", "angpt.pretrain", *MODEL, "--train-iters", str(iterations), "--save", save, "--load", save,
                   "--save-interval", str(SAVE_INTERVAL), *(["--async-save"] if async_save else [])]
        self.process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        start_new_session=True, env={**os.environ, "PYTHONPATH": ROOT,
                                                                     "PYTHONWARNINGS": "ignore", **env})
        self.lines: queue.Queue = queue.Queue()
        self.output: list[str] = []
        self.seen: dict[int, psutil.Process] = {}
        self.iterations: set[int] = set()
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._watch_tree, daemon=True).start()

    def _read(self) -> None:
        for raw in self.process.stdout:
            line = raw.decode(errors="replace")
            self.output.append(line)
            if line.lstrip().startswith("iteration"):
                self.iterations.add(int(line.split()[1].split("/")[0]))
            self.lines.put(line)
        self.lines.put(None)

    def _watch_tree(self) -> None:
        try:
            root = psutil.Process(self.process.pid)
        except psutil.NoSuchProcess:
            return
        while self.process.poll() is None:
            try:
                for child in [root, *root.children(recursive=True)]:
                    self.seen.setdefault(child.pid, child)
            except psutil.NoSuchProcess:
                pass
            time.sleep(0.05)

    def wait_for(self, text: str, count: int = 1, timeout: float = 120) -> bool:
        """Whether `text` appeared in `count` lines before the job ended."""
        found = sum(text in line for line in self.output)
        deadline = time.monotonic() + timeout
        while found < count and time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.5)
            except queue.Empty:
                continue
            if line is None:
                return False
            found += text in line
        return found >= count

    def workers(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.process.pid).children()
        except psutil.NoSuchProcess:
            return []

    def signal(self, kill: Kill, rng: random.Random) -> None:
        workers = self.workers()
        if kill.target == "torchrun":
            victims = [self.process.pid]
        elif kill.target == "one rank":
            victims = [rng.choice(workers).pid] if workers else []
        elif kill.target == "all ranks":
            victims = [worker.pid for worker in workers]
        else:  # everything: torchrun's group and each worker's (torchrun starts each worker in its own session)
            for group in [self.process.pid, *(worker.pid for worker in workers)]:
                try:
                    os.killpg(group, kill.signum)
                except ProcessLookupError:
                    pass
            return
        for pid in victims:
            try:
                os.kill(pid, kill.signum)
            except ProcessLookupError:
                pass

    def end(self, soak: Soak, what: str) -> None:
        """Wait for torchrun (a hang past JOB_END_TIMEOUT is recorded and killed), then for every process the
        job had: those alive ORPHAN_GRACE s later are orphans (recorded and killed)."""
        try:
            self.process.wait(timeout=JOB_END_TIMEOUT)
        except subprocess.TimeoutExpired:
            soak.hangs.append(what)
            for process in self.seen.values():
                try:
                    process.kill()
                except psutil.NoSuchProcess:
                    pass
            self.process.wait()
        _, alive = psutil.wait_procs(list(self.seen.values()), timeout=ORPHAN_GRACE)
        for process in alive:
            try:
                soak.orphans.append(f"{what}: pid {process.pid} {' '.join(process.cmdline()[-4:])}")
                process.kill()
            except psutil.NoSuchProcess:
                pass
        soak.trained += len(self.iterations)


def latest(save: str) -> int:
    try:
        with open(os.path.join(save, "latest_checkpointed_iteration.txt")) as file:
            return int(file.read())
    except FileNotFoundError:
        return 0


def losses(save: str) -> dict[int, float]:
    with open(os.path.join(save, "metrics.jsonl")) as file:
        return {r["iteration"]: r["lm_loss"] for r in map(json.loads, file) if r["kind"] == "train"}


def differing_tensors(save: str, reference: str, iteration: int) -> list[str]:
    """The tensors of `save`'s checkpoint of `iteration` that differ from (or are missing in) `reference`'s."""
    import torch  # noqa: PLC0415 (after quiet_known_warnings)
    from megatron.core.dist_checkpointing import load_plain_tensors  # noqa: PLC0415

    from angpt.training import distributed  # noqa: PLC0415

    if not torch.distributed.is_initialized():
        distributed.initialize()  # megatron-core's loading wants a process group: one process of gloo
    ours, theirs = (load_plain_tensors(os.path.join(directory, f"iter_{iteration:07d}"))
                    for directory in (save, reference))
    names = {key for key, value in [*ours.items(), *theirs.items()] if isinstance(value, torch.Tensor)}
    return sorted(key for key in names if key not in ours or key not in theirs or not torch.equal(ours[key],
                                                                                                    theirs[key]))


def run_to_end(save: str, iterations: int, soak: Soak, what: str) -> str:
    job = Job(save, iterations, async_save=False, env={})
    job.process.wait(timeout=600)
    job.end(soak, what)
    if job.process.returncode != 0:
        raise RuntimeError(f"{what} exited with {job.process.returncode}:\n{''.join(job.output[-60:])}")
    return "".join(job.output)


def one_kill(save: str, iterations: int, kill: Kill, rng: random.Random, soak: Soak, start_seconds: float) -> None:
    """Launch, kill as `kill` says, and wait for the job and its processes to end."""
    resumed_from = latest(save)
    next_save = (resumed_from // SAVE_INTERVAL + 1) * SAVE_INTERVAL
    if resumed_from >= iterations:  # the run is complete: it only starts, loads and ends
        kill.moment = "start and load"
    elif kill.moment in ("sync save", "async save") and next_save > iterations:
        kill.moment = "step"
    env, async_save = {}, kill.moment == "async save"
    if kill.moment in ("sync save", "async save"):
        fault = faults.PAUSE_IN_WRITER_AT if async_save else faults.PAUSE_IN_SAVE_AT
        env[fault] = f"{next_save}:{SLOW_SAVE_SECONDS}"
    job = Job(save, iterations, async_save, env)
    if kill.moment == "start and load":
        time.sleep(rng.uniform(0.2, start_seconds))
    elif kill.moment in ("sync save", "async save"):
        job.wait_for("angpt fault injection: pausing", count=2)
        time.sleep(rng.uniform(0, SLOW_SAVE_SECONDS / 2))
    else:  # within a few steps of the start: kills that find no later save lose what they trained
        job.wait_for(f"iteration {rng.randint(resumed_from + 1, min(resumed_from + 3, iterations)):8d}/")
        time.sleep(rng.uniform(0, 0.2))
    job.signal(kill, rng)
    job.end(soak, str(kill))
    soak.kills.append(kill)
    soak.resumes += 1


def soak_run(kills: int, seed: int, iterations: int, workdir: str, reference: str | None = None,
             log=print) -> Soak:
    rng = random.Random(seed)
    soak = Soak()
    if reference is None:
        reference = os.path.join(workdir, "uninterrupted")
        started = time.monotonic()
        run_to_end(reference, iterations, soak, "the uninterrupted run")
        soak.trained = 0
        start_seconds = max(1.0, (time.monotonic() - started) / 2)
    else:
        start_seconds = 5.0
    # Every (target, signal, moment) once in a shuffled order, then again: 32 kills try each.
    plan = list(itertools.product(TARGETS, SIGNALS, MOMENTS))
    rng.shuffle(plan)
    rounds = 1
    save = os.path.join(workdir, "killed_1")
    for index in range(kills):
        if latest(save) >= iterations:  # this round's run is complete: compare it, and start another
            compare(save, reference, iterations, soak)
            rounds += 1
            save = os.path.join(workdir, f"killed_{rounds}")
        kill = Kill(*plan[index % len(plan)])
        before = latest(save)
        one_kill(save, iterations, kill, rng, soak, start_seconds)
        log(f"kill {index + 1}/{kills} (run {rounds}): {kill}; latest checkpoint {before} -> {latest(save)}")
    run_to_end(save, iterations, soak, "the final run")
    compare(save, reference, iterations, soak)
    soak.runs = rounds
    return soak


def compare(save: str, reference: str, iterations: int, soak: Soak) -> None:
    """A killed and resumed run's final checkpoint and losses against the uninterrupted run's."""
    name = os.path.basename(save)
    soak.differences += [f"{name}: tensor {key}" for key in differing_tensors(save, reference, iterations)]
    ours, theirs = losses(save), losses(reference)
    soak.differences += [f"{name}: loss of iteration {i}: {ours.get(i)} != {theirs[i]}" for i in theirs
                         if ours.get(i) != theirs[i]]
    soak.differences += [f"{name}: {leftover} left" for leftover in os.listdir(save)
                         if leftover.endswith(".incomplete")]


def report(soak: Soak, iterations: int, seconds: float) -> str:
    kinds = Counter(str(kill) for kill in soak.kills)
    lines = [f"{len(soak.kills)} kills of {soak.runs} runs of a 2-process torchrun job of {iterations} iterations "
             f"(saves every {SAVE_INTERVAL}), each compared with an uninterrupted run at its end: {soak.resumes} "
             f"resumes, {soak.trained - soak.runs * iterations} iterations trained again, "
             f"{len(soak.differences)} differences, {len(soak.orphans)} orphans, {len(soak.hangs)} hangs, "
             f"{seconds:.0f} s",
             "", "| kill | times |", "|---|---|"]
    lines += [f"| {kind} | {count} |" for kind, count in sorted(kinds.items())]
    for title, items in (("differences", soak.differences), ("orphans", soak.orphans), ("hangs", soak.hangs)):
        if items:
            lines += ["", f"{title}:", *(f"- {item}" for item in items)]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--iterations", type=int, default=12)
    parser.add_argument("--workdir", help="where the runs go (default: a temporary directory, removed)")
    parser.add_argument("--report", help="append the report to this markdown file")
    args = parser.parse_args()
    quiet_known_warnings()
    workdir = args.workdir or tempfile.mkdtemp(prefix="angpt-chaos-")
    started = time.monotonic()
    try:
        soak = soak_run(args.kills, args.seed, args.iterations, workdir)
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    text = report(soak, args.iterations, time.monotonic() - started)
    print(text)
    if args.report:
        with open(args.report, "a") as file:
            file.write(f"\n### Chaos soak (`benchmarks/chaos_resume.py --kills {args.kills} --seed {args.seed}`)\n\n"
                       f"{text}\n")
    return 1 if soak.differences or soak.orphans or soak.hangs else 0


if __name__ == "__main__":
    sys.exit(main())
