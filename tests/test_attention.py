"""The fused core attention (torch's scaled_dot_product_attention) computes megatron-core's local attention."""

from unittest import mock

import pytest
import torch
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.enums import AttnBackend, AttnMaskType

from angpt.models import attention, build_model, layers, model_config
from angpt.models.attention import (
    FusedDotProductAttention,
    clear_attention_backend_environment,
    fused_rotary_pos_emb,
    uses_fused_attention,
)
from angpt.telemetry.launch_count import compiled_kernels_profiled, kernel_launches

SHAPE = dict(num_layers=2, hidden_size=64, num_attention_heads=4)
VOCAB, SEQ = 128, 32


def test_backend_selection():
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert not uses_fused_attention(AttnBackend.auto, cpu)  # CPU keeps megatron's path by default
    assert uses_fused_attention(AttnBackend.auto, cuda)
    assert uses_fused_attention(AttnBackend.flash, cpu)
    assert not uses_fused_attention(AttnBackend.unfused, cuda)


def run(model, tokens):
    model.zero_grad(set_to_none=True)
    positions = torch.arange(SEQ).unsqueeze(0).expand(tokens.shape[0], -1)
    loss = model(tokens[:, :-1], positions, None, labels=tokens[:, 1:]).float().mean()
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.fixture
def fresh_backend_variables():
    clear_attention_backend_environment()
    yield clear_attention_backend_environment
    clear_attention_backend_environment()


@pytest.mark.parametrize("family,num_query_groups", [("angpt", None), ("gptplus", None), ("gptplus", 2),
                                                     ("ngpt", None)])
def test_fused_attention_equals_megatron_local(seeded, fresh_backend_variables, family, num_query_groups):
    def build(backend):
        fresh_backend_variables()
        extra = {"num_query_groups": num_query_groups} if num_query_groups else {}
        return build_model(model_config(family, **SHAPE, **extra, attention_backend=backend), VOCAB, SEQ)

    unfused, fused = build(AttnBackend.unfused), build(AttnBackend.flash)
    fused.load_state_dict(unfused.state_dict())
    attention = fused.decoder.layers[0].self_attention.core_attention
    assert isinstance(attention, FusedDotProductAttention)

    calls = []
    attention.register_forward_hook(lambda *args: calls.append(1))
    tokens = torch.randint(0, VOCAB, (3, SEQ + 1), generator=torch.Generator().manual_seed(1))
    loss_unfused, grads_unfused = run(unfused, tokens)
    loss_fused, grads_fused = run(fused, tokens)
    assert calls
    torch.testing.assert_close(loss_fused, loss_unfused, rtol=1e-5, atol=1e-6)
    assert grads_fused.keys() == grads_unfused.keys()
    for name, grad in grads_unfused.items():
        torch.testing.assert_close(grads_fused[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    # The fused path really ran: a wrong softmax scale there changes the gradients.
    attention.softmax_scale *= 2
    name = "decoder.layers.0.self_attention.linear_qkv.weight"
    assert not torch.allclose(run(fused, tokens)[1][name], grads_unfused[name], rtol=1e-3)


# The softmax scale each family's attention must apply (docs/model.md, Attention): anGPT and nGPT normalize q
# and k to unit length, so their logits are scaled up by sqrt(h); GPT+ scales by 1/sqrt(h) as a GPT does.
HEAD_DIM = SHAPE["hidden_size"] // SHAPE["num_attention_heads"]
SPEC_SOFTMAX_SCALE = {"angpt": HEAD_DIM**0.5, "ngpt": HEAD_DIM**0.5, "gptplus": HEAD_DIM**-0.5}


def handwritten_attention(query, key, value, scale):
    """softmax(scale * q k^T + causal mask) v per head, for [s, b, heads, h] inputs; [s, b, heads * h] out."""
    q, k, v = (t.permute(1, 2, 0, 3).double() for t in (query, key, value))  # [b, heads, s, h]
    scores = scale * q @ k.transpose(-1, -2)
    causal = torch.ones(scores.shape[-2:], dtype=torch.bool).triu(1)
    probabilities = scores.masked_fill(causal, float("-inf")).softmax(-1)
    out = (probabilities @ v).permute(2, 0, 1, 3)
    return out.reshape(out.shape[0], out.shape[1], -1).float()


@pytest.mark.parametrize("backend", [AttnBackend.unfused, AttnBackend.flash])
@pytest.mark.parametrize("family", list(SPEC_SOFTMAX_SCALE))
def test_core_attention_applies_the_spec_softmax_scale(seeded, fresh_backend_variables, family, backend):
    model = build_model(model_config(family, **SHAPE, attention_backend=backend), VOCAB, SEQ)
    attention = model.decoder.layers[0].self_attention.core_attention
    # Unit-norm q and k, as the normalized families feed them: large enough logits that a wrong scale shows.
    generator = torch.Generator().manual_seed(2)
    query, key, value = torch.randn(3, SEQ, 2, SHAPE["num_attention_heads"], HEAD_DIM, generator=generator)
    query, key = query / query.norm(dim=-1, keepdim=True), key / key.norm(dim=-1, keepdim=True)
    with torch.no_grad():
        out = attention(query, key, value, None)
    expected = handwritten_attention(query, key, value, SPEC_SOFTMAX_SCALE[family])
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)



def spec_rope(t, theta):
    """RoPE as the spec states it, computed independently: the pairs (x_i, x_{i + h/2}) of each head as the
    complex numbers x_i + i x_{i + h/2}, rotated by the angles theta_i of their position."""
    half = t.shape[-1] // 2
    rotated = torch.complex(t[..., :half], t[..., half:]) * torch.polar(torch.ones_like(theta), theta)
    return torch.cat((rotated.real, rotated.imag), dim=-1)


def rope_value_and_grad(rope, t, theta):
    t = t.detach().requires_grad_()
    out = rope(t, theta)
    weights = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)
    return out.detach(), torch.autograd.grad((out * weights).sum(), t)[0]


@pytest.mark.slow
def test_compiled_rope_equals_the_spec_forward_and_backward():
    """The kernel that `--rope-fusion` runs on GPUs without Transformer Engine, compiled here for the CPU (the
    same graph, lowered to C++ instead of Triton): values and gradients equal RoPE as the spec writes it, as
    do those of the eager function it stands in for."""
    generator = torch.Generator().manual_seed(3)
    t = torch.randn(SEQ, 2, 4, HEAD_DIM, generator=generator, dtype=torch.float64)
    theta = torch.rand(SEQ, 1, 1, HEAD_DIM // 2, generator=generator, dtype=torch.float64) * 6.0
    expected, expected_grad = rope_value_and_grad(spec_rope, t, theta)

    def megatron_angles(rope):  # megatron-core passes theta twice along the head dimension, in fp32
        return lambda t, theta: rope(t, torch.cat((theta, theta), dim=-1).float(), False)

    for name, rope in (("compiled", attention._rotary.compiled), ("eager", fused_rotary_pos_emb)):
        out, grad = rope_value_and_grad(megatron_angles(rope), t.float(), theta)
        assert not attention._rotary.compile_failures
        # fp32 angles, cos and sin: a few units of fp32 round-off on values of order one.
        torch.testing.assert_close(out.double(), expected, rtol=0, atol=2e-6, msg=name)
        torch.testing.assert_close(grad.double(), expected_grad, rtol=0, atol=2e-6, msg=name)


def test_rope_fusion_runs_without_transformer_engine(seeded, fresh_backend_variables):
    """`apply_rope_fusion` builds without Transformer Engine (megatron-core refuses it otherwise), and its RoPE
    is ours: the model computes what it computes with megatron-core's unfused RoPE (on the CPU the same
    eager function runs, so bit for bit)."""
    calls = []
    fused = build_model(model_config("gptplus", **SHAPE, apply_rope_fusion=True), VOCAB, SEQ)
    unfused = build_model(model_config("gptplus", **SHAPE), VOCAB, SEQ)
    unfused.load_state_dict(fused.state_dict())
    tokens = torch.randint(0, VOCAB, (2, SEQ + 1), generator=torch.Generator().manual_seed(1))
    with mock.patch.object(attention, "_rotary", wraps=attention._rotary) as rotary:
        loss_fused, grads_fused = run(fused, tokens)
        calls = rotary.call_count
    loss_unfused, grads_unfused = run(unfused, tokens)
    assert calls == 2 * SHAPE["num_layers"]  # q and k of each layer
    assert torch.equal(loss_fused, loss_unfused)
    for name, grad in grads_unfused.items():
        assert torch.equal(grads_fused[name], grad), name


@pytest.mark.slow
def test_rope_fused_with_qk_normalization_equals_the_spec_in_one_kernel_each_way_keeping_nothing_of_its_own():
    """rotary_qk_normalize = (s_qk * Norm(RoPE(q)), s_qk * Norm(RoPE(k))) with s_qk = multiplier * s_hat, the
    kernel of the normalized families' q and k on GPUs (compiled here for the CPU) and its eager form: values and
    gradients equal the spec's RoPE and normalization computed independently in float64. Compiled, q's and k's
    chains and s_qk's multiply are one kernel forward and one backward (a pair each when compiled apart), and it
    keeps for backward the storage of its inputs (views of the qkv projection's output, which attention keeps
    anyway), the angles and s_hat."""
    generator = torch.Generator().manual_seed(4)
    mixed = torch.randn(SEQ, 2, 4, 3 * HEAD_DIM, generator=generator, dtype=torch.float64)  # q, k, v per head
    theta = torch.rand(SEQ, 1, 1, HEAD_DIM // 2, generator=generator, dtype=torch.float64) * 6.0
    multiplier = 4.0  # s_init / s_scale
    s_hat = (0.5 + torch.rand(HEAD_DIM, generator=generator, dtype=torch.float64)) / multiplier
    weights = torch.linspace(-1, 1, SEQ * 2 * 4 * HEAD_DIM, dtype=torch.float64).view(SEQ, 2, 4, HEAD_DIM)

    def value_and_grads(function, mixed, s_hat):
        mixed, s_hat = mixed.detach().requires_grad_(), s_hat.detach().requires_grad_()
        kept = set()

        def pack(tensor):
            if tensor.numel() >= SEQ * 2 * 4 * HEAD_DIM:
                kept.add(tensor.untyped_storage().data_ptr())
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            q, k = function(mixed[..., :HEAD_DIM], mixed[..., HEAD_DIM:2 * HEAD_DIM], s_hat)
        loss = (q * weights.to(q.dtype)).sum() + (k * weights.flip(0).to(k.dtype)).sum()
        grads = torch.autograd.grad(loss, (mixed, s_hat))
        return (q.detach(), k.detach(), *grads), kept, mixed.untyped_storage().data_ptr()

    def spec(q, k, s_hat):
        return tuple(multiplier * s_hat * rotated / rotated.norm(dim=-1, keepdim=True)
                     for rotated in (spec_rope(q, theta), spec_rope(k, theta)))

    expected, _, _ = value_and_grads(spec, mixed, s_hat)
    angles = torch.cat((theta, theta), dim=-1).float()  # as megatron-core passes them

    def run():
        return value_and_grads(lambda q, k, s: layers.rotary_qk_normalize(q, k, angles, angles, s, multiplier, False),
                               mixed.float(), s_hat.float())

    eager, _, _ = run()  # the CPU's path
    with compiled_kernels_profiled():  # the GPU's
        (compiled, kept, mixed_storage), launches = run(), kernel_launches(run)
    assert not layers.rotary_qk_normalize.compile_failures
    for name, results in (("eager", eager), ("compiled", compiled)):
        for computed, reference in zip(results, expected):  # fp32: a few units of round-off on values of order 1
            torch.testing.assert_close(computed.double(), reference, rtol=0, atol=1e-5, msg=name)
    assert kept == {mixed_storage}
    assert launches["compiled kernel"] == 2, launches


@pytest.mark.parametrize("family", ["angpt", "ngpt"])
def test_normalized_attention_applies_rope_in_its_core_attention(family, seeded):
    """NormalizedSelfAttention hands RoPE to its core attention, which applies it with the QK normalization
    (q and k together, once per layer): the model computes what it computes with megatron-core's RoPE
    between the two (bit for bit on the CPU, where the same eager functions run), and no angles are left
    behind on the module after a forward pass."""
    model = build_model(model_config(family, **SHAPE), VOCAB, SEQ)
    tokens = torch.randint(0, VOCAB, (2, SEQ + 1), generator=torch.Generator().manual_seed(2))
    with mock.patch.object(layers, "rotary_qk_normalize", wraps=layers.rotary_qk_normalize) as fused:
        loss, grads = run(model, tokens)
    assert fused.call_count == SHAPE["num_layers"]
    assert all(layer.self_attention.core_attention.rotary_pos_emb is None for layer in model.decoder.layers)
    with mock.patch.object(layers.NormalizedSelfAttention, "forward", SelfAttention.forward):
        loss_megatron, grads_megatron = run(model, tokens)
    assert torch.equal(loss, loss_megatron)
    for name, grad in grads_megatron.items():
        assert torch.equal(grads[name], grad), name


@pytest.mark.parametrize("cp_comm_type", [None, "p2p", "a2a"])
def test_local_attention_under_context_parallelism_is_all_gather_only(cp_comm_type):
    """megatron-core's default exchange (p2p) is Transformer Engine's: the local spec refuses it by name."""
    config = model_config("angpt", num_layers=1, hidden_size=32, num_attention_heads=2, context_parallel_size=2,
                          cp_comm_type=cp_comm_type)
    with pytest.raises(ValueError, match="pass --cp-comm-type all_gather, or use --transformer-impl"):
        FusedDotProductAttention(config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self",
                                 cp_comm_type=cp_comm_type)
