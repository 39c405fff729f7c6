"""--bf16 and --fp16 without --use-distributed-optimizer: megatron-core's Float16OptimizerWithFloat16Params, which
keeps an fp32 main copy of each 16-bit weight and updates anGPT's and nGPT's fp32 learnable scales in place. Its
steps are the distributed optimizer's at data-parallel size 1, bounding included; a run resumes from its checkpoint
exactly, which megatron-core's own state-dict mapping cannot save or load (angpt/megatron_compat/patches.py).
Resharding from 2 processes: test_checkpoint.py. A save before fp16's first applied step resumes exactly with either
optimizer (angpt/megatron_compat/patches.py for both)."""

import pytest
import torch
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params
from megatron.core.utils import get_model_config
from test_trainer import checkpoint_tensors, copy_checkpoint, losses, records, train

from angpt.config.sections import RunConfig
from angpt.megatron_compat import patches
from angpt.models.bounding import constrained_parameters
from angpt.training import checkpointing, distributed
from angpt.training.megatron_configs import ddp_config, transformer_config
from angpt.training.optimizer import build_optimizer
from angpt.training.step import build_model_chunks, train_step

V, S, MB = 128, 16, 2
FAMILIES = ["angpt", "ngpt", "gptplus"]
PRECISIONS = {"bf16": dict(bf16=True), "fp16": dict(fp16=True, hysteresis=1, nan_checks=False)}
# fp16's dynamic loss scale starts where the first step or two of this model overflow (halving it each time:
# hysteresis 1), so that skipped and applied steps both come; no NaN checks, as validation derives for fp16.
INITIAL_LOSS_SCALE = {"angpt": 2.0**22, "ngpt": 2.0**22, "gptplus": 2.0**20}
# An fp32 row of norm 1 after the projection: each element rounded once (2^-24 relative), the factor too.
ON_THE_SPHERE = 2**-22


def batches():
    generator = torch.Generator().manual_seed(0)
    while True:
        tokens = torch.randint(0, V, (MB, S + 1), generator=generator)
        yield dict(tokens=tokens[:, :-1], labels=tokens[:, 1:], loss_mask=torch.ones(MB, S),
                   position_ids=torch.arange(S).unsqueeze(0).expand(MB, -1))


def build(family, precision, seed=1, **flags):
    """A small model and its optimizer and schedule, as `angpt.pretrain` builds them from these flags."""
    if precision == "fp16":
        flags = {"initial_loss_scale": INITIAL_LOSS_SCALE[family], **flags}
    config = RunConfig.from_flags(dict(model_family=family, lr=1e-2, train_iters=6, num_layers=2, hidden_size=64,
                                       num_attention_heads=4, **PRECISIONS[precision], **flags))
    distributed.set_random_seed(seed)
    chunks = build_model_chunks(transformer_config(config), V, S, ddp_config(config))
    optimizer, scheduler = build_optimizer(chunks, config)
    if precision == "fp16":  # as the trainer does: the schedule scales the loss
        get_model_config(chunks[0]).grad_scale_func = optimizer.scale_loss
    return chunks, optimizer, scheduler


def optimizer_state(chunks, optimizer) -> dict[str, torch.Tensor]:
    """{"<what>.<parameter>": tensor}: the fp32 main weight (the parameter itself where it is fp32) and Adam's
    moments and step of every parameter, from either optimizer (at data-parallel size 1 the distributed
    optimizer's shards are whole parameters)."""
    (inner,) = optimizer.chained_optimizers
    if isinstance(inner, DistributedOptimizer):
        pairs = [(inner.model_float16_groups, inner.shard_fp32_from_float16_groups),
                 (inner.model_fp32_groups, inner.shard_fp32_groups)]
    else:
        assert isinstance(inner, Float16OptimizerWithFloat16Params)
        pairs = [(inner.float16_groups, inner.fp32_from_float16_groups),
                 (inner.fp32_from_fp32_groups, inner.fp32_from_fp32_groups)]
    main_of = {id(model): main for models, mains in pairs for model_group, main_group in zip(models, mains)
               for model, main in zip(model_group, main_group)}
    state = {}
    for name, param in chunks[0].module.named_parameters():
        main = main_of[id(param)]
        state[f"main.{name}"] = main.detach().view(param.shape).clone()
        for key, value in inner.optimizer.state[main].items():
            state[f"{key}.{name}"] = value.view(param.shape if value.numel() == param.numel() else -1).clone()
    return state


def assert_equal(actual: dict, expected: dict):
    assert actual.keys() == expected.keys()
    assert [key for key in expected if not torch.equal(actual[key], expected[key])] == []


def model_weights(chunks) -> dict[str, torch.Tensor]:
    return {name: param.detach().clone() for name, param in chunks[0].module.named_parameters()}


def expected_loss_scale(precision, initial: float, applied: list[bool]) -> float:
    """megatron-core's dynamic loss scale with hysteresis 1 and no growth within 1000 steps: halved at each
    overflow, which is each skipped step (bf16: no loss scale)."""
    return initial * 0.5 ** applied.count(False) if precision == "fp16" else 1.0


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("family", FAMILIES)
def test_steps_without_the_distributed_optimizer_are_its_steps_and_keep_the_weights_bounded(
        family, precision, single_process):
    """Four steps with and without the distributed optimizer, at data-parallel size 1, do the same arithmetic on
    the same fp32 main weights: the same steps skipped for fp16's overflows, losses, 16-bit weights, main weights
    and Adam's moments equal bit for bit. Without clipping: the grad norm sums the same squares in another order
    (fp32 round-off, bounded below), which clipping would pass on to every weight. Bounded on the fp32 main weights:
    anGPT's rows in the unit ball, some on its sphere, nGPT's on the sphere, before the 16-bit weights are cast
    from them."""
    runs = {}
    for use_distributed_optimizer in (True, False):
        chunks, optimizer, scheduler = build(family, precision, use_distributed_optimizer=use_distributed_optimizer,
                                             clip_grad=0.0)
        data = batches()
        steps = [train_step(data, chunks, optimizer, scheduler, 1, MB, S) for _ in range(4)]
        runs[use_distributed_optimizer] = steps, chunks, optimizer
    (with_it, _, distributed_optimizer), (without_it, chunks, optimizer) = runs[True], runs[False]
    applied = [updated for _, _, updated in without_it]
    assert applied == [updated for _, _, updated in with_it]
    assert any(applied) and all(applied) == (precision == "bf16")
    assert [loss for loss, _, _ in without_it] == [loss for loss, _, _ in with_it]
    # A sum of n non-negative fp32 terms in two orders: each within (n - 1) 2^-24 relative of the exact sum.
    terms = len(list(chunks[0].parameters()))
    for (_, norm, updated), (_, reference, _) in zip(without_it, with_it):
        assert norm is reference is None if not updated else norm == pytest.approx(
            reference, rel=2 * (terms - 1) * 2**-24, abs=0)
    assert_equal(model_weights(chunks), model_weights(runs[True][1]))
    state = optimizer_state(chunks, optimizer)
    assert_equal(state, optimizer_state(runs[True][1], distributed_optimizer))
    scale = expected_loss_scale(precision, INITIAL_LOSS_SCALE[family], applied)
    assert optimizer.get_loss_scale().item() == distributed_optimizer.get_loss_scale().item() == scale

    weights = constrained_parameters(chunks)
    assert bool(weights) == (family != "gptplus")
    for weight in weights:
        name = next(name for name, param in chunks[0].module.named_parameters() if param is weight)
        main = state[f"main.{name}"]
        assert torch.equal(weight, main.to(weight.dtype)), name
        norms = main.double().norm(dim=weight.unit_norm_dim)
        if family == "angpt":
            assert norms.max() <= 1 + ON_THE_SPHERE and norms.max() >= 1 - ON_THE_SPHERE, name
        else:
            assert (norms - 1).abs().max() <= ON_THE_SPHERE, name


def train_saving_at_3(family, precision, root, **flags):
    """Six steps, saved after the third: (losses, whether each step was applied, chunks, optimizer)."""
    chunks, optimizer, scheduler = build(family, precision, **flags)
    data, losses, applied = batches(), [], []
    for iteration in range(1, 7):
        loss, _, updated = train_step(data, chunks, optimizer, scheduler, 1, MB, S)
        losses.append(loss)
        applied.append(updated)
        if iteration == 3:
            checkpointing.save_checkpoint(str(root), checkpointing.TrainState(iteration=3), chunks, optimizer,
                                          scheduler, {})
    return losses, applied, chunks, optimizer


def resume_from_3(family, precision, root, **flags):
    """Built from another seed, loaded from the checkpoint of step 3 and trained to 6: (losses, chunks, optimizer)."""
    chunks, optimizer, scheduler = build(family, precision, seed=2, **flags)
    state = checkpointing.load_checkpoint(checkpointing.checkpoint_dir(str(root), 3), chunks, optimizer, scheduler)
    data = batches()
    for _ in range(state.iteration):
        next(data)
    losses = [train_step(data, chunks, optimizer, scheduler, 1, MB, S)[0] for _ in range(3)]
    return losses, chunks, optimizer


def assert_resumes_exactly(family, precision, root, **flags) -> list[bool]:
    """Steps 4 to 6 resumed equal the uninterrupted run's bit for bit (on the CPU the arithmetic is the same), and
    so do the weights, the fp32 main weights, Adam's moments and steps of every parameter (the fp32 scales'
    included) and fp16's loss scaler. Returns whether each step of the run was applied."""
    losses, applied, chunks, optimizer = train_saving_at_3(family, precision, root, **flags)
    resumed, resumed_chunks, resumed_optimizer = resume_from_3(family, precision, root, **flags)
    assert resumed == losses[3:]
    assert_equal(model_weights(resumed_chunks), model_weights(chunks))
    state = optimizer_state(resumed_chunks, resumed_optimizer)
    assert_equal(state, optimizer_state(chunks, optimizer))
    assert {value.item() for key, value in state.items() if key.startswith("step.")} == {applied.count(True)}
    (inner,), (resumed_inner,) = optimizer.chained_optimizers, resumed_optimizer.chained_optimizers
    if precision == "fp16":
        assert resumed_inner.grad_scaler.state_dict() == inner.grad_scaler.state_dict()
    initial = flags.get("initial_loss_scale", INITIAL_LOSS_SCALE[family])
    assert resumed_optimizer.get_loss_scale().item() == expected_loss_scale(precision, initial, applied)
    return applied


@pytest.mark.slow  # in-process trainer runs, saved and resumed
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("family", FAMILIES)
def test_a_run_without_the_distributed_optimizer_resumes_exactly(family, precision, single_process, tmp_path):
    """Saved at step 3 of 6, after a step was applied, and resumed into a model built from another seed."""
    applied = assert_resumes_exactly(family, precision, tmp_path)
    assert any(applied[:3]) and all(applied) == (precision == "bf16")


# Initial loss scales at which the first three steps overflow and a later one of the six applies.
BEFORE_THE_FIRST_APPLIED_STEP = {"angpt": 2.0**24, "gptplus": 2.0**21}


@pytest.mark.slow  # in-process trainer runs, saved and resumed
@pytest.mark.parametrize("use_distributed_optimizer", [False, True])
@pytest.mark.parametrize("family", BEFORE_THE_FIRST_APPLIED_STEP)
def test_an_fp16_run_saved_before_its_first_applied_step_resumes_exactly(family, use_distributed_optimizer,
                                                                          single_process, tmp_path):
    """fp16's first steps overflow and are skipped: saved at step 3 with none applied yet, Adam has no state; the
    checkpoint holds the zeros and step 0 it starts from (without them the 16-bit optimizer's load asked for moments
    it lacked, and the distributed optimizer's save failed: the next test)."""
    applied = assert_resumes_exactly(family, "fp16", tmp_path, initial_loss_scale=BEFORE_THE_FIRST_APPLIED_STEP[family],
                                     use_distributed_optimizer=use_distributed_optimizer)
    assert not any(applied[:3]) and any(applied[3:])


def test_megatron_cores_distributed_optimizer_cannot_save_before_the_first_applied_step(
        single_process, tmp_path, monkeypatch):
    """What angpt's replacement fixes: megatron-core 0.16.1 reads torch Adam's step from each parameter's state,
    which it does not have yet."""
    monkeypatch.setattr(DistributedOptimizer, "sharded_state_dict", DistributedOptimizer.sharded_state_dict.__wrapped__)
    with pytest.raises(AssertionError) as failure:
        train_saving_at_3("angpt", "fp16", tmp_path, initial_loss_scale=2.0**24, use_distributed_optimizer=True)
    assert str(failure.traceback[-1].statement).strip() == "assert len(steps) == 1"


@pytest.mark.parametrize("family", ["angpt", "gptplus"])
def test_a_bf16_run_with_the_distributed_optimizer_resumes_exactly(family, single_process, tmp_path):
    """bf16's first step applies, so the save after it is megatron-core's own."""
    assert all(assert_resumes_exactly(family, "bf16", tmp_path, use_distributed_optimizer=True))


def test_megatron_cores_own_state_dict_mapping_cannot_save_the_fp32_scales(single_process, tmp_path, monkeypatch):
    """What angpt's replacement fixes: megatron-core 0.16.1's mapping numbers the 16-bit parameters only, so the
    save finds no model parameter for the first fp32 scale's Adam state."""
    monkeypatch.setattr(Float16OptimizerWithFloat16Params, "sharded_state_dict",
                        patches._float16_optimizer_sharded_state_dict)
    with pytest.raises(ValueError, match="does not match any model sharded param"):
        train_saving_at_3("angpt", "bf16", tmp_path)


def test_groups_of_main_copies_load_keyed_by_group_and_not_as_a_list(single_process, tmp_path):
    """Why angpt keys the main copies by group: megatron-core stores them as a list per group, and anGPT's scales'
    group has none. Distributed checkpointing stores that empty list in the common state and the other groups'
    tensors in the sharded state, each renumbered from 0; the load merges them by position and fails."""

    def groups(value, keyed):
        tensors = [ShardedTensor.from_rank_offsets("main", torch.full((2,), value), replica_id=0)]
        return {0: tensors, 1: []} if keyed else [tensors, []]

    for keyed in (False, True):
        (tmp_path / str(keyed)).mkdir()
        dist_checkpointing.save({"groups": groups(1.0, keyed)}, str(tmp_path / str(keyed)))
    with pytest.raises(ValueError, match="Cannot merge two lists with different lengths"):
        dist_checkpointing.load({"groups": groups(0.0, keyed=False)}, str(tmp_path / "False"))
    loaded = dist_checkpointing.load({"groups": groups(0.0, keyed=True)}, str(tmp_path / "True"))["groups"]
    assert loaded.keys() == {0, 1} and torch.equal(loaded[0][0], torch.ones(2)) and loaded[1] == []


@pytest.mark.multiprocess
def test_an_fp16_run_of_two_processes_saved_before_its_first_applied_step_resumes_exactly(single_process, tmp_path):
    """`angpt.pretrain --fp16 --use-distributed-optimizer` at data-parallel size 2, as users run it: its first five
    steps overflow (hysteresis 1), and resumed from the save at 4, a skipped step and three applied ones equal the
    uninterrupted run's, the loss scale, weights, fp32 main weights and Adam's moments included."""
    flags = ["--use-distributed-optimizer", "--fp16", "--initial-loss-scale", str(2**28), "--hysteresis", "1",
             "--train-iters", "8"]
    run = tmp_path / "run"
    train(*flags, "--save", str(run), "--save-interval", "4")
    assert [r["skipped"] for r in records(run)] == [1] * 5 + [0] * 3
    saved = checkpoint_tensors(run, 4)
    moments = [value for key, value in saved.items() if key.startswith("optimizer.state.exp_avg")]
    assert moments and not any(moment.any() for moment in moments)

    resumed = copy_checkpoint(run, 4, tmp_path / "resumed")
    train(*flags, "--save", resumed, "--load", resumed)
    assert losses(resumed) == {i: loss for i, loss in losses(run).items() if i > 4}
    assert [r["loss_scale"] for r in records(resumed)] == [r["loss_scale"] for r in records(run)][4:]
    final, expected = checkpoint_tensors(resumed, 8), checkpoint_tensors(run, 8)
    assert final.keys() == expected.keys() and any(key.startswith("optimizer.state.param.") for key in final)
    assert [key for key in final if not torch.equal(final[key], expected[key])] == []
