"""Checkpoints in Megatron-LM's layout, written with megatron-core distributed checkpointing (torch_dist).

    <save>/latest_checkpointed_iteration.txt    the iteration of the newest complete checkpoint
    <save>/iter_0001000/                         model, optimizer, scheduler, training state, RNG states
    <save>/iter_0001000/tokenizer/               the tokenizer files the training data were written with
    <save>/iter_0001000/angpt_digests.json       every file's size and digest (angpt.training.digests)
    <save>/angpt_save.lock                       the run writing here (angpt.training.save_lock)

A checkpoint is written into `iter_XXXXXXX.incomplete/`, renamed once every rank has finished, and only
then named in `latest_checkpointed_iteration.txt` (replaced atomically). A process killed at any point of
a save therefore leaves the previous checkpoint as the one `--load` picks up. The digests are recorded just
before the rename and checked before a load, which refuses a damaged checkpoint (or falls back to the
newest intact one when asked).

Sharded tensors are stored by their global names and offsets, so a checkpoint loads at another tensor,
pipeline, virtual-pipeline, context-parallel or data-parallel layout; the distributed optimizer's state is stored per
parameter ("fully_reshardable") for the same reason. RNG states are restored only at the
layout they were saved at (elsewhere each rank's generator would be some other rank's).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import random
import re
import shutil
from dataclasses import asdict, dataclass
from functools import partial
from typing import Callable, Optional

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory, is_main_replica
from megatron.core.dist_checkpointing.serialization import (
    get_default_load_sharded_strategy,
    get_default_save_sharded_strategy,
)
from megatron.core.dist_checkpointing.strategies.fully_parallel import (
    FullyParallelLoadStrategyWrapper,
    FullyParallelSaveStrategyWrapper,
)
from megatron.core.dist_checkpointing.validation import StrictHandling
from torch.distributed.checkpoint.api import CheckpointException

from angpt.config.saved import config_from_saved, shape_differences
from angpt.config.sections import RunConfig
from angpt.megatron_compat import checkpoint_unpickling, patches
from angpt.training import digests
from angpt.training.faults import NO_HOOKS, Hooks

logger = logging.getLogger("angpt.checkpointing")

LATEST = "latest_checkpointed_iteration.txt"
INCOMPLETE = ".incomplete"
# The distributed optimizer's state gathered per parameter: loadable at any layout (megatron-core 0.16's
# per-parameter "fully_sharded_model_space" format no longer validates; angpt/megatron_compat lists it).
OPTIMIZER_SHARDING = {"distrib_optim_sharding_type": "fully_reshardable"}
_ITERATION_DIR = re.compile(r"^iter_(\d{7,})$")
FALLBACK_FLAG = "load-fallback-to-intact"
NEXT_TO_NO_SPACE = 1 << 20  # bytes free after a failed save that leave no doubt about why it failed


class CheckpointError(RuntimeError):
    """A checkpoint directory that cannot be resumed from; the message names the file."""


@dataclass
class TrainState:
    """Where training stands: what a resumed run needs besides the model and the optimizer."""

    iteration: int = 0
    consumed_samples: int = 0
    skipped_steps: int = 0


def checkpoint_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def read_latest_iteration(root: str) -> Optional[int]:
    """The iteration named in `<root>/latest_checkpointed_iteration.txt`, or None when there is none."""
    path = os.path.join(root, LATEST)
    try:
        with open(path) as file:
            text = file.read().strip()
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


def _model_state(chunks) -> dict:
    """Each chunk's sharded state under Megatron-LM's keys: `model`, or `model0`, `model1`, ... per
    virtual pipeline stage (the same mapping serves saving and loading). The tensors inside carry
    global names, so any layout can read them."""
    if len(chunks) == 1:
        return {"model": chunks[0].module.sharded_state_dict()}
    return {f"model{i}": chunk.module.sharded_state_dict() for i, chunk in enumerate(chunks)}


def _layout() -> dict:
    return {
        "tensor": parallel_state.get_tensor_model_parallel_world_size(),
        "pipeline": parallel_state.get_pipeline_model_parallel_world_size(),
        "context": parallel_state.get_context_parallel_world_size(),
        "data": parallel_state.get_data_parallel_world_size(),
    }


def _saved_layout(common: dict) -> dict | None:
    """The layout a checkpoint records; those saved before context parallelism existed were at CP 1."""
    layout = common.get("layout")
    return None if layout is None else {"context": 1, **layout}


def _rng_state() -> dict:
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


def _set_rng_state(state: dict) -> None:
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


def _rng_sharded_object(states: Optional[list]) -> ShardedObject:
    """Every rank's RNG state, as Megatron-LM stores it: one object per (pipeline, tensor) rank holding
    the states of all ranks of its data x context-parallel group (each a replica of the others)."""
    return ShardedObject(
        "rng_state",
        states,
        (
            parallel_state.get_pipeline_model_parallel_world_size(),
            parallel_state.get_tensor_model_parallel_world_size(),
        ),
        (parallel_state.get_pipeline_model_parallel_rank(), parallel_state.get_tensor_model_parallel_rank()),
        replica_id=parallel_state.get_data_parallel_rank(with_context_parallel=True),
    )


def _gathered_rng_states() -> list:
    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    states = [None] * group.size()
    dist.all_gather_object(states, _rng_state(), group=group)
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


def _estimated_bytes(sharded: dict) -> int:
    """What a save's tensors take on disk, over all ranks (each at its main replica; metadata add a little)."""
    local = sum(value.data.numel() * value.data.element_size() for value in nested_values(sharded)
                if isinstance(value, (ShardedTensor, ShardedTensorFactory)) and is_main_replica(value.replica_id))
    total = torch.tensor([local], dtype=torch.float64,
                         device=torch.cuda.current_device() if torch.cuda.is_available() else "cpu")
    dist.all_reduce(total)
    return int(total.item())


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


def _refusing_a_full_disk(action: Callable, root: str, iteration: int, needed: int) -> Callable:
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


def save_checkpoint(
    root: str,
    state: TrainState,
    chunks,
    optimizer,
    scheduler,
    args: dict,
    tokenizer: Optional[dict] = None,
    keep_last: Optional[int] = None,
    retain_interval: Optional[int] = None,
    async_queue=None,
    hooks: Hooks = NO_HOOKS,
    fully_parallel: bool = True,
    assume_constant_structure: bool = False,
    context: Optional[dict] = None,
) -> None:
    """Save collectively (every rank calls this). With `async_queue` (megatron-core's AsyncCallsQueue)
    the tensors are written in the background and the checkpoint is committed when the queue finalizes
    the request; otherwise it is committed before this returns (`hooks`: the points tests pause at, to kill a
    save midway; angpt.training.faults). A save that
    cannot fit in the free space is refused before it writes anything, and one that fills the disk is
    removed; both raise a CheckpointError that says so. `context` (Megatron-LM's checkpointing_context, one dict
    for the run) keeps the save strategy from one save to the next; with `assume_constant_structure` it caches the
    first save's plan and metadata, and the later saves skip megatron-core's checks of the sharding."""
    iteration = state.iteration  # the state moves on while an async save is being written
    staging = checkpoint_dir(root, iteration) + INCOMPLETE
    model = _model_state(chunks)
    sharded = {
        **model,
        "optimizer": optimizer.sharded_state_dict(model, metadata=dict(OPTIMIZER_SHARDING)),
        "opt_param_scheduler": scheduler.state_dict(),
        "train_state": asdict(state),
        "layout": _layout(),
        "args": args,
        "checkpoint_version": 3.0,
        "rng_state": _rng_sharded_object(_gathered_rng_states()),
    }
    needed = _estimated_bytes(sharded)
    refusal = [None]
    if dist.get_rank() == 0:
        free = shutil.disk_usage(root).free
        if free < needed:
            refusal = [_no_space(root, iteration, f"it needs about {_mib(needed)}, {_mib(free)} free")]
        else:
            if os.path.isdir(staging):
                shutil.rmtree(staging)
            os.makedirs(staging)
    dist.broadcast_object_list(refusal, src=0)
    if refusal[0] is not None:
        raise CheckpointError(refusal[0])
    context = {} if context is None else context
    validate = "save_strategy" not in context or not assume_constant_structure
    strategy = context.get("save_strategy") or _save_strategy(fully_parallel, assume_constant_structure)
    context["save_strategy"] = strategy

    def commit():
        hooks.before_commit(iteration)
        dist.barrier()
        commit_checkpoint(root, iteration, tokenizer, keep_last, retain_interval)

    def write():
        return dist_checkpointing.save(sharded, staging, sharded_strategy=strategy,
                                       async_sharded_save=async_queue is not None,
                                       validate_access_integrity=validate)

    if async_queue is None:
        _refusing_a_full_disk(write, root, iteration, needed)()
        _refusing_a_full_disk(commit, root, iteration, needed)()
        return
    request = _refusing_a_full_disk(write, root, iteration, needed)()
    # A partial of module-level functions: megatron-core's persistent worker receives it pickled.
    request = request._replace(async_fn=partial(_after, partial(hooks.before_background_write, iteration),
                                                request.async_fn))
    steps = [*request.finalize_fns, commit]

    def finalize():
        for step in steps:
            step()

    # The background writer's errors surface when the queue finalizes the request, on every rank.
    async_queue.schedule_async_request(
        request._replace(finalize_fns=[_refusing_a_full_disk(finalize, root, iteration, needed)]))


def _after(first: Callable[[], None], function: Callable, *args, **kwargs):
    """`first()`, then `function(*args, **kwargs)`."""
    first()
    return function(*args, **kwargs)


def _save_strategy(fully_parallel: bool, assume_constant_structure: bool):
    """megatron-core's torch_dist save strategy as Megatron-LM builds it."""
    strategy = get_default_save_sharded_strategy()
    strategy.use_cached_ckpt_structure = assume_constant_structure
    if fully_parallel:  # --no-ckpt-fully-parallel-save turns it off (Megatron-LM's default: on)
        strategy = FullyParallelSaveStrategyWrapper(
            strategy, parallel_state.get_data_parallel_group(with_context_parallel=True), assume_constant_structure)
    return strategy


def _iteration_of(path: str) -> int:
    return int(_ITERATION_DIR.match(os.path.basename(os.path.normpath(path))).group(1))


def verify_checkpoint(path: str) -> bool:
    """Collectively check a checkpoint directory against the digests recorded when it was committed. True
    when it is intact; False, with a note, when it has none (saved before digests were recorded); a damaged,
    truncated or missing file raises a CheckpointError of one line naming it and the iteration."""
    what = f"the checkpoint of iteration {_iteration_of(path)}"
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


def intact_checkpoint(root: str, fallback: bool = False) -> Optional[str]:
    """Collectively find the checkpoint directory to resume from under root and verify it: the latest one
    (a damaged one is refused), or with `fallback` the newest intact one at or before it, also when the
    latest file is missing, unreadable or names a missing directory. None when root holds no checkpoint;
    checkpoint directories without a latest file are refused unless `fallback` (never silently skipped)."""
    iterations = complete_iterations(root)
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
            if dist.get_rank() == 0:
                logger.warning("no checkpoint in %s (no %s): starting from scratch", root, LATEST)
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


def _refusing_unsafe(function: Callable):
    """`function()`, a read of a checkpoint; a file that would run code when unpickled is refused by a
    CheckpointError of one line naming it, also when torch or megatron-core wrapped the refusal."""
    try:
        return function()
    except (Exception, CheckpointException) as error:
        unsafe = checkpoint_unpickling.refusal_in(error)
        if unsafe is not None:
            raise CheckpointError(str(unsafe)) from None
        raise


def read_common_state(path: str) -> dict:
    """The common state of the checkpoint directory `path` (`args`, `train_state`, `layout`, ...) read as data
    only: a common.pt that would run code is refused by a CheckpointError naming it; megatron-core's other errors
    pass as they are."""
    return _refusing_unsafe(lambda: dist_checkpointing.load_common_state_dict(path))


def read_plain_tensors(path: str) -> dict:
    """Every tensor (and object) of the distributed checkpoint `path` whole, by its global name: the checkpoint
    as one process reads it, whatever layout saved it (the Hugging Face export). Read as data only, .metadata
    checked first; refusals and other errors as `read_common_state`."""
    _refusing_unsafe(lambda: checkpoint_unpickling.check_metadata(path))
    return _refusing_unsafe(lambda: dist_checkpointing.load_plain_tensors(path))


def _unreadable(error: BaseException, path: str) -> CheckpointError:
    """A failed read of a checkpoint without digests (a truncated or missing file) said in one line."""
    first_line = (str(error).strip().splitlines() or [""])[0]
    return CheckpointError(f"the checkpoint of iteration {_iteration_of(path)} in {path}, which has no digests to "
                           f"name a damaged file, cannot be read: {type(error).__name__}: {first_line}")


def load_checkpoint(
    path: str,
    chunks,
    optimizer,
    scheduler,
    config: Optional[RunConfig] = None,
    load_optimizer: bool = True,
    load_rng: bool = True,
    finetune: bool = False,
    strictness: str = StrictHandling.ASSUME_OK_UNEXPECTED.value,
    fully_parallel: bool = False,
) -> TrainState:
    """Load the checkpoint directory `path` (`intact_checkpoint`'s) into the model (and optimizer, scheduler,
    RNG), collectively. Returns its training state. With the run's `config`, a checkpoint of a model of another
    shape is refused by a CheckpointError naming the flags that differ. `strictness`: --dist-ckpt-strictness
    (megatron-core's StrictHandling; the return_* modes log what they return); `fully_parallel`:
    --ckpt-fully-parallel-load."""
    iteration = _iteration_of(path)
    verified = os.path.isfile(os.path.join(path, digests.DIGESTS))

    def read(function: Callable):
        try:
            return _refusing_unsafe(function)
        except CheckpointError:
            raise
        except (Exception, CheckpointException) as error:
            if verified:
                raise
            raise _unreadable(error, path) from error

    common = read(lambda: dist_checkpointing.load_common_state_dict(path))
    if config is not None and isinstance(common.get("args"), dict):
        differences = shape_differences(config_from_saved(common["args"]), config)
        if differences:
            raise CheckpointError(f"{path} holds a model of another shape: {', '.join(differences)}; give the flags "
                                  "it was saved with (or --load another directory)")
    if finetune:
        load_optimizer = load_rng = False
    same_layout = _saved_layout(common) == _layout()
    if load_rng and not same_layout and dist.get_rank() == 0:
        logger.warning("%s was saved at layout %s, this run is %s: RNG states are not restored",
                       path, _saved_layout(common), _layout())
    load_rng = load_rng and same_layout

    model = _model_state(chunks)
    request = dict(model)
    if load_optimizer:
        patches.prepare_optimizer_for_loading(optimizer)
        request["optimizer"] = optimizer.sharded_state_dict(model, is_loading=True, metadata=dict(OPTIMIZER_SHARDING))
    if load_rng:
        request["rng_state"] = _rng_sharded_object(None)
    read(lambda: checkpoint_unpickling.check_metadata(path))
    strategy = get_default_load_sharded_strategy(path)
    if fully_parallel:
        strategy = FullyParallelLoadStrategyWrapper(
            strategy, parallel_state.get_data_parallel_group(with_context_parallel=True))
    strict = StrictHandling(strictness)
    try:
        loaded = read(lambda: dist_checkpointing.load(request, path, strategy, strict=strict))
    except CheckpointingException as error:
        if strict not in (StrictHandling.RAISE_UNEXPECTED, StrictHandling.RAISE_ALL):
            raise
        # megatron-core's report of the mismatch (the kinds of key, then the keys), on one line.
        raise CheckpointError(f"--dist-ckpt-strictness {strictness}: {path} does not match what this run loads: "
                              f"{' '.join(str(error).split())}") from None
    if StrictHandling.requires_returning_mismatch_keys(strict):
        loaded, missing, unexpected = loaded
        if dist.get_rank() == 0:
            logger.warning("--dist-ckpt-strictness %s: %s holds %d tensors this run does not load (%s) and lacks %d "
                           "it asks for (%s)", strictness, path, len(missing), ", ".join(sorted(missing)) or "none",
                           len(unexpected), ", ".join(sorted(unexpected)) or "none")

    if len(chunks) == 1:
        chunks[0].module.load_state_dict(loaded["model"], strict=True)
    else:
        for i, chunk in enumerate(chunks):
            chunk.module.load_state_dict(loaded[f"model{i}"], strict=True)
    if load_optimizer:
        optimizer.load_state_dict(loaded["optimizer"])
        patches.unshare_adam_steps(optimizer)
        scheduler.load_state_dict(loaded["opt_param_scheduler"])
    else:
        # Mixed-precision optimizers keep fp32 copies of the weights: refresh them from the model.
        optimizer.reload_model_params()
    if load_rng:
        _set_rng_state(loaded["rng_state"][parallel_state.get_data_parallel_rank(with_context_parallel=True)])
    if dist.get_rank() == 0:
        logger.info("loaded checkpoint %s (iteration %d)%s", path, iteration, " for fine-tuning" if finetune else "")
    return TrainState() if finetune else TrainState(**loaded["train_state"])
