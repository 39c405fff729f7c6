"""Checkpoints in Megatron-LM's legacy `torch` format (--ckpt-format torch), as its checkpointing.py writes and reads
them (core_v0.16.1: get_checkpoint_name, save_checkpoint and load_checkpoint for ckpt_format 'torch'):

    <save>/latest_checkpointed_iteration.txt
    <save>/iter_0001000/mp_rank_TT/model_optim_rng.pt        each tensor-parallel rank's (mp_rank_TT_PPP with
    <save>/iter_0001000/mp_rank_TT/distrib_optim.pt           pipeline parallelism), written by its data-parallel
    <save>/iter_0001000/tokenizer/, angpt_digests.json         rank 0; distrib_optim.pt with the distributed optimizer

`model_optim_rng.pt` holds Megatron-LM's keys: `args`, `checkpoint_version` (3.0), `iteration`, `model` (or `model0`,
`model1`, ... per virtual pipeline stage: megatron-core's `state_dict_for_save_checkpoint`), `optimizer` (the
optimizer's `state_dict()`: with 16-bit weights its fp32 main copies, Adam's moments of every parameter, the fp32
learnable scales of anGPT and nGPT among them, and the loss scaler), `opt_param_scheduler`, `rng_state` (a list by
data-parallel rank of Megatron-LM's RNG dict) and `num_floating_point_operations_so_far`; angpt adds `train_state`
(where the data stand) and `layout`. The distributed optimizer's parameter state (its fp32 main weights and Adam's
moments) is gathered to data-parallel rank 0 by megatron-core's `save_parameter_state` and scattered back by
`load_parameter_state`.

As a torch_dist checkpoint, it is written into `iter_XXXXXXX.incomplete/`, its files' digests recorded, renamed and
only then named in the latest file (angpt.training.checkpoint_store.commit_checkpoint), so a crash midway leaves the
previous checkpoint as the latest. There is no asynchronous save (Megatron-LM has none for this format).

Each file holds one rank's tensors as that layout splits them: the format does not reshard. A load at another
tensor or pipeline size, or with the layers split otherwise over the pipeline stages, is refused in one line naming
both layouts, the first from the directory's names before anything is read, the split before any tensor is read
(Megatron-LM's check_checkpoint_args asserts equal sizes); other data- or context-parallel sizes load, without the
RNG states (each rank restores its own where the layout is the same).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from dataclasses import asdict
from typing import Callable, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.optimizer.distrib_optimizer import HAVE_APEX_OR_TE, DistributedOptimizer
from megatron.core.transformer.transformer_layer import TransformerLayer
from megatron.core.utils import get_model_config, unwrap_model

from angpt.config.saved import (
    config_from_saved,
    missing_state_refusal,
    model_refusal,
    optimizer_refusal,
    vocabulary_refusal,
)
from angpt.config.sections import RunConfig
from angpt.megatron_compat import checkpoint_unpickling, patches
from angpt.telemetry.performance import model_flops_per_token
from angpt.training import checkpoint_store, digests
from angpt.training.faults import NO_HOOKS, Hooks

logger = logging.getLogger("angpt.checkpointing")
EMBEDDING = "embedding.word_embeddings.weight"  # the input embedding's key in a model's state dict

MODEL_FILE = "model_optim_rng.pt"  # Megatron-LM's get_checkpoint_name
OPTIMIZER_FILE = "distrib_optim.pt"  # its get_distributed_optimizer_checkpoint_name
CHECKPOINT_VERSION = 3.0
# Megatron-LM's: mp_rank_TT, mp_rank_TT_PPP with pipeline parallelism, a third part (_EEE) with expert parallelism.
_RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")
# angpt's RNG dict (angpt.training.checkpoint_store.rng_state) under Megatron-LM's keys (its get_rng_state).
RNG_KEYS = {"random": "random_rng_state", "numpy": "np_rng_state", "torch": "torch_rng_state",
            "cuda": "cuda_rng_state", "tracker": "rng_tracker_states"}


def rank_dir_name(tensor_rank: int, pipeline_rank: int, pipeline_parallel: bool) -> str:
    """Megatron-LM's get_checkpoint_name without expert parallelism (angpt has none)."""
    return f"mp_rank_{tensor_rank:02d}" + (f"_{pipeline_rank:03d}" if pipeline_parallel else "")


def model_file(iteration_dir: str) -> str:
    """This rank's model_optim_rng.pt in `iteration_dir`."""
    pipeline = parallel_state.get_pipeline_model_parallel_world_size()
    name = rank_dir_name(parallel_state.get_tensor_model_parallel_rank(),
                         parallel_state.get_pipeline_model_parallel_rank(), pipeline > 1)
    return os.path.join(iteration_dir, name, MODEL_FILE)


def _inner_optimizers(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _distributed(optimizer) -> bool:
    return any(isinstance(inner, DistributedOptimizer) for inner in _inner_optimizers(optimizer))


def _layers(chunks) -> list[list[int]]:
    """The global numbers of each chunk's transformer layers: how this rank's stage splits the model."""
    return [[module.layer_number for module in unwrap_model(chunk).modules() if isinstance(module, TransformerLayer)]
            for chunk in chunks]


def _this_layout(chunks) -> dict:
    return {**checkpoint_store.layout(), "layers": _layers(chunks)}


def _shown(tensor: int, pipeline: int, chunks: Optional[int] = None) -> str:
    virtual = f" x {chunks} virtual stages" if chunks and chunks > 1 else ""
    return f"TP {tensor} x PP {pipeline}{virtual}"


def _megatron_rng(state: dict) -> dict:
    return {RNG_KEYS[key]: value for key, value in state.items()}


def _angpt_rng(state: dict) -> dict:
    return {key: state[name] for key, name in RNG_KEYS.items() if name in state}


@contextlib.contextmanager
def _adam_state_present(optimizer):
    """The distributed optimizer's `state_dict` and `save_parameter_state` read Adam's state of every parameter
    (with torch's Adam: `assert len(steps) == 1`, then KeyError 'exp_avg'), which Adam has not before its first
    applied step (fp16's dynamic loss scale skips the first ones). Saved instead, as
    angpt.megatron_compat.patches.saved_from_adams_start saves them for torch_dist: the zero moments and step 0 Adam
    starts from; the live optimizer is left without state, as it was."""
    empty = [inner for inner in _inner_optimizers(optimizer)
             if isinstance(inner, DistributedOptimizer) and not inner.optimizer.state]
    for inner in empty:
        inner.init_state_fn(inner.optimizer, inner.config)
        if not HAVE_APEX_OR_TE:  # torch's Adam counts its steps per parameter
            for state in inner.optimizer.state.values():
                state["step"] = torch.tensor(0.0)
    try:
        yield
    finally:
        for inner in empty:
            inner.optimizer.state.clear()


def _tensor_bytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(_tensor_bytes(item) for item in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(item) for item in value)
    return 0


def _estimated_bytes(state_dict: Optional[dict], optimizer, writes_optimizer: bool) -> int:
    """What the save's files take, over all ranks: the tensors of the model files, and the distributed optimizer's
    fp32 weights and two moments of every parameter (written by data-parallel rank 0)."""
    local = _tensor_bytes(state_dict) if state_dict is not None else 0
    if writes_optimizer:
        local += sum(3 * 4 * buffer.numel_unpadded for inner in _inner_optimizers(optimizer)
                     if isinstance(inner, DistributedOptimizer) and inner.data_parallel_group.rank() == 0
                     for buffer in inner.buffers)
    total = torch.tensor([local], dtype=torch.float64,
                         device=torch.cuda.current_device() if torch.cuda.is_available() else "cpu")
    dist.all_reduce(total)
    return int(total.item())


def _flops_so_far(chunks, args: dict, consumed_samples: int) -> float:
    """Megatron-LM's num_floating_point_operations_so_far: its model FLOPs of every sample trained so far."""
    seq_length = args.get("seq_length")
    vocab_size = getattr(unwrap_model(chunks[0]), "vocab_size", None)
    if not seq_length or not vocab_size:
        return 0
    return model_flops_per_token(get_model_config(chunks[0]), seq_length, vocab_size) * seq_length * consumed_samples


def save_checkpoint(root: str, state: checkpoint_store.TrainState, chunks, optimizer, scheduler, args: dict,
                    tokenizer: Optional[dict] = None, keep_last: Optional[int] = None,
                    retain_interval: Optional[int] = None, hooks: Hooks = NO_HOOKS, save_optimizer: bool = True,
                    save_rng: bool = True) -> None:
    """Save collectively in Megatron-LM's torch format, committed before this returns (as
    angpt.training.checkpointing.save_checkpoint; `hooks` are the same points, `save_optimizer` and `save_rng`
    the same choices)."""
    iteration = state.iteration
    staging = checkpoint_store.checkpoint_dir(root, iteration) + checkpoint_store.INCOMPLETE
    # Collective: every data- and context-parallel rank's.
    rng_states = checkpoint_store.gathered_rng_states() if save_rng else None
    writer = parallel_state.get_data_parallel_rank(with_context_parallel=True) == 0
    distributed_optimizer = _distributed(optimizer) and save_optimizer
    with _adam_state_present(optimizer):
        state_dict = None
        if writer:
            models = [unwrap_model(chunk).state_dict_for_save_checkpoint() for chunk in chunks]
            state_dict = {
                "args": args,
                "checkpoint_version": CHECKPOINT_VERSION,
                "iteration": iteration,
                **({"model": models[0]} if len(models) == 1 else
                   {f"model{i}": model for i, model in enumerate(models)}),
                "num_floating_point_operations_so_far": _flops_so_far(chunks, args, state.consumed_samples),
                "train_state": asdict(state),
                "layout": _this_layout(chunks),
            }
            if save_optimizer:
                state_dict.update(optimizer=optimizer.state_dict(), opt_param_scheduler=scheduler.state_dict())
            if save_rng:
                state_dict["rng_state"] = [_megatron_rng(rng) for rng in rng_states]
        needed = _estimated_bytes(state_dict, optimizer, distributed_optimizer)
        checkpoint_store.prepare_staging(root, iteration, needed)
        path = model_file(staging)

        def write():
            os.makedirs(os.path.dirname(path), exist_ok=True)
            if distributed_optimizer:  # collective over the data-parallel group; its rank 0 writes
                optimizer.save_parameter_state(os.path.join(os.path.dirname(path), OPTIMIZER_FILE))
            if writer:
                torch.save(state_dict, path)

        checkpoint_store.refusing_a_full_disk(write, root, iteration, needed)()

    def commit():
        hooks.before_commit(iteration)
        dist.barrier()  # every rank's files written
        checkpoint_store.commit_checkpoint(root, iteration, tokenizer, keep_last, retain_interval)

    checkpoint_store.refusing_a_full_disk(commit, root, iteration, needed)()


def saved_sizes(path: str) -> tuple[int, int]:
    """(tensor, pipeline) parallel sizes of the torch checkpoint directory `path`, from its mp_rank_* names; a
    CheckpointError when a rank's directory is missing or the names are not Megatron-LM's for a dense model."""
    ranks = []
    for name in sorted(os.listdir(path)):
        match = _RANK_DIR.match(name)
        if not match:
            continue
        if match.group(3) is not None:
            raise checkpoint_store.CheckpointError(f"{path} holds {name}: a checkpoint with expert parallelism, "
                                                   "which angpt's dense models do not have")
        ranks.append((int(match.group(1)), match.group(2)))
    pipelined = {pipeline is not None for _, pipeline in ranks}
    if not ranks:
        raise checkpoint_store.CheckpointError(f"{path} has no rank directory named as Megatron-LM names them "
                                               "(mp_rank_TT or mp_rank_TT_PPP)")
    if len(pipelined) != 1:
        raise checkpoint_store.CheckpointError(f"{path} mixes rank directories with and without a pipeline rank: "
                                               "not one checkpoint")
    tensor = max(rank for rank, _ in ranks) + 1
    pipeline = max(int(stage) for _, stage in ranks) + 1 if pipelined == {True} else 1
    expected = {rank_dir_name(t, p, pipelined == {True}) for t in range(tensor) for p in range(pipeline)}
    missing = sorted(expected - {rank_dir_name(t, int(p or 0), p is not None) for t, p in ranks})
    if missing:
        raise checkpoint_store.CheckpointError(f"the checkpoint of iteration {checkpoint_store.iteration_of(path)} "
                                               f"is incomplete: {path} has no {', '.join(missing)}")
    return tensor, pipeline


def _no_reshard(path: str, saved: str, here: str) -> str:
    return (f"{path} was saved in the torch format at {saved} and this run is {here}: the torch format does not "
            "reshard (Megatron-LM's neither); continue at the saved layout, or save with --ckpt-format torch_dist to "
            "move between layouts")


def _read(path: str, verified: bool) -> Callable:
    def read(function: Callable):
        try:
            return checkpoint_store.refusing_unsafe(function)
        except checkpoint_store.CheckpointError:
            raise
        except Exception as error:
            if verified:
                raise
            raise checkpoint_store.unreadable(error, path) from error

    return read


def _one_refusal(problem: Optional[str]) -> None:
    """Raise the first rank's problem on every rank (a rank alone refusing would leave the others hanging)."""
    problems = [None] * dist.get_world_size()
    dist.all_gather_object(problems, problem)
    first = next((found for found in problems if found is not None), None)
    if first is not None:
        raise checkpoint_store.CheckpointError(first)


def _problem(path: str, saved: dict, chunks, optimizer, config: Optional[RunConfig], load_optimizer: bool,
             load_rng: bool, tensor: int, pipeline: int, finetune: bool = False,
             vocab_size: Optional[int] = None) -> Optional[str]:
    """Why this rank cannot load its file `saved` (read without its tensors), or None."""
    keys = ["model"] if "model" in saved else sorted((key for key in saved if re.fullmatch(r"model\d+", key)),
                                                     key=lambda key: int(key[len("model"):]))
    layout = saved.get("layout") or {}
    saved_layers = layout.get("layers")
    here = _layers(chunks)
    if len(keys) != len(chunks) or (saved_layers is not None and saved_layers != here):
        stage = parallel_state.get_pipeline_model_parallel_rank()
        split = (f"; pipeline rank {stage} holds layers {saved_layers} there, {here} here"
                 if saved_layers is not None and len(keys) == len(chunks) else "")
        return _no_reshard(path, _shown(tensor, pipeline, len(keys)), _shown(tensor, pipeline, len(chunks)) + split)
    if isinstance(saved.get("args"), dict) and (config is not None or "model_family" in saved["args"]):
        recorded = config_from_saved(saved["args"])
        refusal = missing_state_refusal(path, recorded, load_optimizer, load_rng) or (
            config is not None and model_refusal(path, recorded, config, finetune))
        if refusal:
            return refusal
    embedding = saved[keys[0]].get(EMBEDDING)  # the first pipeline stage's (its rows split over TP)
    if config is not None and vocab_size is not None and embedding is not None:
        refusal = vocabulary_refusal(path, embedding.shape[0] * tensor, config, vocab_size)
        if refusal:
            return refusal
    if load_optimizer:
        saved_distributed = os.path.isfile(os.path.join(os.path.dirname(model_file(path)), OPTIMIZER_FILE))
        refusal = optimizer_refusal(path, saved_distributed, _distributed(optimizer))
        if refusal:
            return refusal
    return None


def load_checkpoint(path: str, chunks, optimizer, scheduler, config: Optional[RunConfig] = None,
                    load_optimizer: bool = True, load_rng: bool = True,
                    finetune: bool = False, vocab_size: Optional[int] = None,
                    main_params_from_checkpoint: bool = False) -> checkpoint_store.TrainState:
    """Load the torch-format checkpoint directory `path` collectively (as angpt.training.checkpointing.load_checkpoint,
    whose dispatch calls this); returns its training state."""
    iteration = checkpoint_store.iteration_of(path)
    read = _read(path, os.path.isfile(os.path.join(path, digests.DIGESTS)))
    tensor, pipeline = read(lambda: saved_sizes(path))
    here = (parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_pipeline_model_parallel_world_size())
    if (tensor, pipeline) != here:  # from the names alone: every rank decides the same, before anything is read
        raise checkpoint_store.CheckpointError(_no_reshard(path, _shown(tensor, pipeline), _shown(*here)))
    if finetune:
        load_optimizer = load_rng = False
    file = model_file(path)
    # Memory-mapped: the pickle is read, the tensors only where they are copied into the model and optimizer.
    problem, saved = None, None
    try:
        saved = read(lambda: checkpoint_unpickling.read_as_data(file, map_location="cpu", mmap=True))
        problem = _problem(path, saved, chunks, optimizer, config, load_optimizer, load_rng, tensor, pipeline,
                           finetune, vocab_size)
    except checkpoint_store.CheckpointError as error:
        problem = str(error)
    except Exception as error:  # said on every rank, which would otherwise wait for this one
        problem = f"{file} cannot be read: {type(error).__name__}: {(str(error).strip().splitlines() or [''])[0]}"
    _one_refusal(problem)

    models = [saved["model"]] if "model" in saved else [saved[f"model{i}"] for i in range(len(chunks))]
    try:
        for chunk, model in zip(chunks, models):
            unwrap_model(chunk).load_state_dict(model, strict=True)
    except RuntimeError as error:  # missing or unexpected keys, other shapes: torch's message, on one line
        problem = f"{file}: {' '.join(str(error).split())}"
    _one_refusal(problem)
    if load_optimizer:
        optimizer.load_state_dict(saved["optimizer"])
        if _distributed(optimizer):  # collective: data-parallel rank 0 reads and scatters
            optimizer.load_parameter_state(os.path.join(os.path.dirname(file), OPTIMIZER_FILE))
        patches.unshare_adam_steps(optimizer)
        scheduler.load_state_dict(saved["opt_param_scheduler"])
    else:
        # Mixed-precision optimizers keep fp32 copies of the weights: refresh them from the model (or the file's).
        optimizer.reload_model_params({key: saved[key] for key in saved if re.fullmatch(r"model\d*", key)}
                                      if main_params_from_checkpoint else None)
    saved_layout = checkpoint_store.saved_layout(saved)
    if saved_layout is not None:
        saved_layout = {key: saved_layout.get(key) for key in checkpoint_store.layout()}
    same_layout = saved_layout == checkpoint_store.layout()
    rng_states = saved.get("rng_state")
    if load_rng and not same_layout:
        if dist.get_rank() == 0:
            logger.warning("%s was saved at layout %s, this run is %s: RNG states are not restored", path,
                           saved_layout, checkpoint_store.layout())
    elif load_rng and isinstance(rng_states, list):
        rank = parallel_state.get_data_parallel_rank(with_context_parallel=True)
        checkpoint_store.set_rng_state(_angpt_rng(rng_states[rank]))
    if dist.get_rank() == 0:
        logger.info("loaded checkpoint %s (torch format, iteration %d)%s", path, iteration,
                    " for fine-tuning" if finetune else "")
    return checkpoint_store.TrainState() if finetune else checkpoint_store.TrainState(**saved["train_state"])

