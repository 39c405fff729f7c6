"""Bad inputs, the checkpoint side (issue 51; the data side is tests/test_bad_inputs.py): every kind of file in a
checkpoint directory angpt writes, in both formats, x each damage (empty, truncated, a flipped byte, the wrong kind
of file, missing), loaded with --load. Each refused case ends, before training, in one CheckpointError line (the
trainer's `angpt.pretrain: ...`) that names the file; with --load-fallback-to-intact a damaged latest checkpoint
is skipped for the one before it (checked once per file, on the flipped byte), with a warning that names the
damaged file and one that names the checkpoint resumed from. A traceback would be an exception other than
CheckpointError escaping the trainer, which fails the test; one subprocess checks the command line itself.

    torch_dist   <root>/latest_checkpointed_iteration.txt, iter_XXXXXXX/{metadata.json, common.pt, __0_0.distcp,
                 __0_1.distcp, .metadata, angpt_digests.json, tokenizer/{bytes.tiktoken, angpt_tokenizer.json}}
    torch        <root>/latest_checkpointed_iteration.txt, iter_XXXXXXX/{mp_rank_00/model_optim_rng.pt,
                 angpt_digests.json, tokenizer/...}, and mp_rank_00/distrib_optim.pt with
                 --use-distributed-optimizer (torch_dist keeps the distributed optimizer's state in its shards)

The runs train on data written with a tokenizer, whose files the checkpoint copies into tokenizer/. Every file but
the latest file and the digests is covered by angpt_digests.json, so each damage of it is named by the
verification before a byte of it is unpickled. Rows that load regardless, and why (WHY below):
- a latest file cut in half: "2\n" cut to "2" still names iteration 2, the same checkpoint;
- a checkpoint without digests (saved before they were recorded; test_checkpoint_integrity.py::
  test_a_checkpoint_without_digests_still_loads_with_a_note): a flipped byte among a tensor's values is another
  valid number, which nothing can tell (test_without_digests_a_flipped_tensor_byte_cannot_be_seen).

Cases tested elsewhere are referred to, not repeated (ELSEWHERE, for the table), and so are neighbours of them:
- 256 bytes overwritten in a shard, and the message's form ("the checkpoint of iteration N is damaged: <file>
  ..."): test_checkpoint_integrity.py::test_a_damaged_checkpoint_is_refused_in_one_line_naming_the_file
- the fallback over a damaged shard:
  test_checkpoint_integrity.py::test_the_fallback_resumes_from_the_newest_intact_checkpoint
- a file that would run code when unpickled (common.pt, .metadata, model_optim_rng.pt), with and without digests:
  test_checkpoint_integrity.py::test_a_checkpoint_that_would_run_code_is_refused_in_one_line_naming_the_file
- a rank directory missing from a torch checkpoint, another layout: test_torch_checkpoint_format.py
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys

import pytest
from test_bad_inputs import (
    DAMAGES,
    Elsewhere,
    cell,
    damage,
    record_elsewhere,
    write_dataset,
)

from angpt.training import checkpointing, digests

from conftest import ROOT, in_process_trainer

# 74 tests of a trainer build and load each (the fallback's cases two): 65 s alone on 2 cores; with the long
# checks, to keep `make test` (9:46 in the fresh-clone CI run without it) under 10 minutes.
pytestmark = pytest.mark.long

MODEL = ["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "8",
         "--micro-batch-size", "1", "--global-batch-size", "1", "--eval-iters", "0", "--train-iters", "2",
         "--log-interval", "1"]
# Each saved run's flags (the data's with a tokenizer, whose files the checkpoint copies into tokenizer/: the
# `saved` fixture adds them); distrib_optim.pt is written in the torch format with the distributed optimizer only
# (torch_dist keeps its state in the shards).
FORMATS = {"torch_dist": [], "torch": ["--ckpt-format", "torch"],
           "torch, distributed optimizer": ["--ckpt-format", "torch", "--use-distributed-optimizer"]}
ACCEPTED = "accepted"  # the damage leaves a checkpoint the run may resume (the docstring says why)

# The files of each format's checkpoint directory (iteration 2, the latest), relative to the --save directory.
LATEST = checkpointing.LATEST
TOKENIZER = [f"iter_0000002/tokenizer/{name}" for name in ("bytes.tiktoken", "angpt_tokenizer.json")]
FILES = {
    "torch_dist": [LATEST, *(f"iter_0000002/{name}" for name in
                             ("metadata.json", "common.pt", "__0_0.distcp", "__0_1.distcp", ".metadata",
                              digests.DIGESTS)), *TOKENIZER],
    "torch": [LATEST, "iter_0000002/mp_rank_00/model_optim_rng.pt", f"iter_0000002/{digests.DIGESTS}", *TOKENIZER],
    "torch, distributed optimizer": ["iter_0000002/mp_rank_00/distrib_optim.pt"],
}
# Damages whose outcome is not a refusal naming the file: ACCEPTED (why), or tested elsewhere (the test).
WHY = {(LATEST, "truncated"): '"2\\n" cut to "2" still names iteration 2, the same checkpoint'}
ELSEWHERE = {
    (LATEST, "missing"): "tests/test_checkpoint_integrity.py::"
                         "test_a_missing_latest_file_beside_checkpoints_is_refused_or_resolved_when_asked",
    (f"iter_0000002/{digests.DIGESTS}", "missing"): "tests/test_checkpoint_integrity.py::"
                                                    "test_a_checkpoint_without_digests_still_loads_with_a_note",
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory, single_process):
    """A tiny run of each format on data written with a tokenizer, checkpointed at iterations 1 and 2."""
    directory = tmp_path_factory.mktemp("data")
    data = ["--data-path", write_dataset(directory), "--split", "100,0,0", "--data-cache-path",
            str(directory / "cache")]
    runs = {}
    for name, flags in FORMATS.items():
        runs[name] = tmp_path_factory.mktemp("saved")
        assert in_process_trainer([*MODEL, *data, *flags, "--save", str(runs[name]), "--save-interval", "1"]).run() == 0
    return runs, data


def cases():
    for ckpt_format, files in FILES.items():
        for file in files:
            for how in DAMAGES:
                if (file, how) not in ELSEWHERE:
                    yield pytest.param(ckpt_format, file, how, id=f"{ckpt_format}-{file}-{how}")


def damaged_copy(saved, tmp_path, ckpt_format: str, file: str, how: str):
    root = tmp_path / "run"
    shutil.copytree(saved[0][ckpt_format], root)
    damage(root / file, how)
    return root


@pytest.mark.parametrize("ckpt_format, file, how", cases())
def test_a_damaged_checkpoint_file_is_refused_naming_it_or_skipped_when_asked(ckpt_format, file, how, saved,
                                                                               tmp_path, caplog):
    root = damaged_copy(saved, tmp_path, ckpt_format, file, how)
    resume = [*MODEL, *saved[1], *FORMATS[ckpt_format], "--train-iters", "3", "--load", str(root)]
    with cell(f"checkpoint ({ckpt_format})", file.replace("iter_0000002", "iter_XXXXXXX"), how) as outcome:
        if (file, how) in WHY:
            assert in_process_trainer(resume).state.iteration == 2
            outcome["accepted"] = WHY[file, how]
            return
        with pytest.raises(checkpointing.CheckpointError) as refusal:
            in_process_trainer(resume)
        message = outcome["line"] = str(refusal.value)
    assert "\n" not in message
    assert str(root / file) in message
    if file != LATEST:
        assert "--load-fallback-to-intact" in message
    if how != "flipped":
        return  # the fallback once per file (each trainer costs seconds)
    # The fallback: past an unusable latest file to the newest checkpoint (2), past a damaged one to the one before.
    with caplog.at_level(logging.WARNING, logger="angpt"):
        resumed = in_process_trainer([*resume, "--load-fallback-to-intact"])
    intact = 2 if file == LATEST else 1
    assert resumed.state.iteration == intact
    assert str(root / file) in caplog.text
    assert f"resuming from {root / f'iter_{intact:07d}'}, the newest intact checkpoint" in caplog.text


def test_the_cases_tested_elsewhere_are_recorded():
    for (file, how), test in ELSEWHERE.items():
        for ckpt_format, files in FILES.items():
            if file in files:
                record_elsewhere(Elsewhere(f"checkpoint ({ckpt_format})", file.replace("iter_0000002", "iter_XXXXXXX"),
                                           how, test))


def test_without_digests_a_flipped_tensor_byte_cannot_be_seen(saved, tmp_path):
    root = damaged_copy(saved, tmp_path, "torch_dist", f"iter_0000002/{digests.DIGESTS}", "missing")
    damage(root / "iter_0000002" / "__0_0.distcp", "flipped")
    with cell("checkpoint (torch_dist)", "iter_XXXXXXX/__0_0.distcp", "flipped", "no angpt_digests.json") as outcome:
        assert in_process_trainer([*MODEL, *saved[1], "--train-iters", "3", "--load", str(root)]).state.iteration == 2
        outcome["accepted"] = ("without digests (saved before they were recorded), a byte among a tensor's values "
                               "is another valid number: nothing can tell")


def test_the_command_line_says_one_line_naming_the_damaged_file(saved, tmp_path):
    root = damaged_copy(saved, tmp_path, "torch_dist", "iter_0000002/common.pt", "wrong kind")
    done = subprocess.run([sys.executable, "-m", "angpt.pretrain", *MODEL, *saved[1], "--train-iters", "3", "--load",
                           str(root)], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert done.returncode != 0
    assert "Traceback" not in done.stderr + done.stdout
    lines = [line for line in done.stderr.splitlines() if line.startswith("angpt.pretrain:")]
    assert len(lines) == 1, done.stderr
    assert str(root / "iter_0000002" / "common.pt") in lines[0]
