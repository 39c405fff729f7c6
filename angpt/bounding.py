"""Bounded weights (spec section 6) and nGPT's normalized weights, applied after every optimizer step.

Each weight matrix W (out x in) of anGPT has every row projected into the unit ball,
w_i <- w_i / max(1, ||w_i||); nGPT instead normalizes exactly, along the embedding dimension. Which
dimension holds the vectors is recorded on each parameter as `unit_norm_dim` when the model is built.

The projection runs on whatever holds the authoritative copy of each weight:
- the model parameters themselves (fp32 training without a distributed optimizer, model init);
- the fp32 main parameters of megatron-core's mixed-precision optimizer;
- the fp32 main-parameter shards of the distributed optimizer, which cut rows at arbitrary points.

A vector is complete on one rank unless it is split by tensor parallelism (row-parallel W_p, W_d under
anGPT) or by the distributed optimizer's shards. Every rank therefore computes partial squared norms for
the vectors it holds (in float64), sums them over the tensor-parallel and data-parallel groups where
vectors are split, and scales its own elements: one collective per group per step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state

MODES = ("bound", "normalize")


@dataclass
class _Piece:
    """A contiguous run `data` of the flattened weight `param`, starting at element `offset`."""

    data: torch.Tensor
    param: torch.nn.Parameter
    offset: int

    def blocks(self):
        """(views of `data` as [rows, columns] blocks, first row, first column): the partial first row,
        the whole rows, the partial last row."""
        cols = self.param.shape[1]
        start, end = self.offset, self.offset + self.data.numel()
        position = start
        while position < end:
            row, col = divmod(position, cols)
            if col or end - position < cols:
                n_rows, width = 1, min(cols - col, end - position)
            else:
                n_rows, width = (end - position) // cols, cols
            flat = self.data[position - start : position - start + n_rows * width]
            yield flat.view(n_rows, width), row, col
            position += n_rows * width


def _split_over_tp(param) -> bool:
    return getattr(param, "tensor_model_parallel", False) and param.partition_dim == param.unit_norm_dim


@torch.no_grad()
def _project(params: list[torch.nn.Parameter], pieces: list[_Piece], mode: str, data_parallel_group=None):
    """Project the vectors of `params`, of which this rank holds `pieces`. `params` lists every weight
    whose pieces any rank of `data_parallel_group` holds, in the same order on every rank."""
    if mode not in MODES:
        raise ValueError(f"weight constraint must be one of {MODES}, got {mode!r}")
    device = params[0].device if params else torch.device("cpu")
    sums = {
        id(p): torch.zeros(p.shape[0] if p.unit_norm_dim == 1 else p.shape[1], dtype=torch.float64, device=device)
        for p in params
    }
    for piece in pieces:
        along_rows = piece.param.unit_norm_dim == 1
        total = sums[id(piece.param)]
        for block, row, col in piece.blocks():
            squares = block.double().pow(2)
            if along_rows:
                total[row : row + block.shape[0]] += squares.sum(dim=1)
            else:
                total[col : col + block.shape[1]] += squares.sum(dim=0)
    if data_parallel_group is not None and data_parallel_group.size() > 1:
        _all_reduce_in_place([sums[id(p)] for p in params], data_parallel_group)
    tp_group = parallel_state.get_tensor_model_parallel_group()
    if tp_group.size() > 1:
        _all_reduce_in_place([sums[id(p)] for p in params if _split_over_tp(p)], tp_group)
    factors = {}
    for key, squared in sums.items():
        norms = squared.sqrt()
        # Bounding multiplies vectors already inside the ball by exactly 1.
        factors[key] = 1.0 / (norms.clamp_min(1.0) if mode == "bound" else norms.clamp_min(1e-30))
    for piece in pieces:
        along_rows = piece.param.unit_norm_dim == 1
        factor = factors[id(piece.param)].to(piece.data.dtype)
        for block, row, col in piece.blocks():
            if along_rows:
                block.mul_(factor[row : row + block.shape[0], None])
            else:
                block.mul_(factor[None, col : col + block.shape[1]])


def _all_reduce_in_place(tensors: list[torch.Tensor], group) -> None:
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
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params, FP32Optimizer

    def wanted(param):
        return hasattr(param, "unit_norm_dim")

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
        pieces = [
            _Piece(main.data.view(-1), model, 0)
            for model_group, main_group in zip(optimizer.float16_groups, optimizer.fp32_from_float16_groups)
            for model, main in zip(model_group, main_group)
            if wanted(model)
        ]
        pieces += [_Piece(p.data.view(-1), p, 0) for group in optimizer.fp32_from_fp32_groups for p in group if wanted(p)]
        return [piece.param for piece in pieces], pieces, None
    if isinstance(optimizer, FP32Optimizer):
        params = [p for group in optimizer.optimizer.param_groups for p in group["params"] if wanted(p)]
        return params, [_Piece(p.data.view(-1), p, 0) for p in params], None
    raise TypeError(f"weight constraints do not support {type(optimizer).__name__}")


def attach_weight_constraint(optimizer, mode: str) -> None:
    """Project the weights after every step of a megatron-core optimizer, on its main parameters,
    before they are copied to the model (a post-step hook on each inner torch optimizer)."""
    if mode not in MODES:
        raise ValueError(f"weight constraint must be one of {MODES}, got {mode!r}")
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):

        def project_after_step(torch_optimizer, args, kwargs, inner=inner):
            params, pieces, data_parallel_group = _optimizer_pieces(inner)
            _project(params, pieces, mode, data_parallel_group)

        inner.optimizer.register_step_post_hook(project_after_step)
