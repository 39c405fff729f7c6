"""The code passes ruff with the configuration of pyproject.toml (what `make lint` runs)."""

import subprocess
import sys

from conftest import ROOT


def test_ruff_finds_nothing():
    done = subprocess.run([sys.executable, "-m", "ruff", "check", ROOT], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
