"""Checkpoints are loaded as data: no pickle a checkpoint holds can name a function to call or a class to build
beyond the few that a checkpoint's contents need.

Three pickles are read by a load (`--load`, tools/convert_to_hf.py), and megatron-core 0.16.1 with torch 2.13 reads
two of them with Python's unrestricted unpickler, which runs whatever a crafted file asks for:
- the distributed checkpoint's `.metadata` (torch's `FileSystemReader.read_metadata`: `pickle.load`): read
  here by an unpickler that knows only the metadata's own classes (`METADATA_GLOBALS`);
- its non-tensor items, the RNG states among them (torch's `DefaultLoadPlanner.load_bytes`:
  `torch.load(weights_only=False)`): read here with `weights_only=True`, NumPy's RNG state allowed;
- `common.pt` (megatron-core's `TorchCommonLoadStrategy.load_common`: `torch.load`, whose `weights_only`
  default `TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD` can turn off): read here with `weights_only=True` always.
Megatron-LM's torch format (`model_optim_rng.pt`) is read here with `weights_only=True` too (`read_as_data`).
A refusal raises `UnsafeCheckpointError`, naming what the file asked for.
"""

from __future__ import annotations

import os
import pickle
import re
from typing import Optional

import numpy
import torch
from megatron.core.dist_checkpointing.strategies.common import COMMON_STATE_FNAME, TorchCommonLoadStrategy
from torch.distributed.checkpoint import default_planner, filesystem
from torch.distributed.checkpoint.metadata import StorageMeta

_CHECKPOINT = "torch.distributed.checkpoint"
# What torch 2.11-2.13 pickle into a distributed checkpoint's .metadata (the classes of its metadata and save
# plans, torch.Size, dtypes, the layout and memory-format encodings), and nothing that calls out.
METADATA_GLOBALS = frozenset({
    *((f"{_CHECKPOINT}.metadata", name) for name in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING")),
    *((f"{_CHECKPOINT}.planner", name) for name in (
        "SavePlan", "WriteItem", "WriteItemType", "TensorWriteData", "LoadPlan", "ReadItem", "LoadItemType")),
    (f"{_CHECKPOINT}.filesystem", "_StorageInfo"),
    # A save plan's file prefix (one str), in the metadata of a save with --ckpt-assume-constant-structure.
    (f"{_CHECKPOINT}.filesystem", "_StoragePrefix"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
})
# megatron-core's RNG state holds NumPy's (`numpy.random.get_state()`: an array of uint32).
NUMPY_RNG_STATE = [numpy._core.multiarray._reconstruct, numpy.ndarray, numpy.dtype, numpy.dtypes.UInt32DType]


class UnsafeCheckpointError(pickle.UnpicklingError):
    """A checkpoint file whose unpickling would call or build something a checkpoint does not hold."""

    def __init__(self, path: str, wanted: str):
        super().__init__(f"{path}: refused: loading it would call or build {wanted}, which no checkpoint holds "
                         "(checkpoints are loaded as data only)")


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file, path: str):
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str):
        if (module, name) in METADATA_GLOBALS or (module == "torch" and isinstance(getattr(torch, name, None),
                                                                                   torch.dtype)):
            return super().find_class(module, name)
        raise UnsafeCheckpointError(self.path, f"{module}.{name}")


def read_metadata(reader: filesystem.FileSystemReader, *args, **kwargs):
    """torch's FileSystemReader.read_metadata, through `_MetadataUnpickler`."""
    path = reader._get_metadata_path(kwargs.get("rank"))
    with reader.fs.create_stream(path, "rb") as file:
        metadata = _MetadataUnpickler(file, str(path)).load()
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = StorageMeta()
    metadata.storage_meta.load_id = reader.load_id
    return metadata


def check_metadata(checkpoint_dir: str) -> None:
    """Read the distributed checkpoint's .metadata through `_MetadataUnpickler` before torch does: torch 2.13 folds
    a failure to read it into an AssertionError's text ("global metadata read failed: ..."), and the refusal is
    said better by itself."""
    path = os.path.join(checkpoint_dir, ".metadata")
    if os.path.isfile(path):
        with open(path, "rb") as file:
            _MetadataUnpickler(file, path).load()


def _weights_only(source, path: str, **kwargs):
    """torch.load(weights_only=True), its refusal (several paragraphs that suggest weights_only=False) said in a
    line."""
    try:
        with torch.serialization.safe_globals(NUMPY_RNG_STATE):
            return torch.load(source, weights_only=True, **kwargs)
    except pickle.UnpicklingError as error:
        wanted = re.search(r"GLOBAL ([\w.]+)", str(error))  # torch's wording varies with the reason
        raise UnsafeCheckpointError(path, wanted.group(1) if wanted else "an object of no allowed type") from None


def read_as_data(path: str, **kwargs):
    """torch.load(path, weights_only=True, **kwargs), NumPy's RNG state allowed: a file of Megatron-LM's torch
    checkpoint format (angpt.training.torch_checkpoint). A pickle that would call or build anything else raises
    UnsafeCheckpointError naming it."""
    return _weights_only(path, path, **kwargs)


def load_bytes(planner: default_planner.DefaultLoadPlanner, read_item, value) -> None:
    """torch's DefaultLoadPlanner.load_bytes, through `_weights_only`."""
    fqn = read_item.dest_index.fqn
    loaded = _weights_only(value, f"the checkpoint's item {fqn}")
    if planner.flatten_state_dict:
        default_planner.set_element(planner.original_state_dict, planner.mappings[fqn], loaded)
    else:
        planner.state_dict[fqn] = loaded


def load_common(strategy: TorchCommonLoadStrategy, checkpoint_dir):
    """megatron-core's TorchCommonLoadStrategy.load_common for local files, through `_weights_only`."""
    path = os.path.join(checkpoint_dir, COMMON_STATE_FNAME)
    if not os.path.isfile(path):
        return _original_load_common(strategy, checkpoint_dir)  # megatron-core's error for a missing file
    return _weights_only(path, path, map_location="cpu")


_original_load_common = TorchCommonLoadStrategy.load_common


def refusal_in(error: BaseException) -> Optional[UnsafeCheckpointError]:
    """The UnsafeCheckpointError behind `error`: torch's distributed checkpoint gathers each rank's failure into a
    CheckpointException (`failures`: rank -> (exception, traceback)), megatron-core chains its own."""
    seen, pending = set(), [error]
    while pending:
        error = pending.pop()
        if error is None or id(error) in seen:
            continue
        seen.add(id(error))
        if isinstance(error, UnsafeCheckpointError):
            return error
        pending += [error.__cause__, error.__context__]
        for failure in (getattr(error, "failures", None) or {}).values():
            pending.append(failure[0] if isinstance(failure, tuple) else failure)
    return None


def install() -> None:
    filesystem.FileSystemReader.read_metadata = read_metadata
    default_planner.DefaultLoadPlanner.load_bytes = load_bytes
    TorchCommonLoadStrategy.load_common = load_common
