"""A missing build of the fused kernels is not silent: a training run's first line says so and how to build them
(README, Install)."""

import os
import subprocess
import sys

import pytest

import angpt.kernels as kernels

from conftest import ROOT

BUILD = "pip install --no-build-isolation -e ."


def test_missing_build_names_the_reason_and_the_build_command_once(monkeypatch):
    monkeypatch.setattr(kernels, "_extension", None)
    monkeypatch.setattr(kernels, "_why_not", "the extension is not built for this CPU (avx2)")
    monkeypatch.setattr(kernels, "_logged", set())
    line = kernels.missing_build()
    assert line.startswith("angpt fused kernels are missing: the extension is not built for this CPU (avx2)")
    assert BUILD in line and "PyTorch implementations" in line
    assert "the extension is not built for this CPU (avx2)" in kernels._logged  # not logged again at first use
    monkeypatch.setenv("ANGPT_KERNELS", "0")
    assert kernels.missing_build() is None  # switched off on purpose: nothing to say


def test_a_built_extension_says_nothing(monkeypatch):
    monkeypatch.setattr(kernels, "_extension", object())
    assert kernels.missing_build() is None


# The extension's modules hidden, the trainer stubbed: what angpt.pretrain prints before it trains.
RUN = """
import sys, types
for isa in ("avx512", "avx2", "default"):
    sys.modules[f"angpt.kernels._fused_{isa}"] = None
sys.modules["angpt.training.trainer"] = types.SimpleNamespace(pretrain=lambda config: 0)
from angpt.pretrain import main
main(["--model-family", "angpt", "--num-layers", "1", "--hidden-size", "64", "--num-attention-heads", "1",
      "--seq-length", "16", "--micro-batch-size", "1", "--global-batch-size", "1", "--train-iters", "1",
      "--mock-data", "--vocab-size", "256"])
"""


@pytest.mark.slow
def test_a_run_without_the_built_kernels_starts_by_saying_so():
    result = subprocess.run([sys.executable, "-c", RUN], cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "ANGPT_KERNELS": "1"})
    assert result.returncode == 0, result.stderr
    lines = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    assert "angpt fused kernels are missing" in lines[0] and BUILD in lines[0], lines[:3]
