"""The PyTorch implementations of the fused kernels: the fallback when the extension is absent, and the
reference the kernels are tested against."""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch


def scaled_swiglu(uz: torch.Tensor, s_u: torch.Tensor, s_v: torch.Tensor, input_factor: float = 1.0,
                  output_factor: float = 1.0) -> torch.Tensor:
    """output_factor * (s_u input_factor u) * SiLU(s_v input_factor z) for uz = [u; z] along the last dim,
    computed as the model always has: each factor a separate multiply in the activations' dtype."""
    if input_factor != 1.0:
        uz = uz * input_factor
    u, z = torch.chunk(uz, 2, dim=-1)
    a = (s_u.to(uz.dtype) * u) * torch.nn.functional.silu(s_v.to(uz.dtype) * z)
    return a if output_factor == 1.0 else a * output_factor


class Piece(NamedTuple):
    """A contiguous run `data` (1-D) of a flattened [rows, cols] weight, starting at element `offset`. Its
    vectors are rows (along_rows) or columns; the squared norm and factor of vector i are at index
    `region + i` of a float64 buffer."""

    data: torch.Tensor
    offset: int
    cols: int
    along_rows: bool
    region: int


def blocks(piece: Piece):
    """(views of `piece.data` as [rows, columns] blocks, first row, first column): the partial first row,
    the whole rows, the partial last row."""
    cols = piece.cols
    start, end = piece.offset, piece.offset + piece.data.numel()
    position = start
    while position < end:
        row, col = divmod(position, cols)
        if col or end - position < cols:
            n_rows, width = 1, min(cols - col, end - position)
        else:
            n_rows, width = (end - position) // cols, cols
        flat = piece.data[position - start : position - start + n_rows * width]
        yield flat.view(n_rows, width), row, col
        position += n_rows * width


def projection_factors(sums: torch.Tensor, mode: str) -> torch.Tensor:
    """What each vector is multiplied by, from its squared norm: 1 / max(1, norm) to bound it (exactly 1
    inside the unit ball), 1 / norm to normalize it."""
    norms = sums.sqrt()
    return 1.0 / (norms.clamp_min(1.0) if mode == "bound" else norms.clamp_min(1e-30))


def accumulate_sq_norms_(pieces: Sequence[Piece], sums: torch.Tensor) -> None:
    for piece in pieces:
        for block, row, col in blocks(piece):
            squares = block.double().pow(2)
            if piece.along_rows:
                sums[piece.region + row : piece.region + row + block.shape[0]] += squares.sum(dim=1)
            else:
                sums[piece.region + col : piece.region + col + block.shape[1]] += squares.sum(dim=0)


def scale_(pieces: Sequence[Piece], factors: torch.Tensor) -> None:
    for piece in pieces:
        vectors = -(-(piece.offset + piece.data.numel()) // piece.cols) if piece.along_rows else piece.cols
        factor = factors[piece.region : piece.region + vectors].to(piece.data.dtype)
        for block, row, col in blocks(piece):
            if piece.along_rows:
                block.mul_(factor[row : row + block.shape[0], None])
            else:
                block.mul_(factor[None, col : col + block.shape[1]])


def project_whole_(pieces: Sequence[Piece], mode: str) -> None:
    regions, total = [], 0
    for piece in pieces:
        regions.append(piece._replace(region=total))
        total += piece.data.numel() // piece.cols if piece.along_rows else piece.cols
    device = pieces[0].data.device if pieces else torch.device("cpu")
    sums = torch.zeros(total, dtype=torch.float64, device=device)
    accumulate_sq_norms_(regions, sums)
    scale_(regions, projection_factors(sums, mode))
