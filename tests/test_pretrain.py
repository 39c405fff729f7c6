"""The main job: `python -m angpt.pretrain` under torchrun, and its refusal of impossible layouts."""

import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT

FLAGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
         "--micro-batch-size", "4", "--global-batch-size", "8", "--lr", "1e-2"]


def pretrain(*args, nproc=2, timeout=600):
    env = {**os.environ, "PYTHONPATH": ROOT, "PYTHONWARNINGS": "ignore"}
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
         "-m", "angpt.pretrain", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env,
    )


@pytest.mark.multiprocess
@pytest.mark.parametrize("family", ["angpt", "gptplus", "ngpt"])
def test_training_at_tensor_parallel_2_lowers_the_loss(family):
    done = pretrain("--model-family", family, "--tensor-model-parallel-size", "2", "--train-iters", "30", *FLAGS)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    losses = [float(x) for x in re.findall(r"lm loss ([0-9.]+)", output)]
    assert len(losses) == 30
    print(family, f"loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    assert losses[0] == pytest.approx(5.545, abs=0.1)  # ln 256: uniform over bytes at the start
    assert losses[-1] < losses[0] - 1.0


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--tensor-model-parallel-size", "3"], "world size 2 is not divisible by --tensor-model-parallel-size 3"),
        (["--tensor-model-parallel-size", "2", "--num-attention-heads", "3"], "--num-attention-heads 3 is not divisible"),
        (["--pipeline-model-parallel-size", "2", "--num-layers", "3"], "--num-layers 3 is not divisible"),
        (["--global-batch-size", "6"], "--global-batch-size 6 is not divisible by --micro-batch-size 4"),
        (["--text-file", "/nonexistent/corpus.txt"], "--text-file /nonexistent/corpus.txt: no such file"),
    ],
)
def test_impossible_layouts_fail_before_starting(flags, message, monkeypatch, capsys):
    from angpt.pretrain import parse_args

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit):
        parse_args([*FLAGS, *flags])
    assert message in capsys.readouterr().err
