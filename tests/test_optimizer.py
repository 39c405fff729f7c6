"""Each family's optimizer and the effective learning rates of the scales (docs/model.md, Optimizer and
schedule; Learnable scales)."""

import importlib
import math

import pytest
import torch
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.optimizer import clip_grads
from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32
from megatron.core.utils import local_multi_tensor_l2_norm

from angpt.config.sections import RunConfig
from angpt.megatron_compat import patches
from angpt.models import model_config
from angpt.models.scales import LearnableScale
from angpt.training import distributed
from angpt.training.optimizer import build_optimizer, recipe_departures
from angpt.training.step import build_model_chunks, step_unless_not_finite, train_step

V, S, MB = 128, 16, 2


def tiny_chunks(family, **overrides):
    config = model_config(family, num_layers=2, hidden_size=64, num_attention_heads=4, **overrides)
    return build_model_chunks(config, V, S)


def run_config(family, **flags) -> RunConfig:
    """The run's configuration of these flags (no validation), for build_optimizer."""
    return RunConfig.from_flags(dict(model_family=family, **flags))


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
    optimizer, scheduler = build_optimizer(chunks, run_config(family, lr=lr, train_iters=10, adam_eps=1e-15))
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
    optimizer, _ = build_optimizer(chunks, run_config("gptplus", lr=1e-3, train_iters=1000))
    decay = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            decay[id(param)] = group["weight_decay"]
    for name, param in chunks[0].module.named_parameters():
        assert decay[id(param)] == (0.1 if param.dim() == 2 else 0.0), name


@pytest.mark.parametrize("style", ["linear", "cosine"])
def test_a_weight_decay_schedule_goes_from_start_to_end_over_the_training(style, seeded):
    """--weight-decay-incr-style (Megatron-LM's: over --train-iters, whatever --lr-decay-iters): the decayed groups'
    weight decay after k of 10 steps is start + (end - start) c, c = k / 10 (linear) or (1 - cos(pi k / 10)) / 2
    (cosine), computed here; the undecayed groups (1-D parameters) stay at 0."""
    chunks = tiny_chunks("gptplus")
    optimizer, scheduler = build_optimizer(chunks, run_config(
        "gptplus", lr=1e-3, train_iters=10, lr_decay_iters=4, weight_decay_incr_style=style, start_weight_decay=0.02,
        end_weight_decay=0.1))
    for k in range(11):
        ratio = k / 10 if style == "linear" else (1 - math.cos(math.pi * k / 10)) / 2
        expected = 0.02 + (0.1 - 0.02) * ratio
        assert sorted({group["weight_decay"] for group in optimizer.param_groups}) == pytest.approx([0.0, expected]), k
        if k < 10:
            scheduler.step(1)


@pytest.mark.parametrize(
    "family, first_lr, last_lr",
    [("angpt", 1e-2, 1e-3), ("ngpt", 1e-2, 0.0), ("gptplus", 1e-2 / 10, 1e-3)],
)
def test_schedules(family, first_lr, last_lr, seeded):
    """anGPT and nGPT start at full lr (no warm-up); GPT+ warms up over 1% of steps; cosine to min_lr."""
    chunks = tiny_chunks(family)
    optimizer, scheduler = build_optimizer(chunks, run_config(family, lr=1e-2, train_iters=1000))
    scheduler.step(1)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(first_lr, rel=1e-4)
    scheduler.step(999)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(last_lr, abs=1e-12)
    weight_decays = {group["weight_decay"] for group in optimizer.param_groups}
    assert weight_decays == ({0.0, 0.1} if family == "gptplus" else {0.0})


def _two_identical_runs(family, use_distributed_optimizer, fused_adam):
    """Two copies of one tiny model, each with its optimizer: the first with `fused_adam`, the second
    with torch's fused Adam."""
    runs = []
    for fused in (fused_adam, True):
        distributed.set_random_seed(1234)
        chunks = build_model_chunks(model_config(family, num_layers=2, hidden_size=64, num_attention_heads=4), V, S,
                                    DistributedDataParallelConfig(grad_reduce_in_fp32=True,
                                                                  use_distributed_optimizer=use_distributed_optimizer))
        config = run_config(family, lr=1e-2, train_iters=10, use_distributed_optimizer=use_distributed_optimizer)
        runs.append((chunks, *build_optimizer(chunks, config, fused_adam=fused)))
    return runs


def _torch_adams(optimizer):
    return [inner.optimizer for inner in getattr(optimizer, "chained_optimizers", [optimizer])]


@pytest.mark.parametrize("family, use_distributed_optimizer", [("angpt", False), ("gptplus", True)])
def test_fused_adam_steps_as_foreach_adam(family, use_distributed_optimizer, seeded, monkeypatch):
    """Three steps of torch's fused AdamW (one kernel) and of its foreach AdamW (CPU default), on the same
    gradients: the same parameters and Adam states up to fp32 rounding. Gradients are drawn, the same for both,
    so that the comparison is of the optimizers' arithmetic, not of the model's sensitivity to last bits."""
    fused_calls = []
    adam_module = importlib.import_module("torch.optim.adam")  # torch.optim's namespace hides the module
    real_fused = adam_module._fused_adam
    monkeypatch.setattr(adam_module, "_fused_adam", lambda *a, **k: fused_calls.append(1) or real_fused(*a, **k))
    runs = _two_identical_runs(family, use_distributed_optimizer, fused_adam=False)
    generator = torch.Generator().manual_seed(0)
    for _ in range(3):
        grads = [torch.randn(p.shape, generator=generator) for p in runs[0][0][0].parameters()]
        for chunks, optimizer, scheduler in runs:
            for param, grad in zip(chunks[0].parameters(), grads):
                param.main_grad.copy_(grad)
            assert step_unless_not_finite(optimizer, 0.0)[0]
            scheduler.step(increment=1)
    assert fused_calls, "the fused kernel never ran"
    foreach, fused = (_torch_adams(optimizer) for _, optimizer, _ in runs)
    assert all(group["fused"] for adam in fused for group in adam.param_groups)
    assert not any(group["fused"] for adam in foreach for group in adam.param_groups)
    # Each step's update (at most lr in size) is rounded differently by a few fp32 ulps; three steps.
    for param_a, param_b in zip(runs[0][0][0].parameters(), runs[1][0][0].parameters()):
        torch.testing.assert_close(param_b, param_a, rtol=3 * 4 * 2**-24, atol=3 * 4 * 1e-2 * 2**-24)
    for adam_a, adam_b in zip(foreach, fused):
        for group_a, group_b in zip(adam_a.param_groups, adam_b.param_groups):
            for param_a, param_b in zip(group_a["params"], group_b["params"]):
                state_a, state_b = adam_a.state[param_a], adam_b.state[param_b]
                assert state_b["step"].item() == state_a["step"].item() == 3
                for key in ("exp_avg", "exp_avg_sq"):
                    torch.testing.assert_close(state_b[key], state_a[key], rtol=3 * 4 * 2**-24, atol=0)


def test_fused_adam_survives_loading_a_foreach_state(seeded):
    """A state dict saved by a foreach run restores the saved groups' settings: fused again after the load."""
    (chunks, foreach, _), (_, fused, _) = _two_identical_runs("angpt", False, fused_adam=False)
    for param in chunks[0].parameters():
        param.main_grad.fill_(1.0)
    step_unless_not_finite(foreach, 0.0)
    fused.load_state_dict(foreach.state_dict())
    for adam in _torch_adams(fused):
        assert adam.state
        for group in adam.param_groups:
            assert group["fused"] and not group["foreach"]
            for param in group["params"]:
                assert adam.state[param]["step"].device == param.device
                assert adam.state[param]["step"].item() == 1


def _drawn_main_grads(chunks, seed=0):
    generator = torch.Generator().manual_seed(seed)
    grads = {}
    for name, param in chunks[0].named_parameters():
        grads[name] = torch.randn(param.shape, generator=generator)
        param.main_grad.copy_(grads[name])
    return grads


@pytest.mark.parametrize("family", ["angpt", "gptplus"])
def test_foreach_grad_norm_and_clipping_equal_megatrons(family, seeded, monkeypatch):
    """The grad norm of megatron's optimizer through the foreach fallback (angpt.megatron_compat.patches) equals
    megatron's own fallback and the norm of all gradients as one vector; clipping scales every gradient by
    max_norm / (norm + 1e-6), megatron's coefficient."""
    assert clip_grads.l2_norm_impl is patches.foreach_l2_norm  # installed by angpt.training.distributed.initialize
    chunks = tiny_chunks(family)
    optimizer, _ = build_optimizer(chunks, run_config(family, lr=1e-3, train_iters=10, clip_grad=1.0))
    grads = _drawn_main_grads(chunks)
    assert not optimizer.prepare_grads()
    norm = optimizer.get_grad_norm()
    expected = torch.linalg.vector_norm(torch.cat([g.double().flatten() for g in grads.values()])).item()
    # fp32 sums of squares in a different order: relative error ~ log2(numel) * 2**-24.
    assert norm == pytest.approx(expected, rel=1e-5)
    with monkeypatch.context() as original:
        original.setattr(clip_grads, "l2_norm_impl", local_multi_tensor_l2_norm)
        assert norm == pytest.approx(optimizer.get_grad_norm(), rel=1e-5)
    assert norm > 10  # so that clipping scales
    clip_grad_by_total_norm_fp32(optimizer.get_parameters(), 1.0, norm)
    for name, param in chunks[0].named_parameters():
        torch.testing.assert_close(param.grad, grads[name] * (1.0 / (norm + 1e-6)), rtol=2**-23, atol=0, msg=name)


def _host_reads(function) -> int:
    """How many times `function()` reads a tensor's value back to the host (.item(), float(), torch.tensor of
    tensors...): each is a device sync on a GPU. The profiler sees the reads below torch's dispatcher too."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        function()
    return sum(event.name == "aten::_local_scalar_dense" for event in profile.events())


@pytest.mark.parametrize("use_distributed_optimizer", [False, True])
def test_the_grad_norm_and_clipping_read_the_device_once(use_distributed_optimizer, seeded, monkeypatch):
    """With the foreach grad norm, the step up to the update (gradients prepared, their norm, clipping) reads
    one value back (the norm) whatever the number of parameters, where megatron's fallback reads one per
    parameter. The update itself is torch's: fused Adam keeps its step counters on the device (on the CPU its
    kernel reads each one, in host memory)."""
    (chunks, optimizer, _), (other_chunks, other, _) = _two_identical_runs("gptplus", use_distributed_optimizer,
                                                                           fused_adam=False)
    parameters = len(list(chunks[0].parameters()))
    for megatron_optimizer, model_chunks in ((optimizer, chunks), (other, other_chunks)):
        for inner in getattr(megatron_optimizer, "chained_optimizers", [megatron_optimizer]):
            monkeypatch.setattr(inner, "step_with_ready_grads", lambda: True)
        _drawn_main_grads(model_chunks)
    assert _host_reads(lambda: step_unless_not_finite(optimizer, 0.0)) == 1
    monkeypatch.setattr(clip_grads, "l2_norm_impl", local_multi_tensor_l2_norm)
    assert _host_reads(lambda: step_unless_not_finite(other, 0.0)) > parameters


def test_foreach_scale_writes_source_times_scale_into_target():
    """megatron's multi_tensor_scale contract, dst = src * scale, for separate lists as for clipping's one list."""
    sources, targets = [torch.ones(3), torch.full((2, 2), 2.0)], [torch.zeros(3), torch.zeros(2, 2)]
    patches.foreach_scale(0, None, [sources, targets], 0.5)
    for source, target in zip(sources, targets):
        torch.testing.assert_close(target, source * 0.5)
    patches.foreach_scale(0, None, [sources, sources], 0.5)
    torch.testing.assert_close(sources[1], torch.full((2, 2), 1.0))


def test_a_recipe_flag_departing_from_the_familys_recipe_is_said_and_the_recipes_own_value_is_not():
    assert recipe_departures("angpt", 0.1, None, None) == [
        "--weight-decay 0.1 departs from anGPT's recipe, no weight decay (docs/model.md)"]
    assert recipe_departures("ngpt", None, 5, 0.0) == [
        "--lr-warmup-iters 5 departs from nGPT's recipe, no warm-up (docs/model.md)"]
    assert recipe_departures("gptplus", 0.0, None, 0.001) == [
        "--weight-decay 0 departs from GPT+'s recipe, weight decay 0.1 (docs/model.md)",
        "--lr-warmup-fraction 0.001 departs from GPT+'s recipe, a warm-up of 0.01 of the decay (docs/model.md)"]
    # The recipe's own values, given explicitly or left out, depart from nothing.
    assert recipe_departures("angpt", 0.0, 0, 0.0) == recipe_departures("gptplus", 0.1, None, 0.01) == []
