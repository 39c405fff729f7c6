"""--fp16 with megatron-core's dynamic loss scaling (Megatron-LM's flags and defaults): the scale finds itself
from 2^32 by skipped steps, which do not stop the run; the run resumes exactly, the scaler's state included;
anGPT's bounded weights stay on the unit ball in fp16."""

from __future__ import annotations

import pytest
import torch
from test_trainer import checkpoint_tensors, copy_checkpoint, losses, records, train

from angpt.config.arguments import parse_args

pytestmark = pytest.mark.multiprocess

FP16 = ["--use-distributed-optimizer", "--fp16", "--train-iters", "16", "--max-skipped-steps", "3"]


def test_an_fp16_run_finds_its_loss_scale_trains_and_resumes_exactly(tmp_path, single_process):
    """megatron-core's DynamicGradScaler from Megatron-LM's defaults (2^32, hysteresis 2, window 1000): the first
    overflow uses up the hysteresis, each later one halves the scale, and those skipped steps do not count
    towards --max-skipped-steps 3. Resumed at 12 (after the scale settled), the run equals the uninterrupted one."""
    run = tmp_path / "run"
    train(*FP16, "--save", str(run), "--save-interval", "12")
    logged = records(run)
    skipped = [r for r in logged if r["skipped"]]
    assert len(skipped) > 3 and [r["iteration"] for r in skipped] == list(range(1, len(skipped) + 1))
    scales = [r["loss_scale"] for r in logged]
    assert scales[0] == 2.0**32  # the first overflow is absorbed by the hysteresis
    assert scales[1:len(skipped)] == [2.0**32 / 2**k for k in range(1, len(skipped))]
    assert len(set(scales[len(skipped):])) == 1 and len(skipped) < 12
    trained = [r["lm_loss"] for r in logged if not r["skipped"]]
    assert trained[-1] < trained[0]

    resumed = copy_checkpoint(run, 12, tmp_path / "resumed")
    train(*FP16, "--save", resumed, "--load", resumed)
    assert {i: v for i, v in losses(resumed).items()} == {i: v for i, v in losses(run).items() if i > 12}
    assert [r["loss_scale"] for r in records(resumed)] == scales[12:]
    final, expected = checkpoint_tensors(resumed, 16), checkpoint_tensors(run, 16)
    assert final.keys() == expected.keys() and any(key.startswith("optimizer.") for key in final)
    assert [key for key in final if not torch.equal(final[key], expected[key])] == []
    # Bounded on the fp32 main weights before the cast: every embedding row within fp16's rounding of the
    # unit ball (2^-11 relative per element).
    embedding = final["embedding.word_embeddings.weight"]
    assert embedding.dtype == torch.float16
    assert embedding.float().norm(dim=-1).max() <= 1 + 2**-10


@pytest.mark.parametrize("argv,message", [
    (["--fp16", "--bf16", "--use-distributed-optimizer"], "give one of --bf16 and --fp16"),
    (["--loss-scale", "1024"], "--loss-scale needs --fp16"),
    (["--hysteresis", "1"], "--hysteresis needs --fp16"),
    (["--fp16", "--use-distributed-optimizer", "--loss-scale-window", "0"], "--loss-scale-window 0 must be at least 1"),
])
def test_fp16_flags_alone_or_out_of_range_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit):
        parse_args(["--mock-data", "--vocab-size", "64", "--train-iters", "2", *argv], world_size=1)
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("half", ["--fp16", "--bf16"])
def test_16_bit_without_the_distributed_optimizer_is_accepted(half):
    """megatron-core's Float16OptimizerWithFloat16Params, checkpointed by angpt.megatron_compat.patches
    (tests/test_float16_optimizer.py); --use-distributed-optimizer is no longer needed."""
    config = parse_args(["--mock-data", "--vocab-size", "64", "--train-iters", "2", half], world_size=1)
    assert getattr(config.precision, half[2:]) and not config.parallel.use_distributed_optimizer
