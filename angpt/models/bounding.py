"""Bounded weights (docs/model.md, Bounding) and nGPT's normalized weights, applied after every optimizer step.

Each weight matrix W (out x in) of anGPT has every row projected into the unit ball,
w_i <- w_i / max(1, ||w_i||); nGPT instead normalizes exactly, along the embedding dimension. Which
dimension holds the vectors is recorded on each parameter as `unit_norm_dim` when the model is built.

The projection runs on whatever holds the authoritative copy of each weight:
- the model parameters themselves (fp32 training without a distributed optimizer, model init);
- the fp32 main parameters of megatron-core's mixed-precision optimizer;
- the fp32 main-parameter shards of the distributed optimizer, which cut rows at arbitrary points;
- the row shards of FSDP2 (`--use-torch-fsdp2`: DTensors sharded on dim 0), which hold whole rows but cut the
  columns that nGPT normalizes along dim 0 (its W_p and W_d);
- the shards of Megatron-FSDP (`--use-megatron-fsdp`), whole rows too, any number of them per rank (see
  `_megatron_fsdp_pieces`).

A vector is complete on one rank unless it is split by tensor parallelism (row-parallel W_p, W_d under
anGPT), by the distributed optimizer's shards or by FSDP2's or Megatron-FSDP's. Every rank therefore computes partial
squared norms for the vectors it holds (in float64), sums them over the tensor-parallel and data-parallel groups where
vectors are split, and scales its own elements: one collective per group per step. Weights a rank holds
whole are projected in one pass each. The arithmetic runs in the fused kernels of `angpt.kernels`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params, FP32Optimizer
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from angpt import kernels

MODES = ("bound", "normalize")


@dataclass
class _Piece:
    """A contiguous run `data` of the flattened weight `param`, starting at element `offset`."""

    data: torch.Tensor
    param: torch.nn.Parameter
    offset: int

    @property
    def whole(self) -> bool:
        return self.offset == 0 and self.data.numel() == self.param.numel()


def split_over_tp(param) -> bool:
    return getattr(param, "tensor_model_parallel", False) and param.partition_dim == param.unit_norm_dim


def _kernel_piece(piece: _Piece, region: int = 0) -> kernels.Piece:
    return kernels.Piece(piece.data, piece.offset, piece.param.shape[1], piece.param.unit_norm_dim == 1, region)


@torch.no_grad()
def _project(params: list[torch.nn.Parameter], pieces: list[_Piece], mode: str, data_parallel_group=None):
    """Project the vectors of `params`, of which this rank holds `pieces`. `params` lists every weight
    whose pieces any rank of `data_parallel_group` holds, in the same order on every rank."""
    if mode not in MODES:
        raise ValueError(f"weight constraint must be one of {MODES}, got {mode!r}")
    reduce_over_dp = data_parallel_group is not None and data_parallel_group.size() > 1
    tp_group = parallel_state.get_tensor_model_parallel_group()
    split = {id(p) for p in params if tp_group.size() > 1 and split_over_tp(p)}
    if not reduce_over_dp:
        # Weights whose vectors this rank holds whole: one pass each, no collective.
        alone = [piece for piece in pieces if piece.whole and id(piece.param) not in split]
        kernels.project_whole_([_kernel_piece(piece) for piece in alone], mode)
        pieces = [piece for piece in pieces if not piece.whole or id(piece.param) in split]
        held = {id(piece.param) for piece in pieces}
        params = [p for p in params if id(p) in held]
    if not params:
        return
    # One float64 buffer of squared norms, the weights split over TP first, so that each group's
    # all-reduce is one call on a prefix or the whole of it.
    ordered = [p for p in params if id(p) in split] + [p for p in params if id(p) not in split]
    regions, total, split_total = {}, 0, 0
    for param in ordered:
        regions[id(param)] = total
        total += param.shape[0] if param.unit_norm_dim == 1 else param.shape[1]
        if id(param) in split:
            split_total = total
    on_kernels = [_kernel_piece(piece, regions[id(piece.param)]) for piece in pieces]
    sums = torch.zeros(total, dtype=torch.float64, device=params[0].device)
    kernels.accumulate_sq_norms_(on_kernels, sums)
    if reduce_over_dp:
        dist.all_reduce(sums, group=data_parallel_group)
    if split_total:
        dist.all_reduce(sums[:split_total], group=tp_group)
    # Bounding multiplies vectors already inside the ball by exactly 1, which leaves them untouched.
    kernels.scale_(on_kernels, kernels.projection_factors(sums, mode))


def all_reduce_in_place(tensors: list[torch.Tensor], group) -> None:
    """One all-reduce for a list of tensors. Every rank of the group passes the same shapes."""
    if not tensors:
        return
    flat = torch.cat(tensors)
    dist.all_reduce(flat, group=group)
    offset = 0
    for tensor in tensors:
        tensor.copy_(flat[offset : offset + tensor.numel()])
        offset += tensor.numel()


def constrained_parameters(modules: Iterable[torch.nn.Module]) -> list[torch.nn.Parameter]:
    """The weights carrying `unit_norm_dim`, each once (a tied embedding appears in two modules)."""
    seen, params = set(), []
    for module in modules:
        for param in module.parameters():
            if hasattr(param, "unit_norm_dim") and id(param) not in seen:
                seen.add(id(param))
                params.append(param)
    return params


def project_parameters_(modules: Iterable[torch.nn.Module], mode: str) -> None:
    """Project the model's own parameters (at initialization, or when no optimizer holds main copies)."""
    params = constrained_parameters(modules)
    _project(params, [_Piece(p.data.view(-1), p, 0) for p in params], mode)


def _optimizer_pieces(optimizer) -> tuple[list[torch.nn.Parameter], list[_Piece], Optional[object]]:
    """(weights, the pieces of them this rank updates, data-parallel group over which they are split)
    of one megatron-core optimizer."""
    def wanted(param):
        return hasattr(param, "unit_norm_dim")

    if isinstance(optimizer, DistributedOptimizer) and optimizer.ddp_config.use_megatron_fsdp:
        return _megatron_fsdp_pieces(optimizer)
    if isinstance(optimizer, DistributedOptimizer):
        pieces = []
        for model_groups, main_groups in (
            (optimizer.model_float16_groups, optimizer.shard_fp32_from_float16_groups),
            (optimizer.model_fp32_groups, optimizer.shard_fp32_groups),
        ):
            for model_group, main_group in zip(model_groups, main_groups):
                for model_param, main_shard in zip(model_group, main_group):
                    if wanted(model_param):
                        start = optimizer._get_model_param_range_map(model_param)["param"].start
                        pieces.append(_Piece(main_shard.data.view(-1), model_param, start))
        # Shards cut weights anywhere: every data-parallel rank sums over all weights of the buffers.
        params = [p for buffer in optimizer.buffers for p in buffer.params if wanted(p)]
        return params, pieces, optimizer.data_parallel_group
    if isinstance(optimizer, Float16OptimizerWithFloat16Params):
        return _pieces_of([
            (model, main)
            for model_group, main_group in zip(optimizer.float16_groups, optimizer.fp32_from_float16_groups)
            for model, main in zip(model_group, main_group)
            if wanted(model)
        ] + [(p, p) for group in optimizer.fp32_from_fp32_groups for p in group if wanted(p)])
    if isinstance(optimizer, FP32Optimizer):
        return _pieces_of([(p, p) for group in optimizer.optimizer.param_groups for p in group["params"] if wanted(p)])
    raise TypeError(f"weight constraints do not support {type(optimizer).__name__}")


def _megatron_fsdp_pieces(optimizer: DistributedOptimizer):
    """_optimizer_pieces of Megatron-FSDP's optimizer, whose parameters are DTensors of its main weights' shards,
    each over the model's weight `orig_param` (which keeps its global shape and carries `unit_norm_dim`). A shard is
    the run `megatron_fsdp_slice` of its flattened weight. megatron-core cuts its buffers at multiples of a row (the
    bucket's chunk_size_factor), so a shard holds whole rows, any number of them, none on some ranks: a weight
    normalized along dim 1 (rows) has each vector on one rank, one normalized along dim 0 (nGPT's W_p and W_d:
    columns) has each vector split over the ranks where its rows are. The partial norms are summed over the group
    its shards are cut over either way: the data-parallel group, or under hybrid sharding
    (--num-distributed-optimizer-instances above 1) the ranks of one instance, the other instances holding the same
    shards (summed over them too, every norm counted once per instance: each weight shrunk by sqrt(instances)).
    Under no_shard every rank holds and steps its whole weights alike."""
    params, pieces = [], []
    whole = optimizer.ddp_config.data_parallel_sharding_strategy == "no_shard"
    for group in optimizer.optimizer.param_groups:
        for param in group["params"]:
            weight = param.orig_param
            if not hasattr(weight, "unit_norm_dim"):
                continue
            params.append(weight)
            shard, run = param.to_local(), param.megatron_fsdp_slice
            if run.stop - run.start != shard.numel():
                raise TypeError(f"a Megatron-FSDP shard of {shard.numel()} elements at {run} of its weight")
            if shard.numel():
                pieces.append(_Piece(shard.view(-1), weight, run.start))
    shards_over = optimizer.model_chunks[0].module.get_distributed_index().get_fsdp_group()
    return params, pieces, None if whole else shards_over


def _pieces_of(weights: list[tuple[torch.nn.Parameter, torch.Tensor]]):
    """_optimizer_pieces of (model weight, the main weight the optimizer updates for it) pairs: whole weights, or
    FSDP2 shards of them over its data-parallel group."""
    params = [model for model, _ in weights]
    if params and isinstance(params[0], DTensor):
        return params, [_fsdp_piece(model, main) for model, main in weights], params[0].device_mesh.get_group()
    return params, [_Piece(main.data.view(-1), model, 0) for model, main in weights], None


def _fsdp_piece(param: DTensor, main: DTensor) -> _Piece:
    """This rank's FSDP2 shard of `main` (`param`, or the 16-bit optimizer's fp32 copy of it): rows `torch.chunk`
    gives it (the last ranks' fewer, or none), a contiguous run of the flattened weight."""
    if tuple(param.placements) != (Shard(0),):
        raise TypeError(f"weight constraints take FSDP2 shards of rows (Shard(0)), not {param.placements}")
    _, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return _Piece(main.to_local().view(-1), param, offset[0] * param.shape[1])


def attach_weight_constraint(optimizer, mode: str) -> None:
    """Project the weights after every step of a megatron-core optimizer, on its main parameters,
    before they are copied to the model (a post-step hook on each inner torch optimizer)."""
    if mode not in MODES:
        raise ValueError(f"weight constraint must be one of {MODES}, got {mode!r}")
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):

        def project_after_step(torch_optimizer, args, kwargs, inner=inner):
            # Timed as "bounding" when the optimizer's config holds megatron-core's Timers (--timing-log-level 1).
            timers = getattr(inner.config, "timers", None)
            projection = timers("bounding", log_level=1) if timers is not None else None
            if projection is not None:
                projection.start()
            params, pieces, data_parallel_group = _optimizer_pieces(inner)
            _project(params, pieces, mode, data_parallel_group)
            if projection is not None:
                projection.stop()

        inner.optimizer.register_step_post_hook(project_after_step)
