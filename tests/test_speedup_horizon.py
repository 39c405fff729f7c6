"""benchmarks/speedup_horizon.py on stand-in convergence.py reports with straight-line validation curves, whose
crossing steps are worked out by hand below, and on the committed reports (the speed-up it recomputes from
their mean curves is the one they state)."""

import glob
import json
import os
import sys

import pytest

from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import speedup_horizon  # noqa: E402

SETTINGS = {"hidden_size": 128, "num_layers": 4, "seq_length": 128, "eval_interval": 10}
PAPER = {"speedup": {"angpt": 1.4, "ngpt": 1.29}}


def line(slope):
    """Validation loss 10 - slope * step, evaluated every 10 steps up to 100."""
    return [[step, 10 - slope * step] for step in range(10, 101, 10)]


def family(lr, slopes):
    """A family's block of a report: its seed-mean curve over the seeds' straight lines."""
    mean = sum(slopes) / len(slopes)
    return {"best_lr": lr, "mean_curve": line(mean), "finals_by_seed": {str(s): 10 - 100 * k
                                                                         for s, k in enumerate(slopes)}}


def runs(name, lr, slopes):
    return [{"name": f"{name}_lr{lr:g}_seed{s}", "family": name, "lr": lr, "seed": s, "curve": line(k)}
            for s, k in enumerate(slopes)]


def write(path, steps, families, run_list=(), speedup=None, settings=SETTINGS):
    report = {"settings": {**settings, "train_iters": steps}, "corpus": "data/shakespeare", "paper": PAPER,
              "families": families, "runs": list(run_list)}
    if speedup:
        report["speedup"] = speedup
    path.write_text(json.dumps(report))
    return str(path)


def test_one_report_per_horizon_sorted_with_the_stated_per_seed_spread(tmp_path):
    # GPT+ reaches its final loss 5 at step 100; anGPT (slope 0.1) at step 50: 2.00x; nGPT (0.08) at 62.5: 1.60x.
    three = {"gptplus": family(0.003, [0.05]), "angpt": family(0.01, [0.1]), "ngpt": family(0.01, [0.08])}
    stated = {"angpt": {"per_seed": [1.0, 2.0, 3.0]}, "ngpt": {"per_seed": [1.6]}}
    long = write(tmp_path / "long.json", 640, three, speedup=stated)
    short = write(tmp_path / "short.json", 160, {**three, "ngpt": family(0.03, [0.2])})  # 25 steps: 4.00x
    speedup_horizon.main([long, short, "--output", str(tmp_path / "out")])
    lines = (tmp_path / "out.md").read_text().splitlines()
    assert lines[2] == "| 160 | 1 | 0.01 / 0.003 / 0.03 | 2.00x | 4.00x |"
    assert lines[3] == "| 640 | 1 | 0.01 / 0.003 / 0.01 | 2.00x (per seed 2.00 ± 1.00) | 1.60x |"  # std: n - 1
    assert lines[4] == "| paper | | | 1.40x | 1.29x |" and len(lines) == 5
    assert (tmp_path / "out.png").stat().st_size > 0


def test_a_later_report_of_one_family_replaces_it_and_per_seed_comes_from_the_runs_curves(tmp_path):
    old_gpt = family(0.003, [0.01, 0.01])
    first = write(tmp_path / "all.json", 2560, {"gptplus": old_gpt, "angpt": family(0.01, [0.1, 0.125]),
                                                "ngpt": family(0.01, [0.08])},
                  runs("angpt", 0.01, [0.1, 0.125]))
    gpt = write(tmp_path / "gptplus.json", 2560, {"gptplus": family(0.001, [0.0625, 0.05])},
                runs("gptplus", 0.001, [0.0625, 0.05]))
    # GPT+'s mean curve (slope 0.05625) ends at 4.375, reached by anGPT's mean (0.1125) at step 50: 2.00x, and
    # by nGPT (0.08) at 70.3125: 1.42x. Per seed: anGPT seed 0 reaches GPT+ seed 0's 3.75 at 62.5 (1.60x),
    # seed 1 reaches 5 at 40 (2.50x): mean 2.05, std 0.64.
    rows = speedup_horizon.horizon_rows([first, gpt])
    assert len(rows) == 1
    assert rows[0]["angpt"] == pytest.approx(2.0) and rows[0]["ngpt"] == pytest.approx(100 / 70.3125)
    assert rows[0]["angpt_per_seed"] == pytest.approx([1.6, 2.5])
    lines = speedup_horizon.markdown(rows).splitlines()
    assert lines[2] == ("| 2560 | 2/2/1 | 0.01 / 0.001 / 0.01 | 2.00x (per seed 2.05 ± 0.64) | 1.42x |")
    assert lines[-1] == f"- 2560 steps: anGPT, nGPT from {first}; GPT+ from {gpt}."
    # The other order: the full report's GPT+ wins (0.01 a step: L* 9, anGPT there at step 10: 10x), and
    # without GPT+'s runs' curves anGPT's two seeds have no per-seed figure.
    row = speedup_horizon.horizon_rows([gpt, first])[0]
    assert row["angpt"] == pytest.approx(10.0) and row["angpt_per_seed"] == []
    assert "(per seed: n/a, the runs' curves are not in the reports)" in speedup_horizon.markdown([row])


def test_different_settings_are_different_horizons_and_a_missing_family_is_named(tmp_path):
    three = {"gptplus": family(0.003, [0.05]), "angpt": family(0.01, [0.1]), "ngpt": family(0.01, [0.08])}
    a = write(tmp_path / "a.json", 640, three)
    b = write(tmp_path / "b.json", 640, three, settings={**SETTINGS, "hidden_size": 256})
    assert len(speedup_horizon.horizon_rows([a, b])) == 2
    alone = write(tmp_path / "alone.json", 640, {"gptplus": family(0.001, [0.05])},
                  settings={**SETTINGS, "num_layers": 8})
    with pytest.raises(SystemExit, match=r"640 steps: no run of anGPT, nGPT in .*alone\.json"):
        speedup_horizon.horizon_rows([alone])
    (tmp_path / "x.md").write_text("| not json |")
    with pytest.raises(SystemExit, match=r"x\.md: not a convergence.py report"):
        speedup_horizon.horizon_rows([str(tmp_path / "x.md")])


def full_reports() -> list[str]:
    """The committed convergence.py reports of all three families (other JSON under docs/results left out)."""
    paths = []
    for path in sorted(glob.glob(os.path.join(ROOT, "docs", "results", "**", "*.json"), recursive=True)):
        with open(path) as file:
            report = json.load(file)
        if isinstance(report, dict) and {"speedup", "families", "settings"} <= set(report):
            paths.append(path)
    return paths


@pytest.mark.parametrize("path", full_reports(), ids=lambda path: os.path.relpath(path, ROOT))
def test_the_committed_reports_speedup_is_recomputed_from_their_curves(path):
    with open(path) as file:
        report = json.load(file)
    row = speedup_horizon.horizon_rows([path])[0]
    for model in ("angpt", "ngpt"):
        assert row[model] == pytest.approx(report["speedup"][model]["speedup"], rel=1e-12)
        assert row[f"{model}_per_seed"] == pytest.approx(report["speedup"][model]["per_seed"], rel=1e-12)
