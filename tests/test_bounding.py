"""Bounded weights (docs/model.md, Bounding) and nGPT's normalized weights, in one process.

The multi-process equality of tensor-parallel and distributed-optimizer bounding with single-process
bounding is in test_parallel_equivalence.py."""

import pytest
import torch
from megatron.core.optimizer import OptimizerConfig
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params, FP32Optimizer
from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes
from megatron.core.timers import Timers
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from angpt.config.sections import RunConfig
from angpt.models import build_model, model_config
from angpt.models.bounding import (
    _Piece,
    _project,
    all_reduce_in_place,
    attach_weight_constraint,
    constrained_parameters,
    project_parameters_,
    split_over_tp,
)
from angpt.training.megatron_configs import ddp_config, transformer_config
from angpt.training.optimizer import build_optimizer
from angpt.training.step import build_model_chunks, train_step


def weight(rows, cols, unit_norm_dim, seed=0):
    generator = torch.Generator().manual_seed(seed)
    factors = torch.empty(rows, 1).uniform_(0.2, 3.0, generator=generator)
    param = torch.nn.Parameter(torch.randn(rows, cols, generator=generator) / cols**0.5 * factors)
    param.unit_norm_dim = unit_norm_dim
    return param


@pytest.mark.parametrize("unit_norm_dim", [0, 1])
@pytest.mark.parametrize("mode", ["bound", "normalize"])
def test_pieces_cut_anywhere_give_the_whole_weight_projection(unit_norm_dim, mode, single_process):
    """A weight cut into runs at arbitrary points (as distributed-optimizer shards cut it) is projected
    exactly as when whole."""
    whole = weight(13, 7, unit_norm_dim)
    cut = torch.nn.Parameter(whole.detach().clone())
    cut.unit_norm_dim = unit_norm_dim
    _project([whole], [_Piece(whole.data.view(-1), whole, 0)], mode)
    flat = cut.data.view(-1)
    bounds = [0, 3, 4, 11, 30, 31, 58, 91]  # partial rows, whole rows, single elements
    pieces = [_Piece(flat[a:b], cut, a) for a, b in zip(bounds, bounds[1:])]
    _project([cut], pieces, mode)
    assert torch.equal(cut.data, whole.data)
    norms = whole.data.norm(dim=unit_norm_dim)
    if mode == "normalize":
        torch.testing.assert_close(norms, torch.ones_like(norms))


def test_bounding_leaves_rows_inside_the_ball_untouched(single_process):
    param = weight(50, 32, 1)
    before = param.data.clone()
    inside = before.norm(dim=1) <= 1
    assert inside.any() and (~inside).any()
    _project([param], [_Piece(param.data.view(-1), param, 0)], "bound")
    assert torch.equal(param.data[inside], before[inside])
    torch.testing.assert_close(param.data[~inside].norm(dim=1), torch.ones(int((~inside).sum())))
    # Projected rows keep their direction.
    cosine = torch.nn.functional.cosine_similarity(param.data[~inside], before[~inside], dim=1)
    torch.testing.assert_close(cosine, torch.ones_like(cosine))


@pytest.mark.parametrize("family", ["angpt", "ngpt"])
def test_weights_start_on_the_unit_sphere(family, seeded):
    model = build_model(model_config(family, num_layers=2, hidden_size=64, num_attention_heads=4), 128, 16)
    params = constrained_parameters([model])
    # Embedding, W_qkv, W_p, W_fc1, W_fc2 per layer, and the head.
    assert len(params) == 2 + 4 * 2
    for param in params:
        norms = param.data.norm(dim=param.unit_norm_dim)
        torch.testing.assert_close(norms, torch.ones_like(norms))


@pytest.mark.parametrize("family", ["angpt", "ngpt"])
def test_after_a_large_step_every_vector_is_bounded(family, seeded):
    chunks = build_model_chunks(model_config(family, num_layers=2, hidden_size=64, num_attention_heads=4), 128, 16)
    run = RunConfig.from_flags(dict(model_family=family, lr=0.02, train_iters=10))
    optimizer, scheduler = build_optimizer(chunks, run)
    tokens = torch.randint(0, 128, (4, 17), generator=torch.Generator().manual_seed(1))
    batch = dict(tokens=tokens[:, :-1], labels=tokens[:, 1:], loss_mask=torch.ones(4, 16),
                 position_ids=torch.arange(16).unsqueeze(0).expand(4, -1))
    before = {id(p): p.data.clone() for p in constrained_parameters(chunks)}
    train_step(iter([batch]), chunks, optimizer, scheduler, 1, 4, 16)
    below_one = 0
    for param in constrained_parameters(chunks):
        assert not torch.equal(param.data, before[id(param)])
        norms = param.data.norm(dim=param.unit_norm_dim)
        assert norms.max().item() <= 1 + 1e-6
        if family == "ngpt":
            torch.testing.assert_close(norms, torch.ones_like(norms))
        below_one += int((norms < 1 - 1e-3).sum())
    if family == "angpt":
        assert below_one > 0  # bounded, not normalized: some rows moved inside the ball


def test_projection_of_the_model_is_idempotent_to_round_off(seeded):
    model = build_model(model_config("angpt", num_layers=2, hidden_size=64, num_attention_heads=4), 128, 16)
    with torch.no_grad():
        for param in constrained_parameters([model]):
            param.mul_(torch.linspace(0.5, 2.0, param.shape[0]).unsqueeze(1))
    project_parameters_([model], "bound")
    once = {name: p.data.clone() for name, p in model.named_parameters()}
    project_parameters_([model], "bound")
    for name, param in model.named_parameters():
        # A projected row's float norm is 1 within an ulp, so a second pass may rescale it by 1 +- 1e-7.
        torch.testing.assert_close(param.data, once[name], rtol=1e-6, atol=0, msg=name)


def test_vectors_are_split_over_tp_where_megatron_partitions_their_dimension():
    """megatron-core's partition_dim is the dimension tensor parallelism cuts; a vector along unit_norm_dim is
    split when it is that one (row-parallel W_p, W_d under anGPT), whole otherwise."""
    def param(unit_norm_dim, *tp_attributes):
        p = torch.nn.Parameter(torch.ones(4, 6))
        p.unit_norm_dim = unit_norm_dim
        if tp_attributes:
            set_tensor_model_parallel_attributes(p, *tp_attributes)
        return p

    assert split_over_tp(param(1, True, 1, 1))  # row-parallel: each row cut
    assert not split_over_tp(param(1, True, 0, 1))  # column-parallel: whole rows on each rank
    assert not split_over_tp(param(1, False, 1, 1))  # not split, whatever its partition_dim says
    assert not split_over_tp(param(1))  # no tensor-parallel attributes at all


def test_all_reduce_in_place_sums_every_tensor_in_one_call(monkeypatch):
    calls = []

    def all_reduce(tensor, group=None):
        calls.append((tensor.numel(), group))
        tensor.mul_(2)  # the sum over two ranks that hold the same values

    monkeypatch.setattr(torch.distributed, "all_reduce", all_reduce)
    group = object()
    tensors = [torch.tensor([1.0, 2.0, 3.0]), torch.tensor([4.0]), torch.tensor([5.0, 6.0])]
    all_reduce_in_place(tensors, group)
    assert calls == [(6, group)]
    assert [t.tolist() for t in tensors] == [[2.0, 4.0, 6.0], [8.0], [10.0, 12.0]]
    all_reduce_in_place([], group)  # nothing to reduce: no collective (every rank passes the same shapes)
    assert len(calls) == 1


def test_a_weight_shared_by_two_modules_is_constrained_once():
    shared = torch.nn.Parameter(torch.ones(3, 2))
    shared.unit_norm_dim = 1
    first, second = torch.nn.Linear(2, 3, bias=False), torch.nn.Linear(2, 3)
    first.weight = second.weight = shared
    second.bias.unit_norm_dim = 0
    assert constrained_parameters([first, second]) == [shared, second.bias]


def projected(tensor, unit_norm_dim, mode="bound"):
    """The projection computed apart in float64: each vector divided by max(1, its norm), or by its norm."""
    norms = tensor.double().norm(dim=unit_norm_dim, keepdim=True)
    return (tensor.double() / (norms.clamp(min=1) if mode == "bound" else norms)).to(tensor.dtype)


def spread(main, unit_norm_dim):
    """Vectors of norm 1/4 to 4 from weights that start on the unit sphere: some inside the ball, some not."""
    count = main.shape[1 - unit_norm_dim]
    factors = torch.linspace(0.25, 4.0, count)
    main.mul_(factors.unsqueeze(1) if unit_norm_dim == 1 else factors)


def main_copies(inner) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
    """(model weight, the fp32 copy the optimizer updates, in the weight's shape) of a megatron-core optimizer;
    at data-parallel size 1 the distributed optimizer's shards are whole weights."""
    if isinstance(inner, DistributedOptimizer):
        pairs = [(inner.model_float16_groups, inner.shard_fp32_from_float16_groups),
                 (inner.model_fp32_groups, inner.shard_fp32_groups)]
    elif isinstance(inner, Float16OptimizerWithFloat16Params):
        pairs = [(inner.float16_groups, inner.fp32_from_float16_groups),
                 (inner.fp32_from_fp32_groups, inner.fp32_from_fp32_groups)]
    else:
        return [(p, p.data) for group in inner.optimizer.param_groups for p in group["params"]]
    return [(model, main.data.view(model.shape)) for models, mains in pairs
            for model_group, main_group in zip(models, mains) for model, main in zip(model_group, main_group)]


def step_and_check(inner, mode="bound"):
    """Spread the main copies' vectors, step the torch optimizer (no gradients: only its post-step hook acts),
    and compare each main copy with the projection computed apart; the other parameters are untouched."""
    copies = main_copies(inner)
    expected = []
    for model, main in copies:
        if hasattr(model, "unit_norm_dim"):
            spread(main, model.unit_norm_dim)
            expected.append(projected(main, model.unit_norm_dim, mode))
        else:
            expected.append(main.clone())
    assert any(not torch.equal(e, main) for e, (_, main) in zip(expected, copies))
    inner.optimizer.step()
    for (model, main), want in zip(copies, expected):
        torch.testing.assert_close(main, want, rtol=1e-6, atol=0)


@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("use_distributed_optimizer", [False, True])
def test_the_hook_projects_the_main_copies_of_each_optimizer(bf16, use_distributed_optimizer, seeded):
    """FP32Optimizer, Float16OptimizerWithFloat16Params and the distributed optimizer's fp32 and bf16 shards, as
    build_optimizer makes them from the flags."""
    config = RunConfig.from_flags(dict(model_family="angpt", lr=1e-2, train_iters=2, num_layers=1, hidden_size=32,
                                       num_attention_heads=2, bf16=bf16,
                                       use_distributed_optimizer=use_distributed_optimizer))
    chunks = build_model_chunks(transformer_config(config), 64, 8, ddp_config(config))
    optimizer, _ = build_optimizer(chunks, config)
    (inner,) = optimizer.chained_optimizers
    step_and_check(inner)


def test_the_hook_projects_fp32_weights_beside_16_bit_ones(single_process):
    """A weight left in fp32 under --bf16 is its own main copy (megatron-core's fp32_from_fp32_groups); the hook
    attached to an optimizer that is not a chain projects it beside the fp32 copy of a bf16 weight."""
    generator = torch.Generator().manual_seed(0)
    half = torch.nn.Parameter(torch.nn.functional.normalize(torch.randn(5, 4, generator=generator), dim=1).bfloat16())
    half.unit_norm_dim = 1
    full = torch.nn.Parameter(torch.nn.functional.normalize(torch.randn(3, 6, generator=generator), dim=0))
    full.unit_norm_dim = 0
    optimizer = Float16OptimizerWithFloat16Params(torch.optim.AdamW([half, full]), OptimizerConfig(bf16=True), None,
                                                  lambda optimizer: None)
    attach_weight_constraint(optimizer, "normalize")
    step_and_check(optimizer, "normalize")


def fsdp_weight(placement, rows=6, cols=4):
    mesh = init_device_mesh("cpu", (1,))
    param = torch.nn.Parameter(distribute_tensor(torch.randn(rows, cols, generator=torch.Generator().manual_seed(0)),
                                                 mesh, [placement]))
    param.unit_norm_dim = 1
    return param


def test_the_hook_projects_fsdp2_row_shards_and_refuses_other_placements(single_process):
    param = fsdp_weight(Shard(0))
    optimizer = FP32Optimizer(torch.optim.AdamW([param]), OptimizerConfig(), lambda optimizer: None)
    attach_weight_constraint(optimizer, "bound")
    local = param.detach().to_local()  # this rank's rows: all of them at one rank
    spread(local, 1)
    expected = projected(local, 1)
    optimizer.optimizer.step()
    torch.testing.assert_close(local, expected, rtol=1e-6, atol=0)
    for placement in (Replicate(), Shard(1)):
        optimizer = FP32Optimizer(torch.optim.AdamW([fsdp_weight(placement)]), OptimizerConfig(),
                                  lambda optimizer: None)
        attach_weight_constraint(optimizer, "bound")
        with pytest.raises(TypeError, match=rf"Shard\(0\).*{type(placement).__name__}"):
            optimizer.optimizer.step()


def test_the_projection_is_timed_as_bounding_at_timing_log_level_1(seeded):
    """docs/guide.md, A slow run: --timing-log-level 1 times anGPT's `bounding` projection (megatron-core's Timers
    time a level-1 timer at level 1)."""
    config = RunConfig.from_flags(dict(model_family="angpt", lr=1e-2, train_iters=2, num_layers=1, hidden_size=32,
                                       num_attention_heads=2))
    chunks = build_model_chunks(transformer_config(config), 64, 8, ddp_config(config))
    optimizer, _ = build_optimizer(chunks, config)
    (inner,) = optimizer.chained_optimizers
    inner.config.timers = Timers(1, "minmax")
    inner.optimizer.step()
    assert list(inner.config.timers._timers) == ["bounding"]
    assert inner.config.timers._timers["bounding"].elapsed(reset=False) > 0


def test_an_unknown_mode_or_optimizer_is_refused_by_name():
    with pytest.raises(ValueError, match="'clip'"):
        attach_weight_constraint(torch.optim.SGD([torch.nn.Parameter(torch.ones(2))]), "clip")

    class Other:
        config = OptimizerConfig()
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))])

    other = Other()
    attach_weight_constraint(other, "bound")
    with pytest.raises(TypeError, match="do not support Other"):
        other.optimizer.step()
