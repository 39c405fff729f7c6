"""Megatron-LM's timers (--timing-log-level, --timing-log-option, --log-timers-to-tensorboard) through megatron-core's
Timers: which timers each level turns on, per step in metrics.jsonl, the log line and TensorBoard; and its
--log-params-norm and --log-num-zeros-in-grad."""

import json

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from angpt.telemetry.metrics import format_log_line

from conftest import in_process_trainer

MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
         "--micro-batch-size", "2", "--global-batch-size", "4", "--mock-data", "--vocab-size", "128",
         "--eval-iters", "1", "--eval-interval", "2", "--train-iters", "4", "--log-interval", "2",
         "--save-interval", "2"]


def train_records(run_dir) -> list[dict]:
    with open(run_dir / "metrics.jsonl") as file:
        return [record for record in map(json.loads, file) if record["kind"] == "train"]


@pytest.mark.slow  # three in-process trainer runs
def test_each_timing_level_times_what_megatron_lm_times_at_it(tmp_path, single_process):
    timed = {}
    for level in (0, 1, 2):
        run_dir = tmp_path / f"level{level}"
        assert in_process_trainer([*MODEL, "--save", str(run_dir), "--timing-log-level", str(level)]).run() == 0
        records = train_records(run_dir)
        timed[level] = [set(record.get("timers_ms", {})) for record in records]
    # Level 0: the save of iteration 2 shows in the window that follows it; nothing else is timed.
    assert timed[0] == [set(), {"save-checkpoint"}]
    level1 = {"forward-backward", "optimizer", "bounding", "optimizer-copy-to-main-grad", "optimizer-inner-step"}
    assert level1 <= timed[1][0] and "evaluate" in timed[1][1] and "batch-generator" not in timed[1][0]
    assert {"batch-generator", "forward-compute", "backward-compute"} <= timed[2][0] and level1 <= timed[2][0]


def test_timers_in_metrics_the_log_line_and_tensorboard(tmp_path, single_process):
    run_dir = tmp_path / "run"
    assert in_process_trainer([*MODEL, "--save", str(run_dir), "--timing-log-level", "2",
                               "--log-timers-to-tensorboard", "--timing-log-option", "minmax"]).run() == 0
    first = train_records(run_dir)[0]
    timers = first["timers_ms"]
    # One rank: min = max. Per step, the parts are within the whole they are part of, the whole within the step.
    assert all(low == high > 0 for low, high in timers.values())
    assert timers["forward-compute"][0] + timers["backward-compute"][0] <= timers["forward-backward"][0]
    assert timers["bounding"][0] <= timers["optimizer"][0]
    assert timers["forward-backward"][0] + timers["optimizer"][0] <= first["ms_per_step"]
    line = format_log_line(first)
    low, high = timers["forward-backward"]
    assert "| timers (ms): " in line and f" forward-backward {low:.1f}/{high:.1f}," in line
    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    assert {"timers/forward-backward-time", "timers/optimizer-time"} <= set(events.Tags()["scalars"])
    assert events.Scalars("timers/forward-backward-time")[0].value == pytest.approx(timers["forward-backward"][1])


def test_params_norm_and_zero_gradients_are_those_of_the_model(tmp_path, single_process):
    """--log-params-norm and --log-num-zeros-in-grad against the model itself after the logged step: the norm of
    all its weights, and the zeros of its gradients (the embedding rows of tokens not in the batch among them)."""
    run_dir = tmp_path / "run"
    trainer = in_process_trainer([*MODEL, "--save", str(run_dir), "--log-params-norm", "--log-num-zeros-in-grad",
                                  "--train-iters", "2", "--eval-iters", "0"])
    assert trainer.run() == 0
    record = train_records(run_dir)[-1]
    params = [param for chunk in trainer.chunks for param in chunk.parameters()]
    expected_norm = torch.cat([param.detach().double().flatten() for param in params]).norm().item()
    assert record["params_norm"] == pytest.approx(expected_norm, rel=1e-6)
    zeros = sum(int((param.main_grad == 0).sum()) for param in params)
    assert record["num_zeros"] == zeros > 0
    line = format_log_line(record)
    assert f"| num zeros: {zeros} | params norm: {record['params_norm']:.3f} |" in line
