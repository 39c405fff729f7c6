"""Megatron-LM's logging flags with its meaning: --tensorboard-log-interval, --tensorboard-queue-size,
--no-log-loss-scale-to-tensorboard, --log-world-size-to-tensorboard, --log-memory-interval, --log-device-memory-used,
--logging-level, --log-progress, --log-energy, --config-logger-dir, --save-wgrads-interval, --save-dgrads-interval and
--dump-param-to-param-group-map."""

import glob
import json
import logging
import math
import os
import pickle
from types import SimpleNamespace

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.metadata import StorageMeta
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from angpt import pretrain
from angpt.config import megatron_lm
from angpt.config.arguments import parse_args
from angpt.telemetry import performance
from angpt.telemetry.metrics import MetricsLogger, format_log_line
from angpt.telemetry.metrics_reader import read_metrics
from angpt.telemetry.monitoring import TrainingMonitor
from angpt.telemetry.performance import GpuEnergy, memory_report, model_flops_per_token

from conftest import in_process_trainer

MOCK = ["--mock-data", "--vocab-size", "64", "--train-iters", "4"]


def parse_error(argv, capsys) -> str:
    with pytest.raises(SystemExit):
        parse_args([*MOCK, *argv], world_size=1)
    return capsys.readouterr().err


@pytest.mark.parametrize("argv,message", [
    (["--log-memory-interval", "150"], "--log-memory-interval 150 must be a multiple of --log-interval 100 "
                                       "(Megatron-LM's check)"),
    (["--log-interval", "2", "--log-memory-interval", "3"], "--log-memory-interval 3 must be a multiple of "
                                                            "--log-interval 2"),
    (["--log-memory-interval", "0"], "--log-memory-interval 0 must be at least 1"),
    (["--tensorboard-log-interval", "0", "--tensorboard-dir", "tb"], "--tensorboard-log-interval 0 with "
                                                                     "--tensorboard-dir: Megatron-LM divides"),
    (["--tensorboard-log-interval", "-1"], "--tensorboard-log-interval -1 cannot be negative"),
    (["--save-wgrads-interval", "2"], "--save-wgrads-interval needs --save"),
    (["--save", "x", "--save-wgrads-interval", "0"], "--save-wgrads-interval 0 must be at least 1"),
    (["--save", "x", "--bf16", "--save-dgrads-interval", "0"], "--save-dgrads-interval 0 must be at least 1"),
    (["--save", "x", "--save-dgrads-interval", "1"], "--save-dgrads-interval needs --bf16 or --fp16"),
])
def test_these_logging_flags_out_of_range_or_alone_are_refused(argv, message, capsys):
    assert message in parse_error(argv, capsys)


def test_the_logging_flags_take_megatron_lms_defaults_and_their_boundaries():
    """Megatron-LM's defaults ask for nothing; --log-memory-interval equal to --log-interval, 1 for the others, and
    --tensorboard-log-interval 0 without --tensorboard-dir (Megatron-LM writes no TensorBoard then) are taken."""
    default = parse_args(MOCK, world_size=1)
    given = parse_args([*MOCK, "--tensorboard-log-interval", "1", "--tensorboard-queue-size", "1000",
                        "--config-logger-dir", "", "--log-memory-interval", "100"], world_size=1)
    assert default.logging.tensorboard_log_interval == given.logging.tensorboard_log_interval == 1
    assert given.logging.log_memory_interval == 100 and given.logging.config_logger_dir == ""
    assert megatron_lm.notes(given) == megatron_lm.notes(default) == []
    ones = parse_args([*MOCK, "--log-interval", "1", "--log-memory-interval", "1", "--save", "x",
                       "--save-wgrads-interval", "1", "--bf16", "--save-dgrads-interval", "1",
                       "--tensorboard-queue-size", "0"], world_size=1)
    assert (ones.logging.log_memory_interval, ones.checkpoint.save_wgrads_interval,
            ones.checkpoint.save_dgrads_interval, ones.logging.tensorboard_queue_size) == (1, 1, 1, 0)
    zero = parse_args([*MOCK, "--tensorboard-log-interval", "0"], world_size=1)
    assert megatron_lm.notes(zero) == [
        "--tensorboard-log-interval 0: no step's own figures go to TensorBoard or W&B, only the other figures of each "
        "--log-interval record (Megatron-LM writes no TensorBoard without --tensorboard-dir)"]


@pytest.mark.parametrize("argv,cuda,line", [
    (["--no-log-loss-scale-to-tensorboard"], True, "--no-log-loss-scale-to-tensorboard: without --fp16 there is no "
                                                   "loss scale to log (nothing changes)"),
    (["--disable-log-loss-scale-to-tensorboard"], True, "--no-log-loss-scale-to-tensorboard: without --fp16"),
    (["--log-memory-interval", "100"], False, "--log-memory-interval: without CUDA there is no CUDA memory to report "
                                              "(nothing changes)"),
    (["--log-device-memory-used", "--log-memory-interval", "100"], False, "--log-device-memory-used: without CUDA"),
    (["--log-device-memory-used"], True, "--log-device-memory-used: its figure goes into the reports of "
                                         "--log-memory-interval, not given"),
    (["--log-progress"], True, "--log-progress: without --save there is no progress.txt (as in Megatron-LM, nothing "
                               "is written)"),
    (["--log-energy"], False, "--log-energy: without CUDA there is no GPU energy counter to read (nothing changes)"),
])
def test_what_changes_nothing_here_is_said_in_one_line(argv, cuda, line):
    notes = megatron_lm.notes(parse_args([*MOCK, *argv], world_size=1), cuda=cuda)
    assert any(note.startswith(line) for note in notes), notes
    assert megatron_lm.notes(parse_args([*MOCK, "--fp16", "--no-log-loss-scale-to-tensorboard"], world_size=1)) == []


def test_log_energy_without_nvidia_ml_py_is_said_to_measure_nothing(monkeypatch):
    monkeypatch.setattr(megatron_lm.importlib.util, "find_spec", lambda name: None)
    assert megatron_lm.notes(parse_args([*MOCK, "--log-energy"], world_size=1), cuda=True) == [
        "--log-energy: reading the GPUs' energy needs nvidia-ml-py (pynvml), which is not installed: nothing is "
        "measured (Megatron-LM logs 0 J then)"]


def test_the_steps_figures_for_tensorboard_follow_the_loss_scale_and_world_size_flags():
    """Megatron-LM's tags at each --tensorboard-log-interval: the step's loss, lr, batch size, grad norm, the loss
    scale unless --no-log-loss-scale-to-tensorboard, the world size with --log-world-size-to-tensorboard."""
    step = dict(loss=4.5, lr=1e-3, grad_norm=None, global_batch_size=8, consumed_samples=24, loss_scale=1024.0)
    for scale, world, expected in ((True, False, {"train/loss_scale": 1024.0}), (False, True, {"train/world_size": 4}),
                                   (False, False, {})):
        monitor = SimpleNamespace(seq_length=16, world_size=4, logging=SimpleNamespace(
            log_loss_scale_to_tensorboard=scale, log_world_size_to_tensorboard=world))
        scalars = TrainingMonitor.step_scalars(monitor, step)
        assert math.isnan(scalars.pop("train/grad_norm"))
        assert scalars == {"train/lm_loss": 4.5, "train/lr": 1e-3, "train/global_batch_size": 8,
                           "train/consumed_samples": 24, "train/consumed_tokens": 384, **expected}


def test_tensorboard_queue_size_is_the_summary_writers_max_queue(tmp_path):
    for size in (7, 0):
        metrics = MetricsLogger(None, str(tmp_path / str(size)), queue_size=size)
        assert metrics._writer._get_file_writer().event_writer._async_writer._byte_queue.maxsize == size
        metrics.close()


def test_logging_level_sets_the_root_loggers_and_angpts_level_over_the_environment(monkeypatch):
    """Megatron-LM's setup_logging: --logging-level, else MEGATRON_LOGGING_LEVEL, is the root logger's level (so
    megatron-core's); angpt's follows it. Without either: the root at WARNING, angpt at INFO."""
    root, angpt = logging.getLogger(), logging.getLogger("angpt")
    saved = root.level, angpt.level
    core = logging.getLogger("megatron.core.optimizer")
    try:
        monkeypatch.delenv("MEGATRON_LOGGING_LEVEL", raising=False)
        pretrain.set_logging_levels(None)
        assert (core.getEffectiveLevel(), angpt.level) == (logging.WARNING, logging.INFO)
        pretrain.set_logging_levels(10)
        assert (root.level, core.getEffectiveLevel(), angpt.level) == (10, 10, 10)
        monkeypatch.setenv("MEGATRON_LOGGING_LEVEL", "40")
        pretrain.set_logging_levels(None)
        assert (core.getEffectiveLevel(), angpt.level) == (40, 40)
        pretrain.set_logging_levels(20)
        assert (core.getEffectiveLevel(), angpt.level) == (20, 20)
    finally:
        root.setLevel(saved[0])
        angpt.setLevel(saved[1])
    assert parse_args([*MOCK, "--logging-level", "10"], world_size=1).logging.logging_level == 10


def test_the_memory_report_is_megatron_lms_line(monkeypatch):
    """Megatron-LM's report_memory (training/utils.py), MB of the CUDA allocator; the device's total with
    --log-device-memory-used."""
    mib = 1024 * 1024
    for name, value in (("memory_allocated", 1.5 * mib), ("max_memory_allocated", 2 * mib),
                        ("memory_reserved", 4 * mib), ("max_memory_reserved", 8 * mib),
                        ("device_memory_used", 80 * mib)):
        monkeypatch.setattr(performance.torch.cuda, name, lambda value=value: value)
    line = "[Rank 3] (after 200 iterations) memory (MB) | allocated: 1.50 | max allocated: 2.00 | reserved: 4.00 | " \
           "max reserved: 8.00"
    assert memory_report(200, 3) == line
    assert memory_report(200, 3, device_memory_used=True) == line + " | total device memory used: 80.00"


class RecordingEnergyMonitor:
    """megatron-core's EnergyMonitor's interface, with the joules its NVML counter would give."""

    def __init__(self):
        self.calls, self.laps = [], [240.0, 120.0]

    def __getattr__(self, name):
        return lambda: self.calls.append(name)

    def lap(self):
        self.calls.append("lap")
        return self.laps.pop(0)

    def get_total(self):
        self.calls.append("get_total")
        return 3.6e6


def test_log_energy_gives_megatron_lms_energy_and_power_per_gpu():
    """energy = lap / iterations / world size, power = energy / seconds per iteration (Megatron-LM's training_log):
    240 J over 4 iterations on 2 GPUs is 30 J/iter/GPU, and 0.5 s per iteration 60 W; paused around what is not a
    step; the total at the end."""
    monitor = RecordingEnergyMonitor()
    energy = GpuEnergy(monitor)
    figures = energy.figures(steps=4, seconds=2.0, world_size=2)
    assert figures == {"energy_per_gpu_j": 30.0, "power_per_gpu_w": 60.0}
    line = format_log_line({"kind": "train", "iteration": 4, **figures})
    assert "energy per GPU (J/iter/GPU): 30.0 | power per GPU (W/GPU): 60.0" in line
    with energy.paused():
        assert monitor.calls[-1] == "pause"
    assert energy.close() == 3.6e6
    assert monitor.calls == ["setup", "resume", "lap", "pause", "resume", "lap", "get_total", "shutdown"]


class TrustedReader(FileSystemReader):
    """torch's reader of a distributed checkpoint with torch's own read_metadata (angpt's refuses the path object
    torch's writer pickles into this file's metadata; the test trusts the file its run wrote)."""

    def read_metadata(self, *args, **kwargs):
        with open(os.path.join(self.path, ".metadata"), "rb") as file:
            metadata = pickle.load(file)
        metadata.storage_meta = metadata.storage_meta or StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def _event_steps(directory) -> dict[str, list[tuple[int, float]]]:
    events = EventAccumulator(str(directory), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [(event.step, event.value) for event in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


@pytest.fixture(scope="module")
def logged_run(tmp_path_factory, single_process):
    """Six bf16 steps logged every 2, TensorBoard's step figures every 3, saved every 3, with every flag here."""
    run = tmp_path_factory.mktemp("logged_run")
    save = run / "save"
    trainer = in_process_trainer([
        *MOCK[:-2], "--train-iters", "6", "--num-layers", "1", "--hidden-size", "32", "--seq-length", "16",
        "--micro-batch-size", "2", "--global-batch-size", "2", "--eval-iters", "0", "--bf16",
        "--use-distributed-optimizer", "--log-interval", "2", "--tensorboard-log-interval", "3",
        "--log-world-size-to-tensorboard", "--save", str(save), "--save-interval", "3", "--log-progress",
        "--save-wgrads-interval", "2", "--save-dgrads-interval", "3", "--dump-param-to-param-group-map",
        str(run / "groups"), "--config-logger-dir", str(run / "configs")])
    flops_per_token = model_flops_per_token(trainer.config, 16, trainer.vocab_size)
    names = {name: param for name, param in trainer.chunks[0].module.named_parameters()}
    assert trainer.run() == 0
    return SimpleNamespace(dir=run, save=save, flops_per_token=flops_per_token, params=names,
                           records=read_metrics(str(save / "metrics.jsonl")))


@pytest.mark.slow  # the in-process run
def test_tensorboard_gets_the_steps_figures_at_their_interval_and_the_rest_every_log_interval(logged_run):
    scalars = _event_steps(logged_run.save / "tensorboard")
    for tag in ("train/lm_loss", "train/lr", "train/grad_norm", "train/global_batch_size", "train/consumed_tokens"):
        assert [step for step, _ in scalars[tag]] == [3, 6], tag
    assert scalars["train/world_size"] == [(3, 1.0), (6, 1.0)]
    assert [step for step, _ in scalars["train/ms_per_step"]] == [2, 4, 6]
    record = next(r for r in logged_run.records if r["kind"] == "train" and r["iteration"] == 6)
    assert dict(scalars["train/grad_norm"])[6] == pytest.approx(record["grad_norm"], rel=1e-6)
    assert dict(scalars["train/lr"])[6] == pytest.approx(record["lr"], rel=1e-6)
    assert dict(scalars["train/consumed_tokens"])[3] == 3 * 2 * 16


@pytest.mark.slow  # the in-process run
def test_log_progress_writes_megatron_lms_progress_txt(logged_run):
    lines = [line.split("\t") for line in (logged_run.save / "progress.txt").read_text().splitlines()]
    assert [fields[3] for fields in lines] == ["Starting job", "Saved checkpoint", "Saved checkpoint"]
    assert all(fields[1] == f"Job ID: {os.getenv('SLURM_JOB_ID', '')}" and fields[2] == "# GPUs: 1"
               for fields in lines)
    for fields, iteration in zip(lines[1:], (3, 6)):
        assert len(fields) == 9 and fields[4] == f"Iteration: {iteration}"
        assert fields[5].startswith("Job throughput: ") and fields[5].endswith(" TFLOP/s/GPU")
        assert fields[6].startswith("Cumulative throughput: ") and fields[6].endswith(" TFLOP/s/GPU")
        # Megatron-LM's: the model FLOPs of every sample so far (2 per iteration, of 16 tokens).
        assert fields[7] == f"Floating-point operations: {logged_run.flops_per_token * 16 * 2 * iteration:.2e}"
        assert fields[8] == "Tokens (in billions): 0.00"


@pytest.mark.slow  # the in-process run
def test_save_wgrads_interval_saves_the_reduced_grads_whose_norm_the_step_logs(logged_run):
    """Every weight's main_grad at iterations 2, 4 and 6; their L2 norm is the logged step's (unclipped) grad
    norm."""
    files = sorted(glob.glob(str(logged_run.save / "wgrads" / "iter_*" / "*.pth")))
    assert [os.path.relpath(f, logged_run.save) for f in files] == [
        f"wgrads/iter_000000{i}/mp_rank_00.pth" for i in (2, 4, 6)]
    grads = torch.load(files[-1])["model_chunk0"]
    assert set(grads) == set(logged_run.params)
    assert all(grads[name].shape == param.shape for name, param in logged_run.params.items())
    norm = math.sqrt(sum(float(grad.double().square().sum()) for grad in grads.values()))
    record = next(r for r in logged_run.records if r["kind"] == "train" and r["iteration"] == 6)
    assert norm == pytest.approx(record["grad_norm"], rel=1e-5)


@pytest.mark.slow  # the in-process run
def test_save_dgrads_interval_saves_the_linear_layers_input_and_output_grads(logged_run):
    files = sorted(glob.glob(str(logged_run.save / "dgrads" / "iter_*" / "*.pth")))
    assert [os.path.relpath(f, logged_run.save) for f in files] == [
        f"dgrads/iter_000000{i}/mp_rank_00.pth" for i in (3, 6)]
    grads = torch.load(files[-1])["model_chunk0"]
    # The output layer's: its input [s, b, h] and its logits' [s, b, padded vocabulary].
    assert grads["output_layer/input0"].shape == (16, 2, 32)
    assert grads["output_layer/output0"].shape[:2] == (16, 2)
    assert {"decoder.layers.0.mlp.linear_fc1/output0", "decoder.layers.0.mlp.linear_fc2/input0"} <= set(grads)


@pytest.mark.slow  # the in-process run
def test_dump_param_to_param_group_map_writes_megatron_cores_map(logged_run, tmp_path):
    """Each weight's optimizer group: megatron-core decays no 1-D parameter, so they share no group with the
    matrices."""
    groups = {}
    _load_state_dict(groups, storage_reader=TrustedReader(str(logged_run.dir / "groups")),
                     planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    # megatron-core names them as the DDP wrapper does.
    assert set(groups) == {f"module.{name}" for name in logged_run.params}
    vectors = {groups[f"module.{name}"] for name, param in logged_run.params.items() if param.dim() == 1}
    matrices = {groups[f"module.{name}"] for name, param in logged_run.params.items() if param.dim() > 1}
    assert vectors and matrices and not vectors & matrices


@pytest.mark.slow  # the in-process run
def test_config_logger_dir_holds_megatron_cores_config_logs(logged_run):
    """megatron-core's config logger: the model's, the DDP wrapper's and the optimizer's constructor arguments, the
    initial weights, and one input_and_logits file per forward pass (6 steps of one micro-batch)."""
    directory = logged_run.dir / "configs"
    model = json.loads(next(directory.glob("NormalizedGPTModel.rank_*.iter0.json")).read_text())
    assert model["vocab_size"] == 128 and model["config"]["hidden_size"] == 32  # 64 padded to a multiple of 128
    assert list(directory.glob("DistributedDataParallel.rank_*.iter0.json"))
    assert list(directory.glob("DistributedOptimizer.rank_*.json"))
    initial = torch.load(next(directory.glob("NormalizedGPTModel_init_ckpt.rank_*.iter0.pth")))
    assert set(initial) >= {"embedding.word_embeddings.weight", "output_layer.weight"}
    forwards = sorted(directory.glob("input_and_logits.rank_*.pth"))
    assert len(forwards) == 6
    assert set(torch.load(forwards[0])) == {"input_ids", "position_ids", "attention_mask", "decoder_input", "logits"}
