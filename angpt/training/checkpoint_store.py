"""A checkpoint directory, whichever format writes it (angpt.training.checkpointing's torch_dist,
angpt.training.torch_checkpoint's torch): its iter_XXXXXXX layout, the staging in `iter_XXXXXXX.incomplete/` and the
commit (digests recorded, renamed, then named in the latest file, so that a process killed midway leaves the previous
checkpoint the latest), the verification against the digests, the full-disk guard, the RNG states and parallel
layout a checkpoint records, and the errors.

    <save>/latest_checkpointed_iteration.txt    the iteration of the newest complete checkpoint
    <save>/iter_0001000/                         the format's files: model, optimizer, scheduler, state, RNG states
    <save>/iter_0001000/tokenizer/               the tokenizer files the training data were written with
    <save>/iter_0001000/angpt_digests.json       every file's size and digest (angpt.training.digests)
    <save>/angpt_save.lock                       the run writing here (angpt.training.save_lock)
    <save>/non_persistent/                       --non-persistent-ckpt-type global's checkpoints (the same layout;
                                                 --non-persistent-global-ckpt-dir elsewhere), each replacing the last
"""

from __future__ import annotations

import errno
import json
import logging
import os
import random
import re
import shutil
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from torch.distributed.checkpoint.api import CheckpointException

from angpt.megatron_compat import checkpoint_unpickling
from angpt.training import digests

logger = logging.getLogger("angpt.checkpointing")

LATEST = "latest_checkpointed_iteration.txt"
INCOMPLETE = ".incomplete"
_ITERATION_DIR = re.compile(r"^iter_(\d{7,})$")
FALLBACK_FLAG = "load-fallback-to-intact"
NON_PERSISTENT = "non_persistent"  # Megatron-LM's _NON_PERSISTENT_CKPT_SUBDIR
NEXT_TO_NO_SPACE = 1 << 20  # bytes free after a failed save that leave no doubt about why it failed


class CheckpointError(RuntimeError):
    """A checkpoint directory that cannot be resumed from or saved; the message names the file. `every_rank`: every
    rank raised this very message (a verdict rank 0 broadcast), so rank 0 alone says it."""

    def __init__(self, message: str, every_rank: bool = False):
        super().__init__(message)
        self.every_rank = every_rank


class NoCheckpointToLoad(Exception):
    """--exit-on-missing-checkpoint and a --load without a checkpoint: the run exits instead of starting from scratch,
    with status 0 (Megatron-LM's sys.exit())."""


@dataclass
class TrainState:
    """Where training stands: what a resumed run needs besides the model and the optimizer."""

    iteration: int = 0
    consumed_samples: int = 0
    skipped_steps: int = 0


def checkpoint_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def iteration_of(path: str) -> int:
    return int(_ITERATION_DIR.match(os.path.basename(os.path.normpath(path))).group(1))


def read_latest_iteration(root: str) -> Optional[int]:
    """The iteration named in `<root>/latest_checkpointed_iteration.txt`, or None when there is none."""
    path = os.path.join(root, LATEST)
    try:
        with open(path, "rb") as file:  # bytes: a damaged file may not be text
            text = file.read().decode("ascii", errors="backslashreplace").strip()
    except FileNotFoundError:
        return None
    if not text.isdigit():
        raise CheckpointError(f"{path}: expected an iteration number, found {text[:40]!r}")
    iteration = int(text)
    if not os.path.isdir(checkpoint_dir(root, iteration)):
        raise CheckpointError(f"{path} names iteration {iteration}, but {checkpoint_dir(root, iteration)} is missing")
    return iteration


def complete_iterations(root: str) -> list[int]:
    """The iterations of the complete checkpoint directories under root, oldest first."""
    if not os.path.isdir(root):
        return []
    found = (_ITERATION_DIR.match(name) for name in os.listdir(root))
    return sorted(int(match.group(1)) for match in found if match)


def remove_incomplete(root: str) -> None:
    """Delete what saves interrupted by a crash left behind (rank 0, when no save is in progress)."""
    if not os.path.isdir(root):
        return
    for name in os.listdir(root):
        if name.startswith("iter_") and name.endswith(INCOMPLETE):
            logger.warning("removing %s, left by a save that did not finish", os.path.join(root, name))
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def layout() -> dict:
    return {
        "tensor": parallel_state.get_tensor_model_parallel_world_size(),
        "pipeline": parallel_state.get_pipeline_model_parallel_world_size(),
        "context": parallel_state.get_context_parallel_world_size(),
        "data": parallel_state.get_data_parallel_world_size(),
    }


def saved_layout(common: dict) -> dict | None:
    """The layout a checkpoint records; those saved before context parallelism existed were at CP 1."""
    layout = common.get("layout")
    return None if layout is None else {"context": 1, **layout}


def rng_state() -> dict:
    state = {
        "random": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        # Generators where CUDA graphs are on (angpt.training.distributed.set_random_seed): saved as their states, so
        # that a checkpoint resumes with CUDA graphs on or off.
        "tracker": {name: rng.get_state() if isinstance(rng, torch.Generator) else rng
                    for name, rng in tensor_parallel.get_cuda_rng_tracker().get_states().items()},
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["random"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tracker = tensor_parallel.get_cuda_rng_tracker()
    if getattr(tracker, "use_cudagraphable_rng", False):  # its generators stay: captured graphs hold them
        for name, rng in tracker.get_states().items():
            rng.set_state(state["tracker"][name])
    else:
        tracker.set_states(state["tracker"])


def gathered_rng_states() -> list:
    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    states = [None] * group.size()
    dist.all_gather_object(states, rng_state(), group=group)
    return states


def save_tokenizer_files(description: Optional[dict], destination: str) -> None:
    """Copy the tokenizer files named in the dataset metadata, and the description itself (mock data
    have no tokenizer)."""
    if not isinstance(description, dict):
        return
    os.makedirs(destination, exist_ok=True)
    for entry in description.values():
        if isinstance(entry, dict) and os.path.isfile(entry.get("path", "")):
            shutil.copy2(entry["path"], os.path.join(destination, os.path.basename(entry["path"])))
    with open(os.path.join(destination, "angpt_tokenizer.json"), "w") as file:
        json.dump(description, file, indent=2)
        file.write("\n")


def write_latest_iteration(root: str, iteration: int) -> None:
    temporary = os.path.join(root, LATEST + ".tmp")
    with open(temporary, "w") as file:
        file.write(f"{iteration}\n")
        file.flush()
        os.fsync(file.fileno())
    os.replace(temporary, os.path.join(root, LATEST))


def _delete_old(root: str, keep_last: Optional[int], retain_interval: Optional[int] = None) -> None:
    """--keep-last-n-checkpoints, sparing the multiples of --save-retain-interval; that alone keeps the latest one
    besides them (Megatron-LM's: each save deletes the one before, unless retained)."""
    keep = keep_last or (1 if retain_interval else None)
    if not keep:
        return
    for iteration in complete_iterations(root)[:-keep]:
        if retain_interval and iteration % retain_interval == 0:
            continue
        shutil.rmtree(checkpoint_dir(root, iteration), ignore_errors=True)
        why = (f"--keep-last-n-checkpoints {keep_last}" if keep_last else
               f"--save-retain-interval {retain_interval}: the latest and its multiples are kept")
        logger.info("deleted %s (%s)", checkpoint_dir(root, iteration), why)


def commit_checkpoint(root: str, iteration: int, tokenizer: Optional[dict] = None,
                      keep_last: Optional[int] = None, retain_interval: Optional[int] = None) -> None:
    """Collectively turn the written `iter_XXXXXXX.incomplete` into the latest checkpoint: the tokenizer
    files are added, every file's digest recorded, the directory renamed and named in the latest file."""
    final = checkpoint_dir(root, iteration)
    staging = final + INCOMPLETE
    if dist.get_rank() == 0:
        save_tokenizer_files(tokenizer, os.path.join(staging, "tokenizer"))
    digests.record(staging)
    if dist.get_rank() == 0:
        if os.path.isdir(final):  # a checkpoint of this iteration that is not the latest one
            shutil.rmtree(final)
        os.rename(staging, final)
        write_latest_iteration(root, iteration)
        _delete_old(root, keep_last, retain_interval)
        logger.info("saved checkpoint %s", final)
    dist.barrier()


def _mib(size: float) -> str:
    return f"{size / 2**20:.1f} MiB"


def _no_space(root: str, iteration: int, need: str) -> str:
    try:
        latest = read_latest_iteration(root)
    except CheckpointError:
        latest = None
    previous = f"the previous checkpoint (iteration {latest}) is intact" if latest is not None else \
        "nothing was saved before"
    return f"no space left in {root} for the checkpoint of iteration {iteration}: {need}; {previous}"


def _causes(error: BaseException):
    while error is not None:
        yield error
        error = error.__cause__ or error.__context__


def _out_of_space(error: BaseException, free: int, missing: int) -> bool:
    """Whether a save failed for want of space: an ENOSPC (or quota) error, also as the text other ranks and
    megatron-core's writer processes pass on, or less free space than the rest of the checkpoint needed, or
    next to none (torch.save says only "unexpected pos", and an estimate may fall short)."""
    codes = (errno.ENOSPC, errno.EDQUOT)
    if any(isinstance(cause, OSError) and cause.errno in codes for cause in _causes(error)):
        return True
    return any(os.strerror(code) in str(error) for code in codes) or free < max(missing, NEXT_TO_NO_SPACE)


def _bytes_under(directory: str) -> int:
    return sum(os.path.getsize(os.path.join(parent, name)) for parent, _, names in os.walk(directory) for name in names)


def refusing_a_full_disk(action: Callable, root: str, iteration: int, needed: int) -> Callable:
    """`action` (writing a checkpoint, committing it), turning a failure for want of space into a CheckpointError
    that says so, with the space needed; the partial checkpoint is removed to give its space back."""
    staging = checkpoint_dir(root, iteration) + INCOMPLETE

    def guarded():
        try:
            return action()
        except (Exception, CheckpointException) as error:  # torch's CheckpointException is a BaseException
            written = _bytes_under(staging)
            free = shutil.disk_usage(root).free
            if not _out_of_space(error, free, needed - written):
                raise
            shutil.rmtree(staging, ignore_errors=True)
            message = (f"it needs more than the {_mib(free + written)} that were free "
                       f"(its tensors: about {_mib(needed)})")
            raise CheckpointError(_no_space(root, iteration, message)) from error

    return guarded


def prepare_staging(root: str, iteration: int, needed: int) -> None:
    """Collectively: refuse a save of `needed` bytes that cannot fit in the free space (a CheckpointError that says
    so, on every rank), else make its empty `iter_XXXXXXX.incomplete` directory."""
    staging = checkpoint_dir(root, iteration) + INCOMPLETE
    refusal = [None]
    if dist.get_rank() == 0:
        os.makedirs(root, exist_ok=True)  # non_persistent/ in --save, made at its first save (Megatron-LM's)
        free = shutil.disk_usage(root).free
        if free < needed:
            refusal = [_no_space(root, iteration, f"it needs about {_mib(needed)}, {_mib(free)} free")]
        else:
            if os.path.isdir(staging):
                shutil.rmtree(staging)
            os.makedirs(staging)
    dist.broadcast_object_list(refusal, src=0)
    if refusal[0] is not None:
        raise CheckpointError(refusal[0], every_rank=True)  # else rank 0 made the directory before the broadcast


def verify_checkpoint(path: str) -> bool:
    """Collectively check a checkpoint directory against the digests recorded when it was committed. True
    when it is intact; False, with a note, when it has none (saved before digests were recorded); a damaged,
    truncated or missing file raises a CheckpointError of one line naming it and the iteration."""
    what = f"the checkpoint of iteration {iteration_of(path)}"
    if not os.path.isdir(path):
        raise CheckpointError(f"{what} is missing: no {path}")
    problem = digests.check(path)
    if problem == digests.NOT_RECORDED:
        if dist.get_rank() == 0:
            logger.warning("%s has no %s (saved before digests were recorded): it cannot be verified",
                           path, digests.DIGESTS)
        return False
    if problem is not None:
        raise CheckpointError(f"{what} is damaged: {problem}")
    return True


def non_persistent_dir(root: str, given: Optional[str]) -> str:
    """Where the --non-persistent-ckpt-type global checkpoints of the run saving to (or resuming from) `root` are:
    --non-persistent-global-ckpt-dir (`given`), else non_persistent/ in `root` (Megatron-LM's)."""
    return given or os.path.join(root, NON_PERSISTENT)


def checkpoint_to_resume(root: str, fallback: bool = False, step: Optional[int] = None,
                         non_persistent: Optional[str] = None, exit_on_missing: bool = False) -> Optional[str]:
    """Collectively: `intact_checkpoint`'s of root, or, with `non_persistent` (--non-persistent-ckpt-type global's
    directory) and no `step`, the latest there where it is at least as new as root's (Megatron-LM's
    _load_base_checkpoint), verified as well; with `fallback`, root's where it is damaged. None when neither holds a
    checkpoint (said in one line), or with `exit_on_missing` (--exit-on-missing-checkpoint) NoCheckpointToLoad."""
    if non_persistent is not None and step is None:
        try:
            if non_persistent_is_newer(root, non_persistent):
                path = intact_checkpoint(non_persistent)
                if dist.get_rank() == 0:
                    logger.info("resuming from the non-persistent checkpoint %s (--non-persistent-ckpt-type global), "
                                "at least as new as %s's", path, root)
                return path
        except CheckpointError as error:
            if not fallback:
                raise
            if dist.get_rank() == 0:
                logger.warning("%s; resuming from %s's instead", error, root)
    path = intact_checkpoint(root, fallback, step)
    if path is None:
        if exit_on_missing:
            raise NoCheckpointToLoad(f"--exit-on-missing-checkpoint: no checkpoint in {root} (no {LATEST}): exiting "
                                     "instead of starting from scratch")
        if dist.get_rank() == 0:
            logger.warning("no checkpoint in %s (no %s): starting from scratch", root, LATEST)
    return path


def non_persistent_is_newer(root: str, non_persistent: str) -> bool:
    """Whether `non_persistent` holds a checkpoint at least as new as root's, which Megatron-LM's _load_base_checkpoint
    then loads instead (and --use-checkpoint-args reads the flags of)."""
    newer = read_latest_iteration(non_persistent)
    return newer is not None and newer >= _newest(root)


def _newest(root: str) -> int:
    """The iteration of root's latest checkpoint (-1: none), for comparing with a non-persistent one."""
    try:
        latest = read_latest_iteration(root)
    except CheckpointError:  # intact_checkpoint decides what becomes of it
        latest = None
    return max(complete_iterations(root), default=-1) if latest is None else latest


def intact_checkpoint(root: str, fallback: bool = False, step: Optional[int] = None) -> Optional[str]:
    """Collectively find the checkpoint directory to resume from under root and verify it: the latest one
    (a damaged one is refused), or with `fallback` the newest intact one at or before it, also when the
    latest file is missing, unreadable or names a missing directory. None when root holds no checkpoint;
    checkpoint directories without a latest file are refused unless `fallback` (never silently skipped).
    With `step` (--ckpt-step), that iteration's, whatever the latest file says (Megatron-LM's)."""
    iterations = complete_iterations(root)
    if step is not None:
        if step not in iterations:
            held = ", ".join(map(str, iterations)) or "none"
            raise CheckpointError(f"--ckpt-step {step}: {root} holds no complete checkpoint of iteration {step} "
                                  f"(its iterations: {held})")
        path = checkpoint_dir(root, step)
        verify_checkpoint(path)
        return path
    try:
        latest = read_latest_iteration(root)
    except CheckpointError as error:
        if not fallback:
            raise
        if dist.get_rank() == 0:
            logger.warning("%s; looking for the newest intact checkpoint", error)
        latest = None
    if latest is None:
        if not iterations:
            return None
        if not fallback:
            raise CheckpointError(
                f"{root} has no {LATEST} but holds checkpoints of iterations {', '.join(map(str, iterations))}: "
                f"give --{FALLBACK_FLAG} to resume from the newest intact one, or another --load")
        if dist.get_rank() == 0:
            logger.warning("%s has no usable %s: looking for the newest intact checkpoint of iterations %s",
                           root, LATEST, ", ".join(map(str, iterations)))
    candidates = [latest] if latest is not None else []
    candidates += [iteration for iteration in reversed(iterations) if latest is None or iteration < latest]
    for iteration in candidates:
        path = checkpoint_dir(root, iteration)
        try:
            verify_checkpoint(path)
        except CheckpointError as error:
            if not fallback:
                raise CheckpointError(f"{error}; --{FALLBACK_FLAG} resumes from the newest intact checkpoint "
                                      "before it") from None
            if dist.get_rank() == 0:
                logger.warning("%s; trying the checkpoint before it", error)
            continue
        if iteration != latest and dist.get_rank() == 0:
            logger.warning("resuming from %s, the newest intact checkpoint in %s", path, root)
        return path
    raise CheckpointError(f"no intact checkpoint in {root} (iterations {', '.join(map(str, candidates))} checked)")


def refusing_unsafe(function: Callable):
    """`function()`, a read of a checkpoint; a file that would run code when unpickled is refused by a
    CheckpointError of one line naming it, also when torch or megatron-core wrapped the refusal."""
    try:
        return function()
    except (Exception, CheckpointException) as error:
        unsafe = checkpoint_unpickling.refusal_in(error)
        if unsafe is not None:
            raise CheckpointError(str(unsafe)) from None
        raise


def unreadable(error: BaseException, path: str) -> CheckpointError:
    """A failed read of a checkpoint without digests (a truncated or missing file) said in one line."""
    first_line = (str(error).strip().splitlines() or [""])[0]
    return CheckpointError(f"the checkpoint of iteration {iteration_of(path)} in {path}, which has no digests to "
                           f"name a damaged file, cannot be read: {type(error).__name__}: {first_line}")
