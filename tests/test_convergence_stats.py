"""The paired statistics of benchmarks/convergence.py's ablation rows: per-seed changes against anGPT's run of
the same seed, the Student t interval of their mean (t quantiles from printed tables), and when a sign is
stated."""

import os
import sys

import pytest

from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import convergence  # noqa: E402

T_975_DF2 = 4.302653  # Student t, 97.5% quantile, 2 degrees of freedom (printed tables)


def runs(finals: dict) -> list[dict]:
    return [{"seed": seed, "final_val_loss": final} for seed, final in finals.items()]


REFERENCE = {r["seed"]: r for r in runs({0: 5.0, 1: 4.0, 2: 2.0})}


@pytest.mark.parametrize(("finals", "changes", "sign"), [
    ({0: 5.05, 1: 4.08, 2: 2.06}, (0.01, 0.02, 0.03), "inside noise"),
    ({0: 5.05, 1: 4.044, 2: 2.024}, (0.01, 0.011, 0.012), "+"),
    ({0: 4.9, 1: 3.912, 2: 1.964}, (-0.02, -0.022, -0.018), "-"),
])
def test_paired_change_interval_and_sign(finals, changes, sign):
    change = convergence.paired_change(runs(finals), REFERENCE)
    mean = sum(changes) / 3
    std = (sum((c - mean) ** 2 for c in changes) / 2) ** 0.5
    half = T_975_DF2 * std / 3 ** 0.5
    assert change["by_seed"] == pytest.approx(dict(enumerate(changes)), abs=1e-12)
    assert change["n"] == 3 and change["mean"] == pytest.approx(mean) and change["std"] == pytest.approx(std)
    assert change["interval"] == pytest.approx([mean - half, mean + half], rel=1e-6)
    assert change["sign"] == sign


def test_paired_change_one_seed_has_no_interval_and_unpaired_runs_are_left_out():
    change = convergence.paired_change(runs({0: 5.5, 3: 1.0}) + [{"seed": 1, "final_val_loss": None}], REFERENCE)
    assert change["by_seed"] == {0: pytest.approx(0.1)}
    assert change["n"] == 1 and change["interval"] is None and change["sign"] is None


def test_more_ablation_seeds_than_seeds_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="--ablation-seeds 3: between 1 and --seeds"):
        convergence.main(["--output-dir", str(tmp_path), "--seeds", "2", "--ablation-seeds", "3"])
