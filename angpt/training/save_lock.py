"""One writer per --save directory.

Rank 0 takes `<save>/angpt_save.lock` before anything is written there and removes it when the run ends.
The file names its holder: host, PID, the process's start time (a PID alone may have been reused) and the
command. A second run on the directory is refused, naming the holder. A lock whose holder is gone (same
host, and no process with that PID and start time) is taken over with a warning; so is one left by an
earlier attempt of the same Slurm job (the same SLURM_JOB_ID and a lower SLURM_RESTART_COUNT: Slurm requeues a
job only once it has stopped, and its rank 0 may start on another node). Any other lock from another host
cannot be checked from here and is refused, saying how to remove it. A process holds a lock once: taking
it again (another trainer in the same process, as tests build them) is a no-op.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import socket
import sys
import time
from typing import Optional

import psutil
import torch.distributed as dist

from angpt.training.checkpoint_store import CheckpointError

logger = logging.getLogger("angpt.save_lock")

LOCK = "angpt_save.lock"
STARTED_TOLERANCE_S = 1.0  # the start times psutil gives for one process agree to well within this


class SaveLockError(CheckpointError):
    """Another run writes, or may write, into the --save directory."""


def this_process() -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid(), "started": psutil.Process().create_time(),
            "command": " ".join(sys.argv), "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
            "slurm_restart_count": int(os.environ.get("SLURM_RESTART_COUNT", 0))}


def _earlier_attempt_of_this_slurm_job(holder: dict, me: dict) -> bool:
    return me["slurm_job_id"] is not None and holder.get("slurm_job_id") == me["slurm_job_id"] \
        and isinstance(holder.get("slurm_restart_count"), int) \
        and holder["slurm_restart_count"] < me["slurm_restart_count"]


def describe(holder: dict) -> str:
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder["started"]))
    return f"PID {holder['pid']} on {holder['host']}, started {started}"


def _is_running(holder: dict) -> bool:
    try:
        process = psutil.Process(holder["pid"])
        # A killed run is a zombie until its parent (or init, for an orphan) reaps it: it has ended.
        return abs(process.create_time() - holder["started"]) < STARTED_TOLERANCE_S \
            and process.status() != psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return False


def _same_process(holder: dict, me: dict) -> bool:
    return (holder["host"], holder["pid"]) == (me["host"], me["pid"]) \
        and abs(holder["started"] - me["started"]) < STARTED_TOLERANCE_S


def _read(path: str) -> Optional[dict]:
    """The holder the lock names, or None when it names none (being written, or damaged); FileNotFoundError
    when there is no lock."""
    with open(path, "rb") as file:
        content = file.read()
    try:
        holder = json.loads(content)
    except ValueError:
        return None
    valid = isinstance(holder, dict) and isinstance(holder.get("host"), str) and isinstance(holder.get("pid"), int) \
        and isinstance(holder.get("started"), (int, float))
    return holder if valid else None


def _write_new(path: str, me: dict) -> bool:
    """Create the lock naming this process; False when one exists."""
    try:
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(descriptor, "w") as file:
        json.dump(me, file)
        file.write("\n")
    return True


def _replace(path: str, me: dict) -> None:
    """Put a lock naming this process in place of a stale one, atomically."""
    temporary = f"{path}.{me['pid']}.tmp"
    with open(temporary, "w") as file:
        json.dump(me, file)
        file.write("\n")
    os.replace(temporary, path)


def acquire(directory: str) -> None:
    """Take the lock of `directory` for this process (one process: rank 0), or raise SaveLockError."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, LOCK)
    me = this_process()
    for _ in range(50):  # another run may be between creating its lock and writing who it is
        if _write_new(path, me):
            break
        try:
            holder = _read(path)
        except FileNotFoundError:  # released meanwhile
            continue
        if holder is None:
            time.sleep(0.1)
            continue
        if _same_process(holder, me):
            return
        if _earlier_attempt_of_this_slurm_job(holder, me):
            logger.warning("taking over %s from an earlier attempt of Slurm job %s, requeued (%s)", path,
                           me["slurm_job_id"], describe(holder))
        elif holder["host"] != me["host"]:
            raise SaveLockError(
                f"{directory} is locked by a run on another host ({describe(holder)}), which cannot be checked "
                f"from here: if that run has ended, remove {path} and start again")
        elif _is_running(holder):
            raise SaveLockError(f"{directory} is being written by another run ({describe(holder)}): wait for it "
                                "to end or give this run another --save")
        else:
            logger.warning("taking over %s from a run that is no longer running (%s)", path, describe(holder))
        _replace(path, me)
        # Of two runs replacing one stale lock at the same moment, the one overwritten finds out here.
        winner = _read(path)
        if winner is None or not _same_process(winner, me):
            raise SaveLockError(f"{directory} was taken over at the same time by another run"
                                + (f" ({describe(winner)})" if winner else ""))
        break
    else:
        raise SaveLockError(f"{path} exists but names no run (damaged?): if no run writes into {directory}, "
                            "remove it and start again")
    atexit.register(release, directory)


def release(directory: str) -> None:
    """Remove the lock of `directory` if this process holds it (not in a forked child)."""
    path = os.path.join(directory, LOCK)
    try:
        holder = _read(path)
    except FileNotFoundError:
        return
    if holder is not None and _same_process(holder, this_process()):
        os.remove(path)


def take(directory: str) -> None:
    """Collectively: rank 0 takes the lock of `directory`; every rank raises SaveLockError if it could not."""
    refusal = [None]
    if dist.get_rank() == 0:
        try:
            acquire(directory)
        except SaveLockError as error:
            refusal = [str(error)]
        except OSError as error:  # a directory that cannot be created or written: every rank stops alike
            refusal = [f"cannot lock {directory}: {error}"]
    dist.broadcast_object_list(refusal, src=0)
    if refusal[0] is not None:
        raise SaveLockError(refusal[0])
