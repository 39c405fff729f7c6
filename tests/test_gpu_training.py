"""Training on a CUDA device: the fused CUDA kernels inside training, FlashAttention, BF16 with the
distributed optimizer. All `gpu`: skipped without a CUDA device (CPU versions of each live beside the code
they test)."""

import itertools
import math

import pytest
import torch
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.transformer.enums import AttnBackend

from angpt import kernels
from angpt.config.sections import RunConfig
from angpt.megatron_compat import patches
from angpt.models import attention, build_model, layers, model_config, norms
from angpt.models.attention import clear_attention_backend_environment
from angpt.models.bounding import constrained_parameters
from angpt.models.factors import nu_alpha
from angpt.training.distributed import set_random_seed
from angpt.training.optimizer import build_optimizer
from angpt.training.step import build_model_chunks, train_step

pytestmark = pytest.mark.gpu

SHAPE = dict(num_layers=2, hidden_size=128, num_attention_heads=4)
VOCAB, SEQ, BATCH = 256, 64, 4


def batch(seed=1):
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(seed)).cuda()
    return dict(tokens=tokens[:, :-1], labels=tokens[:, 1:], loss_mask=torch.ones(BATCH, SEQ, device="cuda"),
                position_ids=torch.arange(SEQ, device="cuda").unsqueeze(0).expand(BATCH, -1))


def train(family, steps, bf16=False, distributed_optimizer=False, lr=0.01, microbatches=1, after_step=None,
          **overrides):
    """Losses of `steps` training steps on one batch; `after_step(chunks)` runs after each."""
    clear_attention_backend_environment()
    set_random_seed(1234, cuda_graphs=overrides.get("cuda_graph_impl") == "local")
    dtype = dict(bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16) if bf16 else {}
    config = model_config(family, **SHAPE, **dtype, **overrides)
    chunks = build_model_chunks(config, VOCAB, SEQ, DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=distributed_optimizer))
    optimizer, scheduler = build_optimizer(chunks, RunConfig.from_flags(dict(
        model_family=family, lr=lr, train_iters=steps, use_distributed_optimizer=distributed_optimizer, bf16=bf16)))
    data = itertools.repeat(batch())
    losses = []
    for _ in range(steps):
        losses.append(train_step(data, chunks, optimizer, scheduler, microbatches, BATCH, SEQ)[0])
        if after_step:
            after_step(chunks)
    return losses, chunks, optimizer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_elementwise_chains_equal_eager(dtype):
    generator = torch.Generator(device="cuda").manual_seed(0)
    h, x = (torch.randn(64, 2, 256, device="cuda", generator=generator).to(dtype).requires_grad_() for _ in range(2))
    alpha = (0.2 * torch.rand(256, device="cuda", generator=generator)).requires_grad_()
    angles = 6.0 * torch.rand(64, 1, 1, 64, device="cuda", generator=generator)  # RoPE's, in fp32 as megatron-core's
    chains = {
        layers.scaled_l2_normalize: lambda: layers.scaled_l2_normalize(h, alpha.to(dtype)),
        # q and k as 4 heads of 64, s_qk from 64 of alpha's entries
        layers.rotary_qk_normalize: lambda: torch.cat(layers.rotary_qk_normalize(
            h.view(64, 2, 4, 64), x.view(64, 2, 4, 64), angles, angles, alpha[:64], 4.0, False), dim=-1),
        layers.fused_l2_normalize: lambda: layers.fused_l2_normalize(h),
        layers.lerp_update: lambda: layers.lerp_update(h, x, alpha, nu_alpha(alpha)),
        layers.normalized_lerp_update: lambda: layers.normalized_lerp_update(h, x, alpha),
        norms.rms_norm: lambda: norms.rms_norm(h, (1 + alpha).to(dtype), 1e-5),  # GPT+'s, weight 1 + alpha
    }

    def assert_close(a, b, name):
        if dtype == torch.float32:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=name)
        else:  # bf16 rounding, and eager reduces alpha's gradient in bf16 where Triton uses fp32
            assert (a.float() - b.float()).norm() <= 3e-2 * b.float().norm(), name

    def value_and_grads(chain):
        out = chain()
        weights = torch.linspace(-1, 1, out.numel(), device="cuda").view_as(out)
        return out, torch.autograd.grad((out.float() * weights).sum(), (h, x, alpha), allow_unused=True)

    for function, chain in chains.items():
        fused, fused_grads = value_and_grads(chain)
        assert not function.compile_failures, function.compile_failures
        with kernels.reference_only():
            eager, eager_grads = value_and_grads(chain)
        assert_close(fused, eager, function.__name__)
        for a, b in zip(fused_grads, eager_grads):
            if b is not None:
                assert_close(a, b, function.__name__)


def test_the_extension_has_cuda_kernels():
    ext = kernels.extension(torch.device("cuda"))
    assert ext is not None and ext.with_cuda


@pytest.mark.parametrize("family", ["angpt", "ngpt"])
def test_training_with_the_cuda_kernels_equals_the_pytorch_path(family, single_process):
    fused, _, _ = train(family, steps=6)
    with kernels.reference_only():
        reference, _, _ = train(family, steps=6)
    assert all(math.isfinite(loss) for loss in fused) and fused[-1] < fused[0]
    # fp32 throughout; the kernels reduce in another order than PyTorch.
    for a, b in zip(fused, reference):
        assert abs(a - b) <= 1e-5 * abs(b), (fused, reference)


@pytest.mark.parametrize("family", ["angpt", "gptplus", "ngpt"])
def test_flash_attention_equals_unfused_attention_in_bf16(family, single_process):
    logits = {}
    for backend in (AttnBackend.unfused, AttnBackend.flash):
        clear_attention_backend_environment()
        set_random_seed(1234)
        config = model_config(family, **SHAPE, bf16=True, params_dtype=torch.bfloat16, attention_backend=backend)
        model = build_model(config, VOCAB, SEQ).cuda()
        data = batch()
        with torch.no_grad():
            logits[backend] = model(data["tokens"], data["position_ids"], None).float()
    reference, flash = logits[AttnBackend.unfused], logits[AttnBackend.flash]
    # BF16 operands: both round differently (FlashAttention keeps the scores in fp32 on chip).
    assert (flash - reference).norm() / reference.norm() < 2e-2


def test_bf16_distributed_optimizer_trains_and_keeps_weights_bounded(single_process):
    losses, chunks, optimizer = train("angpt", steps=30, bf16=True, distributed_optimizer=True, lr=0.02)
    assert all(math.isfinite(loss) for loss in losses) and losses[-1] < losses[0] - 0.5, losses
    weights = constrained_parameters(chunks)
    assert weights
    for weight in weights:
        norms = weight.float().norm(dim=weight.unit_norm_dim)
        # The fp32 main weights are projected; the model's BF16 copies round them (2^-8 relative).
        assert norms.max() <= 1 + 1e-2, norms.max()


@pytest.mark.parametrize("family", ["gptplus", "angpt", "ngpt"])
def test_rope_and_swiglu_fusions_train_as_unfused(family, single_process):
    """--rope-fusion (our compiled RoPE: no Transformer Engine here) and --bias-swiglu-fusion (megatron-core's
    compiled SwiGLU, GPT+'s MLP) in training, fp32: the unfused losses, to fp32 round-off."""
    fused, _, _ = train(family, steps=6, apply_rope_fusion=True, bias_activation_fusion=True)
    unfused, _, _ = train(family, steps=6, apply_rope_fusion=False, bias_activation_fusion=False)
    assert all(math.isfinite(loss) for loss in fused) and fused[-1] < fused[0]
    # The first two steps to fp32 round-off; then Adam turns round-off in gradients near zero into whole
    # steps of lr: GPT+ drifted by up to 1.9e-5 relative by the third step on an H200 (2026-11-30).
    for step, (a, b) in enumerate(zip(fused, unfused)):
        assert abs(a - b) <= (1e-5 if step < 2 else 1e-4) * abs(b), (fused, unfused)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_rope_equals_eager_on_cuda(dtype):
    generator = torch.Generator(device="cuda").manual_seed(0)
    t = torch.randn(SEQ, BATCH, 4, 32, device="cuda", generator=generator).to(dtype).requires_grad_()
    theta = 6 * torch.rand(SEQ, 1, 1, 16, device="cuda", generator=generator)
    freqs = torch.cat((theta, theta), dim=-1)
    weights = torch.linspace(-1, 1, t.numel(), device="cuda").view_as(t)

    def value_and_grad():
        out = attention.fused_rotary_pos_emb(t, freqs)
        return out.float(), torch.autograd.grad((out.float() * weights).sum(), t)[0].float()

    fused, fused_grad = value_and_grad()
    assert not attention._rotary.compile_failures, attention._rotary.compile_failures
    with kernels.reference_only():
        eager, eager_grad = value_and_grad()
    # fp32: round-off; bf16: eager rounds t * cos and the rotated half * sin before adding, Triton once.
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(fused, eager, **tolerance)
    torch.testing.assert_close(fused_grad, eager_grad, **tolerance)


def main_grads(store):
    """An `after_step` that keeps the step's gradients (left in the grad buffers until the next step)."""
    return lambda chunks: store.append({name: p.main_grad.clone() for name, p in chunks[0].named_parameters()})


@pytest.mark.parametrize("family", ["gptplus", "angpt", "ngpt"])
def test_cuda_graphs_compute_eager_steps(family, single_process):
    """--cuda-graph-impl local: megatron-core runs the first step eagerly, captures each layer's forward and
    backward at its end, and replays them from the second step on, here for 2 micro-batches a step (graphs
    reused across micro-batches). fp32, from the same initial weights: the second step (the first replayed)
    has eager's loss (the graphs read the weights the optimizer and projection updated in place, and the
    learnable scales) and eager's gradients for every parameter, to fp32 round-off (cuBLAS may pick other
    kernels under capture). Later losses may drift further: Adam turns round-off in gradients near zero into
    whole steps of lr (up to 1.7% by the sixth step, measured on an H200), so they are only checked to fall.
    On an H200 (2026-11-30) this test found the first layer's input overwritten before its backward read it
    (megatron-core's buffer reuse; fixed by angpt.megatron_compat.patches, not yet rerun on a GPU)."""
    eager_grads, graphed_grads, chunks = [], [], None
    eager, _, _ = train(family, steps=6, microbatches=2, after_step=main_grads(eager_grads))
    try:
        graphed, chunks, _ = train(family, steps=6, microbatches=2, cuda_graph_impl="local",
                                   after_step=main_grads(graphed_grads))
        runners = [runner for module in chunks[0].modules() if hasattr(module, "cudagraph_manager")
                   for runner in module.cudagraph_manager.cudagraph_runners]
        assert len(runners) == SHAPE["num_layers"], runners
        assert all(runner.fwd_graph is not None and runner.bwd_graph is not None for runner in runners)
    finally:
        patches.delete_cuda_graphs(chunks or [])
    assert_graphed_steps_are_eager(graphed, eager, graphed_grads, eager_grads, steps=2)


def assert_graphed_steps_are_eager(graphed, eager, graphed_grads, eager_grads, steps: int) -> None:
    """The first `steps` graphed steps have eager's loss and gradients to fp32 round-off; all losses finite, falling."""
    for step in range(steps):
        assert abs(graphed[step] - eager[step]) <= 1e-6 * abs(eager[step]), (step, graphed, eager)
        for name, grad in eager_grads[step].items():
            scale = grad.abs().max().item()
            torch.testing.assert_close(graphed_grads[step][name], grad, rtol=1e-4, atol=1e-5 * scale,
                                       msg=lambda message: f"step {step + 1}, {name}: {message}")
    assert all(math.isfinite(loss) for loss in graphed) and graphed[-1] < graphed[0] - 0.5, graphed

