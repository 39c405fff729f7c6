"""Runs counted in samples, as Megatron-LM counts them: --train-samples, the schedule in samples
(--lr-decay-samples, --lr-warmup-samples) and the batch ramp-up (--rampup-batch-size). The expected values are
worked out here from Megatron-LM's rules (megatron/training/training.py: update_train_iters,
get_optimizer_param_scheduler; megatron-core's OptimizerParamScheduler.get_lr), not read from the code."""

import math

import pytest
from test_optimizer import tiny_chunks

from angpt.config.arguments import parse_args
from angpt.config.batch_schedule import BatchSchedule, ramp, rampup_train_iters
from angpt.config.sections import RunConfig
from angpt.training.optimizer import build_optimizer

MOCK = ["--mock-data", "--vocab-size", "64", "--micro-batch-size", "1", "--global-batch-size", "8"]


def parsed(*argv, world_size=2):
    return parse_args([*MOCK, *argv], world_size=world_size)


def test_a_ramp_up_grows_the_batch_in_equal_shares_of_its_samples_then_trains_whole_batches():
    """START 2, INCREMENT 2 to 8: 3 increments, one per 16/3 samples consumed; the ramp-up ends once more
    than 16 samples are consumed: consumed 0, 2, 4 -> 2; 6, 10 -> 4; 14 -> 6; 20 -> 8. Then (45 - 20) // 8 = 3
    whole batches; the last sample is left out."""
    config = parsed("--train-samples", "45", "--rampup-batch-size", "2", "2", "16")
    assert config.training.train_iters == 9
    assert ramp(config.training) == [(2, 3), (4, 2), (6, 1), (8, 3)]
    schedule = BatchSchedule(8, 1, 2, [2, 2, 16])
    assert [schedule.global_batch_size(consumed) for consumed in (0, 4, 5, 6, 10, 11, 16, 17, 1000)] == \
        [2, 2, 2, 4, 4, 6, 8, 8, 8]
    assert BatchSchedule(8, 1, 2).global_batch_size(123) == 8


@pytest.mark.parametrize("samples,iterations", [(8, 1), (15, 1), (16, 2)])
def test_train_samples_trains_whole_global_batches(samples, iterations):
    assert parsed("--train-samples", str(samples)).training.train_iters == iterations


@pytest.mark.parametrize("argv,message", [
    (["--train-iters", "10", "--lr-decay-samples", "40"],
     "--lr-decay-samples needs --train-samples (this run gives --train-iters: use --lr-decay-iters)"),
    (["--train-iters", "10", "--lr-warmup-samples", "8"], "--lr-warmup-samples needs --train-samples"),
    (["--train-samples", "80", "--lr-decay-iters", "5"],
     "--lr-decay-iters needs --train-iters (this run gives --train-samples: use --lr-decay-samples)"),
    (["--train-samples", "80", "--lr-warmup-iters", "1"], "--lr-warmup-iters needs --train-iters"),
    (["--train-samples", "80", "--lr-warmup-samples", "8", "--lr-warmup-fraction", "0.1"],
     "give one of --lr-warmup-fraction and --lr-warmup-samples"),
    (["--train-samples", "80", "--lr-decay-style", "WSD"], "--lr-decay-style WSD needs --lr-wsd-decay-samples"),
    (["--train-iters", "10", "--rampup-batch-size", "2", "2", "16"],
     "--rampup-batch-size 2 2 16 needs --train-samples"),
    # At the boundaries: START equal to the global batch (megatron-core would divide by zero), START not
    # reaching it in whole increments, a batch that does not split over the 2 data-parallel ranks.
    (["--train-samples", "80", "--rampup-batch-size", "8", "2", "16"], "START must be below --global-batch-size 8"),
    (["--train-samples", "80", "--rampup-batch-size", "2", "4", "16"], "reach it in whole INCREMENTs"),
    (["--train-samples", "80", "--rampup-batch-size", "3", "1", "16"],
     "START and INCREMENT must be multiples of --micro-batch-size 1 x data-parallel size 2"),
    (["--train-samples", "80", "--rampup-batch-size", "2", "2", "-1"], "--rampup-batch-size -1 cannot be negative"),
    (["--train-samples", "80", "--rampup-batch-size", "2", "2", "0"],
     "START, INCREMENT and SAMPLES must be at least 1"),
    (["--train-samples", "7"], "--train-samples 7 is less than one --global-batch-size 8"),
])
def test_mixing_iterations_and_samples_or_an_impossible_ramp_up_is_refused(argv, message, capsys):
    with pytest.raises(SystemExit):
        parsed(*argv)
    assert message in capsys.readouterr().err


def test_the_ramp_up_just_inside_the_limits_is_accepted():
    config = parsed("--train-samples", "80", "--rampup-batch-size", "6", "2", "1")
    # SAMPLES 1: one increment per sample; only the first step (0 consumed) is at START, then 6 > 1.
    assert ramp(config.training) == [(6, 1), (8, 9)]


def megatron_lr(step_samples, lr, min_lr, warmup, decay):
    """megatron-core's OptimizerParamScheduler.get_lr, cosine, from init lr 0."""
    if warmup > 0 and step_samples <= warmup:
        return lr * step_samples / warmup
    if step_samples > decay:
        return min_lr
    ratio = (step_samples - warmup) / (decay - warmup)
    return min_lr + 0.5 * (math.cos(math.pi * ratio) + 1.0) * (lr - min_lr)


@pytest.mark.parametrize("family,warmup_flags,warmup", [
    ("angpt", dict(lr_warmup_samples=12), 12),
    # GPT+'s recipe warms up over 1% of the decay, in samples and not rounded, as Megatron-LM's fraction.
    ("gptplus", {}, 0.01 * 60),
])
def test_a_schedule_in_samples_steps_by_each_global_batch_as_megatron_lms(family, warmup_flags, warmup, seeded):
    chunks = tiny_chunks(family)
    optimizer, scheduler = build_optimizer(chunks, RunConfig.from_flags(dict(
        model_family=family, lr=1e-3, min_lr=1e-4, train_iters=None, train_samples=80, lr_decay_samples=60,
        **warmup_flags)))
    consumed = 0
    for batch_size in (2, 2, 4, 6, 8, 8, 8, 8, 8, 8, 8):
        assert optimizer.param_groups[0]["lr"] == pytest.approx(megatron_lr(consumed, 1e-3, 1e-4, warmup, 60),
                                                                rel=1e-12, abs=1e-15)
        scheduler.step(increment=batch_size)
        consumed += batch_size


@pytest.mark.parametrize("argv, warmup", [(["--train-iters", "1000", "--lr-warmup-samples", "0"], 10),
                                          (["--train-samples", "8000", "--lr-warmup-iters", "0"], 80)])
def test_a_warm_up_of_zero_in_the_other_unit_is_megatron_lms_default_and_asks_for_nothing(argv, warmup, capsys,
                                                                                        seeded):
    """Megatron-LM's scripts give --lr-warmup-samples 0 with --train-iters (its default; validate_args asserts
    it is 0): accepted, and the warm-up stays GPT+'s 1% in the run's unit. One more is refused."""
    config = parsed("--model-family", "gptplus", *argv)
    _, scheduler = build_optimizer(tiny_chunks("gptplus"), config)
    assert scheduler.lr_warmup_steps == warmup  # 1% of 1000 iterations, or of 8000 samples
    one = [*argv[:-1], "1"]
    with pytest.raises(SystemExit):
        parsed(*one)
    assert f"{one[2]} needs --train-{'samples' if '--train-iters' in argv else 'iters'}" in capsys.readouterr().err


def test_a_run_of_train_samples_equal_to_the_ramp_ups_samples_takes_the_step_at_that_sample():
    """Megatron-LM's update_train_iters counts ramp-up steps while consumed <= SAMPLES and consumed <=
    --train-samples, both inclusive. START 2, INCREMENT 2 to 4 over SAMPLES 4: steps at consumed 0 (2), 2 (2) and
    4 (4, the full batch); at --train-samples 4 the third step still counts, so 3 iterations (a partial batch)."""
    assert rampup_train_iters(4, [2, 2, 4], 4) == 3
    # The same ramp-up ends at consumed 8; then (19 - 8) // 4 = 2 whole batches, the 3 samples left out.
    assert rampup_train_iters(4, [2, 2, 4], 19) == 5


def test_a_ramp_up_of_odd_batches_on_one_rank_is_counted_with_one_sample_per_micro_batch():
    """START 3, INCREMENT 1 to 8 over SAMPLES 10 on one rank: 5 increments, one per 2 samples; consumed 0 -> 3,
    3 -> 3 + 1 = 4, 7 -> 3 + 3 = 6, 13 > 10 -> 8; then (40 - 13) // 8 = 3 whole batches. Odd batches do not
    split over two micro-batches or two ranks: the count must not depend on the run's layout."""
    config = parse_args([*MOCK, "--train-samples", "40", "--rampup-batch-size", "3", "1", "10"], world_size=1)
    assert config.training.train_iters == 6
    assert ramp(config.training) == [(3, 1), (4, 1), (6, 1), (8, 3)]
    constant = parse_args([*MOCK, "--global-batch-size", "7", "--train-iters", "5"], world_size=1)
    assert ramp(constant.training) == [(7, 5)]


def test_a_global_batch_that_does_not_split_over_the_ranks_is_refused_not_rounded():
    """Megatron-LM builds the calculators with decrease_batch_size_if_needed=False and checks each ramp-up step's
    batch: 7 samples over 2 ranks, or a ramp-up step of 3 over 2 ranks, is an error rather than a smaller batch."""
    with pytest.raises(AssertionError, match="not divisible"):
        BatchSchedule(7, 1, 2)
    schedule = BatchSchedule(8, 1, 2, [3, 1, 10])
    with pytest.raises(AssertionError, match="not divisible"):
        schedule.global_batch_size(0)
    assert BatchSchedule(8, 1, 2, [2, 2, 16]).global_batch_size(16) == 8  # at SAMPLES: the last increment
