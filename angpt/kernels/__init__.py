"""The fused kernels of csrc/ behind one Python function each, whatever the back end. The lowest layer: it
imports nothing else of angpt.

- `scaled_swiglu`: the nu-scaled SwiGLU of the MLP, forward and backward in one pass each; it applies
  nu_uz and nu_acf for the MLP's NuScale modules (docs/model.md, Fused kernels).
- `accumulate_sq_norms_`, `scale_`, `project_whole_`: the bounded-weight projection over many weights
  per call, in two phases (partial squared norms, reduced by the caller, then scaling) or in one pass.

The extension is used when it was built (`pip install --no-build-isolation -e .`) and supports the
tensors' device; otherwise the PyTorch implementations of `angpt.kernels.reference` run, and the first
such call logs why. ANGPT_KERNELS=0 (or off) in the environment, or `reference_only()`, forces them.

- `fused_on_gpu`: the model's short elementwise chains (QK normalization, post-norm, LERP residual) as one
  torch.compile'd (Triton) kernel each on CUDA tensors, instead of 4-8 eager passes forward and backward;
  eager elsewhere, and under the same switches.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import os
from typing import Callable, Optional, Sequence

import torch

from angpt.kernels import reference
from angpt.kernels.reference import Piece, projection_factors

__all__ = ["Piece", "scaled_swiglu", "accumulate_sq_norms_", "scale_", "project_whole_", "projection_factors",
           "extension", "missing_build", "reference_only", "fused_on_gpu"]

log = logging.getLogger(__name__)

# Vector ISAs from the widest down; setup.py names the module after the one it was built for, so that a
# CPU without that ISA never imports (and crashes on) it.
_ISAS = ("avx512", "avx2", "default")


def _switched_off_by_environment() -> bool:
    return os.environ.get("ANGPT_KERNELS", "1").strip().lower() in ("0", "off", "false", "no")


def _load() -> tuple[Optional[object], str]:
    """(the extension module or None, why not)."""
    if _switched_off_by_environment():
        return None, "ANGPT_KERNELS is set to off"
    runtime = torch.backends.cpu.get_cpu_capability().lower()
    usable = _ISAS[_ISAS.index(runtime):] if runtime in _ISAS else _ISAS[-1:]
    for isa in usable:
        name = f"{__name__}._fused_{isa}"
        try:
            return importlib.import_module(name), ""
        except ModuleNotFoundError as error:
            if error.name != name:
                return None, f"{name} failed to import: {error}"
        except ImportError as error:  # built against another torch, say
            return None, f"{name} failed to import: {error}"
    return None, (f"the extension is not built for this CPU ({runtime}); "
                  "build it with `pip install --no-build-isolation -e .`")


_extension, _why_not = _load()
_forced_off = False
_compiled_everywhere = False
_logged = set()


def extension(device: torch.device) -> Optional[object]:
    """The extension module if it runs on `device` here and now, else None (and the first time, a log line)."""
    reason = _why_not
    if _forced_off:
        return None
    if _extension is not None:
        if device.type == "cpu" or (device.type == "cuda" and _extension.with_cuda):
            return _extension
        reason = f"the extension was built without {device.type} kernels"
    if reason not in _logged:
        _logged.add(reason)
        log.warning("angpt fused kernels: %s; running the PyTorch implementations", reason)
    return None


def missing_build() -> Optional[str]:
    """The line a run starts with when the extension is not built here (None when it is, or is switched off)."""
    if _extension is not None or _switched_off_by_environment():
        return None
    _logged.add(_why_not)  # said once: not again at the first kernel call
    build = "" if "pip install" in _why_not else "; build them with `pip install --no-build-isolation -e .`"
    return f"angpt fused kernels are missing: {_why_not}{build}; running the slower PyTorch implementations"


@contextlib.contextmanager
def reference_only():
    """Run the PyTorch implementations inside, whether or not the extension is there (for comparisons)."""
    global _forced_off
    previous, _forced_off = _forced_off, True
    try:
        yield
    finally:
        _forced_off = previous


@contextlib.contextmanager
def compiled_everywhere():
    """Run every `fused_on_gpu` function's compiled form inside, on any device, as a GPU runs them: to see on a
    CPU what the GPU path saves for the backward pass (benchmarks/activation_memory.py) or computes."""
    global _compiled_everywhere
    previous, _compiled_everywhere = _compiled_everywhere, True
    try:
        yield
    finally:
        _compiled_everywhere = previous


def fused_on_gpu(function: Optional[Callable] = None, *, eager: Optional[Callable] = None) -> Callable:
    """`function` (tensors first) compiled by torch.compile when its first argument is a CUDA tensor and the
    kernels are on; `eager` (the same function in fewer eager ops, say with a hand-written backward; by
    default `function`) otherwise. A compilation failure is logged once and `eager` runs from then on.
    A decorator, `@fused_on_gpu` or `@fused_on_gpu(eager=...)`."""
    if function is None:
        return functools.partial(fused_on_gpu, eager=eager)
    compiled = torch.compile(function, dynamic=False)
    eager = eager or function
    failed = []  # the error, once compiling failed

    @functools.wraps(function)
    def run(x: torch.Tensor, *args):
        if (x.is_cuda or _compiled_everywhere) and not failed and _fusion_on():
            try:
                return compiled(x, *args)
            except Exception as error:  # noqa: BLE001 - Triton or Inductor missing or failing on this machine
                failed.append(error)
                log.warning("torch.compile of %s failed (%s); running it eagerly", function.__name__, error)
        return eager(x, *args)

    run.compile_failures = failed
    run.compiled = compiled  # for comparisons against `eager` on any device
    return run


def _fusion_on() -> bool:
    return not _forced_off and not _switched_off_by_environment()


class _FusedScaledSwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, uz, s_u, s_v, input_factor, output_factor, ext):
        ctx.save_for_backward(uz, s_u, s_v)
        ctx.factors, ctx.ext = (input_factor, output_factor), ext
        return ext.swiglu_forward(uz, s_u, s_v, input_factor, output_factor)

    @staticmethod
    def backward(ctx, grad):
        uz, s_u, s_v = ctx.saved_tensors
        grad_uz, grad_s_u, grad_s_v = ctx.ext.swiglu_backward(grad, uz, s_u, s_v, *ctx.factors)
        return grad_uz, grad_s_u, grad_s_v, None, None, None


def scaled_swiglu(uz: torch.Tensor, s_u: torch.Tensor, s_v: torch.Tensor, input_factor: float = 1.0,
                  output_factor: float = 1.0) -> torch.Tensor:
    """output_factor * (s_u input_factor u) * SiLU(s_v input_factor z) for uz = [u; z] along the last dim
    (a tensor-parallel shard of it with the matching shards of s_u and s_v). The kernel computes in fp32
    (fp64 for fp64 inputs) and rounds once; the gradients of s_u and s_v are summed over tokens in fp32."""
    ext = extension(uz.device)
    if ext is None:
        return reference.scaled_swiglu(uz, s_u, s_v, input_factor, output_factor)
    acc = torch.float64 if uz.dtype == torch.float64 else torch.float32
    return _FusedScaledSwiGLU.apply(uz, s_u.to(acc), s_v.to(acc), float(input_factor), float(output_factor), ext)


def _as_args(pieces: Sequence[Piece]) -> list[tuple]:
    return [(p.data, int(p.offset), int(p.cols), bool(p.along_rows), int(p.region)) for p in pieces]


def accumulate_sq_norms_(pieces: Sequence[Piece], sums: torch.Tensor) -> None:
    """sums[region + i] += the squared norm of the part of vector i in each piece (float64 accumulation;
    deterministic on the CPU)."""
    ext = extension(sums.device)
    if ext is None:
        reference.accumulate_sq_norms_(pieces, sums)
    else:
        ext.accumulate_sq_norms_(_as_args(pieces), sums)


def scale_(pieces: Sequence[Piece], factors: torch.Tensor) -> None:
    """Multiply vector i of each piece by factors[region + i], rounded to the piece's dtype; a factor of
    exactly 1 leaves the vector untouched."""
    ext = extension(factors.device)
    if ext is None:
        reference.scale_(pieces, factors)
    else:
        ext.scale_(_as_args(pieces), factors)


def project_whole_(pieces: Sequence[Piece], mode: str) -> None:
    """Bound (mode "bound") or normalize (mode "normalize") every vector of whole weights (offset 0,
    every element), one pass over each; `region` is ignored."""
    if not pieces:
        return
    ext = extension(pieces[0].data.device)
    if ext is None:
        reference.project_whole_(pieces, mode)
    else:
        ext.project_whole_(_as_args(pieces), mode == "bound")
