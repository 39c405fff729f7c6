"""Every command-line entry point answers --help at once: before torch, megatron-core, transformers or the
plotting and logging libraries are imported (a `--help` that imports them takes 5-45 s on a loaded 2-core
machine), and with nothing on stderr (no library's warnings)."""

import glob
import os
import subprocess
import sys

import pytest

from conftest import ROOT

HEAVY = ("torch", "megatron", "transformers", "matplotlib", "scipy", "wandb", "lm_eval", "pyarrow")
# Importing one of HEAVY raises, so a --help that needs one fails with a traceback naming it.
PROBE = """\
import os, runpy, sys
class RefuseHeavyImports:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {heavy!r}:
            raise ImportError(f"--help imported {{name}}")
sys.meta_path.insert(0, RefuseHeavyImports())
sys.argv = [{script!r}, "--help"]
if {script!r}.endswith(".py"):
    sys.path.insert(0, os.path.dirname(os.path.abspath({script!r})))  # as `python SCRIPT` puts its folder first
    runpy.run_path({script!r}, run_name="__main__")
else:
    runpy.run_module({script!r}, run_name="__main__")
"""
ENTRY_POINTS = ["angpt.pretrain", *sorted(os.path.relpath(p, ROOT) for p in glob.glob(f"{ROOT}/tools/*.py"))]


@pytest.mark.parametrize("script", ENTRY_POINTS)
def test_help_imports_no_heavy_library_and_prints_no_warning(script):
    env = {key: value for key, value in os.environ.items() if key != "PYTHONWARNINGS"}
    done = subprocess.run([sys.executable, "-c", PROBE.format(heavy=HEAVY, script=script)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("usage:") and done.stderr == ""
