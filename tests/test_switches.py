"""Each choice made where the paper is silent and each ablation it measured (docs/model.md, Families and
switches) is a switch that does what it says."""

import math

import pytest
import torch

from angpt.models import build_model, model_config
from angpt.models.factors import nu_alpha
from angpt.models.layers import NormalizedResidual

SHAPE = dict(num_layers=2, hidden_size=64, num_attention_heads=4)


def config(family="angpt", **overrides):
    return model_config(family, **SHAPE, **overrides)


def unit_vectors(*shape, seed=0):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
    return x / x.norm(dim=-1, keepdim=True)


def test_constant_factor_switches():
    base = config().normalization_factors().as_dict()
    for multiplier in (0.5, 2.0):
        scaled = config(constant_factor_multiplier=multiplier).normalization_factors().as_dict()
        assert scaled == pytest.approx({k: multiplier * v for k, v in base.items()})
    assert set(config(constant_factors="one").normalization_factors().as_dict().values()) == {1.0}
    assert config(nu_p_reading="sqrt_h_over_d").normalization_factors().nu_p == pytest.approx(math.sqrt(16 / 64))
    assert config().normalization_factors().nu_p == 1.0


def test_exact_factors_normalize_each_head_and_each_half(seeded):
    model = build_model(config(constant_factors="exact"), 128, 16)
    seen = {}
    layer = model.decoder.layers[0]
    layer.self_attention.linear_qkv.register_forward_hook(lambda m, a, out: seen.__setitem__("qkv", out[0]))
    layer.mlp.linear_fc1.register_forward_hook(lambda m, a, out: seen.__setitem__("uz", out[0]))
    layer.mlp.nu_acf.register_forward_hook(lambda m, a, out: seen.__setitem__("a", out))
    tokens = torch.randint(0, 128, (2, 16))
    model(tokens, torch.arange(16).unsqueeze(0).expand(2, -1), None)
    heads = seen["qkv"].reshape(16, 2, -1, 16).norm(dim=-1)
    torch.testing.assert_close(heads, torch.ones_like(heads))
    for half in seen["uz"].chunk(2, dim=-1):
        torch.testing.assert_close(half.norm(dim=-1), torch.ones(16, 2))
    torch.testing.assert_close(seen["a"].norm(dim=-1), torch.ones(16, 2))


def residual(single_process_config, h, x):
    module = NormalizedResidual(single_process_config)
    return module, module(h, x)


@pytest.fixture
def vectors():
    return unit_vectors(8, 2, 64, seed=1), unit_vectors(8, 2, 64, seed=2)


def test_residual_switches(vectors, seeded):
    h, x = vectors
    module, out = residual(config(), h, x)
    alpha = module.alpha()
    assert alpha.detach() == pytest.approx(torch.full((64,), 0.01))
    lerp = h + alpha * (x - h)
    torch.testing.assert_close(out, nu_alpha(alpha) * lerp)
    torch.testing.assert_close(residual(config(nu_alpha_multiplier=2.0), h, x)[1], 2 * nu_alpha(alpha) * lerp)
    torch.testing.assert_close(residual(config(nu_alpha_mode="one"), h, x)[1], lerp)
    exact = residual(config(nu_alpha_mode="exact"), h, x)[1]
    torch.testing.assert_close(exact.norm(dim=-1), torch.ones(8, 2))
    plain_module, plain = residual(config(residual="plain"), h, x)
    assert not hasattr(plain_module, "alpha")
    torch.testing.assert_close(plain, (h + x) / math.sqrt(2))
    alpha_init = residual(config(alpha_init=0.2), h, x)[0].alpha()
    assert alpha_init.detach() == pytest.approx(torch.full((64,), 0.2))


def test_nu_alpha_gradient_switch(vectors, seeded):
    h, x = vectors
    grads = {}
    for flows in (True, False):
        module, out = residual(config(nu_alpha_grad=flows), h, x)
        out.sum().backward()
        grads[flows] = module.alpha.s_hat.grad.clone()
    alpha = torch.full((64,), 0.01, requires_grad=True)
    by_hand = (nu_alpha(alpha).detach() * (h + alpha * (x - h))).sum()
    (expected,) = torch.autograd.grad(by_hand, alpha)
    scale = 0.01 / (1 / 8)  # d alpha / d s_hat = s_init / s_scale
    torch.testing.assert_close(grads[False], expected * scale)
    assert not torch.allclose(grads[True], grads[False])


def test_ngpt_uses_the_absolute_alpha_and_exact_normalization(vectors, seeded):
    h, x = vectors
    module = NormalizedResidual(config("ngpt"))
    assert module.alpha().detach() == pytest.approx(torch.full((64,), 0.05))
    with torch.no_grad():
        module.alpha.s_hat.neg_()
    out = module(h, x)
    expected = h + 0.05 * (x - h)
    torch.testing.assert_close(out, expected / expected.norm(dim=-1, keepdim=True))


def test_post_norm_switch(vectors):
    """The residual update normalizes the sub-block's output x (the post-norm), or with post_norm "none" not."""
    h, x = vectors
    for post_norm, x_used in (("l2", x / x.norm(dim=-1, keepdim=True)), ("none", x)):
        module = NormalizedResidual(config(post_norm=post_norm))
        alpha = module.alpha().detach()
        expected = (h + alpha * (x_used - h)) / torch.sqrt((1 - alpha) ** 2 + alpha**2)
        torch.testing.assert_close(module(h, 3 * x if post_norm == "l2" else x), expected)


ABLATIONS = {
    "default": {},
    "post-norm none": dict(post_norm="none"),
    "nu_p sqrt(h/d)": dict(nu_p_reading="sqrt_h_over_d"),
    "constant factors off": dict(constant_factors="one"),
    "all factors off": dict(constant_factors="one", nu_alpha_mode="one"),
    "nu(alpha) off": dict(nu_alpha_mode="one"),
    "every factor exact": dict(constant_factors="exact", nu_alpha_mode="exact"),
    "constant factors x0.5": dict(constant_factor_multiplier=0.5),
    "constant factors x2": dict(constant_factor_multiplier=2.0),
    "nu(alpha) x0.5": dict(nu_alpha_multiplier=0.5),
    "nu(alpha) x2": dict(nu_alpha_multiplier=2.0),
    "plain residual": dict(residual="plain"),
    "alpha 0.05": dict(alpha_init=0.05),
    "nu(alpha) without gradient": dict(nu_alpha_grad=False),
    "tied embeddings": dict(share_embeddings_and_output_weights=True),
}


@pytest.mark.parametrize("name", list(ABLATIONS))
def test_every_switch_trains(name, seeded):
    model = build_model(config(**ABLATIONS[name]), 128, 16)
    tokens = torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(0))
    loss = model(tokens[:, :-1], torch.arange(16).unsqueeze(0).expand(2, -1), None, labels=tokens[:, 1:]).mean()
    loss.backward()
    assert math.isfinite(loss.item())
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_tied_embeddings_use_the_embedding_as_the_head(seeded):
    model = build_model(config(share_embeddings_and_output_weights=True), 128, 16)
    assert model.output_layer.weight is None
    assert model.shared_embedding_or_output_weight() is model.embedding.word_embeddings.weight


def test_scales_stay_fp32_in_a_bf16_model(seeded):
    model = build_model(config(), 128, 16).bfloat16()
    scales = [p for n, p in model.named_parameters() if n.endswith("s_hat")]
    assert scales and all(p.dtype == torch.float32 for p in scales)
    assert model.embedding.word_embeddings.weight.dtype == torch.bfloat16
    tokens = torch.randint(0, 128, (2, 17))
    loss = model(tokens[:, :-1], torch.arange(16).unsqueeze(0).expand(2, -1), None, labels=tokens[:, 1:]).mean()
    loss.backward()
    assert math.isfinite(loss.item()) and all(p.grad.dtype == torch.float32 for p in scales)


def test_invalid_switch_values_are_refused():
    with pytest.raises(ValueError, match="constant_factors"):
        config(constant_factors="sometimes")
    with pytest.raises(ValueError, match="model family"):
        model_config("gpt5", **SHAPE)
    with pytest.raises(TypeError, match="unknown model config fields"):
        config(alpha_start=0.1)


def nu_scales(model):
    layer = model.decoder.layers[0]
    return {name: getattr(getattr(layer, block), child).nu for name, block, child in (
        ("nu_qkv", "self_attention", "linear_qkv"), ("nu_p", "self_attention", "linear_proj"),
        ("nu_uz", "mlp", "linear_fc1"), ("nu_d", "mlp", "linear_fc2"))}


def loss_and_grads(model):
    tokens = torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(0))
    loss = model(tokens[:, :-1], torch.arange(16).unsqueeze(0).expand(2, -1), None, labels=tokens[:, 1:]).mean()
    return [loss, *torch.autograd.grad(loss, list(model.parameters()))]


@pytest.mark.parametrize("post_norm", ["l2", "none"])
def test_factors_are_skipped_exactly_where_a_normalization_cancels_them(post_norm, seeded):
    # A multiplier that makes every factor a non-power of two (nu_p included: sqrt(h/d)).
    model = build_model(config(post_norm=post_norm, nu_p_reading="sqrt_h_over_d", constant_factor_multiplier=1.3),
                        128, 16)
    scales = nu_scales(model)
    expected = {"nu_qkv", "nu_p", "nu_d"} if post_norm == "l2" else set()
    assert {name for name, nu in scales.items() if nu.cancelled} == expected
    assert not model.decoder.layers[0].mlp.nu_acf.cancelled
    x = torch.randn(4, 64)
    for nu in scales.values():
        applied = x if nu.cancelled or nu.fused else x * nu.value
        assert torch.equal(nu(x), applied)
    as_built = loss_and_grads(model)
    for layer in model.decoder.layers:  # skip (l2) or apply (none) the three factors, the other way round
        for nu in (layer.self_attention.linear_qkv.nu, layer.self_attention.linear_proj.nu, layer.mlp.linear_fc2.nu):
            nu.cancelled = post_norm == "none"
    switched = loss_and_grads(model)
    if post_norm == "l2":
        for a, b in zip(as_built, switched):  # fp32 roundings through two layers
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    else:  # the factors carry load: skipping them changes the loss (by 4e-4 here), far past fp32 rounding
        assert abs(as_built[0].item() - switched[0].item()) > 1e-4


@pytest.mark.parametrize("overrides", [dict(constant_factors="exact"), dict(constant_factor_multiplier=-1.0)])
def test_no_factor_is_skipped_where_it_does_not_cancel(overrides, seeded):
    assert not any(nu.cancelled for nu in nu_scales(build_model(config(**overrides), 128, 16)).values())
