"""benchmarks/speedup_horizon.py on two stand-in convergence.py reports: sorted by horizon, per-seed spread."""

import json
import os
import sys

import pytest

from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import speedup_horizon  # noqa: E402


def report(path, steps, angpt, ngpt, seeds):
    speedup = {family: {"speedup": value, "per_seed": per_seed}
               for family, (value, per_seed) in (("angpt", angpt), ("ngpt", ngpt))}
    path.write_text(json.dumps({"settings": {"train_iters": steps}, "seeds": list(range(seeds)),
                                "paper": {"speedup": {"angpt": 1.4, "ngpt": 1.29}}, "speedup": speedup}))
    return str(path)


def test_table_sorted_by_horizon_with_the_per_seed_spread(tmp_path):
    long = report(tmp_path / "long.json", 640, (1.5, [1.0, 2.0, 3.0]), (None, []), 3)
    short = report(tmp_path / "short.json", 160, (2.5, [2.5]), (2.0, [2.0]), 1)
    speedup_horizon.main([long, short, "--output", str(tmp_path / "out")])
    lines = (tmp_path / "out.md").read_text().splitlines()
    assert lines[2] == "| 160 | 1 | 2.50x | 2.00x |"
    assert lines[3] == "| 640 | 3 | 1.50x (per seed 2.00 ± 1.00) | not reached |"  # std with n - 1
    assert lines[4] == "| paper | | 1.40x | 1.29x |"
    assert (tmp_path / "out.png").stat().st_size > 0
    with pytest.raises(SystemExit, match="not a convergence.py report"):
        speedup_horizon.main([str(tmp_path / "out.md"), "--output", str(tmp_path / "x")])
