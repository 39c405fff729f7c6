"""Fault drills that once ended in a wrong result or a traceback: token ids beyond the vocabulary at tensor
parallelism 2 (under torchrun), and what metrics.jsonl says about a skipped step and a resumed run (in
this process: a torchrun launch costs 20 s or more)."""

import json
import os
import shutil

import numpy as np
import pytest
import torch
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

from angpt.data.indexed import IndexedDatasetError, write_metadata
from angpt.telemetry.metrics_reader import read_metrics
from angpt.training import step
from angpt.training.checkpointing import write_latest_iteration

from conftest import ROOT, in_process_trainer
from launch import launch

MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
         "--micro-batch-size", "4", "--global-batch-size", "8", "--lr", "1e-2", "--log-interval", "1",
         "--eval-iters", "0"]


def write_understated_dataset(prefix: str, **metadata) -> int:
    """20 documents of ids up to 599 whose .json records vocab_size 100; returns the largest id."""
    documents = [np.random.default_rng(seed).integers(0, 600, size=300) for seed in range(20)]
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for document in documents:
        builder.add_document(torch.from_numpy(document), [len(document)])
    builder.finalize(prefix + ".idx")
    write_metadata(prefix + ".json", {"tokenizer": {"type": "test"}, "vocab_size": 100, "eod": 99,
                                      "append_eod": False, "documents": 20, "tokens": 20 * 300, **metadata})
    return max(int(document.max()) for document in documents)


def test_a_dataset_written_by_megatron_lms_tool_trains_with_its_tokenizer_flags(tmp_path, single_process):
    """No .json beside the .bin/.idx, as Megatron-LM's tools/preprocess_data.py writes it: its NullTokenizer
    flags give the vocabulary (599 ids and the end-of-document id 599), and the run trains."""
    prefix = str(tmp_path / "megatron_text_document")
    largest = write_understated_dataset(prefix)
    os.remove(prefix + ".json")
    trainer = in_process_trainer([*MODEL, "--train-iters", "2", "--train-data-path", prefix, "--data-cache-path",
                                  str(tmp_path / "cache"), "--tokenizer-type", "NullTokenizer", "--vocab-size",
                                  str(largest), "--save", str(tmp_path / "run")])
    assert (trainer.vocabulary.vocab_size, trainer.vocabulary.eod) == (largest + 1, largest)
    assert trainer.run() == 0
    assert [record["iteration"] for record in read_metrics(str(tmp_path / "run" / "metrics.jsonl"))
            if record["kind"] == "train"] == [1, 2]


@pytest.mark.multiprocess
def test_token_ids_beyond_the_vocabulary_stop_a_tensor_parallel_run_before_it_trains(tmp_path):
    """The drill: a .json (here without max_token_id, as older ones) records vocab_size 100 for ids up to 599.
    At TP 1 megatron-core's embedding raised IndexError; at TP 2 its vocab-parallel embedding and
    cross-entropy mask ids outside each rank's rows, and the run trained to exit 0 on zero embeddings."""
    prefix = str(tmp_path / "understated_text_document")
    largest = write_understated_dataset(prefix)
    done = launch(["-m", "angpt.pretrain", *MODEL, "--tensor-model-parallel-size", "2", "--train-iters", "2",
                   "--train-data-path", prefix, "--data-cache-path", str(tmp_path / "cache")],
                  nproc=2, timeout=300, env={**os.environ, "PYTHONPATH": ROOT, "PYTHONWARNINGS": "ignore"})
    output = done.stdout + done.stderr
    assert done.returncode != 0, output[-4000:]
    assert (f"angpt.pretrain: {prefix}.bin holds token id {largest}, outside the vocab_size 100 of {prefix}.json"
            in done.stderr.splitlines()), output[-4000:]
    assert "iteration        1/" not in output  # refused before the first step


def train_in_process(*flags: str, data=("--mock-data", "--vocab-size", "256")) -> int:
    return in_process_trainer([*MODEL, *data, *flags]).run()


def test_a_max_token_id_that_understates_the_bin_is_caught_by_the_batches(tmp_path, single_process):
    """The check at opening trusts a recorded max_token_id; the trainer's batches do not."""
    prefix = str(tmp_path / "lying_text_document")
    write_understated_dataset(prefix, max_token_id=99)
    with pytest.raises(IndexedDatasetError, match=rf"^{prefix}\.bin: sample 0 holds token id \d+, outside the "
                                                  "vocabulary of 100"):
        train_in_process("--train-iters", "1", data=("--train-data-path", prefix, "--data-cache-path",
                                                     str(tmp_path / "cache")))


@pytest.fixture(scope="module")
def resumed_run(tmp_path_factory, single_process):
    """A run of 3 steps whose step 2 has a NaN grad norm but a finite loss, checkpointed at 2 (its save at
    3 lost, as in a crash), then resumed from 2 to 4, both logging to one metrics.jsonl. Returns (the
    metrics file, the second checkpoint directory, the loss step 2 computed)."""
    root = tmp_path_factory.mktemp("resumed")
    metrics, first, second = root / "metrics.jsonl", root / "first", root / "second"
    real_step = step.step_unless_not_finite
    losses = []

    def nan_grad_norm_at_step_2(optimizer, loss):
        losses.append(loss)
        return (False, float("nan")) if len(losses) == 2 else real_step(optimizer, loss)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(step, "step_unless_not_finite", nan_grad_norm_at_step_2)
        assert train_in_process("--train-iters", "3", "--save", str(first), "--save-interval", "2",
                                "--metrics-file", str(metrics)) == 0
    shutil.copytree(first / "iter_0000002", second / "iter_0000002")
    write_latest_iteration(str(second), 2)
    assert train_in_process("--train-iters", "4", "--save", str(second), "--load", str(second),
                            "--metrics-file", str(metrics)) == 0
    return metrics, second, losses[1]


@pytest.mark.slow
def test_a_step_skipped_for_its_grad_norm_logs_the_loss_it_computed(resumed_run):
    metrics, _, loss = resumed_run
    record = next(r for r in read_metrics(str(metrics)) if r["kind"] == "train" and r["iteration"] == 2)
    # It used to log NaN (null): the window's loss left skipped steps out.
    assert record["skipped"] == 1 and record["grad_norm"] is None
    assert record["lm_loss"] == pytest.approx(loss)


def test_each_start_is_marked_and_readers_keep_the_resumed_runs_steps(resumed_run):
    metrics, second, _ = resumed_run
    with open(metrics) as file:
        lines = [json.loads(line) for line in file]
    assert [(r["kind"], r["iteration"]) for r in lines] == [
        ("start", 0), ("train", 1), ("train", 2), ("train", 3), ("start", 2), ("train", 3), ("train", 4)]
    first_start, resumed_start = lines[0], lines[4]
    assert first_start["resumed"] is False and first_start["checkpoint"] is None
    assert resumed_start["resumed"] is True and resumed_start["checkpoint"] == str(second / "iter_0000002")
    assert resumed_start["world_size"] == 1 and resumed_start["train_iters"] == 4
    assert resumed_start["time"] >= lines[3]["time"]
    current = read_metrics(str(metrics))
    assert [r["iteration"] for r in current if r["kind"] == "train"] == [1, 2, 3, 4]
    assert lines[3] not in current and lines[5] in current  # step 3 as the resumed run trained it


def test_readers_drop_every_step_a_restart_trains_again(tmp_path):
    """Resumed from 2 and stopped after 3 without a save, then resumed from 3: the first run's steps 4 and 5
    are gone, though no later run logged 5 again."""
    path = tmp_path / "metrics.jsonl"
    runs = [("start", 0), *[("train", i) for i in range(1, 6)], ("start", 2), ("train", 3), ("start", 3),
            ("train", 4)]
    path.write_text("".join(json.dumps({"kind": kind, "iteration": i, "run": n}) + "\n"
                            for n, (kind, i) in enumerate(runs)) + '{"kind": "tra')  # a line cut by a kill
    assert [(r["kind"], r["iteration"], r["run"]) for r in read_metrics(str(path))] == [
        ("start", 0, 0), ("train", 1, 1), ("train", 2, 2), ("start", 2, 6), ("train", 3, 7), ("start", 3, 8),
        ("train", 4, 9)]
