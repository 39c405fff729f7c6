"""Running many training runs on one machine: each a subprocess with its own directory, a few at a time,
with one resume marker. tools/sweep.py (scaling-law grids) and benchmarks/convergence.py (the paper at small
scale) both run their runs here.

A run's directory holds log.txt (its output, appended over attempts) and status.json: "running" while it
runs, then "finished" or "failed" with the exit code, the seconds it took and whatever the caller's `judge`
adds. A run whose status.json says "finished" with the same `flags` is skipped, so running the same list
again resumes it. torch-free: a coordinator starts in a fraction of a second.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, TextIO

from angpt.telemetry.metrics_reader import read_metrics

STATUS_FILE = "status.json"
LOG_FILE = "log.txt"
LOG_TAIL_LINES = 15  # of a failed run's log, printed with its failure


@dataclass
class Job:
    name: str  # printed, e.g. "[3/12] angpt_lr0.01"
    directory: str
    command: list[str]
    # What makes two attempts the same run: the training flags, without the interpreter or launcher, which
    # may differ between machines (a resumed sweep on another node is still the same run).
    flags: list[str]
    description: str = ""  # printed when it starts
    env: dict = field(default_factory=dict)  # added to this process's environment
    cwd: Optional[str] = None  # where it runs (default: here)
    start_over: tuple = ()  # names in `directory` removed before each attempt (files or folders)
    metrics_file: Optional[str] = None  # where its progress is read (default <directory>/metrics.jsonl)

    @property
    def status_path(self) -> str:
        return os.path.join(self.directory, STATUS_FILE)

    @property
    def log_path(self) -> str:
        return os.path.join(self.directory, LOG_FILE)

    def status(self) -> dict:
        return read_json(self.status_path) or {}

    def is_finished(self) -> bool:
        status = self.status()
        # Status files written before `flags` was recorded: the flags end the command.
        flags = status.get("flags") or (status.get("command") or [])[-len(self.flags):]
        return status.get("status") == "finished" and flags == self.flags

    def last_iteration(self) -> int:
        """The last iteration the run has logged (read while it writes: a cut last line is no news)."""
        path = self.metrics_file or os.path.join(self.directory, "metrics.jsonl")
        if not os.path.isfile(path):
            return 0
        return max((record.get("iteration", 0) for record in read_metrics(path, warn=False)), default=0)


# judge(job, returncode) -> the status fields to record: at least "status" ("finished" or "failed"); a
# "summary" is printed after the outcome, a "reason" explains a failure.
Judge = Callable[[Job, int], dict]


def exit_code_judge(job: Job, returncode: int) -> dict:
    return {"status": "finished" if returncode == 0 else "failed"}


def read_json(path: str) -> Optional[dict]:
    try:
        with open(path) as file:
            return json.load(file)
    except (OSError, ValueError):
        return None


def write_json(path: str, data: dict) -> None:
    temporary = path + ".tmp"
    with open(temporary, "w") as file:
        json.dump(data, file, indent=1)
        file.write("\n")
    os.replace(temporary, path)


@dataclass
class _Attempt:
    job: Job
    process: subprocess.Popen
    log: TextIO
    started: float


def start(job: Job, threads: Optional[int] = None) -> _Attempt:
    os.makedirs(job.directory, exist_ok=True)
    for name in job.start_over:
        path = os.path.join(job.directory, name)
        if os.path.isdir(path):
            shutil.rmtree(path)
        elif os.path.exists(path):
            os.remove(path)
    write_json(job.status_path, dict(status="running", command=job.command, flags=job.flags, started=time.time()))
    env = {**os.environ, **job.env}
    env.setdefault("PYTHONWARNINGS", "ignore")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):  # each run is its own job, never part of ours
        env.pop(name, None)
    if threads:
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
    log = open(job.log_path, "a")
    log.write(f"$ {shlex.join(job.command)}\n")
    log.flush()
    process = subprocess.Popen(job.command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=job.cwd)
    return _Attempt(job, process, log, time.time())


def finish(attempt: _Attempt, judge: Judge) -> dict:
    attempt.log.close()
    job = attempt.job
    returncode = attempt.process.returncode
    status = dict(judge(job, returncode), returncode=returncode, seconds=round(time.time() - attempt.started, 1),
                  log=job.log_path, command=job.command, flags=job.flags)
    write_json(job.status_path, status)
    return status


def log_tail(path: str, lines: int = LOG_TAIL_LINES) -> str:
    with open(path, errors="replace") as file:
        return "".join(file.readlines()[-lines:])


def stop(attempts: list[_Attempt]) -> None:
    """SIGTERM to every run in flight (each saves or stops as its trainer does), then recorded as failed."""
    for attempt in attempts:
        attempt.process.send_signal(signal.SIGTERM)
    for attempt in attempts:
        try:
            attempt.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            attempt.process.kill()
            attempt.process.wait()
        finish(attempt, lambda job, code: {"status": "failed", "reason": "interrupted"})


def run_jobs(jobs: list[Job], parallel: int = 1, threads: Optional[int] = None, judge: Judge = exit_code_judge,
             stop_on_failure: bool = False, force: bool = False, out: Optional[TextIO] = None,
             progress_seconds: float = 30.0, on_progress: Optional[Callable[[], None]] = None) -> dict:
    """Run the jobs not finished before, `parallel` at a time (OMP_NUM_THREADS=threads each when given),
    printing each start and outcome and, every `progress_seconds`, the step each running job has logged
    (`on_progress` is called then and after each outcome). A KeyboardInterrupt (Ctrl-C, or SIGTERM through
    `interrupt_on_sigterm`) stops the runs in flight, records them failed and propagates.
    Returns counts: finished, skipped, failed, not_started (after a failure with stop_on_failure), seconds,
    failed_runs (names)."""
    out = out or sys.stdout
    counts = dict(finished=0, skipped=0, failed=0, not_started=0, failed_runs=[])
    pending = []
    for job in jobs:
        if not force and job.is_finished():
            summary = job.status().get("summary")
            print(f"{job.name}: already finished{f' ({summary})' if summary else ''}, skipped", file=out, flush=True)
            counts["skipped"] += 1
        else:
            pending.append(job)
    running: list[_Attempt] = []
    stopping = False
    began = last_report = time.time()
    try:
        while (pending and not stopping) or running:
            while pending and not stopping and len(running) < max(1, parallel):
                job = pending.pop(0)
                queued = f" ({len(pending)} queued after it)" if pending else ""
                print(f"{job.name}: {job.description or 'started'}{queued} ...", file=out, flush=True)
                running.append(start(job, threads))
            time.sleep(0.2)
            for attempt in [a for a in running if a.process.poll() is not None]:
                running.remove(attempt)
                status = finish(attempt, judge)
                summary = f", {status['summary']}" if status.get("summary") else ""
                if status["status"] == "finished":
                    counts["finished"] += 1
                    print(f"{attempt.job.name}: finished in {status['seconds']:.0f} s{summary}", file=out, flush=True)
                else:
                    counts["failed"] += 1
                    counts["failed_runs"].append(attempt.job.name)
                    reason = f", {status['reason']}" if status.get("reason") else ""
                    print(f"{attempt.job.name}: FAILED (exit code {status['returncode']}{reason}){summary}; "
                          f"log: {status['log']}, which ends:\n{log_tail(status['log'])}", file=out, flush=True)
                    stopping = stopping or stop_on_failure
                if on_progress:
                    on_progress()
            if running and time.time() - last_report > progress_seconds:
                last_report = time.time()
                if on_progress:
                    on_progress()
                steps = ", ".join(f"{a.job.name} at step {a.job.last_iteration()}" for a in running)
                print(f"  ... {steps}; load average {os.getloadavg()[0]:.2f}", file=out, flush=True)
    except KeyboardInterrupt:
        stop(running)
        raise
    counts["not_started"] = len(pending)
    counts["seconds"] = round(time.time() - began, 1)
    return counts


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def interrupt_on_sigterm() -> None:
    """SIGTERM (kill, Slurm's scancel or time limit) stops the runs as Ctrl-C does: they are stopped and
    recorded as failed, to be rerun by the next invocation."""
    signal.signal(signal.SIGTERM, _interrupt)
