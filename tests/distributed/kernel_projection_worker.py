"""The two-phase projection over 2 ranks equals the one-process projection of the whole weights, exactly.

    torchrun --nproc-per-node 2 tests/distributed/kernel_projection_worker.py

Layouts: tensor parallelism 2 (a row-parallel weight whose rows are split over the ranks, nGPT's column
vectors of a row-parallel weight, a column-parallel weight, a replicated one), and 2 data-parallel ranks
holding distributed-optimizer-like shards of one flat buffer of all weights, cut inside rows. Rank 0 prints
one PASS per layout, mode and back end (the fused kernels, then the PyTorch reference).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from angpt import kernels
from angpt.models.bounding import _Piece, _project
from angpt.training import distributed

# name: (rows, cols, unit_norm_dim, tensor-parallel partition dim or None)
WEIGHTS = {
    "row_parallel": (12, 24, 1, 1),
    "row_parallel_column_vectors": (10, 16, 0, 1),
    "column_parallel": (20, 9, 1, 0),
    "replicated": (13, 7, 1, None),
}
BACKENDS = {"kernels": contextlib.nullcontext, "reference": kernels.reference_only}


def full_weights() -> dict[str, torch.Tensor]:
    """The same weights on every rank, their vectors' norms spread over 0.2 to 3."""
    generator = torch.Generator().manual_seed(11)
    weights = {}
    for name, (rows, cols, unit_norm_dim, _) in WEIGHTS.items():
        vectors, length = (rows, cols) if unit_norm_dim == 1 else (cols, rows)
        norms = torch.empty(vectors, 1).uniform_(0.2, 3.0, generator=generator)
        tensor = torch.randn(vectors, length, generator=generator) / length**0.5 * norms
        weights[name] = tensor if unit_norm_dim == 1 else tensor.t().contiguous()
    return weights


def parameter(tensor: torch.Tensor, name: str, tensor_parallel: bool) -> torch.nn.Parameter:
    param = torch.nn.Parameter(tensor.clone())
    param.unit_norm_dim = WEIGHTS[name][2]
    if tensor_parallel and WEIGHTS[name][3] is not None:
        param.tensor_model_parallel, param.partition_dim = True, WEIGHTS[name][3]
    return param


def one_process(full: dict[str, torch.Tensor], mode: str) -> dict[str, torch.Tensor]:
    params = [parameter(tensor, name, tensor_parallel=False) for name, tensor in full.items()]
    _project(params, [_Piece(p.data.view(-1), p, 0) for p in params], mode)
    return {name: p.data for name, p in zip(full, params)}


def tensor_parallel(full: dict[str, torch.Tensor], mode: str) -> dict[str, torch.Tensor]:
    group = parallel_state.get_tensor_model_parallel_group()
    rank = group.rank()
    params = {}
    for name, tensor in full.items():
        dim = WEIGHTS[name][3]
        shard = tensor if dim is None else tensor.chunk(2, dim=dim)[rank].contiguous()
        params[name] = parameter(shard, name, tensor_parallel=True)
    _project(list(params.values()), [_Piece(p.data.view(-1), p, 0) for p in params.values()], mode)
    result = {}
    for name, param in params.items():
        dim = WEIGHTS[name][3]
        if dim is None:
            result[name] = param.data
            continue
        parts = [torch.empty_like(param.data) for _ in range(2)]
        dist.all_gather(parts, param.data, group=group)
        result[name] = torch.cat(parts, dim=dim)
    return result


def distributed_optimizer(full: dict[str, torch.Tensor], mode: str) -> dict[str, torch.Tensor]:
    """Rank 0 holds elements [0, cut) of the weights laid end to end, rank 1 the rest; cut inside a row."""
    group = parallel_state.get_data_parallel_group()
    rank = group.rank()
    params = [parameter(tensor, name, tensor_parallel=False) for name, tensor in full.items()]
    total = sum(p.numel() for p in params)
    cut = total * 3 // 7 + 1
    mine = (0, cut) if rank == 0 else (cut, total)
    pieces, start = [], 0
    for param in params:
        begin, end = max(mine[0], start), min(mine[1], start + param.numel())
        if begin < end:
            pieces.append(_Piece(param.data.view(-1)[begin - start : end - start], param, begin - start))
        start += param.numel()
    _project(params, pieces, mode, group)
    flat = torch.cat([p.data.view(-1) for p in params])
    held = [torch.empty_like(flat) for _ in range(2)]
    dist.all_gather(held, flat, group=group)
    assembled = torch.cat([held[0][:cut], held[1][cut:]])
    result, start = {}, 0
    for name, param in zip(full, params):
        result[name] = assembled[start : start + param.numel()].view_as(param)
        start += param.numel()
    return result


def main():
    distributed.initialize()  # joins the torchrun job
    full = full_weights()
    for layout, tp in (("tensor_parallel", 2), ("distributed_optimizer", 1)):
        distributed.destroy_model_parallel()
        distributed.initialize(tp, 1, None)
        run = tensor_parallel if layout == "tensor_parallel" else distributed_optimizer
        for mode in ("bound", "normalize"):
            for backend, context in BACKENDS.items():
                with context():
                    expected = one_process(full, mode)
                    projected = run(full, mode)
                for name in full:
                    assert torch.equal(projected[name], expected[name]), (layout, mode, backend, name)
                assert any(not torch.equal(expected[name], full[name]) for name in full)
                if dist.get_rank() == 0:
                    print(f"PASS {layout} {mode} {backend}", flush=True)
    distributed.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
