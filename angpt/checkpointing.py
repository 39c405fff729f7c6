"""Checkpoints in Megatron-LM's layout, written with megatron-core distributed checkpointing (torch_dist).

    <save>/latest_checkpointed_iteration.txt    the iteration of the newest complete checkpoint
    <save>/iter_0001000/                         model, optimizer, scheduler, training state, RNG states
    <save>/iter_0001000/tokenizer/               the tokenizer files the training data were written with

A checkpoint is written into `iter_XXXXXXX.incomplete/`, renamed once every rank has finished, and only
then named in `latest_checkpointed_iteration.txt` (replaced atomically). A process killed at any point of
a save therefore leaves the previous checkpoint as the one `--load` picks up.

Sharded tensors are stored by their global names and offsets, so a checkpoint loads at another tensor,
pipeline, virtual-pipeline or data-parallel layout; the distributed optimizer's state is stored per
parameter ("fully_reshardable") for the same reason. RNG states are restored only at the
layout they were saved at (elsewhere each rank's generator would be some other rank's).
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import signal
from dataclasses import asdict, dataclass
from typing import Callable, Optional

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper

logger = logging.getLogger("angpt.checkpointing")

LATEST = "latest_checkpointed_iteration.txt"
INCOMPLETE = ".incomplete"
# The distributed optimizer's state gathered per parameter: loadable at any layout (megatron-core 0.16's
# per-parameter "fully_sharded_model_space" format no longer validates).
OPTIMIZER_SHARDING = {"distrib_optim_sharding_type": "fully_reshardable"}
_ITERATION_DIR = re.compile(r"^iter_(\d{7,})$")


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
        "data": parallel_state.get_data_parallel_world_size(),
    }


def _rng_state() -> dict:
    state = {
        "random": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
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
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _rng_sharded_object(states: Optional[list]) -> ShardedObject:
    """Every rank's RNG state, as Megatron-LM stores it: one object per (pipeline, tensor) rank holding
    the states of all data-parallel ranks."""
    return ShardedObject(
        "rng_state",
        states,
        (parallel_state.get_pipeline_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_world_size()),
        (parallel_state.get_pipeline_model_parallel_rank(), parallel_state.get_tensor_model_parallel_rank()),
        replica_id=parallel_state.get_data_parallel_rank(),
    )


def _gathered_rng_states() -> list:
    states = [None] * parallel_state.get_data_parallel_world_size()
    dist.all_gather_object(states, _rng_state(), group=parallel_state.get_data_parallel_group())
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


def _delete_old(root: str, keep_last: Optional[int]) -> None:
    if not keep_last:
        return
    for iteration in complete_iterations(root)[:-keep_last]:
        shutil.rmtree(checkpoint_dir(root, iteration), ignore_errors=True)
        logger.info("deleted %s (--keep-last-n-checkpoints %d)", checkpoint_dir(root, iteration), keep_last)


def _results_queue_that_outlives_exit_signals():
    """megatron-core 0.16's `filesystem_async._get_write_results_queue`, with its Manager process deaf
    to the exit signals. Every save, sync or async, sends the written files' metadata back through a
    queue served by a spawned multiprocessing Manager, started at the first save and kept for the
    process's life, in the training process's process group. torchrun forwards SIGTERM and SIGINT to
    that group (os.killpg), as `kill -TERM -<pgid>` does, and Slurm signals every process of a job: the
    Manager died of it, and the save the signal asked for failed (BrokenPipeError or
    ConnectionRefusedError, an `.incomplete` directory left, the steps since the last save lost).
    The Manager starts with the exit signals blocked (a child inherits its parent's signal mask, and
    the Manager never unblocks them), so they stay pending there: the training process decides, and
    shuts it down at exit; SIGKILL to the group still ends it. Starting multiprocessing's resource
    tracker unblocks SIGINT and SIGTERM, so it is started before they are blocked."""
    from multiprocessing import get_context, resource_tracker
    from multiprocessing.managers import SyncManager

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from angpt.arguments import EXIT_SIGNALS

    if filesystem_async._results_queue is None:
        manager = SyncManager(ctx=get_context("spawn"))
        resource_tracker.ensure_running()
        unblocked = signal.pthread_sigmask(signal.SIG_BLOCK, {getattr(signal, name) for name in EXIT_SIGNALS})
        try:
            manager.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, unblocked)  # what arrived meanwhile is handled now
        filesystem_async._results_queue = manager.Queue()  # the queue's proxy keeps the manager alive
    return filesystem_async._results_queue


def _make_saves_outlive_exit_signals() -> None:
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    filesystem_async._get_write_results_queue = _results_queue_that_outlives_exit_signals


def save_checkpoint(
    root: str,
    state: TrainState,
    chunks,
    optimizer,
    scheduler,
    args: dict,
    tokenizer: Optional[dict] = None,
    keep_last: Optional[int] = None,
    async_queue=None,
    before_commit: Optional[Callable[[], None]] = None,
) -> None:
    """Save collectively (every rank calls this). With `async_queue` (megatron-core's AsyncCallsQueue)
    the tensors are written in the background and the checkpoint is committed when the queue finalizes
    the request; otherwise it is committed before this returns. `before_commit` runs on every rank after
    the files are written and before the commit (tests pause there to kill a save midway)."""
    _make_saves_outlive_exit_signals()
    iteration = state.iteration  # the state moves on while an async save is being written
    final = checkpoint_dir(root, iteration)
    staging = final + INCOMPLETE
    rank = dist.get_rank()
    if rank == 0:
        if os.path.isdir(staging):
            shutil.rmtree(staging)
        os.makedirs(staging)
    dist.barrier()

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
    strategy = FullyParallelSaveStrategyWrapper(
        get_default_save_sharded_strategy(), parallel_state.get_data_parallel_group(with_context_parallel=True)
    )

    def commit():
        if before_commit is not None:
            before_commit()
        dist.barrier()
        if rank == 0:
            save_tokenizer_files(tokenizer, os.path.join(staging, "tokenizer"))
            if os.path.isdir(final):  # a checkpoint of this iteration that is not the latest one
                shutil.rmtree(final)
            os.rename(staging, final)
            write_latest_iteration(root, iteration)
            _delete_old(root, keep_last)
            logger.info("saved checkpoint %s", final)
        dist.barrier()

    request = dist_checkpointing.save(sharded, staging, sharded_strategy=strategy,
                                      async_sharded_save=async_queue is not None)
    if async_queue is None:
        commit()
    else:
        request.add_finalize_fn(commit)
        async_queue.schedule_async_request(request)


def prepare_optimizer_for_loading(optimizer) -> None:
    """megatron-core's distributed optimizer over torch's Adam (no apex or Transformer Engine) can only
    build its sharded state dict for loading once Adam's state exists: create it with dummy values,
    which the load then overwrites."""
    from megatron.core.optimizer import distrib_optimizer

    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        if isinstance(inner, distrib_optimizer.DistributedOptimizer) and not inner.optimizer.state:
            inner._init_optimizer_states_with_dummy_values()
    if not distrib_optimizer.HAVE_APEX_OR_TE:
        _load_only_checkpointed_states()


def _load_only_checkpointed_states() -> None:
    """With torch's Adam, the distributed optimizer's "fully_reshardable" load copies every key of
    Adam's per-parameter state from the checkpoint, but the checkpoint stores `step` once, in the
    parameter groups (KeyError: 'step'). Copy the keys the checkpoint has; `_unshare_adam_steps` then
    fixes the steps."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer._set_main_param_and_optimizer_states
    if getattr(original, "copies_only_checkpointed_states", False):
        return

    @torch.no_grad()
    def set_states(self, model_param, tensors):
        if self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            return original(self, model_param, tensors)
        group_index, group_order = self.model_param_group_index_map[model_param]
        main_param = self.optimizer.param_groups[group_index]["params"][group_order]
        for key, target in {"param": main_param, **self.optimizer.state[main_param]}.items():
            if key in tensors:
                target.copy_(tensors[key])

    set_states.copies_only_checkpointed_states = True
    DistributedOptimizer._set_main_param_and_optimizer_states = set_states


def _unshare_adam_steps(optimizer) -> None:
    """The distributed optimizer restores torch Adam's per-parameter `step` as one tensor shared by
    every parameter, which Adam then increments once per parameter per step (bias correction would
    restart in earnest): give each parameter its own copy."""
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        for state in inner.optimizer.state.values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()


def load_checkpoint(
    root: str,
    chunks,
    optimizer,
    scheduler,
    load_optimizer: bool = True,
    load_rng: bool = True,
    finetune: bool = False,
) -> Optional[TrainState]:
    """Load the latest complete checkpoint under root into the model (and optimizer, scheduler, RNG),
    collectively. Returns its training state, or None when root holds no checkpoint."""
    iteration = read_latest_iteration(root)
    if iteration is None:
        if dist.get_rank() == 0:
            logger.warning("no checkpoint in %s (no %s): starting from scratch", root, LATEST)
        return None
    path = checkpoint_dir(root, iteration)
    common = dist_checkpointing.load_common_state_dict(path)
    if finetune:
        load_optimizer = load_rng = False
    same_layout = common.get("layout") == _layout()
    if load_rng and not same_layout and dist.get_rank() == 0:
        logger.warning("%s was saved at layout %s, this run is %s: RNG states are not restored",
                       path, common.get("layout"), _layout())
    load_rng = load_rng and same_layout

    model = _model_state(chunks)
    request = dict(model)
    if load_optimizer:
        prepare_optimizer_for_loading(optimizer)
        request["optimizer"] = optimizer.sharded_state_dict(model, is_loading=True, metadata=dict(OPTIMIZER_SHARDING))
    if load_rng:
        request["rng_state"] = _rng_sharded_object(None)
    loaded = dist_checkpointing.load(request, path)

    if len(chunks) == 1:
        chunks[0].module.load_state_dict(loaded["model"], strict=True)
    else:
        for i, chunk in enumerate(chunks):
            chunk.module.load_state_dict(loaded[f"model{i}"], strict=True)
    if load_optimizer:
        optimizer.load_state_dict(loaded["optimizer"])
        _unshare_adam_steps(optimizer)
        scheduler.load_state_dict(loaded["opt_param_scheduler"])
    else:
        # Mixed-precision optimizers keep fp32 copies of the weights: refresh them from the model.
        optimizer.reload_model_params()
    if load_rng:
        _set_rng_state(loaded["rng_state"][parallel_state.get_data_parallel_rank()])
    if dist.get_rank() == 0:
        logger.info("loaded checkpoint %s (iteration %d)%s", path, iteration, " for fine-tuning" if finetune else "")
    return TrainState() if finetune else TrainState(**loaded["train_state"])
