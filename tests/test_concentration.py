"""Concentration of norms at initialization (docs/model.md, Normalization factors), watched through the
model's own modules."""

import statistics

import torch

from angpt.models import build_model, model_config

D, LAYERS, HEAD_DIM, VOCAB, SEQ, BATCH = 256, 8, 64, 1024, 128, 4


def mean_norm(x: torch.Tensor, width: int) -> float:
    return x.detach().reshape(-1, width).norm(dim=-1).mean().item()


def measure(family: str, **overrides) -> dict[str, list[float]]:
    """Mean norm of each watched intermediate, per layer, for random tokens."""
    config = model_config(family, num_layers=LAYERS, hidden_size=D, num_attention_heads=D // HEAD_DIM, **overrides)
    model = build_model(config, VOCAB, SEQ)
    norms: dict[str, list[float]] = {}

    def record(name, value):
        norms.setdefault(name, []).append(value)

    def watch(module, fn):
        module.register_forward_hook(lambda mod, args, out: fn(out))

    for layer in model.decoder.layers:
        if config.normalized:
            attention, mlp = layer.self_attention, layer.mlp

            def unscaled(nu):
                # A factor that the post-norm cancels, or that the fused SwiGLU applies, is applied after
                # the hooked output.
                return nu.value if nu.fused or nu.cancelled else 1.0

            def qkv(out, nu=attention.linear_qkv.nu):
                per_head = (out[0] * unscaled(nu)).reshape(SEQ, BATCH, -1, 3, HEAD_DIM)  # [q, k, v] per group
                for i, name in enumerate("qkv"):
                    record(name, mean_norm(per_head[..., i, :], HEAD_DIM))

            def uz(out, nu=mlp.linear_fc1.nu):
                u, z = (out[0] * unscaled(nu)).chunk(2, dim=-1)
                record("u", mean_norm(u, u.shape[-1]))
                record("z", mean_norm(z, z.shape[-1]))

            watch(attention.linear_qkv, qkv)
            watch(mlp.linear_fc1, uz)
            watch(mlp.nu_acf, lambda out: record("swiglu", mean_norm(out, out.shape[-1])))
            watch(mlp.linear_fc2,
                  lambda out, nu=mlp.linear_fc2.nu: record("W_d out", mean_norm(out[0] * unscaled(nu), D)))
            watch(attention.linear_proj,
                  lambda out, nu=attention.linear_proj.nu: record("W_p out", mean_norm(out[0] * unscaled(nu), D)))
        watch(layer, lambda out: record("residual", mean_norm(out[0], D)))
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(tokens, torch.arange(SEQ).unsqueeze(0).expand(BATCH, -1), None)
    return norms


def test_angpt_intermediates_and_residual_stay_near_unit_norm(seeded):
    norms = measure("angpt")
    for name in ("q", "k", "v", "u", "z", "swiglu", "W_d out", "residual"):
        assert len(norms[name]) == LAYERS
        worst = max(norms[name], key=lambda value: abs(value - 1))
        print(f"{name:>9}: " + " ".join(f"{value:.3f}" for value in norms[name]))
        assert abs(worst - 1) < 0.15, (name, norms[name])
    # Near-uniform attention averages the values, so W_p's output sits below 1; the post-norm absorbs it.
    print("  W_p out: " + " ".join(f"{value:.3f}" for value in norms["W_p out"]) + " (reported, not asserted)")


def test_without_constant_factors_the_intermediates_do_not_concentrate(seeded):
    norms = measure("angpt", constant_factors="one")
    for name in ("q", "k", "v", "u", "z", "swiglu", "W_d out"):
        print(f"{name:>9}: {statistics.mean(norms[name]):.3f}")
        assert all(abs(value - 1) > 0.15 for value in norms[name]), (name, norms[name])


def test_gptplus_residual_norm_grows_with_depth(seeded):
    residual = measure("gptplus")["residual"]
    print("GPT+ residual: " + " ".join(f"{value:.3f}" for value in residual))
    assert all(later > earlier for earlier, later in zip(residual, residual[1:]))
    assert residual[-1] > 1.5 * residual[0]
