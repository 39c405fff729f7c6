"""Megatron-LM's timers (--timing-log-level, --timing-log-option, --log-timers-to-tensorboard) through megatron-core's
Timers: which timers each level turns on, per step in metrics.jsonl, the log line and TensorBoard; its
--log-params-norm and --log-num-zeros-in-grad; --log-straggler's rule (a rank delayed on purpose is named in
tests/test_trainer.py's test_a_save_killed_midway_leaves_the_previous_checkpoint, over two ranks),
--record-memory-history and the flight recorder's variables."""

import json
import os
import pickle

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from angpt.config.arguments import parse_args
from angpt.telemetry.metrics import format_log_line
from angpt.telemetry.stragglers import STRAGGLER_MARGIN, stragglers
from angpt.training import distributed, faults
from angpt.training.distributed import flight_recorder_environment

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


@pytest.mark.slow
def test_timers_in_metrics_the_log_line_and_tensorboard(tmp_path, single_process, monkeypatch):
    """With --log-straggler on too: this rank's forward passes, each made 50 ms late, are timed."""
    monkeypatch.setenv(faults.SLOW_RANK, "0:0.05")
    run_dir = tmp_path / "run"
    assert in_process_trainer([*MODEL, "--save", str(run_dir), "--timing-log-level", "2",
                               "--log-timers-to-tensorboard", "--timing-log-option", "minmax",
                               "--log-straggler"]).run() == 0
    first = train_records(run_dir)[0]
    # Two micro-batches per step (global batch 4 of micro-batches of 2), each forward 50 ms late at least; the
    # forward passes are within forward-compute's time.
    [[rank, forward_ms]] = first["forward_ms_slowest"]
    assert rank == 0 and 2 * 50 <= forward_ms <= first["timers_ms"]["forward-compute"][0]
    assert first["stragglers"] == [] and f"forward ms fastest: {forward_ms:.1f} (rank 0)" in format_log_line(first)
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


@pytest.mark.slow
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


def test_a_straggler_is_a_rank_over_its_stage_median_by_more_than_the_margin():
    assert STRAGGLER_MARGIN == 0.10  # the rule docs/guide.md states
    # One stage: the median of 10, 10.5, 11.6 and 30 is 11.05; 11.6 is within 10% of it (12.155), 30 is not.
    report = stragglers([10.0, 10.5, 11.6, 30.0], [0, 0, 0, 0], count=1)
    assert report == {"forward_ms_fastest": [[0, 10.0]], "forward_ms_slowest": [[3, 30.0]],
                      "stragglers": [[3, 30.0, 11.05]], "stragglers_count": 1}
    # Two pipeline stages, each rank against its own stage: stage 0 (ranks 0, 2) has the median 20 and rank 2's 30
    # is over 22; stage 1's 50 and 52 (median 51) are within 10%, though both are slower than rank 2.
    report = stragglers([10.0, 50.0, 30.0, 52.0], [0, 1, 0, 1], count=2)
    assert report["stragglers"] == [[2, 30.0, 20.0]] and report["stragglers_count"] == 1
    assert report["forward_ms_fastest"] == [[0, 10.0], [2, 30.0]]
    assert report["forward_ms_slowest"] == [[3, 52.0], [1, 50.0]]
    # The furthest over first, up to the count; the count says how many there were.
    report = stragglers([10.0, 10.0, 10.0, 40.0, 10.0, 20.0], [0] * 6, count=1)
    assert report["stragglers"] == [[3, 40.0, 10.0]] and report["stragglers_count"] == 2
    line = format_log_line({"kind": "train", "iteration": 1, **report})
    assert line.endswith("| stragglers (2): rank 3 40.0 ms (+300% over its stage's median 10.0)")


@pytest.mark.parametrize("argv, message", [
    (["--straggler-minmax-count", "2"], "--straggler-minmax-count needs --log-straggler"),
    (["--memory-snapshot-path", "x.pickle"], "--memory-snapshot-path needs --record-memory-history"),
    (["--flight-recorder-trace-buffer-size", "10"],
     "--flight-recorder-trace-buffer-size needs --flight-recorder-dump-path"),
    (["--log-straggler", "--straggler-minmax-count", "0"], "--straggler-minmax-count 0 must be at least 1"),
])
def test_diagnostics_flags_without_what_they_steer_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit):
        parse_args([*MODEL, *argv])
    assert message in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusals on CPU")
@pytest.mark.parametrize("argv, message", [
    (["--record-memory-history"], "--record-memory-history records the CUDA caching allocator's history and "
                                  "needs CUDA"),
    (["--log-straggler", "--disable-straggler-on-startup"], "--disable-straggler-on-startup steers megatron-core's "
                                                            "StragglerDetector controller, which runs on CUDA only"),
    (["--log-straggler", "--straggler-ctrlr-port", "6000"], "--straggler-ctrlr-port 6000 steers"),
    (["--flight-recorder-dump-path", "fr"], "--flight-recorder-dump-path: NCCL's flight recorder records NCCL's "
                                            "collectives, which run on CUDA only"),
])
def test_cuda_only_diagnostics_are_refused_on_cpu_in_one_line(argv, message, tmp_path, single_process):
    with pytest.raises(ValueError, match=message):
        in_process_trainer([*MODEL, "--save", str(tmp_path), *argv])


def test_the_flight_recorder_gets_megatron_lms_variables(tmp_path, monkeypatch):
    """Megatron-LM's initialize.py (main, after core_v0.16.1): a directory becomes the prefix <dir>/_dump_, a
    variable already set wins, and a path already in the environment turns the recorder on without the flag."""
    variables = ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "TORCH_NCCL_TRACE_BUFFER_SIZE",
                 "TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_INCLUDE_STACK_TRACE", "TORCH_INCLUDE_ONLY_ACTIVE",
                 "TORCH_NCCL_EXTRA_DUMP_ON_EXEC")
    for name in variables:
        monkeypatch.delenv(name, raising=False)
    flight_recorder_environment(None, 2000)
    assert not any(name in os.environ for name in variables)
    monkeypatch.setenv("TORCH_NCCL_DUMP_ON_TIMEOUT", "0")
    flight_recorder_environment(str(tmp_path), 500)
    prefix = str(tmp_path / "_dump_")
    assert {name: os.environ[name] for name in variables} == {
        "TORCH_FR_DUMP_TEMP_FILE": prefix, "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": prefix,
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "500", "TORCH_NCCL_DUMP_ON_TIMEOUT": "0", "TORCH_INCLUDE_STACK_TRACE": "0",
        "TORCH_INCLUDE_ONLY_ACTIVE": "1", "TORCH_NCCL_EXTRA_DUMP_ON_EXEC": "1"}
    for name in variables:
        monkeypatch.delenv(name)
    monkeypatch.setenv("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", str(tmp_path / "trace_"))
    flight_recorder_environment(None, 2000)
    assert os.environ["TORCH_FR_DUMP_TEMP_FILE"] == str(tmp_path / "trace_")
    assert os.environ["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "2000"


def test_the_flight_recorder_is_set_up_before_the_process_group(monkeypatch):
    """distributed.initialize sets the variables before it creates the process group (NCCL reads them then)."""
    seen = {}

    def init_process_group(*args, **kwargs):
        seen.update(os.environ)
        raise RuntimeError("stop here")

    monkeypatch.delenv("TORCH_FR_DUMP_TEMP_FILE", raising=False)
    monkeypatch.delenv("TORCH_NCCL_TRACE_BUFFER_SIZE", raising=False)
    monkeypatch.setattr(distributed.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(distributed.torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(distributed.dist, "init_process_group", init_process_group)
    with pytest.raises(RuntimeError, match="stop here"):
        distributed.initialize(flight_recorder_dump_path="/tmp/fr_", flight_recorder_trace_buffer_size=64)
    assert seen["TORCH_FR_DUMP_TEMP_FILE"] == "/tmp/fr_" and seen["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "64"


@pytest.mark.gpu
def test_record_memory_history_writes_megatron_lms_snapshots(tmp_path, single_process):
    """The last rank (here the only one) writes torch's snapshot at each logged iteration and the first: the
    allocator's segments and the history of allocations with their Python stacks."""
    snapshot = tmp_path / "snapshot.pickle"
    trainer = in_process_trainer([*MODEL, "--save", str(tmp_path / "run"), "--record-memory-history",
                                  "--memory-snapshot-path", str(snapshot), "--eval-iters", "0"])
    assert trainer.run() == 0
    with open(snapshot, "rb") as file:
        state = pickle.load(file)
    assert state["segments"] and any(trace for trace in state["device_traces"])
    allocations = [entry for trace in state["device_traces"] for entry in trace if entry["action"] == "alloc"]
    assert allocations and any(frame["filename"].endswith("step.py") for entry in allocations
                               for frame in entry["frames"])


@pytest.mark.gpu
def test_megatron_cores_straggler_detector_times_the_forward_passes_on_cuda(tmp_path, single_process, monkeypatch):
    """On CUDA the forward passes are timed by megatron-core's StragglerDetector (the larger of CUDA events and
    the wall clock): two micro-batches a step, each forward 50 ms late."""
    pytest.importorskip("pynvml")  # the detector reads the GPU's temperature through NVML
    monkeypatch.setenv(faults.SLOW_RANK, "0:0.05")
    run_dir = tmp_path / "run"
    trainer = in_process_trainer([*MODEL, "--save", str(run_dir), "--log-straggler", "--eval-iters", "0"])
    assert trainer.run() == 0
    for record in train_records(run_dir):
        [[rank, forward_ms]] = record["forward_ms_slowest"]
        assert rank == 0 and forward_ms >= 2 * 50 and record["stragglers"] == []
