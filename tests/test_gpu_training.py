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
from angpt.bounding import constrained_parameters
from angpt.distributed import set_random_seed
from angpt.factors import nu_alpha
from angpt.models import build_model, layers, model_config
from angpt.models.attention import clear_attention_backend_environment
from angpt.optimizer import build_optimizer
from angpt.step import build_model_chunks, train_step

pytestmark = pytest.mark.gpu

SHAPE = dict(num_layers=2, hidden_size=128, num_attention_heads=4)
VOCAB, SEQ, BATCH = 256, 64, 4


def batch(seed=1):
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(seed)).cuda()
    return dict(tokens=tokens[:, :-1], labels=tokens[:, 1:], loss_mask=torch.ones(BATCH, SEQ, device="cuda"),
                position_ids=torch.arange(SEQ, device="cuda").unsqueeze(0).expand(BATCH, -1))


def train(family, steps, bf16=False, distributed_optimizer=False, lr=0.01, **overrides):
    clear_attention_backend_environment()
    set_random_seed(1234)
    dtype = dict(bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16) if bf16 else {}
    config = model_config(family, **SHAPE, **dtype, **overrides)
    chunks = build_model_chunks(config, VOCAB, SEQ, DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=distributed_optimizer))
    optimizer, scheduler = build_optimizer(chunks, family, lr=lr, train_iters=steps,
                                           use_distributed_optimizer=distributed_optimizer, bf16=bf16)
    data = itertools.repeat(batch())
    losses = [train_step(data, chunks, optimizer, scheduler, 1, BATCH, SEQ)[0] for _ in range(steps)]
    return losses, chunks, optimizer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_elementwise_chains_equal_eager(dtype):
    generator = torch.Generator(device="cuda").manual_seed(0)
    h, x = (torch.randn(64, 2, 256, device="cuda", generator=generator).to(dtype).requires_grad_() for _ in range(2))
    alpha = (0.2 * torch.rand(256, device="cuda", generator=generator)).requires_grad_()
    chains = {
        layers.scaled_l2_normalize: lambda: layers.scaled_l2_normalize(h, alpha.to(dtype)),
        layers.fused_l2_normalize: lambda: layers.fused_l2_normalize(h),
        layers.lerp_update: lambda: layers.lerp_update(h, x, alpha, nu_alpha(alpha)),
        layers.normalized_lerp_update: lambda: layers.normalized_lerp_update(h, x, alpha),
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
