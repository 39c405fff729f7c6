"""tools/sweep.py (grids of angpt.pretrain runs from one YAML file, locally or as a Slurm job array, and
the table of their results) and tools/fit_scaling_law.py (L(C) = E + A C^-alpha, lr_opt and batch_opt as
power laws of N, with bootstrap intervals)."""

import json
import math
import os
import sys

import numpy as np
import pytest

from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "tools"))

import fit_scaling_law
import sweep

TINY = """\
name: tiny
base:
  model-family: angpt
  seq-length: 16
  micro-batch-size: 4
  mock-data: true
  vocab-size: 128
  eval-iters: 1
  log-interval: 1
grid:
  shapes:
    - {num_layers: 2, hidden_size: 32, num_attention_heads: 1}
  tokens: [128]
  lr: [1e-2, 3e-2]
  global_batch_size: [4]
"""


def write(tmp_path, text, name="sweep.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


# ---------------------------------------------------------------------------------------------------------
# The fits


def test_the_loss_fit_recovers_a_known_power_law_within_its_interval():
    # One fixed data set (a 95 % interval misses the truth for about 1 in 20 of them).
    rng = np.random.default_rng(1)
    E, A, alpha = 1.8, 2000.0, 0.2
    compute = np.logspace(15, 19, 20)
    loss = (E + A * compute ** -alpha) * np.exp(rng.normal(0, 0.01, len(compute)))
    fit = fit_scaling_law.bootstrap_loss_compute(compute, loss, resamples=150, seed=0)
    for name, truth in (("E", E), ("A", A), ("alpha", alpha)):
        low, high = fit["ci"][name]
        assert low <= truth <= high, (name, truth, fit["ci"][name], fit[name])
        assert low <= fit[name] <= high
    assert fit["ci"]["alpha"][1] - fit["ci"]["alpha"][0] < 0.08
    assert fit["ci"]["E"][1] - fit["ci"]["E"][0] < 0.3
    assert abs(fit["alpha"] - alpha) < 0.02 and abs(fit["E"] - E) < 0.1
    assert fit["bootstrap_used"] == 150
    # Seeded: the same intervals again.
    again = fit_scaling_law.bootstrap_loss_compute(compute, loss, resamples=150, seed=0)
    assert again["ci"] == fit["ci"]


def synthetic_records(n_values, lr_opt, batch_opt, noise=0.002, seed=0):
    """Runs of a grid whose loss is a bowl in log lr and log batch around the given optima."""
    rng = np.random.default_rng(seed)
    records = []
    lrs = [2.0 ** (k / 2) * 1e-4 for k in range(0, 24)]
    batches = [2 ** k for k in range(3, 12)]
    for i, (n, lr_best, batch_best) in enumerate(zip(n_values, lr_opt, batch_opt)):
        for lr in lrs:
            for batch in batches:
                loss = (3.0 + 0.05 * math.log(lr / lr_best) ** 2 + 0.02 * math.log(batch / batch_best) ** 2
                        + rng.normal(0, noise))
                records.append(dict(num_layers=i + 1, hidden_size=64 * (i + 1), num_attention_heads=i + 1,
                                    N=n, D=1e9, C=6e9 * n, lr=lr, global_batch_size=batch, valid_loss=loss,
                                    run_id=f"{i}-{lr}-{batch}", status="finished"))
    return records


def test_the_lr_and_batch_fits_recover_known_exponents():
    n = np.logspace(6, 9, 6)
    lr_opt = 0.3 * n ** -0.25
    batch_opt = 2.0 * n ** 0.3
    records = synthetic_records(n, lr_opt, batch_opt)
    for name, a, b in (("lr", 0.3, -0.25), ("global_batch_size", 2.0, 0.3)):
        result = fit_scaling_law.fit_hyperparameter(records, name, None, resamples=300, seed=0)
        fit = result["fit"]
        low, high = fit["ci"]["b"]
        assert low <= b <= high and high - low < 0.1, (name, fit)
        assert abs(fit["b"] - b) < 0.03 and fit["a"] == pytest.approx(a, rel=0.5)
        assert not any(row["at_edge"] for row in result["per_shape"])


def test_too_few_shapes_is_said():
    n = [1e6, 1e7]
    two = fit_scaling_law.fit_hyperparameter(synthetic_records(n, [1e-3, 5e-4], [64, 128]), "lr", None, 100, 0)
    assert two["fit"]["b"] == pytest.approx(math.log10(0.5), abs=0.05)
    assert two["fit"]["ci"]["b"] is None and "no confidence interval" in two["fit"]["note"]
    one = fit_scaling_law.fit_hyperparameter(synthetic_records([1e6], [1e-3], [64]), "lr", None, 100, 0)
    assert one["fit"] is None and "too few shapes" in one["note"]
    beyond = fit_scaling_law.fit_hyperparameter(synthetic_records(n, [1e-5, 1e-5], [64, 128]), "lr", None, 100, 0)
    assert beyond["fit"] is None and "edge of the grid for every shape" in beyond["note"]
    with pytest.raises(ValueError, match="at least 3 points"):
        fit_scaling_law.fit_loss_compute([1e15, 1e16], [3.0, 2.9])


def test_the_frontier_keeps_the_lower_envelope():
    points = [dict(C=1.0, valid_loss=5.0), dict(C=2.0, valid_loss=5.5), dict(C=3.0, valid_loss=4.0),
              dict(C=4.0, valid_loss=4.5), dict(C=5.0, valid_loss=3.9)]
    assert [p["C"] for p in fit_scaling_law.compute_frontier(points)] == [1.0, 3.0, 5.0]


def test_compute_multiplier_of_a_family_with_a_smaller_coefficient():
    """Family b's loss is 10 C^-0.5 and family a's 10 (2 C)^-0.5 (the same exponent, a coefficient 2^-0.5
    times b's): a reaches each of b's losses with half b's compute, a multiplier of 2 at every loss that a's
    frontier spans (a power law is a line in log C against log L, which the interpolation follows exactly)."""
    def frontier(computes, factor):
        return [dict(run_id=f"C{c:g}", C=c, valid_loss=10 * (factor * c) ** -0.5) for c in computes]

    a, b = frontier([1, 2, 4, 8, 16], 2.0), frontier([2, 8, 32, 64], 1.0)
    rows = fit_scaling_law.compute_multipliers(b, a)
    # b's losses at C = 2, 8, 32 are a's at C = 1, 4, 16; at C = 64 below anything a reached.
    assert [row["run_id"] for row in rows] == ["C2", "C8", "C32"]
    assert [row["multiplier"] for row in rows] == pytest.approx([2.0, 2.0, 2.0])
    assert fit_scaling_law.compute_to_reach(a, 10 * 6**-0.5) == pytest.approx(3.0)
    assert fit_scaling_law.compute_to_reach(a, 100.0) is None


# ---------------------------------------------------------------------------------------------------------
# The sweep file


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda t: t + "seeds: 3\n", "unknown key 'seeds'"),
        (lambda t: t.replace("  log-interval: 1\n", "  log-intervall: 1\n"),
         "base.log-intervall: unknown key (not a flag of angpt.pretrain)"),
        (lambda t: t.replace("  log-interval: 1\n", "  lr: 0.1\n"), "base.lr: set by the sweep"),
        (lambda t: t.replace("  log-interval: 1\n", "  log-interval: often\n"),
         "base.log-interval: 'often' is not a valid int (--log-interval)"),
        (lambda t: t.replace("  model-family: angpt\n", "  model-family: bert\n"),
         "base.model-family: 'bert' is not one of"),
        (lambda t: t.replace("lr: [1e-2, 3e-2]", "lr: [1e-2, fast]"), "grid.lr[1]: expected a float, got 'fast'"),
        (lambda t: t.replace("lr: [1e-2, 3e-2]", "lr: []"), "grid.lr is empty"),
        (lambda t: t.replace("tokens: [128]", "tokens: [lots]"), "grid.tokens[0]: 'lots' is not a number of tokens"),
        (lambda t: t.replace("global_batch_size: [4]", "global_batch_size: [6]"),
         "grid.global_batch_size 6 is not a multiple of base.micro-batch-size 4"),
        (lambda t: t.replace("global_batch_size: [4]", "global_batch_size: [4.5]"),
         "grid.global_batch_size[0]: expected a int"),
        (lambda t: t.replace("{num_layers: 2, hidden_size: 32, num_attention_heads: 1}",
                             "{num_layers: 2, hidden: 32}"),
         "grid.shapes[0].hidden: unknown key"),
        (lambda t: t.replace("{num_layers: 2, hidden_size: 32, num_attention_heads: 1}",
                             "{num_layers: 2, num_attention_heads: 1}"),
         "grid.shapes[0]: missing hidden_size"),
        (lambda t: t.split("grid:")[0] + "grid: {}\n", "grid: is empty"),
        (lambda t: t.split("grid:")[0], "no grid:"),
        (lambda t: t.replace("  lr:", "  learning_rate:"), "grid.learning_rate: unknown key"),
        (lambda t: "grid: [\n", "not valid YAML"),
        (lambda t: t.replace("  eval-iters: 1\n", "  eval-iters: 1\n") + "eval_tokens: 64\n", "either eval_tokens"),
    ],
)
def test_bad_sweep_files_are_refused_naming_the_file_and_key(edit, message, tmp_path):
    path = write(tmp_path, edit(TINY))
    with pytest.raises(sweep.SweepError) as error:
        sweep.load_sweep(path)
    assert str(error.value).startswith(path) and message in str(error.value), str(error.value)


def test_the_grid_becomes_runs_with_iterations_from_the_token_budget(tmp_path):
    text = TINY.replace("tokens: [128]", "tokens: [1k, 2048]")
    text = text.replace("global_batch_size: [4]", "global_batch_size: [4, 8]")
    text = text.replace("  eval-iters: 1\n", "") + "eval_tokens: 128\n"
    loaded = sweep.load_sweep(write(tmp_path, text), output_dir=str(tmp_path / "out"))
    assert len(loaded.runs) == 1 * 2 * 2 * 2
    first = loaded.runs[0]
    assert (first.lr, first.global_batch_size, first.train_iters, first.tokens,
            first.eval_iters) == (0.01, 4, 16, 1024, 2)
    last = loaded.runs[-1]
    assert (last.tokens_requested, last.lr, last.global_batch_size, last.train_iters,
            last.eval_iters) == (2048, 0.03, 8, 16, 1)
    command = loaded.command(last, sweep.launcher())
    flags = command[command.index("angpt.pretrain") + 1:]
    assert flags[flags.index("--train-iters") + 1] == "16" and flags[flags.index("--lr") + 1] == "0.03"
    assert "--mock-data" in flags and flags.count("--micro-batch-size") == 1
    assert flags[flags.index("--metrics-file") + 1] == os.path.join(loaded.run_dir(last), "metrics.jsonl")


def test_the_slurm_script_is_a_job_array_of_run_one(tmp_path, capsys):
    path = write(tmp_path, TINY)
    script_path = tmp_path / "array.slurm"
    assert sweep.main(["slurm", path, "--output-dir", str(tmp_path / "out"), "--partition", "gpu",
                       "--time", "02:00:00", "--nodes", "2", "--gpus-per-node", "4", "--max-parallel", "1",
                       "--script", str(script_path)]) == 0
    script = script_path.read_text()
    for line in ("#SBATCH --array=0-1%1", "#SBATCH --partition=gpu", "#SBATCH --time=02:00:00", "#SBATCH --nodes=2",
                 "#SBATCH --gpus-per-node=4"):
        assert line in script.splitlines(), line
    assert f"tools/sweep.py run-one {path} --index $SLURM_ARRAY_TASK_ID --output-dir {tmp_path / 'out'}" in script
    assert "--nnodes $SLURM_NNODES --node-rank $SLURM_NODEID" in script
    assert "sbatch" in capsys.readouterr().out


def test_a_failed_run_is_recorded_and_the_sweep_goes_on(tmp_path, capsys):
    loaded = sweep.load_sweep(write(tmp_path, TINY), output_dir=str(tmp_path / "out"))
    fail = [sys.executable, "-c", "import sys; print('boom'); sys.exit(3)"]
    counts = sweep.run_sweep(loaded, launch=fail)
    assert (counts["failed"], counts["finished"]) == (2, 0)
    status = json.loads((tmp_path / "out" / "runs" / loaded.runs[1].run_id / "status.json").read_text())
    assert status["status"] == "failed" and status["returncode"] == 3
    assert "boom" in open(status["log"]).read()
    output = capsys.readouterr().out
    assert "[1/2]" in output and "[2/2]" in output and "FAILED (exit code 3)" in output and status["log"] in output
    stopped = sweep.run_sweep(loaded, launch=fail, stop_on_failure=True)
    assert (stopped["failed"], stopped["not_started"]) == (1, 1)


@pytest.mark.slow
def test_a_local_sweep_of_two_tiny_runs_resumes_and_collects(tmp_path, capsys):
    path = write(tmp_path, TINY)
    out = tmp_path / "out"
    loaded = sweep.load_sweep(path, output_dir=str(out))
    counts = sweep.run_sweep(loaded, jobs=2, threads=1)
    output = capsys.readouterr().out
    assert counts["finished"] == 2 and counts["failed"] == 0, (output, [
        open(out / "runs" / r.run_id / "log.txt").read()[-3000:] for r in loaded.runs])
    assert "validation loss" in output
    # Again: nothing to do.
    again = sweep.run_sweep(loaded)
    assert (again["skipped"], again["finished"]) == (2, 0)
    assert "already finished" in capsys.readouterr().out

    assert sweep.main(["collect", path, "--output-dir", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    records = results["records"]
    assert [r["lr"] for r in records] == [0.01, 0.03] and results["finished"] == 2
    # 2 layers x (qkv 32 x 96 + output 32 x 32 + SwiGLU 3 x 128 x 32) weights, no embeddings.
    n = 2 * (32 * 96 + 32 * 32 + 3 * 128 * 32)
    for record in records:
        assert record["status"] == "finished" and record["train_iters"] == 2
        assert (record["N"], record["D"], record["C"]) == (n, 2 * 4 * 16, 6.0 * n * 2 * 4 * 16)
        assert 3.0 < record["valid_loss"] < 6.0  # about ln 128 = 4.85 after 2 steps
    header = (out / "results.csv").read_text().splitlines()[0]
    assert header.startswith("index,run_id,status") and "valid_loss" in header
