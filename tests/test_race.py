"""benchmarks/race.py (the convergence race of issue 50, docs/race.md): its arithmetic on hand-made curves,
checked against numpy's interpolation, and, with the long checks, the GPU runner's race stages end to end on
the CPU (`gpu_checks.sh --race --no-gpu`) on a tiny corpus built by tools/race_corpus.py."""

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import race  # noqa: E402 (benchmarks/ is not a package)

GPTPLUS = {"curve": [(1000, 6.0), (2000, 5.0), (3000, 4.5), (4000, 4.2)],
           "seconds": [(0, 0.0), (1000, 8.0), (2000, 12.0), (3000, 16.0), (4000, 20.0)], "tokens_per_s": 250.0}
ANGPT = {"curve": [(1000, 5.5), (2000, 4.6), (3000, 4.1), (4000, 3.9)],
         "seconds": [(0, 0.0), (1000, 10.0), (2000, 15.0), (3000, 20.0), (4000, 25.0)], "tokens_per_s": 200.0}
NGPT = {"curve": [(1000, 5.8), (2000, 5.1), (3000, 4.7), (4000, 4.4)],
        "seconds": [(0, 0.0), (4000, 30.0)], "tokens_per_s": 150.0}


def test_reach_against_numpy_interpolation():
    result = race.reach(GPTPLUS, ANGPT)
    target = 4.2  # GPT+'s final loss
    # anGPT passes 4.2 between 2000 (4.6) and 3000 (4.1); numpy's interp wants increasing x: the losses reversed.
    tokens = np.interp(target, [4.1, 4.6], [3000, 2000])
    seconds = np.interp(tokens, *zip(*ANGPT["seconds"]))
    assert result["target_loss"] == target and result["reached"]
    assert result["tokens"] == pytest.approx(tokens) == pytest.approx(2800)
    assert result["gptplus_tokens"] == 4000 and result["gptplus_seconds"] == pytest.approx(20.0)
    assert result["tokens_speedup"] == pytest.approx(4000 / tokens)
    assert result["seconds"] == pytest.approx(seconds) == pytest.approx(19.0)
    assert result["seconds_speedup"] == pytest.approx(20.0 / seconds)
    assert result["seconds_steady"] == pytest.approx(tokens / 200.0)
    assert result["seconds_steady_speedup"] == pytest.approx((4000 / 250.0) / (tokens / 200.0))


def test_reach_not_reached_compares_the_other_way_round():
    result = race.reach(GPTPLUS, NGPT)
    assert not result["reached"] and result["tokens"] is None and result["seconds"] is None
    # GPT+ reaches nGPT's final 4.4 between 3000 (4.5) and 4000 (4.2).
    gptplus_tokens = np.interp(4.4, [4.2, 4.5], [4000, 3000])
    assert result["own_final_loss"] == 4.4 and result["tokens_to_own_final"] == 4000
    assert result["gptplus_tokens_to_own_final"] == pytest.approx(gptplus_tokens)
    assert result["tokens_speedup_at_own_final"] == pytest.approx(gptplus_tokens / 4000)


def test_seconds_curve_sums_the_logged_windows():
    records = [{"kind": "start", "iteration": 0}, {"kind": "train", "iteration": 2, "ms_per_step": 1500.0},
               {"kind": "eval", "iteration": 2, "lm_loss": 5.0},
               {"kind": "train", "iteration": 4, "ms_per_step": 500.0},
               {"kind": "train", "iteration": 5, "ms_per_step": 400.0}]
    assert race.seconds_curve(records, 100) == [(0, 0.0), (200, 3.0), (400, 4.0), (500, pytest.approx(4.4))]


def test_affordable_steps():
    # Two families at 100 and 200 ms a step of 1000 tokens: 0.3 ms a token for both; 4 evaluations of 3 global
    # batches each, a third of a step each: 4 * 3 * (100 + 200) / 3 ms = 1.2 s.
    steps, budget = race.affordable_steps(100.0, 10.0, {"a": 100.0, "b": 200.0}, 1000, 5.0, 4, 3, 2.0, safety=0.4)
    assert budget["evaluations_s"] == pytest.approx(1.2)
    train_s = 100 - 10 - 2 * 5 - 1.2 - 2
    assert budget["train_s"] == pytest.approx(train_s)
    assert steps == 102  # 0.4 * 76.8 s / 0.3 ms = 102,400 tokens


def test_learning_rates_transferred_by_the_square_root_of_the_width():
    lrs = {f: race.transferred_lr(f, 768) for f in race.FAMILIES}
    assert lrs == {"angpt": 0.0041, "ngpt": 0.0041, "gptplus": 0.00071}
    assert race.transferred_lr("angpt", 128) == 0.01


@pytest.mark.slow
@pytest.mark.long
def test_race_runner_on_the_cpu(tmp_path):
    """tools/race_corpus.py builds a tiny corpus (Python sources only: no network), then the runner does what it
    does on the GPU machine: tokenize it, measure the families, race them, report."""
    corpus, out = tmp_path / "corpus", tmp_path / "out"
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    built = subprocess.run([sys.executable, "tools/race_corpus.py", "--output-dir", str(corpus), "--sources", "python",
                            "--train-mb", "0.25", "--valid-fraction", "0.1", "--vocab-size", "384",
                            "--limit-mib", "1000"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=200)
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-2000:]
    manifest = json.loads((corpus / "manifest.json").read_text())
    assert manifest["train"]["documents"] > 0 and manifest["valid"]["documents"] > 0
    assert set(manifest["sources"]) == {"python"} and manifest["vocab_size"] == 384

    tokens = 8 * 8 * 64  # 8 steps of the tiny shape's 8 x 64
    runner = {"PYTHON": sys.executable, "NO_WHEELS": "1", "RACE_CORPUS": str(corpus),
              "RACE_DATA": str(tmp_path / "data"), "RACE_TOKENS": str(tokens)}
    done = subprocess.run(["bash", "benchmarks/gpu_checks.sh", "--race", "--no-gpu", str(out)], cwd=ROOT,
                          env={**env, **runner}, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "race-data: ok" in done.stdout and "race: ok" in done.stdout

    report = json.loads((out / "race" / "race.json").read_text())
    assert report["train_tokens"] == tokens and report["sizing"]["steps"] == 8
    assert set(report["sizing"]["probe_ms_per_step"]) == set(race.FAMILIES)  # --time-budget measured each
    families = report["families"]
    # The same tokens reached each family's steps: one digest, and every token of the 8 steps counted.
    assert report["same_tokens"] and len({f["token_digest"] for f in families.values()}) == 1
    assert all(f["tokens_seen"] == tokens and f["exit_code"] == 0 for f in families.values())
    for family in families.values():
        # --evals 4 of 8 steps: every 2 steps, at fixed token counts.
        assert [t for t, _ in family["curve"]] == [1024, 2048, 3072, 4096]
        assert all(math.isfinite(loss) and 0 < loss < math.log(384) + 1 for _, loss in family["curve"])
        assert family["final_val_loss"] == family["curve"][-1][1] and family["tokens_per_s"] > 0
        assert [t for t, _ in family["seconds"]] == [0, 1024, 2048, 3072, 4096]
        assert (out / "race" / "runs" / family["family"] / "metrics.jsonl").is_file()
    target = families["gptplus"]["final_val_loss"]
    for name in ("angpt", "ngpt"):
        result, curve = report["reach"][name], families[name]["curve"]
        assert result["target_loss"] == target
        below = [i for i, (_, loss) in enumerate(curve) if loss <= target]
        if not below:
            assert not result["reached"] and result["tokens"] is None
            continue
        i = below[0]
        expected = curve[0][0] if i == 0 else np.interp(target, [curve[i][1], curve[i - 1][1]],
                                                        [curve[i][0], curve[i - 1][0]])
        assert result["tokens"] == pytest.approx(expected)
        assert result["seconds"] == pytest.approx(np.interp(expected, *zip(*families[name]["seconds"])))
    assert (out / "race" / "race.png").read_bytes().startswith(b"\x89PNG")
    markdown = (out / "race" / "race.md").read_text()
    assert "| anGPT |" in markdown and "| GPT+ |" in markdown and "| nGPT |" in markdown
