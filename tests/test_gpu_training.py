"""Training on a CUDA device: the fused CUDA kernels inside training, FlashAttention, BF16 with the
distributed optimizer. All `gpu`: skipped without a CUDA device (CPU versions of each live beside the code
they test)."""

import itertools
import math

import pytest
import torch
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.transformer.cuda_graphs import delete_cuda_graphs
from megatron.core.transformer.enums import AttnBackend

from angpt import kernels
from angpt.bounding import constrained_parameters
from angpt.distributed import set_random_seed
from angpt.factors import nu_alpha
from angpt.models import attention, build_model, layers, model_config
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


def train(family, steps, bf16=False, distributed_optimizer=False, lr=0.01, microbatches=1, **overrides):
    clear_attention_backend_environment()
    set_random_seed(1234, cuda_graphs=overrides.get("cuda_graph_impl") == "local")
    dtype = dict(bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16) if bf16 else {}
    config = model_config(family, **SHAPE, **dtype, **overrides)
    chunks = build_model_chunks(config, VOCAB, SEQ, DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=distributed_optimizer))
    optimizer, scheduler = build_optimizer(chunks, family, lr=lr, train_iters=steps,
                                           use_distributed_optimizer=distributed_optimizer, bf16=bf16)
    data = itertools.repeat(batch())
    losses = [train_step(data, chunks, optimizer, scheduler, microbatches, BATCH, SEQ)[0] for _ in range(steps)]
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


@pytest.mark.parametrize("family", ["gptplus", "angpt", "ngpt"])
def test_rope_and_swiglu_fusions_train_as_unfused(family, single_process):
    """--rope-fusion (our compiled RoPE: no Transformer Engine here) and --bias-swiglu-fusion (megatron-core's
    compiled SwiGLU, GPT+'s MLP) in training, fp32: the unfused losses, to fp32 round-off."""
    fused, _, _ = train(family, steps=6, apply_rope_fusion=True, bias_activation_fusion=True)
    unfused, _, _ = train(family, steps=6, apply_rope_fusion=False, bias_activation_fusion=False)
    assert all(math.isfinite(loss) for loss in fused) and fused[-1] < fused[0]
    for a, b in zip(fused, unfused):
        assert abs(a - b) <= 1e-5 * abs(b), (fused, unfused)


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


@pytest.fixture
def cuda_graphs_forgotten():
    yield
    delete_cuda_graphs()


@pytest.mark.parametrize("family", ["gptplus", "angpt", "ngpt"])
def test_cuda_graphs_train_as_eager(family, single_process, cuda_graphs_forgotten):
    """--cuda-graph-impl local: megatron-core captures each layer's forward and backward after the first step
    and replays them from then on. Over 6 steps of 2 micro-batches each (graphs reused across micro-batches),
    fp32, the losses are eager's to round-off: the graphs read the weights the optimizer and the projection
    update in place, and the learnable scales; nothing is captured stale."""
    eager, _, _ = train(family, steps=6, microbatches=2)
    graphed, chunks, _ = train(family, steps=6, microbatches=2, cuda_graph_impl="local")
    runners = [runner for module in chunks[0].modules() if hasattr(module, "cudagraph_manager")
               for runner in module.cudagraph_manager.cudagraph_runners]
    assert len(runners) == SHAPE["num_layers"], runners
    assert all(runner.fwd_graph is not None and runner.bwd_graph is not None for runner in runners)
    assert all(math.isfinite(loss) for loss in graphed) and graphed[-1] < graphed[0]
    for a, b in zip(graphed, eager):
        assert abs(a - b) <= 1e-5 * abs(b), (graphed, eager)


def test_cuda_graphs_in_bf16_with_the_distributed_optimizer(single_process, cuda_graphs_forgotten):
    eager, _, _ = train("angpt", steps=8, bf16=True, distributed_optimizer=True)
    graphed, _, _ = train("angpt", steps=8, bf16=True, distributed_optimizer=True, cuda_graph_impl="local")
    # The same kernels in the same order: bf16 rounding cannot differ, only the reductions' order (atomics).
    for a, b in zip(graphed, eager):
        assert abs(a - b) <= 1e-2 * abs(b), (graphed, eager)
