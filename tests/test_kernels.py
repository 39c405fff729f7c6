"""The fused kernels (csrc/, `angpt.kernels`) against their PyTorch reference (`angpt.kernels.reference`).

CPU always; the same comparisons on CUDA are marked `gpu`. Multi-process projection (tensor parallelism 2,
distributed-optimizer shards) runs tests/distributed/kernel_projection_worker.py under torchrun."""

import math
import os
import shutil
import subprocess
import sys

import pytest
import torch

from angpt import kernels
from angpt.config.sections import RunConfig
from angpt.kernels import Piece, reference
from angpt.models import model_config
from angpt.training.distributed import set_random_seed
from angpt.training.optimizer import build_optimizer
from angpt.training.step import build_model_chunks, train_step

from conftest import ROOT, run_workers

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
# (tokens, f): one token; widths that are not a multiple of any vector width; a TP shard of 0.5B's f = 4096.
SHAPES = [(1, 1), (1, 37), (5, 3), (33, 100), (64, 2048 // 16), (128, 2048)]
FACTORS = (0.5, 3.7)  # nu_uz, nu_acf at f = 4d


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|."""
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def assert_within_one_bf16_ulp(a: torch.Tensor, b: torch.Tensor) -> None:
    """a and b are bf16 roundings of products that agree to fp32 (their factors come from float64 sums added
    in another order): equal, or one unit in the last place apart (2^-7 of the value at most)."""
    assert a.dtype == b.dtype == torch.bfloat16
    error = (a.double() - b.double()).abs()
    assert (error <= 2.0**-7 * b.double().abs()).all(), (error / b.double().abs().clamp_min(1e-30)).max().item()


def swiglu_inputs(tokens, f, dtype, device, seed=0):
    generator = torch.Generator().manual_seed(seed)
    uz = torch.randn(tokens, 2 * f, generator=generator).to(dtype)
    # Scales around sqrt(d) * s_v at init, with spread, so that SiLU sees both signs and its tails.
    s_u = torch.empty(f).uniform_(0.5, 2.0, generator=generator)
    s_v = torch.empty(f).uniform_(-4.0, 4.0, generator=generator)
    grad = torch.randn(tokens, f, generator=generator).to(dtype)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    return [t.to(device) for t in (uz, s_u.to(acc), s_v.to(acc), grad)]


def run_swiglu(function, uz, s_u, s_v, grad, factors=FACTORS):
    uz, s_u, s_v = (t.detach().clone().requires_grad_() for t in (uz, s_u, s_v))
    out = function(uz, s_u, s_v, *factors)
    out.backward(grad)
    return out.detach(), uz.grad, s_u.grad, s_v.grad


def exact_swiglu(uz, s_u, s_v, grad):
    """The reference in float64 from the same (rounded) inputs: what a single rounding should hit."""
    return run_swiglu(reference.scaled_swiglu, *(t.double() for t in (uz, s_u, s_v, grad)))


def test_extension_is_built_and_used():
    """`make test` builds the extension; without it every other test here would compare the fallback with
    itself."""
    assert kernels.extension(torch.device("cpu")) is not None, kernels._why_not


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tokens,f", SHAPES)
def test_swiglu_fp32_matches_reference(tokens, f, device):
    inputs = swiglu_inputs(tokens, f, torch.float32, device)
    fused = run_swiglu(kernels.scaled_swiglu, *inputs)
    expected = run_swiglu(reference.scaled_swiglu, *inputs)
    for name, a, b in zip(("out", "grad uz", "grad s_u", "grad s_v"), fused, expected):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert relative(a, b) < 1e-6, (name, relative(a, b))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,unit_roundoff", [(torch.bfloat16, 2.0**-8), (torch.float16, 2.0**-11)])
@pytest.mark.parametrize("tokens,f", SHAPES)
def test_swiglu_half_precision_rounds_once(tokens, f, dtype, unit_roundoff, device):
    """bf16 / fp16 outputs and input gradients are the exact result rounded once (within one unit of
    round-off of each element); the scale gradients are fp32, summed over tokens in fp32."""
    inputs = swiglu_inputs(tokens, f, dtype, device)
    fused = run_swiglu(kernels.scaled_swiglu, *inputs)
    exact = exact_swiglu(*inputs)
    assert fused[0].dtype == dtype and fused[1].dtype == dtype
    assert fused[2].dtype == torch.float32 and fused[3].dtype == torch.float32
    # Besides the one rounding: fp32 arithmetic before it (1e-6 of the largest element: the z gradient
    # cancels where 1 + z'(1 - sigmoid(z')) crosses 0), and absolute round-off below the smallest normal.
    for name, a, b in zip(("out", "grad uz"), fused[:2], exact[:2]):
        error = (a.double() - b).abs()
        bound = unit_roundoff * b.abs() + 1e-6 * b.abs().max() + unit_roundoff * torch.finfo(dtype).tiny
        assert (error <= bound).all(), (name, (error / bound).max().item())
    for name, a, b in zip(("grad s_u", "grad s_v"), fused[2:], exact[2:]):
        # The kernel differentiates at the rounded scaled inputs exactly; fp32 sums of the products.
        assert relative(a, b) < 1e-5, (name, relative(a, b))


def test_swiglu_gradcheck_float64():
    uz, s_u, s_v, _ = swiglu_inputs(4, 7, torch.float64, "cpu")
    inputs = tuple(t.requires_grad_() for t in (uz, s_u, s_v))
    assert torch.autograd.gradcheck(lambda *x: kernels.scaled_swiglu(*x, *FACTORS), inputs)


@pytest.mark.parametrize("device", DEVICES)
def test_swiglu_three_dim_noncontiguous_gradient(device):
    """[sequence, batch, 2f] activations as megatron-core lays them out, and a gradient that is a view."""
    uz, s_u, s_v, _ = swiglu_inputs(6 * 3, 40, torch.float32, device)
    uz = uz.view(6, 3, 80)
    grad = torch.randn(3, 6, 40, generator=torch.Generator().manual_seed(3)).to(device).transpose(0, 1)
    fused = run_swiglu(kernels.scaled_swiglu, uz, s_u, s_v, grad)
    expected = run_swiglu(reference.scaled_swiglu, uz, s_u, s_v, grad)
    assert fused[0].shape == (6, 3, 40) and fused[1].shape == (6, 3, 80)
    for a, b in zip(fused, expected):
        assert relative(a, b) < 1e-6


def test_swiglu_refuses_mismatched_inputs():
    uz, s_u, s_v, _ = swiglu_inputs(2, 8, torch.float32, "cpu")
    with pytest.raises(RuntimeError, match="twice the size"):
        kernels.scaled_swiglu(uz[:, :-2], s_u, s_v)
    with pytest.raises(RuntimeError, match="one size"):
        kernels.scaled_swiglu(uz, s_u, s_v[:-1])


# The projection


def weight(rows, cols, along_rows=True, dtype=torch.float32, seed=0):
    """Vectors (rows, or columns) with norms from 0.2 to 3: some inside the unit ball, some outside."""
    if not along_rows:
        return weight(cols, rows, True, dtype, seed).t().contiguous()
    generator = torch.Generator().manual_seed(seed)
    norms = torch.empty(rows, 1).uniform_(0.2, 3.0, generator=generator)
    return (torch.randn(rows, cols, generator=generator) / cols**0.5 * norms).to(dtype)


def whole(tensor, along_rows, region=0):
    return Piece(tensor.view(-1), 0, tensor.shape[1], along_rows, region)


def cut(tensor, along_rows, bounds, region=0):
    """Pieces of the flattened tensor between `bounds`, as distributed-optimizer shards cut it."""
    flat = tensor.view(-1)
    return [Piece(flat[a:b], a, tensor.shape[1], along_rows, region) for a, b in zip(bounds, bounds[1:])]


def assert_projected_like_reference(projected, expected, before, along_rows, mode):
    """Exactly the reference where the reference left vectors untouched (inside the ball), else to 1e-7."""
    dim = 1 if along_rows else 0
    untouched = (expected == before).all(dim=dim)
    if mode == "bound":
        assert untouched.any() and not untouched.all()
    index = (untouched, slice(None)) if along_rows else (slice(None), untouched)
    assert torch.equal(projected[index], before[index])
    assert relative(projected, expected) < 1e-7
    norms = projected.double().norm(dim=dim)
    assert norms.max() <= 1 + 1e-6
    if mode == "normalize":
        torch.testing.assert_close(norms, torch.ones_like(norms), atol=1e-6, rtol=0)


SIZES = [(13, 7), (50, 33), (96, 1280), (1, 5)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("mode", ["bound", "normalize"])
@pytest.mark.parametrize("along_rows", [True, False])
def test_one_pass_projection_matches_reference(along_rows, mode, dtype, device):
    """Several weights of different shapes in one call."""
    weights = [weight(r, c, along_rows, dtype, seed=i).to(device) for i, (r, c) in enumerate(SIZES)]
    before = [w.clone() for w in weights]
    expected = [w.clone() for w in weights]
    reference.project_whole_([whole(w, along_rows) for w in expected], mode)
    kernels.project_whole_([whole(w, along_rows) for w in weights], mode)
    for w, e, b in zip(weights, expected, before):
        if mode == "bound" and w.numel() < 10:
            continue  # too few vectors for both sides of the ball
        if dtype == torch.bfloat16:
            assert_within_one_bf16_ulp(w, e)
        else:
            assert_projected_like_reference(w, e, b, along_rows, mode)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["bound", "normalize"])
@pytest.mark.parametrize("along_rows", [True, False])
def test_two_phase_projection_of_cut_pieces(along_rows, mode, device):
    """Pieces cut inside rows (several per row, single elements, whole rows), of two weights sharing one
    float64 buffer, in any order, give the one-pass result and the reference's."""
    before = [weight(13, 7, along_rows).to(device), weight(40, 96, along_rows, seed=1).to(device)]
    bounds = [[0, 3, 4, 11, 30, 31, 58, 91], [0, 1000, 1001, 2047, 3840]]
    vectors = [w.shape[0] if along_rows else w.shape[1] for w in before]
    regions = [3, 3 + vectors[0]]  # the buffer starts with the vectors of some other weight
    expected = [w.clone() for w in before]
    reference.project_whole_([whole(w, along_rows) for w in expected], mode)
    for run in (kernels, reference):
        weights = [w.clone() for w in before]
        pieces = [piece for w, b, r in zip(weights, bounds, regions) for piece in cut(w, along_rows, b, r)]
        sums = torch.zeros(regions[1] + vectors[1], dtype=torch.float64, device=device)
        run.accumulate_sq_norms_(pieces[::-1], sums)
        assert not sums[:3].any()
        run.scale_(pieces, run.projection_factors(sums, mode))
        for w, e, b in zip(weights, expected, before):
            assert_projected_like_reference(w, e, b, along_rows, mode)


def test_pieces_of_several_dtypes_in_one_call():
    fp32, bf16 = weight(20, 9), weight(20, 9, dtype=torch.bfloat16, seed=2)
    expected = [fp32.clone(), bf16.clone()]
    reference.project_whole_([whole(w, True) for w in expected], "bound")
    kernels.project_whole_([whole(fp32, True), whole(bf16, True)], "bound")
    assert_within_one_bf16_ulp(bf16, expected[1])
    assert relative(fp32, expected[0]) < 1e-7


def test_projection_refuses_pieces_past_the_buffer():
    w = weight(4, 6)
    with pytest.raises(RuntimeError, match="past the end"):
        kernels.accumulate_sq_norms_([whole(w, True, region=2)], torch.zeros(5, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="whole weights"):
        kernels.project_whole_(cut(w, True, [0, 5]), "bound")


@pytest.mark.parametrize("along_rows", [True, False])
def test_reference_projects_one_weight_and_none(along_rows):
    """The reference's one pass with a single weight (and with none: nothing to do), against the projection
    computed apart in float64: each vector divided by max(1, its norm)."""
    w = weight(13, 7, along_rows)
    dim = 1 if along_rows else 0
    norms = w.double().norm(dim=dim, keepdim=True)
    expected = (w.double() / norms.clamp_min(1.0)).float()
    reference.project_whole_([whole(w, along_rows)], "bound")
    assert relative(w, expected) < 1e-7
    reference.project_whole_([], "bound")


def test_reference_swiglu_multiplies_in_the_activations_dtype():
    """Its docstring: each factor a separate multiply in the activations' dtype, so bf16 activations with fp32
    scales give bf16, rounded after each multiply."""
    uz, s_u, s_v, _ = swiglu_inputs(5, 8, torch.bfloat16, "cpu")
    u, z = uz[:, :8], uz[:, 8:]
    expected = (s_u.bfloat16() * u) * torch.nn.functional.silu(s_v.bfloat16() * z)
    out = reference.scaled_swiglu(uz, s_u, s_v)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, expected)


@pytest.mark.parametrize("input_factor, output_factor", [(2.0, 1.0), (1.0, 2.0), (0.5, 3.7)])
def test_reference_swiglu_applies_both_factors(input_factor, output_factor):
    """Its docstring's output_factor * (s_u input_factor u) * SiLU(s_v input_factor z), in float64; a factor of 2,
    beside 1, tells applying it from skipping it."""
    uz, s_u, s_v, _ = swiglu_inputs(5, 8, torch.float64, "cpu")
    u, z = uz[:, :8] * input_factor, uz[:, 8:] * input_factor
    expected = output_factor * (s_u * u) * torch.nn.functional.silu(s_v * z)
    torch.testing.assert_close(reference.scaled_swiglu(uz, s_u, s_v, input_factor, output_factor), expected,
                               rtol=1e-15, atol=0)


@pytest.mark.multiprocess
def test_two_phase_projection_over_ranks_equals_single_process():
    """Tensor parallelism 2 (row vectors split over ranks) and distributed-optimizer shards over 2
    data-parallel ranks (rows cut anywhere), with the kernels and with the reference."""
    output = run_workers("kernel_projection_worker.py", nproc=2)
    assert output.count("PASS") == 2 * 2 * 2, output  # layouts x modes x back ends, on rank 0


# The model


def train_losses(steps=4, family="angpt"):
    set_random_seed(1234)
    config = model_config(family, num_layers=2, hidden_size=64, num_attention_heads=4)
    chunks = build_model_chunks(config, 128, 16)
    run = RunConfig.from_flags(dict(model_family=family, lr=0.02, train_iters=steps))
    optimizer, scheduler = build_optimizer(chunks, run)
    tokens = torch.randint(0, 128, (4, 17), generator=torch.Generator().manual_seed(1))
    batch = dict(tokens=tokens[:, :-1], labels=tokens[:, 1:], loss_mask=torch.ones(4, 16),
                 position_ids=torch.arange(16).unsqueeze(0).expand(4, -1))
    return [train_step(iter([batch]), chunks, optimizer, scheduler, 1, 4, 16)[0] for _ in range(steps)]


@pytest.mark.parametrize("family", ["angpt", "ngpt"])
def test_training_with_and_without_the_kernels_gives_the_same_losses(family, single_process):
    fused = train_losses(family=family)
    with kernels.reference_only():
        fallback = train_losses(family=family)
    assert all(math.isfinite(loss) for loss in fused)
    assert fused[-1] < fused[0]  # it learns (one batch, again and again)
    for a, b in zip(fused, fallback):
        assert abs(a - b) <= 1e-6 * abs(b), (fused, fallback)


@pytest.mark.slow
def test_fallback_is_logged_once_when_switched_off():
    code = ("import logging, torch; logging.basicConfig(); from angpt import kernels; "
            "x = torch.randn(3, 8); s = torch.ones(4); "
            "[kernels.scaled_swiglu(x, s, s) for _ in range(3)]; print(kernels.extension(x.device))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": ROOT, "ANGPT_KERNELS": "0"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "None"
    assert done.stderr.count("ANGPT_KERNELS is set to off; running the PyTorch implementations") == 1, done.stderr


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None and not os.path.exists("/usr/local/cuda/bin/nvcc"),
                    reason="needs nvcc")
def test_cuda_sources_compile_for_sm80_and_sm90():
    """`make cuda-check`: its objects under build/ (ignored by git) are rebuilt when a source changes, so a
    broken .cu fails here and an unchanged tree is not compiled twice."""
    done = subprocess.run(["make", "--no-print-directory", "-j2", "cuda-check", f"PY={sys.executable}"], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
