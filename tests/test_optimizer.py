"""Each family's optimizer and the effective learning rates of the scales (docs/model.md, Optimizer and
schedule; Learnable scales)."""

import pytest
import torch

from angpt.models import model_config
from angpt.models.scales import LearnableScale
from angpt.optimizer import build_optimizer
from angpt.step import build_model_chunks, train_step

V, S, MB = 128, 16, 2


def tiny_chunks(family, **overrides):
    config = model_config(family, num_layers=2, hidden_size=64, num_attention_heads=4, **overrides)
    return build_model_chunks(config, V, S)


def batch(seed=0):
    tokens = torch.randint(0, V, (MB, S + 1), generator=torch.Generator().manual_seed(seed))
    return dict(tokens=tokens[:, :-1], labels=tokens[:, 1:], loss_mask=torch.ones(MB, S),
                position_ids=torch.arange(S).unsqueeze(0).expand(MB, -1))


# The table of docs/model.md, Learnable scales, at d = 64: (initial value s_init, effective lr factor
# s_init / s_scale). Written out here, not read from the modules, so that a wrong s_init or s_scale fails.
D = 64
SPEC_SCALES = {
    "angpt": {"alpha": (0.01, 0.01 * D**0.5), "s_qk": (1.0, D**0.5), "logit_scale": (1.0, D**0.5),
              "s_u": (1.0, 1.0), "s_v": (1.0, 1.0)},
    "ngpt": {"alpha": (0.05, 0.05 * D**0.5), "s_qk": (1.0, D**0.5), "logit_scale": (1.0, D**0.5),
             "s_u": (1.0, 1.0), "s_v": (1.0, 1.0)},
}


@pytest.mark.parametrize("family", ["angpt", "ngpt"])
def test_one_adam_step_moves_each_scale_by_its_effective_lr(family, seeded):
    lr = 1e-3
    chunks = tiny_chunks(family)
    # Adam's first step is lr * g / (|g| + eps); a tiny eps makes it lr * sign(g) for these gradients.
    optimizer, scheduler = build_optimizer(chunks, family, lr=lr, train_iters=10, adam_eps=1e-15)
    scales = {name: module for name, module in chunks[0].module.named_modules() if isinstance(module, LearnableScale)}
    kinds = {name: name.rsplit(".", 1)[-1] for name in scales}
    assert set(kinds.values()) == set(SPEC_SCALES[family])
    before = {name: module().detach().clone() for name, module in scales.items()}
    for name, value in before.items():
        torch.testing.assert_close(value, torch.full_like(value, SPEC_SCALES[family][kinds[name]][0]), msg=name)
    train_step(iter([batch()]), chunks, optimizer, scheduler, 1, MB, S)
    for name, module in scales.items():
        assert module.s_hat.dtype == torch.float32
        expected = lr * SPEC_SCALES[family][kinds[name]][1]
        grad = module.s_hat.main_grad
        moved = (module().detach() - before[name]).abs()
        clear = grad.abs() > 1e-10
        assert clear.any(), name
        torch.testing.assert_close(moved[clear], torch.full_like(moved[clear], expected), rtol=1e-3, atol=0, msg=name)


def test_weight_decay_reaches_two_dimensional_weights_only(seeded):
    chunks = tiny_chunks("gptplus")
    optimizer, _ = build_optimizer(chunks, "gptplus", lr=1e-3, train_iters=1000)
    decay = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            decay[id(param)] = group["weight_decay"]
    for name, param in chunks[0].module.named_parameters():
        assert decay[id(param)] == (0.1 if param.dim() == 2 else 0.0), name


@pytest.mark.parametrize(
    "family, first_lr, last_lr",
    [("angpt", 1e-2, 1e-3), ("ngpt", 1e-2, 0.0), ("gptplus", 1e-2 / 10, 1e-3)],
)
def test_schedules(family, first_lr, last_lr, seeded):
    """anGPT and nGPT start at full lr (no warm-up); GPT+ warms up over 1% of steps; cosine to min_lr."""
    chunks = tiny_chunks(family)
    optimizer, scheduler = build_optimizer(chunks, family, lr=1e-2, train_iters=1000)
    scheduler.step(1)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(first_lr, rel=1e-4)
    scheduler.step(999)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(last_lr, abs=1e-12)
    weight_decays = {group["weight_decay"] for group in optimizer.param_groups}
    assert weight_decays == ({0.0, 0.1} if family == "gptplus" else {0.0})
