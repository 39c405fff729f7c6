"""Bounded weights (docs/model.md, Bounding) and nGPT's normalized weights, in one process.

The multi-process equality of tensor-parallel and distributed-optimizer bounding with single-process
bounding is in test_parallel_equivalence.py."""

import pytest
import torch

from angpt.config.sections import RunConfig
from angpt.models import build_model, model_config
from angpt.models.bounding import _Piece, _project, constrained_parameters, project_parameters_
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
