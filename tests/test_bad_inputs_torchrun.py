"""Bad inputs on torchrun (issue 51, item 3): a data or checkpoint error is printed once, by rank 0 or by the rank
that found it, not once per rank; torchrun's own failure summary follows, but nothing of ours repeats. Two ranks
(data-parallel), warm-started; the damaged files are cases of the matrices of tests/test_bad_inputs.py and
tests/test_bad_checkpoints.py, and a save that finds no space. Cases tested elsewhere: a dataset without its
tokenizer's metadata (test_megatron_examples.py::
test_a_dataset_without_its_tokenizer_is_refused_in_one_line_by_the_node_not_by_each_rank), a checkpoint FSDP2
cannot shard (test_trainer.py, the one line of --use-torch-fsdp2 over 3 ranks)."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
from test_bad_checkpoints import MODEL
from test_bad_inputs import cell, damage, write_dataset
from test_faults import write_understated_dataset

from conftest import ROOT, in_process_trainer
from launch import launch

# Four launches of 2 ranks: about 45 s alone on 2 cores.
pytestmark = [pytest.mark.long, pytest.mark.multiprocess]

GROUP = "torchrun, 2 ranks"
BATCH = ["--micro-batch-size", "1", "--global-batch-size", "2"]


@pytest.fixture(scope="module")
def written(tmp_path_factory, single_process):
    """A dataset written with a tokenizer, and a run on it checkpointed at iterations 1 and 2 (one process:
    torch_dist loads at any layout)."""
    directory = tmp_path_factory.mktemp("written")
    prefix = write_dataset(directory)
    data = ["--data-path", prefix, "--split", "100,0,0"]
    save = directory / "saved"
    assert in_process_trainer([*MODEL, *data, "--data-cache-path", str(directory / "cache"), "--save", str(save),
                               "--save-interval", "1"]).run() == 0
    return prefix, save


def ours(done) -> list[str]:
    """The lines angpt printed, of every rank (torchrun's summary and the ranks' logging left out)."""
    return [line for line in (done.stdout + done.stderr).splitlines() if line.startswith("angpt.pretrain:")]


def train(tmp_path, *flags: str):
    return launch(["-m", "angpt.pretrain", *MODEL, *BATCH, "--data-cache-path", str(tmp_path / "cache"), *flags],
                  nproc=2, timeout=300, env={**os.environ, "PYTHONPATH": ROOT, "PYTHONWARNINGS": "ignore"})


def check_once(done, outcome: dict, named: str, most: int = 1) -> None:
    """One line of ours naming the file (at most `most`, each different: the rank that found it says what)."""
    output = done.stdout + done.stderr
    lines = ours(done)
    outcome["line"] = lines[0] if lines else None
    outcome["where"] = f"printed {len(lines)}x"
    assert done.returncode != 0, output[-4000:]
    assert "Traceback" not in output, output[-4000:]
    assert 1 <= len(lines) <= most and len(set(lines)) == len(lines), output[-4000:]
    assert all(named in line for line in lines), output[-4000:]


def test_a_damaged_checkpoint_is_refused_once(written, tmp_path):
    prefix, save = written
    root = tmp_path / "run"
    shutil.copytree(save, root)
    damage(root / "iter_0000002" / "__0_0.distcp", "flipped")
    with cell(GROUP, "checkpoint shard at --load", "flipped") as outcome:
        done = train(tmp_path, "--data-path", prefix, "--split", "100,0,0", "--train-iters", "3", "--load", str(root))
        check_once(done, outcome, str(root / "iter_0000002" / "__0_0.distcp"))


def test_a_damaged_dataset_is_refused_once(written, tmp_path):
    prefix = str(tmp_path / "corpus_text_document")
    for suffix in (".bin", ".idx", ".json"):
        shutil.copy(written[0] + suffix, prefix + suffix)
    damage(prefix + ".idx", "wrong kind")
    with cell(GROUP, ".idx as training opens it", "wrong kind") as outcome:
        check_once(train(tmp_path, "--data-path", prefix, "--split", "100,0,0", "--train-iters", "2"), outcome,
                   f"{prefix}.idx")


def test_a_token_id_past_the_vocabulary_in_a_batch_is_said_by_the_rank_that_found_it(tmp_path):
    """Found by the batches' check (the .json understates the largest id) on each data-parallel rank whose sample
    holds one: each says its own sample (two lines here, both ranks' samples hold one; the check has no collective,
    which would cost every micro-batch a round trip)."""
    prefix = str(tmp_path / "lying_text_document")
    write_understated_dataset(prefix, max_token_id=99)
    with cell(GROUP, ".bin (an id past the vocabulary, found in a batch)", "flipped") as outcome:
        done = train(tmp_path, "--train-data-path", prefix, "--train-iters", "2")
        check_once(done, outcome, f"{prefix}.bin", most=2)


@pytest.fixture
def small_filesystem(written, tmp_path):
    """A tmpfs with room for one checkpoint of the run, not two. Mounting needs root."""
    mount_point = tmp_path / "small"
    mount_point.mkdir()
    one = sum(path.stat().st_size for path in (written[1] / "iter_0000002").rglob("*") if path.is_file())
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={one * 3 // 2 // 1024 + 8}k", "tmpfs",
                              str(mount_point)], capture_output=True, text=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs (not root?): {mounted.stderr.strip()}")
    yield mount_point
    subprocess.run(["umount", str(mount_point)], check=True)


def test_a_save_that_finds_no_space_is_said_once(written, small_filesystem, tmp_path):
    """Refused before writing, by rank 0's verdict that every rank raises: before, each rank printed it."""
    with cell(GROUP, "--save on a full disk", "no space") as outcome:
        done = train(tmp_path, "--data-path", written[0], "--split", "100,0,0", "--train-iters", "4",
                     "--save", str(small_filesystem / "run"), "--save-interval", "2")
        check_once(done, outcome, f"no space left in {small_filesystem / 'run'} for the checkpoint of iteration 4")
