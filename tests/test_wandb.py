"""The Weights & Biases sink (--wandb-project, Megatron-LM's flags) on a real in-process run in W&B's offline
mode: what W&B wrote is read back from its run file with a reader of the file's format written here, and held
to the run's metrics.jsonl (angpt.telemetry.metrics_reader) and TensorBoard scalars (TensorBoard's own reader)."""

from __future__ import annotations

import contextlib
import glob
import json
import os
import struct
import sys
import time
import zlib

import pytest
import wandb
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from wandb.proto import wandb_internal_pb2

from angpt.config.arguments import parse_args
from angpt.telemetry.metrics_reader import read_metrics

from conftest import in_process_trainer

ITERS, EVAL_INTERVAL = 4, 2
MODEL = ["--model-family", "angpt", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "4", "--mock-data",
         "--vocab-size", "128", "--lr", "1e-2", "--train-iters", str(ITERS), "--log-interval", "1"]
# W&B's own keys in every history row.
WANDB_KEYS = {"_step", "_runtime", "_timestamp"}


def offline_environment(monkeypatch, tmp_path) -> None:
    """Offline W&B that keeps its settings and caches inside the test's directory (and is not told to be silent:
    the logger has to make it so)."""
    for name, value in (("WANDB_MODE", "offline"), ("WANDB_DISABLE_GIT", "true"), ("WANDB_DISABLE_CODE", "true"),
                        ("WANDB_CONFIG_DIR", tmp_path / "wandb_config"), ("WANDB_CACHE_DIR", tmp_path / "wandb_cache"),
                        ("WANDB_DATA_DIR", tmp_path / "wandb_data")):
        monkeypatch.setenv(name, str(value))
    for name in ("WANDB_API_KEY", "WANDB_BASE_URL", "WANDB_RUN_ID", "WANDB_RESUME", "WANDB_SILENT", "WANDB_QUIET",
                 "WANDB_CONSOLE"):
        monkeypatch.delenv(name, raising=False)


@contextlib.contextmanager
def console_to(path):
    """stdout and stderr, of Python and of the processes started inside (W&B's service), into the file `path`."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(path, "w") as file, contextlib.redirect_stdout(file), contextlib.redirect_stderr(file):
        os.dup2(file.fileno(), 1)
        os.dup2(file.fileno(), 2)
        try:
            yield
        finally:
            file.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])


def wandb_records(path: str) -> list:
    """The records of a W&B run file (run-<id>.wandb): after a 7-byte header (":W&B", magic 0xBEE1, version 0),
    LevelDB's log format (32 KiB blocks of chunks, each with a CRC-32 of its type and data, its length and
    its type: whole, first, middle or last part of a record), each record a wandb_internal_pb2.Record."""
    with open(path, "rb") as file:
        data = file.read()
    assert struct.unpack("<4sHB", data[:7]) == (b":W&B", 0xBEE1, 0)
    records, pending, position, block = [], b"", 7, 32768
    while position + 7 <= len(data):
        if block - position % block < 7:  # too little room left in the block for a chunk header: padding
            position += block - position % block
            continue
        checksum, length, kind = struct.unpack("<IHB", data[position:position + 7])
        chunk = data[position + 7:position + 7 + length]
        position += 7 + length
        if kind == 0 and length == 0:  # zeros at the end of a block
            continue
        assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) == checksum, f"{path}: damaged chunk at {position}"
        pending += chunk
        if kind in (1, 4):  # a whole record, or the last part of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    assert not pending, f"{path}: ends inside a record"
    return records


def history(records) -> dict[int, dict]:
    """{step: {key: value}} of the history records, W&B's own keys left out."""
    rows = {}
    for record in records:
        if record.WhichOneof("record_type") == "history":
            row = {".".join(item.nested_key) or item.key: json.loads(item.value_json) for item in record.history.item}
            assert row["_step"] == record.history.step.num
            rows.setdefault(record.history.step.num, {}).update(
                {key: value for key, value in row.items() if key not in WANDB_KEYS})
    return rows


def only(records, kind: str):
    found = [record for record in records if record.WhichOneof("record_type") == kind]
    assert len(found) == 1, f"{len(found)} {kind} records"
    return getattr(found[0], kind)


@pytest.fixture(scope="module")
def offline_run(tmp_path_factory, single_process):
    """A run of ITERS steps, each logged, validation every EVAL_INTERVAL, logged to W&B offline:
    (run directory, the W&B run file, seconds the run took); its console output in console.txt."""
    tmp_path = tmp_path_factory.mktemp("wandb_run")
    with pytest.MonkeyPatch.context() as monkeypatch, console_to(tmp_path / "console.txt"):
        offline_environment(monkeypatch, tmp_path)
        start = time.monotonic()
        trainer = in_process_trainer([
            *MODEL, "--eval-interval", str(EVAL_INTERVAL), "--eval-iters", "1",
            "--metrics-file", str(tmp_path / "metrics.jsonl"), "--tensorboard-dir", str(tmp_path / "tensorboard"),
            "--wandb-project", "angpt-test", "--wandb-exp-name", "tiny", "--wandb-save-dir", str(tmp_path / "wb")])
        assert trainer.run() == 0
        # run.finish() returns before W&B's service has written all of the run file; it has once the service
        # is shut down (what happens at the exit of a training process).
        wandb.teardown()
        seconds = time.monotonic() - start
    # wandb.init(dir=D) writes D/wandb/offline-run-<time>-<id>/run-<id>.wandb.
    run_files = glob.glob(str(tmp_path / "wb" / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(run_files) == 1, run_files
    print(f"trainer with W&B offline: {seconds:.1f} s", file=sys.stderr)
    return tmp_path, run_files[0], seconds


@pytest.mark.slow
def test_wandb_has_the_steps_and_losses_of_metrics_jsonl(offline_run):
    run_dir, run_file, _ = offline_run
    rows = history(wandb_records(run_file))
    records = read_metrics(str(run_dir / "metrics.jsonl"))
    train = {r["iteration"]: r for r in records if r["kind"] == "train"}
    assert sorted(train) == list(range(1, ITERS + 1))
    assert sorted(rows) == sorted(train)
    for iteration, record in train.items():
        for name in ("lm_loss", "lr", "grad_norm", "consumed_tokens"):
            assert rows[iteration][f"train/{name}"] == record[name], (iteration, name)
    validation = [r for r in records if r["kind"] == "eval" and r["split"] == "validation"]
    assert [r["iteration"] for r in validation] == list(range(EVAL_INTERVAL, ITERS + 1, EVAL_INTERVAL))
    for record in validation:  # the last step's too: the test split's loss there has a name of its own
        assert rows[record["iteration"]]["validation/lm_loss"] == record["lm_loss"]


@pytest.mark.slow  # the offline run: an in-process trainer with W&B
def test_wandb_keys_are_the_tensorboard_tags(offline_run):
    run_dir, run_file, _ = offline_run
    rows = history(wandb_records(run_file))
    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert "train/lm_loss" in tags and "train/health/residual_norm/layer_01" in tags
    assert set().union(*rows.values()) == tags
    for tag in tags:
        steps = [event.step for event in events.Scalars(tag)]
        got = {step: row[tag] for step, row in rows.items() if tag in row}
        assert sorted(got) == sorted(set(steps)), tag
        for event in events.Scalars(tag):
            if steps.count(event.step) == 1:  # not the validation and test losses of the last step
                assert got[event.step] == pytest.approx(event.value, rel=1e-6), (tag, event.step)  # float32


@pytest.mark.slow  # the offline run: an in-process trainer with W&B
def test_wandb_run_has_the_flags_as_config_and_is_finished(offline_run):
    _, run_file, _ = offline_run
    records = wandb_records(run_file)
    run = only(records, "run")
    assert (run.project, run.display_name) == ("angpt-test", "tiny")
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert (config["lr"], config["train_iters"], config["model_family"]) == (1e-2, ITERS, "angpt")
    assert config["wandb_project"] == "angpt-test" and config["eval_interval"] == EVAL_INTERVAL
    assert only(records, "exit").exit_code == 0  # run.finish() at the end of training


@pytest.mark.slow  # the offline run: an in-process trainer with W&B
def test_wandb_offline_costs_seconds_not_a_hang(offline_run):
    # The whole in-process run (model built, 4 steps, evaluations, W&B's service started and shut down).
    assert offline_run[2] < 60


@pytest.mark.slow  # the offline run: an in-process trainer with W&B
def test_wandb_prints_nothing_between_the_log_lines(offline_run):
    lines = (offline_run[0] / "console.txt").read_text().splitlines()
    assert sum(line.startswith(" iteration ") for line in lines) == ITERS
    assert not [line for line in lines if "wandb" in line.lower()]


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--wandb-exp-name", "x"], "--wandb-exp-name needs --wandb-project (W&B is off without it)"),
        (["--wandb-entity", "team"], "--wandb-entity needs --wandb-project"),
        (["--wandb-save-dir", "/tmp/wb"], "--wandb-save-dir needs --wandb-project"),
        (["--wandb-project", "p"], "--wandb-project needs --wandb-save-dir or --save (W&B's files go to "
                                   "<save>/wandb)"),
    ],
)
def test_wandb_flags_that_cannot_work_are_refused(flags, message, capsys):
    with pytest.raises(SystemExit):
        parse_args([*MODEL, *flags], world_size=1)
    last_line = capsys.readouterr().err.splitlines()[-1]
    assert last_line.startswith("angpt.pretrain: error: ") and message in last_line


def test_wandb_project_without_the_package_is_one_line_naming_the_flag(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed: find_spec and import fail
    with pytest.raises(SystemExit) as exit_:
        parse_args([*MODEL, "--wandb-project", "p", "--save", "/tmp/unused"], world_size=1)
    assert exit_.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "angpt.pretrain: error: --wandb-project needs the wandb package: pip install wandb (see --help)")
