"""An angpt checkpoint read in one CPU process, whatever layout saved it (distributed checkpoints store tensors
by global name): its recorded flags, its model's tensors whole and its training state, through the checkpoint
reader of angpt.training.checkpointing (digests verified, pickles that would run code refused)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cached_property
from typing import Optional

import torch
from megatron.core import parallel_state

from angpt.config.choices import MODEL_FAMILIES
from angpt.config.saved import config_from_saved, single_process
from angpt.config.sections import RunConfig
from angpt.hf.errors import ExportError
from angpt.models import AnGPTConfig
from angpt.training import checkpointing, distributed
from angpt.training.megatron_configs import transformer_config


@dataclass
class Checkpoint:
    path: str  # the iter_XXXXXXX directory
    args: dict  # the training flags it was saved with, as recorded
    tensors: dict  # the model's tensors by global name, layers stacked: [num_layers, ...]
    train_state: Optional[dict] = None  # checkpointing.TrainState as saved: iteration, consumed_samples

    @cached_property
    def config(self) -> RunConfig:
        """The run's configuration of the recorded flags (flags added since take their defaults)."""
        return config_from_saved(self.args)

    @property
    def family(self) -> str:
        return self.config.model.model_family


def ensure_process_group() -> None:
    """megatron-core's checkpoint loading needs a process group: a one-process gloo group will do."""
    if not parallel_state.model_parallel_is_initialized():
        distributed.initialize()


def checkpoint_path(load: str, iteration: Optional[int] = None) -> str:
    """The iter_XXXXXXX directory of `iteration`, or of the latest one under `load`."""
    if not os.path.isdir(load):
        raise ExportError(f"{load}: no such directory")
    if iteration is None:
        try:
            iteration = checkpointing.read_latest_iteration(load)
        except checkpointing.CheckpointError as error:
            raise ExportError(str(error)) from error
        if iteration is None:
            raise ExportError(f"{load} is not a checkpoint directory: it has no {checkpointing.LATEST}")
    path = checkpointing.checkpoint_dir(load, iteration)
    if not os.path.isdir(path):
        found = checkpointing.complete_iterations(load)
        raise ExportError(f"{load} has no checkpoint of iteration {iteration} (it has {found or 'none'})")
    return path


def read_checkpoint(load: str, iteration: Optional[int] = None) -> Checkpoint:
    """The checkpoint of `iteration` (default: the latest) under `load`, verified against its digests; what
    cannot be exported is refused by an ExportError that says why."""
    path = checkpoint_path(load, iteration)
    ensure_process_group()
    try:
        checkpointing.verify_checkpoint(path)
    except checkpointing.CheckpointError as error:
        raise ExportError(str(error)) from None
    try:
        common = checkpointing.read_common_state(path)
    except checkpointing.CheckpointError as error:  # a refusal of a file that would run code
        raise ExportError(str(error)) from None
    except Exception as error:  # megatron-core raises several kinds for a directory it cannot read
        raise ExportError(f"{path} is not a readable distributed checkpoint: {error}") from error
    args = common.get("args")
    if not isinstance(args, dict) or "model_family" not in args:
        raise ExportError(f"{path} records no training arguments with a model family: not an angpt checkpoint")
    if args["model_family"] not in MODEL_FAMILIES:
        raise ExportError(f"{path}: unknown model family {args['model_family']!r} "
                          "(angpt, ngpt or gptplus can be exported)")
    if args["model_family"] == "gpt":
        raise ExportError(f"{path}: the export of --model-family gpt is not built: megatron-core's GPT of "
                          "Megatron-LM's flags maps onto no one transformers class (GPT-2's for LayerNorm, learned "
                          "positions and GELU, Llama's for RMSNorm, RoPE and SwiGLU, neither for the mixtures)")
    try:
        loaded = checkpointing.read_plain_tensors(path)
    except checkpointing.CheckpointError as error:  # a refusal of a file that would run code
        raise ExportError(str(error)) from None
    tensors = {key: value for key, value in loaded.items()
               if isinstance(value, torch.Tensor) and not key.startswith("optimizer")}
    return Checkpoint(path, args, tensors, common.get("train_state"))


def model_config(checkpoint: Checkpoint) -> AnGPTConfig:
    """The checkpoint's model at one process (TP = PP = CP = 1, no virtual stages), in fp32."""
    return transformer_config(single_process(checkpoint.config))
