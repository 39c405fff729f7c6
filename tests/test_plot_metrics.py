"""tools/plot_metrics.py on the metrics.jsonl of a real (in-process, few-step) anGPT run and on hand-written
files: what it plots, the PNG it writes, and its one-line errors."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys

import numpy as np
import pytest

from conftest import ROOT, in_process_trainer

sys.path.insert(0, os.path.join(ROOT, "tools"))

import plot_metrics

ITERS, EVAL_INTERVAL, LAYERS = 4, 2, 2
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def real_run(tmp_path_factory, single_process):
    """A metrics.jsonl written by the trainer: anGPT, ITERS steps, each logged, validation every EVAL_INTERVAL."""
    path = tmp_path_factory.mktemp("real_run") / "metrics.jsonl"
    argv = ["--model-family", "angpt", "--num-layers", str(LAYERS), "--hidden-size", "64",
                       "--num-attention-heads", "4", "--seq-length", "32", "--micro-batch-size", "2",
                       "--global-batch-size", "4", "--mock-data", "--vocab-size", "128", "--lr", "1e-2",
                       "--train-iters", str(ITERS), "--log-interval", "1", "--eval-interval", str(EVAL_INTERVAL),
                       "--eval-iters", "1", "--metrics-file", str(path)]
    assert in_process_trainer(argv).run() == 0
    return path


def png_size(path) -> tuple[int, int]:
    """(width, height) of a PNG, from its IHDR chunk after checking the signature."""
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def write_records(path, records, tail: str = "") -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(record) + "\n" for record in records) + tail)
    return str(path)


def train(iteration: int, loss: float, **extra) -> dict:
    return {"kind": "train", "iteration": iteration, "consumed_tokens": 100 * iteration, "lm_loss": loss,
            "lr": 1e-3, "grad_norm": 0.5, **extra}


def plotted(ax) -> list[tuple[list, list]]:
    return [(list(line.get_xdata()), list(line.get_ydata())) for line in ax.get_lines()]


@pytest.mark.slow
def test_a_real_runs_curves_are_its_records(real_run, tmp_path):
    records = [json.loads(line) for line in real_run.read_text().splitlines()]
    trains = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval" and r["split"] == "validation"]
    assert [r["iteration"] for r in trains] == list(range(1, ITERS + 1))
    assert [r["iteration"] for r in evals] == list(range(EVAL_INTERVAL, ITERS + 1, EVAL_INTERVAL))

    run = plot_metrics.series(str(real_run), "real")
    assert run.train["iteration"].tolist() == list(range(1, ITERS + 1))
    for name in ("consumed_tokens", "lm_loss", "lr", "grad_norm"):
        assert run.train[name].tolist() == [r[name] for r in trains], name
    # Validation at the tokens the train record of the same iteration consumed.
    assert run.validation["lm_loss"].tolist() == [r["lm_loss"] for r in evals]
    assert run.validation["consumed_tokens"].tolist() == [trains[r["iteration"] - 1]["consumed_tokens"] for r in evals]

    # anGPT's health signals, per layer in order, each in its panel.
    panels = plot_metrics.health_panels([run])
    layers = [f"layer_{i:02d}" for i in range(1, LAYERS + 1)]
    assert panels["residual_norm"] == [f"health/residual_norm/{layer}" for layer in layers]
    assert panels["alpha_attention"] == [f"health/alpha_attention/{layer}" for layer in layers]
    assert panels["rows_at_bound"] == ["health/rows_at_bound"]
    assert set(panels) == set(plot_metrics.HEALTH_TITLES)

    fig = plot_metrics.figure([run])
    axes = {ax.get_title(): ax for ax in fig.axes}
    assert len(axes) == 3 + len(panels)
    tokens = [r["consumed_tokens"] for r in trains]
    assert plotted(axes["loss"]) == [(tokens, [r["lm_loss"] for r in trains]),
                                     ([trains[r["iteration"] - 1]["consumed_tokens"] for r in evals],
                                      [r["lm_loss"] for r in evals])]
    assert plotted(axes["learning rate"]) == [(tokens, [r["lr"] for r in trains])]
    assert plotted(axes["residual-stream norm after the layer"]) == [
        (tokens, [r[f"health/residual_norm/{layer}"] for r in trains]) for layer in layers]

    output = tmp_path / "curves.png"
    done = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "plot_metrics.py"), str(real_run.parent),
                           "--output", str(output)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"wrote {output} ({real_run.parent.name})\n"
    width, height = png_size(output)
    assert (width, height) == (1650, 1140)  # 3 x 3 panels of 5.5 x 3.8 inches at 100 dpi


def test_a_resumed_run_is_plotted_as_it_stands_and_other_kinds_are_left_out(tmp_path):
    # The first run logged 1-4 (evaluating at 2 and 4) and was killed after its checkpoint at 2; the
    # second resumed from 2, logged 3 and was killed before saving; the third resumed from 2 again and
    # logged 3. Iteration 4 is no longer part of the run. (A resumed run repeats the losses exactly;
    # different ones here show which record stands.)
    path = write_records(tmp_path / "metrics.jsonl", [
        {"kind": "start", "iteration": 0, "resumed": False},
        train(1, 5.0), train(2, 4.0),
        {"kind": "eval", "iteration": 2, "split": "validation", "lm_loss": 4.5},
        train(3, 3.5), train(4, 3.4),
        {"kind": "eval", "iteration": 4, "split": "validation", "lm_loss": 9.0},
        {"kind": "start", "iteration": 2, "resumed": True, "checkpoint": "iter_0000002"},
        train(3, 3.2),
        {"kind": "start", "iteration": 2, "resumed": True, "checkpoint": "iter_0000002"},
        train(3, 3.0, **{"health/rows_at_bound": 0.5}),
        {"kind": "eval", "iteration": 3, "split": "validation", "lm_loss": 3.9},
        {"kind": "eval", "iteration": 3, "split": "test", "lm_loss": 7.0},
        {"kind": "something_new", "iteration": "later", "lm_loss": 100.0},
    ])
    run = plot_metrics.series(path, "resumed")
    assert run.train["iteration"].tolist() == [1, 2, 3]
    assert run.train["lm_loss"].tolist() == [5.0, 4.0, 3.0]
    # Health fields only some records hold are NaN in the others.
    assert np.isnan(run.train["health/rows_at_bound"][:2]).all() and run.train["health/rows_at_bound"][2] == 0.5
    assert run.validation["iteration"].tolist() == [2, 3]
    assert run.validation["lm_loss"].tolist() == [4.5, 3.9]
    assert run.validation["consumed_tokens"].tolist() == [200, 300]


def test_without_start_records_the_last_record_of_a_repeated_iteration_stands(tmp_path):
    path = write_records(tmp_path / "metrics.jsonl", [
        train(1, 5.0), train(2, 4.0), train(3, 3.5),
        {"kind": "eval", "iteration": 3, "split": "validation", "lm_loss": 9.0},
        train(3, 3.0), {"kind": "eval", "iteration": 3, "split": "validation", "lm_loss": 3.9},
        train(4, 2.5, lm_loss=None, grad_norm=None),  # a skipped NaN step logs null
    ])
    run = plot_metrics.series(path, "repeated")
    assert run.train["iteration"].tolist() == [1, 2, 3, 4]
    assert run.train["lm_loss"][:3].tolist() == [5.0, 4.0, 3.0] and np.isnan(run.train["lm_loss"][3])
    assert np.isnan(run.train["grad_norm"][3])
    assert run.validation["lm_loss"].tolist() == [3.9]


@pytest.mark.slow
def test_several_runs_are_a_line_each_with_their_labels(tmp_path):
    first = write_records(tmp_path / "a" / "metrics.jsonl", [train(i, 6.0 - i) for i in (1, 2, 3)])
    second = write_records(tmp_path / "b" / "metrics.jsonl", [
        train(i, 7.0 - i, **{f"health/residual_norm/layer_0{layer}": float(layer * i) for layer in (1, 2)})
        for i in (2, 4)])
    assert plot_metrics.default_labels([first, second]) == ["a", "b"]
    runs = [plot_metrics.series(first, "lr 1e-2"), plot_metrics.series(second, "lr 3e-3")]
    fig = plot_metrics.figure(runs)
    axes = {ax.get_title(): ax for ax in fig.axes}
    assert [line.get_label() for line in axes["learning rate"].get_lines()] == ["lr 1e-2", "lr 3e-3"]
    assert [line.get_label() for line in axes["loss"].get_lines()] == ["lr 1e-2, train", "lr 3e-3, train"]
    # The health signal of the one run that has it, as its mean over the layers.
    assert plotted(axes["residual-stream norm after the layer (mean over layers)"]) == [([200, 400], [3.0, 6.0])]

    output = tmp_path / "both.png"
    assert plot_metrics.main([str(tmp_path / "a"), second, "--labels", "x", "y", "--output", str(output)]) == 0
    assert png_size(output) == (1650, 760)  # 3 x 2 panels


def test_runs_sharing_a_directory_name_are_labelled_by_their_paths(tmp_path):
    paths = [str(tmp_path / side / "run" / "metrics.jsonl") for side in ("left", "right")]
    assert plot_metrics.default_labels(paths) == [os.path.relpath(os.path.dirname(p)) for p in paths]


@pytest.mark.parametrize("content, error", [
    (None, "{path}: no such file"),
    ("", "{path}: empty, no records to plot"),
    ("\n\n", "{path}: empty, no records to plot"),
    ('{"kind": "train", "iteration": 1, "consumed_tokens": 10, "lm_loss": 1}\nlm loss: 5.1\n\n',
     "{path}:2: not JSON (Expecting value: line 1 column 1 (char 0))"),
    ('[1, 2]\n', '{path}:1: not a metrics record (a JSON object with a "kind")'),
    ('{"kind": "train", "iteration": 1, "consumed_tokens": 10, "lm_loss": "low"}\n',
     "{path}:1: 'lm_loss' is 'low', not a number"),
    ('{"kind": "train", "iteration": 1, "lm_loss": 1.0}\n', "{path}:1: a train record without 'consumed_tokens'"),
    ('{"kind": "start", "resumed": false}\n', "{path}:1: a start record without 'iteration'"),
    ('{"kind": "eval", "split": "validation", "iteration": 1, "lm_loss": 1.0}\n',
     '{path}: no training records ("kind": "train") to plot'),
])
def test_a_file_that_cannot_be_plotted_is_one_line_naming_it(content, error, tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    if content is not None:
        path.write_text(content)
    assert plot_metrics.main([str(path), "--output", str(tmp_path / "out.png")]) == 1
    assert capsys.readouterr().err == f"error: {error.format(path=path)}\n"
    assert not (tmp_path / "out.png").exists()


def test_a_last_line_cut_by_a_kill_is_left_out_with_a_warning(tmp_path, capsys):
    path = write_records(tmp_path / "metrics.jsonl", [train(1, 5.0), train(2, 4.0)], tail='{"kind": "train", "it')
    assert plot_metrics.series(path, "killed").train["iteration"].tolist() == [1, 2]
    assert capsys.readouterr().err == (f"warning: {path}:3: an unfinished last line (the run was killed while "
                                       "writing it?); left out\n")
