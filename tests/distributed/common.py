"""Helpers of the multi-process test workers: full (unsharded) views of sharded parameters."""

from __future__ import annotations

import json
import re

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from torch.distributed.tensor import DTensor, distribute_tensor

from angpt.models import model_config

V, S, MICRO_BATCH, GLOBAL_BATCH = 128, 16, 2, 4


def small_config(family: str, **overrides):
    settings = dict(
        num_layers=4,
        # Rows of 48 elements, so that the distributed optimizer's shard boundaries (aligned to powers
        # of two) cut rows and partial row norms must be reduced across ranks.
        hidden_size=48,
        num_attention_heads=4,
        pipeline_dtype=torch.float32,
        # The interleaved schedule's batched p2p gives wrong gradients on gloo at PP=2.
        batch_p2p_comm=False,
        batch_p2p_sync=False,
    )
    settings.update(overrides)
    return model_config(family, **settings)


def global_name(chunk, name: str) -> str:
    """The parameter's name in the single-stage model (pipeline stages number their layers from 0)."""
    match = re.match(r"(decoder\.layers\.)(\d+)(\..*)", name)
    if not match:
        return name
    layer = chunk.decoder.layers[int(match.group(2))]
    return f"{match.group(1)}{layer.layer_number - 1}{match.group(3)}"


def unwrap(chunk):
    return getattr(chunk, "module", chunk)


def _tp_gather(param, tensor: torch.Tensor) -> torch.Tensor:
    group = parallel_state.get_tensor_model_parallel_group()
    if group.size() == 1 or not getattr(param, "tensor_model_parallel", False):
        return tensor.detach().clone()
    parts = [torch.empty_like(tensor) for _ in range(group.size())]
    dist.all_gather(parts, tensor.detach().contiguous(), group=group)
    dim, stride = param.partition_dim, getattr(param, "partition_stride", 1)
    # With stride s each rank holds s chunks (e.g. fc1's [u shard; z shard]); the full tensor is
    # chunk 0 of every rank, then chunk 1 of every rank, ...
    chunks = [part.chunk(stride, dim=dim) for part in parts]
    return torch.cat([c[j] for j in range(stride) for c in chunks], dim=dim)


def gather_full(chunks, what: str = "param") -> dict[str, torch.Tensor]:
    """{global name: full tensor} of every parameter (or its main_grad), on every rank."""
    mine = {}
    for chunk in chunks:
        model = unwrap(chunk)
        for name, param in model.named_parameters():
            # FSDP2's parameters and gradients are DTensors (row shards), without main_grad: gathered whole.
            tensor = param.data if what == "param" else getattr(param, "main_grad", param.grad)
            if isinstance(tensor, DTensor):
                tensor = tensor.full_tensor()
            mine[global_name(model, name)] = _tp_gather(param, tensor)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    full = {}
    for part in everyone:
        full.update(part)
    return full


def load_full(chunks, full: dict[str, torch.Tensor]) -> None:
    """Copy full tensors into this rank's shards (the inverse of gather_full)."""
    group = parallel_state.get_tensor_model_parallel_group()
    rank, size = group.rank(), group.size()
    with torch.no_grad():
        for chunk in chunks:
            model = unwrap(chunk)
            for name, param in model.named_parameters():
                tensor = full[global_name(model, name)]
                if size > 1 and getattr(param, "tensor_model_parallel", False):
                    dim, stride = param.partition_dim, getattr(param, "partition_stride", 1)
                    tensor = torch.cat(
                        [c.chunk(size, dim=dim)[rank] for c in tensor.chunk(stride, dim=dim)], dim=dim
                    )
                if isinstance(param.data, DTensor):  # FSDP2: this rank's rows
                    tensor = distribute_tensor(tensor, param.device_mesh, param.placements)
                param.data.copy_(tensor)


def fixed_batches():
    """The global batch: GLOBAL_BATCH sequences as GLOBAL_BATCH / MICRO_BATCH micro-batches."""
    generator = torch.Generator().manual_seed(42)
    tokens = torch.randint(0, V, (GLOBAL_BATCH, S + 1), generator=generator)
    positions = torch.arange(S).unsqueeze(0).expand(MICRO_BATCH, -1)
    return [
        dict(
            tokens=tokens[i : i + MICRO_BATCH, :-1],
            labels=tokens[i : i + MICRO_BATCH, 1:],
            loss_mask=torch.ones(MICRO_BATCH, S),
            position_ids=positions,
        )
        for i in range(0, GLOBAL_BATCH, MICRO_BATCH)
    ]


def report(values: dict) -> None:
    """Print a line the pytest side parses."""
    print("RESULT " + json.dumps(values), flush=True)
