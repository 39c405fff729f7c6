"""benchmarks/convergence.py end to end on a two-step budget, on the pydoc corpus of conftest.py: every
output is written and well-formed. The science (which model wins) is not asserted; only that training
happened and was reported."""

import json
import math
import os
import subprocess
import sys

import pytest

from conftest import PYDOC_VOCAB_SIZE, ROOT

# Ten cold processes (the benchmark's own runner starts each run, as a user's invocation does): over a minute.
pytestmark = [pytest.mark.slow, pytest.mark.long]


def finite(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def test_convergence_quick_two_steps(pydoc_corpus, tmp_path):
    out = tmp_path / "out"
    # One lr per family, two seeds, one ablation at both seeds: 3 + 3 + 2 runs. Each run spends most of its
    # time importing megatron-core, so the runs of a stage all go at once (--jobs 5) and no core waits.
    command = [sys.executable, os.path.join(ROOT, "benchmarks", "convergence.py"), "--output-dir", str(out),
               "--quick", "--train-iters", "2", "--max-lrs", "1", "--seeds", "2", "--ablation-list",
               "plain_residual", "--ablation-seeds", "2", "--step-time-rounds", "1", "--jobs", "5",
               "--work-dir", str(tmp_path / "work"),
               "--corpus", str(pydoc_corpus), "--no-snapshot"]  # the working tree's code, committed or not
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    for name in ("convergence.png", "ablations.png", "norm_health.png"):
        data = (out / name).read_bytes()
        assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 1000, name

    report = json.loads((out / "convergence.json").read_text())
    assert {"settings", "families", "speedup", "speedup_method", "ablations", "norm_health", "load_average",
            "wall_seconds", "runs"} <= set(report)
    assert report["settings"]["train_iters"] == 2
    assert report["corpus"] == str(pydoc_corpus) and report["vocab_size"] == PYDOC_VOCAB_SIZE
    assert report["seeds"] == [0, 1]
    for family in ("angpt", "gptplus", "ngpt"):
        fam = report["families"][family]
        assert fam["final_val_loss"]["n"] == 2
        assert finite(fam["final_val_loss"]["mean"]) and finite(fam["final_val_loss"]["std"])
        assert 0 < fam["final_val_loss"]["mean"] < math.log(PYDOC_VOCAB_SIZE) + 1  # about ln(512) after two steps
        assert finite(fam["ms_per_step"]["mean"]) and fam["ms_per_step"]["mean"] > 0
        assert [step for step, _ in fam["mean_curve"]] == [1, 2]
        health = report["norm_health"][family]
        assert len(health["residual_norms_text"]) == len(health["residual_norms_repeated"]) == 2  # layers
        assert all(finite(v) and v > 0 for v in health["residual_norms_text"] + health["residual_norms_repeated"])
        assert finite(health["ood_ratio"]) and health["ood_ratio"] > 0
    for family in ("angpt", "ngpt"):
        speedup = report["speedup"][family]
        assert finite(speedup["target_loss"])
        assert speedup["speedup"] is None or finite(speedup["speedup"])
        alpha = report["norm_health"][family]["alpha"]
        assert alpha["attention"] and alpha["mlp"] and all(finite(v) for _, v in alpha["attention"])
    assert report["norm_health"]["gptplus"]["alpha"] == {}
    rows = {row["name"]: row for row in report["ablations"]["rows"]}
    assert set(rows) == {"plain_residual", "gptplus_instead"}
    for row in rows.values():
        assert finite(row["final_val_loss"]) and finite(row["relative_change"]) and finite(row["step_time_relative"])
        assert finite(row["step_time_relative_interleaved"]) and row["step_time_relative_interleaved"] > 0
        paired = row["relative_change_paired"]  # each seed against anGPT's run of the same seed
        assert row["seeds"] == [0, 1] and paired["n"] == 2 and set(paired["by_seed"]) == {"0", "1"}
        assert all(finite(v) for v in paired["interval"]) and paired["interval"][0] <= paired["mean"]
        assert paired["sign"] in ("+", "-", "inside noise")
    assert report["ablations"]["reference"]["seeds"] == [0, 1]
    assert len(report["runs"]) == 3 + 3 + 2 and all(r["exit_code"] == 0 for r in report["runs"])

    markdown = (out / "convergence.md").read_text()
    for row_start in ("| anGPT |", "| GPT+ |", "| nGPT |", "| plain residual instead of LERP |",
                      "| GPT+ instead of anGPT"):
        assert row_start in markdown, row_start
    assert f"corpus {pydoc_corpus}, vocabulary {PYDOC_VOCAB_SIZE}." in markdown
    for image in ("convergence.png", "ablations.png", "norm_health.png"):
        assert f"({image})" in markdown

    # A second invocation finds every run done and only rebuilds the report.
    again = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "finished in" not in again.stdout and again.stdout.count("already finished, skipped") == 8

    # One family alone (--families): GPT+ at another lr, its own report, combined with the first by
    # benchmarks/speedup_horizon.py (GPT+ from the later report, anGPT and nGPT from the first).
    gpt_out = tmp_path / "gptplus"
    alone = [sys.executable, os.path.join(ROOT, "benchmarks", "convergence.py"), "--output-dir", str(gpt_out),
             "--quick", "--train-iters", "2", "--families", "gptplus", "--lrs", "gptplus=0.003", "--seeds", "2",
             "--no-ablations", "--jobs", "2", "--work-dir", str(tmp_path / "work"), "--corpus", str(pydoc_corpus),
             "--no-snapshot"]
    done = subprocess.run(alone, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    gpt_report = json.loads((gpt_out / "convergence.json").read_text())
    assert list(gpt_report["families"]) == ["gptplus"] and "speedup" not in gpt_report
    assert gpt_report["families"]["gptplus"]["best_lr"] == 0.003 and gpt_report["seeds"] == [0, 1]
    assert sorted(r["name"] for r in gpt_report["runs"]) == ["gptplus_lr0.003_seed0", "gptplus_lr0.003_seed1"]
    assert all([step for step, _ in r["curve"]] == [1, 2] for r in gpt_report["runs"])
    assert "GPT+ only (--families)" in (gpt_out / "convergence.md").read_text()
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import speedup_horizon  # noqa: PLC0415 (benchmarks/ is not a package)

    (row,) = speedup_horizon.horizon_rows([str(out / "convergence.json"), str(gpt_out / "convergence.json")])
    assert row["lr"]["gptplus"] == 0.003 and row["sources"]["gptplus"] == str(gpt_out / "convergence.json")
    assert row["sources"]["angpt"] == row["sources"]["ngpt"] == str(out / "convergence.json")
    refused = subprocess.run([*alone, "--ablations"], capture_output=True, text=True, timeout=60, cwd=ROOT, env=env)
    assert refused.returncode != 0 and "add angpt to --families" in refused.stderr
