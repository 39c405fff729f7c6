"""Checkpoints written and read with megatron-core distributed checkpointing (torch_dist), and the public
`save_checkpoint` / `load_checkpoint`, which dispatch by the format to Megatron-LM's legacy torch format
(angpt.training.torch_checkpoint) where asked or found on disk, and to Megatron-FSDP's fsdp_dtensor (torch's
distributed checkpoint of its DTensors, as Megatron-LM's checkpointing.py writes it with --use-megatron-fsdp).
Sharded tensors are stored by their global names and offsets, so a checkpoint loads at another tensor, pipeline,
virtual-pipeline, context-parallel or data-parallel layout; the distributed optimizer's state is stored per parameter
("fully_reshardable") for the same reason, and RNG states are restored only at the layout they were saved at
(elsewhere each rank's generator would be some other rank's). The directory both formats write (its layout, staging
and commit, digests, full-disk guard, RNG and layout records, errors) is angpt.training.checkpoint_store's, whose
names callers use are re-exported here.
"""

from __future__ import annotations

import logging
import os
import re
from collections import defaultdict
from dataclasses import asdict, replace
from functools import partial
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace, merge, nested_values
from megatron.core.dist_checkpointing.mapping import (
    ShardedBase,
    ShardedObject,
    ShardedTensor,
    ShardedTensorFactory,
    apply_factory_merges,
    is_main_replica,
)
from megatron.core.dist_checkpointing.serialization import (
    get_default_load_sharded_strategy,
    get_default_save_sharded_strategy,
)
from megatron.core.dist_checkpointing.state_dict_utils import load_preprocess
from megatron.core.dist_checkpointing.strategies.common import TorchCommonLoadStrategy, TorchCommonSaveStrategy
from megatron.core.dist_checkpointing.strategies.fully_parallel import (
    FullyParallelLoadStrategyWrapper,
    FullyParallelSaveStrategyWrapper,
)
from megatron.core.dist_checkpointing.validation import StrictHandling
from megatron.core.distributed import TorchFullyShardedDataParallel
from megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import preprocess_state_dict_for_uneven_dtensor
from megatron.core.transformer import TransformerLayer
from megatron.core.transformer.fsdp_dtensor_checkpoint import flatten_state_dict, handle_fp8_extra_state_case
from megatron.core.utils import get_model_config
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
from torch.distributed.tensor import DTensor

from angpt.config.saved import (
    config_from_saved,
    missing_state_refusal,
    model_refusal,
    optimizer_refusal,
    vocabulary_refusal,
)
from angpt.config.sections import RunConfig
from angpt.megatron_compat import checkpoint_unpickling, fsdp2, patches
from angpt.megatron_compat.megatron_fsdp import handle_swiglu_in_state_dict
from angpt.training import digests, torch_checkpoint
from angpt.training.checkpoint_store import (
    INCOMPLETE,
    LATEST,
    CheckpointError,
    NoCheckpointToLoad,
    TrainState,
    checkpoint_dir,
    checkpoint_to_resume,
    commit_checkpoint,
    complete_iterations,
    gathered_rng_states,
    intact_checkpoint,
    iteration_of,
    layout,
    non_persistent_dir,
    non_persistent_is_newer,
    prepare_staging,
    read_latest_iteration,
    refusing_a_full_disk,
    refusing_unsafe,
    remove_incomplete,
    rng_state,
    save_tokenizer_files,
    saved_layout,
    set_rng_state,
    unreadable,
    verify_checkpoint,
    write_latest_iteration,
)
from angpt.training.faults import NO_HOOKS, Hooks

# This module's names, and checkpoint_store's that callers use as checkpointing's.
__all__ = [
    "OPTIMIZER_SHARDING", "check_savable", "checkpoint_format", "load_checkpoint", "read_common_state",
    "read_plain_tensors", "recorded_flags", "save_checkpoint",
    "INCOMPLETE", "LATEST", "CheckpointError", "NoCheckpointToLoad", "TrainState", "checkpoint_dir",
    "checkpoint_to_resume", "commit_checkpoint", "complete_iterations", "intact_checkpoint", "non_persistent_dir",
    "read_latest_iteration", "remove_incomplete", "save_tokenizer_files", "verify_checkpoint",
    "write_latest_iteration",
]

logger = logging.getLogger("angpt.checkpointing")

# The distributed optimizer's state gathered per parameter: loadable at any layout (megatron-core 0.16's
# per-parameter "fully_sharded_model_space" format no longer validates; angpt/megatron_compat lists it).
OPTIMIZER_SHARDING = {"distrib_optim_sharding_type": "fully_reshardable"}
# The file torch's distributed checkpoint (fsdp_dtensor) writes beside its shards.
DCP_METADATA = ".metadata"


def _model_state(chunks) -> dict:
    """Each chunk's sharded state under Megatron-LM's keys: `model`, or `model0`, `model1`, ... per
    virtual pipeline stage (the same mapping serves saving and loading). The tensors inside carry
    global names, so any layout can read them."""
    # Megatron-LM's metadata: GPTModel's MTP stage without the embedding reads its dp_cp_group itself.
    metadata = {"dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True)}
    states = [fsdp2.place_shards(chunk.module.sharded_state_dict(metadata=metadata), chunk.module) for chunk in chunks]
    if len(chunks) == 1:
        return {"model": states[0]}
    return {f"model{i}": state for i, state in enumerate(states)}


def check_savable(chunks) -> None:
    """Raise a CheckpointError, before any step, if a checkpoint of these chunks cannot be written or read: FSDP2
    over more ranks than some weight has rows, or with tensor parallelism over ranks some weight's rows do not
    divide over (angpt.megatron_compat.fsdp2)."""
    sharded = {name: param.shape[0] for chunk in chunks if isinstance(chunk, TorchFullyShardedDataParallel)
               for name, param in chunk.module.named_parameters() if isinstance(param, DTensor)}
    ranks = parallel_state.get_data_parallel_world_size(with_context_parallel=True)
    short = fsdp2.fewer_rows_than_ranks(sharded, ranks)
    uneven = ({name: rows for name, rows in sharded.items() if rows % ranks}
              if parallel_state.get_tensor_model_parallel_world_size() > 1 else {})
    fewest = min(short.values(), default=0)
    for weights, why, give in (
            (short, "would leave ranks an empty shard", f"at most {fewest} data-parallel ranks"),
            (uneven, "do not divide over the ranks, with tensor parallelism",
             "a data-parallel size that divides them")):
        if weights:
            named = [f"{name} ({rows} rows)" for name, rows in weights.items()]
            more = f" and {len(named) - 2} more" if len(named) > 2 else ""
            raise CheckpointError(f"--use-torch-fsdp2 over {ranks} data-parallel ranks with --save or --load: "
                                  f"{', '.join(named[:2])}{more} {why}, whose checkpoint is not built; give {give}")


def _load_model_state(module: torch.nn.Module, state: dict) -> None:
    """Load a chunk's tensors, strictly. Under FSDP2 a weight's tensor is this rank's shard of it (its sharded
    tensor's local part): it loads as a DTensor placed as the weight is."""
    weights = module.state_dict(keep_vars=True)
    module.load_state_dict({
        name: DTensor.from_local(value, weights[name].device_mesh, weights[name].placements,
                                 shape=weights[name].shape, stride=weights[name].stride())
        if isinstance(weights.get(name), DTensor) else value
        for name, value in state.items()
    }, strict=True)


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


def _estimated_bytes(sharded: dict) -> int:
    """What a save's tensors take on disk, over all ranks (each at its main replica; metadata add a little)."""
    local = sum(value.data.numel() * value.data.element_size() for value in nested_values(sharded)
                if isinstance(value, (ShardedTensor, ShardedTensorFactory)) and is_main_replica(value.replica_id))
    total = torch.tensor([local], dtype=torch.float64,
                         device=torch.cuda.current_device() if torch.cuda.is_available() else "cpu")
    dist.all_reduce(total)
    return int(total.item())


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
    ckpt_format: str = "torch_dist",
    save_optimizer: bool = True,
    save_rng: bool = True,
    mem_efficient: bool = False,
) -> None:
    """Save collectively (every rank calls this), in `ckpt_format` (--ckpt-format: torch_dist, or Megatron-LM's torch
    format, angpt.training.torch_checkpoint, which has no asynchronous save nor the options of distributed
    checkpoints). With `async_queue` (megatron-core's AsyncCallsQueue)
    the tensors are written in the background and the checkpoint is committed when the queue finalizes
    the request; otherwise it is committed before this returns (`hooks`: the points tests pause at, to kill a
    save midway; angpt.training.faults). A save that
    cannot fit in the free space is refused before it writes anything, and one that fills the disk is
    removed; both raise a CheckpointError that says so. `context` (Megatron-LM's checkpointing_context, one dict
    for the run) keeps the save strategy from one save to the next; with `assume_constant_structure` it caches the
    first save's plan and metadata, and the later saves skip megatron-core's checks of the sharding. Without
    `save_optimizer` (--no-save-optim) the optimizer state and learning-rate schedule are left out, without `save_rng`
    (--no-save-rng) the RNG states, in every format, as Megatron-LM leaves them out (the flags the checkpoint records
    say so to a load: angpt.config.saved.missing_state_refusal); `mem_efficient`
    (--distrib-optim-fully-reshardable-mem-efficient): the distributed optimizer's state gathered on data-parallel
    rank 0 over gloo (megatron-core's)."""
    if ckpt_format == "torch":
        if async_queue is not None:
            raise ValueError("--async-save with --ckpt-format torch: Megatron-LM's torch format has no asynchronous "
                             "save")
        torch_checkpoint.save_checkpoint(root, state, chunks, optimizer, scheduler, args, tokenizer, keep_last,
                                         retain_interval, hooks, save_optimizer, save_rng)
        return
    if ckpt_format == "fsdp_dtensor":
        _save_fsdp_dtensor(root, state, chunks, optimizer, scheduler, args, tokenizer, keep_last, retain_interval,
                           hooks, save_optimizer, save_rng)
        return
    iteration = state.iteration  # the state moves on while an async save is being written
    staging = checkpoint_dir(root, iteration) + INCOMPLETE
    model = _model_state(chunks)
    sharded = {**model, "train_state": asdict(state), "layout": layout(), "args": args, "checkpoint_version": 3.0}
    if save_optimizer:
        sharded["optimizer"] = optimizer.sharded_state_dict(model, metadata=_optimizer_metadata(mem_efficient))
        sharded["opt_param_scheduler"] = scheduler.state_dict()
    if save_rng:
        sharded["rng_state"] = _rng_sharded_object(gathered_rng_states())
    needed = _estimated_bytes(sharded)
    prepare_staging(root, iteration, needed)
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
        refusing_a_full_disk(write, root, iteration, needed)()
        refusing_a_full_disk(commit, root, iteration, needed)()
        return
    request = refusing_a_full_disk(write, root, iteration, needed)()
    # A partial of module-level functions: megatron-core's persistent worker receives it pickled.
    request = request._replace(async_fn=partial(_after, partial(hooks.before_background_write, iteration),
                                                request.async_fn))
    steps = [*request.finalize_fns, commit]

    def finalize():
        for step in steps:
            step()

    # The background writer's errors surface when the queue finalizes the request, on every rank.
    async_queue.schedule_async_request(
        request._replace(finalize_fns=[refusing_a_full_disk(finalize, root, iteration, needed)]))


class _FileSystemWriter(dcp.FileSystemWriter):
    """torch's writer, with its checkpoint id (the directory) a string in .metadata, which loads name no path class
    (angpt.megatron_compat.checkpoint_unpickling reads .metadata as data: a pathlib.PosixPath is refused)."""

    def storage_meta(self) -> StorageMeta:
        return StorageMeta(checkpoint_id=str(self.checkpoint_id), save_id=self.save_id)


def _fsdp_dtensor_metadata() -> dict:
    """Megatron-LM's sharded-state metadata for --ckpt-format fsdp_dtensor with the distributed optimizer."""
    return {"distrib_optim_sharding_type": "fsdp_dtensor", "singleton_local_shards": False,
            "chained_optim_avoid_prefix": True,
            "dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True)}


def _fsdp_dtensor_state(chunks, optimizer, is_loading: bool = False) -> dict:
    """The model's and optimizer's DTensors under Megatron-FSDP, by Megatron-LM's keys (one model chunk): the model's
    parameters are the optimizer's shards again (angpt.training.step keeps them whole between steps)."""
    chunks[0].module._replace_param_with_distributed_if_needed()
    model = chunks[0].state_dict_for_save_checkpoint()
    return {"model": model, "optimizer": optimizer.sharded_state_dict({"model": model}, is_loading=is_loading,
                                                                       metadata=_fsdp_dtensor_metadata())}


def _as_on_disk(chunks, state: dict, split_glu: bool) -> dict:
    """`_fsdp_dtensor_state`'s `state` as Megatron-LM's preprocess_fsdp_dtensor_state_dict writes it (a new dict):
    the layers' _extra_state dropped and, with gated linear units (`split_glu`, unless a checkpoint of angpt's from
    before holds fc1 whole), fc1's weight and its Adam moments as their halves W and V (`linear_fc1.weight_w`, `_v`,
    views of fc1's shards), which tensor parallelism splits each on its own: whole, fc1's DTensor over the TP group
    would interleave them, [W_0; V_0; W_1; V_1], and load wrongly at another TP size."""
    model, optimizer = dict(state["model"]), state["optimizer"]
    handle_fp8_extra_state_case(model)
    if split_glu and get_model_config(chunks[0]).gated_linear_unit:
        # megatron-core finds the model's keys' parameters under the wrapper, the optimizer's (a "module." longer)
        # under Megatron-FSDP's module inside it.
        model, _ = handle_swiglu_in_state_dict(chunks[0], model, None)
        _, optimizer = handle_swiglu_in_state_dict(chunks[0].module, {}, optimizer)
    return {"model": model, "optimizer": optimizer}


def _glu_split_on_disk(path: str) -> bool:
    """Whether the fsdp_dtensor checkpoint `path` holds fc1 split as Megatron-LM's (see `_fsdp_dtensor_state`)."""
    keys = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    return not any(key.endswith(".mlp.linear_fc1.weight") for key in keys)


def _save_fsdp_dtensor(root: str, state: TrainState, chunks, optimizer, scheduler, args: dict, tokenizer,
                       keep_last, retain_interval, hooks: Hooks, save_optimizer: bool, save_rng: bool) -> None:
    """save_checkpoint in Megatron-FSDP's fsdp_dtensor format: the model's and optimizer's DTensors (Megatron-LM's
    state dict, `_as_on_disk`; no experts here, so without its experts' conversion) and each rank's RNG states by
    torch's distributed checkpoint; the rest in common.pt, as torch_dist keeps it."""
    iteration = state.iteration
    staging = checkpoint_dir(root, iteration) + INCOMPLETE
    sharded = _as_on_disk(chunks, _fsdp_dtensor_state(chunks, optimizer), split_glu=True)
    common = {"train_state": asdict(state), "layout": layout(), "args": args, "checkpoint_version": 3.0}
    if save_optimizer:
        common.update(opt_param_scheduler=scheduler.state_dict(), **_grad_scaler_state(optimizer))
    else:
        del sharded["optimizer"]
    if save_rng:
        sharded["rng_state"] = {str(dist.get_rank()): rng_state()}
    local = sum(value.to_local().numel() * value.element_size() for value in nested_values(sharded)
                if isinstance(value, DTensor))
    needed = torch.tensor([local], dtype=torch.float64)
    dist.all_reduce(needed)
    prepare_staging(root, iteration, int(needed.item()))
    preprocess_state_dict_for_uneven_dtensor(sharded)

    def write_and_commit():
        dcp.save(sharded, storage_writer=_FileSystemWriter(staging))
        TorchCommonSaveStrategy("torch", 1).save_common(common, staging)  # on rank 0
        hooks.before_commit(iteration)
        dist.barrier()
        commit_checkpoint(root, iteration, tokenizer, keep_last, retain_interval)

    refusing_a_full_disk(write_and_commit, root, iteration, int(needed.item()))()


def _grad_scalers(optimizer) -> list:
    """--fp16's dynamic loss scalers of `optimizer` (a chained optimizer's, one per part, moving alike)."""
    inner = getattr(optimizer, "chained_optimizers", [optimizer])
    return [part.grad_scaler for part in inner if getattr(part, "grad_scaler", None) is not None]


def _grad_scaler_state(optimizer) -> dict:
    """The loss scaler's state for fsdp_dtensor's common.pt: megatron-core's fsdp_dtensor optimizer state holds the
    parameters' alone, and Megatron-LM's resume starts the scale over from --initial-loss-scale (skipped steps, and
    another run than the uninterrupted one); a checkpoint without it (Megatron-LM's) loads as Megatron-LM loads it."""
    scalers = _grad_scalers(optimizer)
    return {"grad_scaler": scalers[0].state_dict()} if scalers else {}


def _load_fsdp_dtensor(path: str, found: str, chunks, optimizer, scheduler, load_optimizer: bool, load_rng: bool,
                       finetune: bool) -> TrainState:
    """load_checkpoint under Megatron-FSDP, at any data-parallel size, of a checkpoint in the format `found`:
    fsdp_dtensor's saved shards read by torch's distributed checkpoint into this run's DTensors in place (Megatron-LM's
    load, strict), torch_dist's by `_read_torch_dist_as_fsdp_dtensor`; the RNG states at the layout they were saved
    at only."""
    common = refusing_unsafe(lambda: TorchCommonLoadStrategy().load_common(path))
    refusing_unsafe(lambda: checkpoint_unpickling.check_metadata(path))
    raw = _fsdp_dtensor_state(chunks, optimizer, is_loading=True)
    # Read into the DTensors in place (W's and V's land in fc1's); the uneven preprocessing replaces their entries.
    split_glu = found != "fsdp_dtensor" or _glu_split_on_disk(path)
    state = {key: value.copy() for key, value in _as_on_disk(chunks, raw, split_glu).items()}
    if not load_optimizer:
        del state["optimizer"]
    load_rng = load_rng and saved_layout(common) == layout()
    if found == "fsdp_dtensor":
        if load_rng:
            state["rng_state"] = {str(dist.get_rank()): rng_state()}
        preprocess_state_dict_for_uneven_dtensor(state)
        refusing_unsafe(lambda: dcp.load(state, storage_reader=dcp.FileSystemReader(path)))  # in place, every key
        rng = state["rng_state"][str(dist.get_rank())] if load_rng else None
    else:
        preprocess_state_dict_for_uneven_dtensor(state)
        step = max((group["step"] for group in _param_groups(common.get("optimizer"))), default=None)
        refusing_unsafe(lambda: _read_torch_dist_as_fsdp_dtensor(path, chunks, state, load_optimizer, step))
        rng = _torch_dist_rng_state(path) if load_rng else None
    # The main weights read, into the model's weights: what Megatron-LM's load_state_dict after the read does, by its
    # post-hook (the keys it loads are the ones just read; under bf16's Float16Module the adapter's miss a level,
    # and Megatron-LM falls back to strict=False).
    chunks[0].module.install_optimized_model_weights()
    if load_optimizer:
        optimizer.load_state_dict(raw["optimizer"])
        scheduler.load_state_dict(common["opt_param_scheduler"])
        for scaler in _grad_scalers(optimizer) if "grad_scaler" in common else ():
            scaler.load_state_dict(common["grad_scaler"])
    if rng is not None:
        set_rng_state(rng)
    _log_loaded(path, found, "fsdp_dtensor", finetune)
    return TrainState() if finetune else TrainState(**common["train_state"])


def _log_loaded(path: str, found: str, run_format: str, finetune: bool) -> None:
    """The one line (rank 0's) saying `path` was loaded, and read across formats where `found` is not `run_format`."""
    if dist.get_rank() == 0:
        across = f", its {found} read across formats into this run's {run_format}" if found != run_format else ""
        logger.info("loaded checkpoint %s (iteration %d)%s%s", path, iteration_of(path), across,
                    " for fine-tuning" if finetune else "")


def _param_groups(state) -> list:
    """Every parameter group in the optimizer's state dict `state` (a chained optimizer's too)."""
    if not isinstance(state, dict):
        return []
    if isinstance(state.get("param_groups"), list):
        return state["param_groups"]
    return [group for value in state.values() for group in _param_groups(value)]


def _renamed_in_layers(chunks) -> dict[str, str]:
    """megatron-core's renaming of a layer's weights in its sharded state dict (`sharded_state_dict_keys_map`: a local
    layer's norms under the names of Transformer Engine's fused ones, `input_layernorm.` as
    `self_attention.linear_qkv.layer_norm_`), which fsdp_dtensor's keys, the modules' names, do not make."""
    return next((module.submodules_config.sharded_state_dict_keys_map for module in chunks[0].modules()
                 if isinstance(module, TransformerLayer)), {})


def _stacked(name: str, renamed: dict[str, str]) -> tuple[str, tuple[int, ...]]:
    """torch_dist's key of the model's weight `name` and its offsets on the axes megatron-core prepends: each weight
    of every layer stacked, layer by layer (its offset the layer's number), under its name in the sharded state dict
    (`renamed`: `_renamed_in_layers`)."""
    layer = re.fullmatch(r"decoder\.layers\.(\d+)\.(.+)", name)
    if not layer:
        return name, ()
    weight = next((key + layer.group(2)[len(module):] for module, key in renamed.items()
                   if layer.group(2).startswith(module)), layer.group(2))
    return f"decoder.layers.{weight}", (int(layer.group(1)),)


def _unstacked(key: str, prepended: tuple[int, ...], renamed: dict[str, str]) -> str:
    """The model's name of the weight at offsets `prepended` of torch_dist's `key` (`_stacked`'s inverse)."""
    if not prepended:
        return key
    weight = key[len("decoder.layers."):]
    weight = next((module + weight[len(stacked):] for module, stacked in renamed.items()
                   if weight.startswith(stacked)), weight)
    return f"decoder.layers.{prepended[0]}.{weight}"


def _fsdp_dtensor_name(key: str) -> tuple[str, Optional[str]]:
    """The model's name of the weight an fsdp_dtensor `key` (model.* or optimizer.state.*) holds, Megatron-FSDP's
    wrappers' `module.` dropped, and the Adam state's name (None: the weight itself, Megatron-FSDP's main weight)."""
    if key.startswith("model."):
        return re.sub(r"^(module\.)+", "", key[len("model."):]), None
    name, state = key[len("optimizer.state."):].rsplit(".", 1)
    return re.sub(r"^(module\.)+", "", name), state


class _RegionsPlanner(DefaultLoadPlanner):
    """torch's load planner, reading into each tensor of the state dict its region of a tensor of the checkpoint
    (`regions`: {name: (the checkpoint's key, the region's offsets)}), of the tensor's shape; several tensors may read
    one of the checkpoint's. (torch's own reads a tensor of the checkpoint whole, or a DTensor's shard of it, into the
    tensor of its name.)"""

    def __init__(self, regions: dict):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.regions = regions

    def create_local_plan(self) -> LoadPlan:
        items = []
        for name, tensor in self.state_dict.items():
            key, offsets = self.regions[name]
            chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=tensor.size())
            items += [replace(item, dest_index=MetadataIndex(name)) for item in
                      create_read_items_for_chunk_list(key, self.metadata.state_dict_metadata[key], [chunk])]
        return LoadPlan(items)


def _read_regions(path: str, reads: list) -> None:
    """Read into each tensor of `reads` ((key, offsets, tensor, shape) each) its region at `offsets` of the tensor
    `key` of the checkpoint `path` (both torch_dist and fsdp_dtensor are torch's distributed checkpoints), cast to its
    dtype, in this process alone. A key that is not there, or of a tensor whose trailing dimensions are not `shape`,
    is refused by a CheckpointError naming it, before anything is read."""
    saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    for key, _, _, shape in reads:
        if not isinstance(saved.get(key), TensorStorageMetadata):
            raise CheckpointError(f"{path} holds no tensor {key}, which this run loads")
        if tuple(saved[key].size)[len(saved[key].size) - len(shape):] != tuple(shape):
            raise CheckpointError(f"{path} holds {key} of shape {tuple(saved[key].size)}, which this run loads as "
                                  f"{tuple(shape)}")
    reads = [read for read in reads if read[2].numel()]  # Megatron-FSDP's empty shards
    _load_state_dict({str(i): tensor for i, (_, _, tensor, _) in enumerate(reads)},
                     storage_reader=dcp.FileSystemReader(path), no_dist=True,
                     planner=_RegionsPlanner({str(i): (key, offsets) for i, (key, offsets, _, _) in enumerate(reads)}))


def _read_torch_dist_as_fsdp_dtensor(path: str, chunks, state: dict, load_optimizer: bool, step) -> None:
    """dcp.load of `state` (`_as_on_disk`'s, preprocessed for uneven DTensors) from the torch_dist checkpoint `path`,
    in place: each DTensor's shard from the torch_dist tensor of its weight (`_stacked`; fc1's W and V the halves of
    its rows, its bias's likewise) or Adam state, at the shard's offsets; Megatron-FSDP's main weights from the
    distributed optimizer's fp32 ones (its `param` state) with `load_optimizer`, else from the model's weights, as
    --no-load-optim refreshes them under torch_dist; Adam's `step`, the parameter groups' under torch_dist, for every
    parameter."""
    reads, renamed = [], _renamed_in_layers(chunks)
    for key, value in flatten_state_dict(state).items():
        if not key.startswith(("model.", "optimizer.state.")):  # param_to_group_meta: this run's groups
            continue
        name, kind = _fsdp_dtensor_name(key)
        if kind == "step":
            value.fill_(step)
            continue
        half = re.fullmatch(r"(.+\.linear_fc1\.(?:weight|bias))_([wv])", name)
        stacked, prepended = _stacked(half.group(1) if half else name, renamed)
        offsets, shape = list(value.__create_chunk_list__()[0].offsets), list(value.shape)
        if half:
            offsets[0] += shape[0] if half.group(2) == "v" else 0
            shape[0] *= 2
        prefix = f"optimizer.state.{kind}." if kind else "optimizer.state.param." if load_optimizer else ""
        local = value.to_local().detach()
        reads.append((prefix + stacked, (*prepended, *offsets), local.view(*[1] * len(prepended), *local.shape),
                      shape))
    _read_regions(path, reads)


def _torch_dist_rng_state(path: str) -> dict:
    """This rank's RNG states in the torch_dist checkpoint `path` (saved at this layout)."""
    loaded = dist_checkpointing.load({"rng_state": _rng_sharded_object(None)}, path,
                                     get_default_load_sharded_strategy(path))
    return loaded["rng_state"][parallel_state.get_data_parallel_rank(with_context_parallel=True)]


def _fsdp_dtensor_rng_state(path: str) -> dict:
    """This rank's RNG states in the fsdp_dtensor checkpoint `path` (saved at this layout), collectively."""
    state = {"rng_state": {str(dist.get_rank()): rng_state()}}
    dcp.load(state, storage_reader=dcp.FileSystemReader(path))
    return state["rng_state"][str(dist.get_rank())]


def _read_fsdp_dtensor_as_torch_dist(path: str, chunks, request: dict) -> dict:
    """What megatron-core's load of the torch_dist sharded state dict `request` returns, read from the fsdp_dtensor
    checkpoint `path`: each sharded tensor's region of the fsdp_dtensor tensor of its weight (a layer's own; fc1's W
    or V for its rows of [W; V]) or Adam state, the distributed optimizer's fp32 main weights (`param`) from the
    model's (Megatron-FSDP saves its main weights as the model's; a 16-bit weight is their rounding, as each step
    makes it). What fsdp_dtensor has not stays this run's: the optimizer's parameter groups, given the saved Adam
    step, and the layers' _extra_state, which Megatron-LM's fsdp_dtensor drops."""
    sharded, nonpersistent, factories = load_preprocess(request)
    saved = {_fsdp_dtensor_name(key): key for key in dcp.FileSystemReader(path).read_metadata().state_dict_metadata
             if key.startswith(("model.", "optimizer.state."))}
    reads, renamed = [], _renamed_in_layers(chunks)
    for tensor in nested_values(sharded):
        if not isinstance(tensor, ShardedTensor):
            continue
        kind, key = tensor.key[len("optimizer.state."):].split(".", 1) if tensor.key.startswith(
            "optimizer.state.") else (None, tensor.key)
        prepended = tensor.prepend_axis_num
        name = _unstacked(key, tensor.global_offset[:prepended], renamed)
        offsets, shape = list(tensor.global_offset[prepended:]), list(tensor.global_shape[prepended:])
        if (f"{name}_w", None) in saved:  # Megatron-LM's split of fc1 (`_as_on_disk`)
            shape[0] //= 2
            name, offsets[0] = (f"{name}_w", offsets[0]) if offsets[0] < shape[0] else (f"{name}_v",
                                                                                          offsets[0] - shape[0])
        kind = None if kind == "param" else kind
        if (name, kind) not in saved:
            raise CheckpointError(f"{path} holds no {name}{f' ({kind})' if kind else ''}, which this run loads")
        reads.append((saved[name, kind], offsets, tensor.data, shape))
    _read_regions(path, reads)
    loaded = dict_list_map_inplace(lambda value: value.data if isinstance(value, ShardedBase) else value, sharded)
    merge(loaded, nonpersistent)
    groups = _param_groups(loaded.get("optimizer"))
    if groups:
        step = torch.zeros(())
        _read_regions(path, [(next(key for (_, kind), key in saved.items() if kind == "step"), (), step, ())])
        for group in groups:
            group["step"] = step.item()
    return apply_factory_merges(loaded, factories)


def _optimizer_metadata(mem_efficient: bool) -> dict:
    """The sharded-state metadata of the distributed optimizer's state, saved and loaded (Megatron-LM's
    _build_sharded_state_dict_metadata with --dist-ckpt-optim-fully-reshardable)."""
    return {**OPTIMIZER_SHARDING, "distrib_optim_fully_reshardable_mem_efficient": mem_efficient}


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


def checkpoint_format(path: str) -> str:
    """The format of the checkpoint directory `path`, as Megatron-LM's _get_checkpoint_format tells it: "torch_dist"
    (megatron-core's metadata.json), "torch" (Megatron-LM's mp_rank_* directories); a CheckpointError otherwise."""
    if dist_checkpointing.check_is_distributed_checkpoint(path):
        return "torch_dist"
    if os.path.isfile(os.path.join(path, DCP_METADATA)):
        return "fsdp_dtensor"
    if os.path.isdir(path) and any(name.startswith("mp_rank_0") for name in os.listdir(path)):
        return "torch"
    raise CheckpointError(f"the checkpoint of iteration {iteration_of(path)} in {path} is in no format angpt reads: "
                          "neither a distributed checkpoint (metadata.json) nor Megatron-LM's torch format (mp_rank_*)")


def read_common_state(path: str) -> dict:
    """The common state of the checkpoint directory `path` (`args`, `train_state`, `layout`, ...) read as data
    only: a common.pt that would run code is refused by a CheckpointError naming it, and so is Megatron-LM's torch
    format, which has no common state; megatron-core's other errors pass as they are."""
    if os.path.isdir(path) and not dist_checkpointing.check_is_distributed_checkpoint(path) and \
            checkpoint_format(path) == "fsdp_dtensor":
        return refusing_unsafe(lambda: TorchCommonLoadStrategy().load_common(path))
    if os.path.isdir(path) and not dist_checkpointing.check_is_distributed_checkpoint(path) and \
            checkpoint_format(path) == "torch":
        raise CheckpointError(f"{path} is in Megatron-LM's torch format (--ckpt-format torch), which is read only by a "
                              "run at its layout: continue it under --ckpt-format torch_dist for a step and read that "
                              "checkpoint")
    return refusing_unsafe(lambda: dist_checkpointing.load_common_state_dict(path))


def recorded_flags(load: str, step: Optional[int] = None, non_persistent_global: bool = False,
                   non_persistent_global_ckpt_dir: Optional[str] = None) -> Optional[tuple[str, dict]]:
    """The checkpoint directory of iteration `step` (--ckpt-step), else the latest, in `load` (or, with
    --non-persistent-ckpt-type global, in its directory where that is at least as new: the one the run resumes from),
    and the flags it recorded; None where `load` holds no checkpoint. Read as data in this process alone, before any
    process group (--use-checkpoint-args: angpt.config.arguments); the load verifies the checkpoint against its digests
    later. A CheckpointError of one line where it records no flags of angpt.pretrain."""
    if non_persistent_global and step is None:
        non_persistent = non_persistent_dir(load, non_persistent_global_ckpt_dir)
        if non_persistent_is_newer(load, non_persistent):
            load = non_persistent
    iteration = step if step is not None else read_latest_iteration(load)
    if iteration is None:
        iteration = max(complete_iterations(load), default=None)  # as --load-fallback-to-intact finds it
    if iteration is None:
        return None
    path = checkpoint_dir(load, iteration)
    if checkpoint_format(path) == "torch":  # every rank's file records the flags
        rank = min(name for name in os.listdir(path) if name.startswith("mp_rank_"))
        saved = refusing_unsafe(lambda: checkpoint_unpickling.read_as_data(
            os.path.join(path, rank, torch_checkpoint.MODEL_FILE), map_location="cpu", mmap=True))
    else:
        saved = read_common_state(path)
    if not isinstance(saved.get("args"), dict) or "model_family" not in saved["args"]:
        raise CheckpointError(f"{path} records no flags of angpt.pretrain (Megatron-LM's own?): give the model's "
                              "flags instead")
    return path, saved["args"]


def read_plain_tensors(path: str) -> dict:
    """Every tensor (and object) of the distributed checkpoint `path` whole, by its global name: the checkpoint
    as one process reads it, whatever layout saved it (the Hugging Face export). Read as data only, .metadata
    checked first; refusals and other errors as `read_common_state`; Megatron-FSDP's fsdp_dtensor's tensors alone."""
    refusing_unsafe(lambda: checkpoint_unpickling.check_metadata(path))
    if os.path.isdir(path) and not dist_checkpointing.check_is_distributed_checkpoint(path) and \
            checkpoint_format(path) == "fsdp_dtensor":
        return refusing_unsafe(lambda: _fsdp_dtensor_plain_tensors(path))
    return refusing_unsafe(lambda: dist_checkpointing.load_plain_tensors(path))


def _fsdp_dtensor_plain_tensors(path: str) -> dict:
    """read_plain_tensors of an fsdp_dtensor checkpoint, by torch's distributed checkpoint in this process alone: its
    model's and optimizer's tensors whole (not the RNG states), the model's by torch_dist's names (`model.module.`
    dropped, fc1's halves W and V, `_as_on_disk`, joined again as [W; V], the layers' weights stacked), the
    optimizer's by their own."""
    metadata = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    keys = {key for key, item in metadata.items() if isinstance(item, TensorStorageMetadata)}
    loaded = {}  # filled by the planner, as torch's dcp_to_torch_save reads a checkpoint (dcp.load would not)
    _load_state_dict(loaded, storage_reader=dcp.FileSystemReader(path), planner=_EmptyStateDictLoadPlanner(keys=keys),
                     no_dist=True)
    flat, tensors, layers = flatten_state_dict(loaded), {}, defaultdict(dict)
    for key, tensor in flat.items():
        if key.startswith("optimizer."):
            tensors[key] = tensor
            continue
        if not key.startswith("model.") or key.endswith("linear_fc1.weight_v"):  # rng_state.*: each rank's own
            continue
        if key.endswith("linear_fc1.weight_w"):
            key, tensor = key[:-len("_w")], torch.cat([tensor, flat[key[:-len("_w")] + "_v"]])
        name, prepended = _stacked(_fsdp_dtensor_name(key)[0], {})
        if prepended:
            layers[name][prepended[0]] = tensor
        else:
            tensors[name] = tensor
    # torch_dist's layers: each weight of every layer stacked, layer by layer (megatron-core's sharded state dict).
    for name, by_layer in layers.items():
        tensors[name] = torch.stack([by_layer[i] for i in range(len(by_layer))])
    return tensors


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
    ckpt_format: str = "torch_dist",
    auto_detect: bool = False,
    vocab_size: Optional[int] = None,
    mem_efficient: bool = False,
    main_params_from_checkpoint: bool = False,
) -> TrainState:
    """Load the checkpoint directory `path` (`intact_checkpoint`'s) into the model (and optimizer, scheduler,
    RNG), collectively. Returns its training state. With the run's `config`, a checkpoint of a model of another
    shape (or, unless `finetune`, of other factor or position flags) is refused by a CheckpointError naming the
    flags that differ, and with its `vocab_size` (unpadded) one whose embedding has another padded size, before
    any tensor is read. `strictness`: --dist-ckpt-strictness
    (megatron-core's StrictHandling; the return_* modes log what they return); `fully_parallel`:
    --ckpt-fully-parallel-load (both for distributed checkpoints only, as in Megatron-LM).

    The format is the one on disk (`checkpoint_format`), as Megatron-LM's load_checkpoint finds it with --ckpt-format
    torch_dist or --auto-detect-ckpt-format; with `ckpt_format` torch and not `auto_detect`, a distributed checkpoint
    is refused (Megatron-LM's error). A checkpoint of Megatron-FSDP (fsdp_dtensor) loads in a run without it, and a
    torch_dist one under Megatron-FSDP, read across formats (Megatron-LM converts torch_dist to fsdp_dtensor offline,
    with its checkpoint_inspector): weights, the distributed optimizer's state, scheduler and iteration.

    A checkpoint saved without its optimizer or RNG states (--no-save-optim, --no-save-rng: the flags it recorded) is
    refused unless this load leaves them out (`load_optimizer`, `load_rng` false, or `finetune`). Without
    `load_optimizer`, mixed-precision optimizers' fp32 main weights are refreshed from the model's, or with
    `main_params_from_checkpoint` (--load-main-params-from-ckpt) from the checkpoint's model state as read
    (megatron-core's reload_model_params(state_dict)); `mem_efficient`: as save_checkpoint's."""
    found = checkpoint_format(path)
    if found == "torch" and ckpt_format == "fsdp_dtensor":
        raise CheckpointError(f"{path} is in Megatron-LM's torch format, which --use-megatron-fsdp does not read: "
                              "continue it under --ckpt-format torch_dist for a step and load that checkpoint")
    if found == "torch":
        return torch_checkpoint.load_checkpoint(path, chunks, optimizer, scheduler, config, load_optimizer, load_rng,
                                                finetune, vocab_size, main_params_from_checkpoint)
    if ckpt_format == "torch" and not auto_detect:
        raise CheckpointError(f"{path} is a distributed checkpoint ({found}) and this run has --ckpt-format torch: "
                              "give --auto-detect-ckpt-format to load it (as Megatron-LM)")
    verified = os.path.isfile(os.path.join(path, digests.DIGESTS))

    def read(function: Callable):
        try:
            return refusing_unsafe(function)
        except CheckpointError:
            raise
        except (Exception, CheckpointException) as error:
            if verified:
                raise
            raise unreadable(error, path) from error

    common = read(lambda: read_common_state(path))
    # A run's recorded flags (a save without them, as the tests' direct ones, names no family: nothing to check).
    if isinstance(common.get("args"), dict) and (config is not None or "model_family" in common["args"]):
        saved = config_from_saved(common["args"])
        refusal = missing_state_refusal(path, saved, load_optimizer and not finetune, load_rng and not finetune)
        if config is not None:
            refusal = refusal or (model_refusal(path, saved, config, finetune)
                                  or (load_optimizer and not finetune
                                      and optimizer_refusal(path, saved.parallel.use_distributed_optimizer,
                                                            config.parallel.use_distributed_optimizer)))
        if refusal:
            raise CheckpointError(refusal)
    if config is not None and vocab_size is not None:
        rows = read(lambda: _embedding_rows(path, found))
        refusal = rows is not None and vocabulary_refusal(path, rows, config, vocab_size)
        if refusal:
            raise CheckpointError(refusal)
    if ckpt_format == "fsdp_dtensor":
        return _load_fsdp_dtensor(path, found, chunks, optimizer, scheduler, load_optimizer and not finetune,
                                  load_rng and not finetune, finetune)
    if finetune:
        load_optimizer = load_rng = False
    same_layout = saved_layout(common) == layout()
    if load_rng and not same_layout and dist.get_rank() == 0:
        logger.warning("%s was saved at layout %s, this run is %s: RNG states are not restored",
                       path, saved_layout(common), layout())
    load_rng = load_rng and same_layout

    model = _model_state(chunks)
    request = dict(model)
    if load_optimizer:
        patches.prepare_optimizer_for_loading(optimizer)
        request["optimizer"] = optimizer.sharded_state_dict(model, is_loading=True,
                                                            metadata=_optimizer_metadata(mem_efficient))
    if load_rng and found == "torch_dist":
        request["rng_state"] = _rng_sharded_object(None)
    read(lambda: checkpoint_unpickling.check_metadata(path))
    if found == "fsdp_dtensor":
        loaded = {**common, **read(lambda: _read_fsdp_dtensor_as_torch_dist(path, chunks, request))}
        return _load_model_and_optimizer(loaded, path, found, chunks, optimizer, scheduler, load_optimizer, finetune,
                                         read(lambda: _fsdp_dtensor_rng_state(path)) if load_rng else None,
                                         main_params_from_checkpoint)
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
    rng = loaded["rng_state"][parallel_state.get_data_parallel_rank(with_context_parallel=True)] if load_rng else None
    return _load_model_and_optimizer(loaded, path, found, chunks, optimizer, scheduler, load_optimizer, finetune, rng,
                                     main_params_from_checkpoint)


def _embedding_rows(path: str, found: str) -> Optional[int]:
    """The rows of the embedding in the checkpoint `path` of the format `found` (torch_dist or fsdp_dtensor), read
    from its metadata; None where it has none."""
    if found == "fsdp_dtensor":
        checkpoint_unpickling.check_metadata(path)  # before torch unpickles it
        saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
        rows = [item.size[0] for key, item in saved.items()
                if key.startswith("model.") and _fsdp_dtensor_name(key)[0] == torch_checkpoint.EMBEDDING]
        return rows[0] if rows else None
    embedding = dist_checkpointing.load_tensors_metadata(path).get(torch_checkpoint.EMBEDDING)  # shapes only
    return None if embedding is None else embedding.global_shape[0]


def _load_model_and_optimizer(loaded: dict, path: str, found: str, chunks, optimizer, scheduler, load_optimizer: bool,
                              finetune: bool, rng: Optional[dict], main_params_from_checkpoint: bool) -> TrainState:
    """load_checkpoint's end outside Megatron-FSDP: what megatron-core `loaded` into the model chunks (and optimizer,
    scheduler, this rank's RNG states `rng`; else the main weights, from `loaded` with
    `main_params_from_checkpoint`); the checkpoint's training state."""
    if len(chunks) == 1:
        _load_model_state(chunks[0].module, loaded["model"])
    else:
        for i, chunk in enumerate(chunks):
            _load_model_state(chunk.module, loaded[f"model{i}"])
    if load_optimizer:
        optimizer.load_state_dict(loaded["optimizer"])
        patches.unshare_adam_steps(optimizer)
        fsdp2.place_loaded_states(optimizer)
        scheduler.load_state_dict(loaded["opt_param_scheduler"])
    else:
        # Mixed-precision optimizers keep fp32 copies of the weights: refresh them from the model (or what was read).
        optimizer.reload_model_params(loaded if main_params_from_checkpoint else None)
    if rng is not None:
        set_rng_state(rng)
    _log_loaded(path, found, "torch_dist", finetune)
    return TrainState() if finetune else TrainState(**loaded["train_state"])
