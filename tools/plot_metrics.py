#!/usr/bin/env python
"""Plot the metrics.jsonl of one or several training runs to one PNG: the loss against consumed tokens
(training and validation), the learning rate, the grad norm, and anGPT's health signals where the runs
logged them (residual-stream norms, post-norm input norms, alphas, weight rows at the bound).

    python tools/plot_metrics.py runs/quickstart                  # writes runs/quickstart/metrics.png
    python tools/plot_metrics.py runs/lr1e-2 runs/lr3e-3 --labels "lr 1e-2" "lr 3e-3" --output lr.png

A run is a metrics.jsonl or the directory holding one; each run is one line per panel, labelled by its
directory's name unless --labels. A resumed run logs again the steps after its checkpoint: the records
of the run as it stands are plotted (angpt.telemetry.metrics_reader), one per iteration. Records of kinds other than
"train", "eval" and "start" are left out. Health signals of one run are drawn per layer (dark: first
layer); of several runs, as each run's mean over the layers. Needs matplotlib (`pip install
'angpt[bench]'`); draws without a display.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
from dataclasses import dataclass, field

import numpy as np

from angpt.telemetry.metrics_reader import MetricsError, current_records, read_records

HEALTH = "health/"
# A per-layer health signal ends in /layer_NN (angpt.telemetry.health.HealthProbe); what comes before names its panel.
LAYER_SUFFIX = re.compile(r"/layer_(\d+)$")
HEALTH_TITLES = {
    "residual_norm": "residual-stream norm after the layer",
    "post_norm_input/attention": "post-norm input norm, attention",
    "post_norm_input/mlp": "post-norm input norm, MLP",
    "alpha_attention": "mean alpha, attention",
    "alpha_mlp": "mean alpha, MLP",
    "rows_at_bound": "fraction of weight rows at the bound",
}


@dataclass
class Run:
    """What is plotted of one run, in iteration order: per figure, an array over the train records (NaN
    where a record lacks it or logged null), and the validation losses with the tokens consumed by then."""

    label: str
    path: str
    train: dict[str, np.ndarray] = field(default_factory=dict)
    validation: dict[str, np.ndarray] = field(default_factory=dict)


def _field(path: str, number: int, record: dict, name: str, kind: type = float):
    value = record.get(name)
    if value is None and name in ("iteration", "consumed_tokens"):
        raise MetricsError(f"{path}:{number}: a {record['kind']} record without {name!r}")
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise MetricsError(f"{path}:{number}: {name!r} is {value!r}, not a number")
    return kind(value) if value is not None else math.nan


def default_labels(paths: list[str]) -> list[str]:
    """Each run's directory name, or its directory's path where two runs share a name."""
    directories = [os.path.dirname(os.path.abspath(path)) for path in paths]
    names = [os.path.basename(directory) for directory in directories]
    return names if len(set(names)) == len(names) else [os.path.relpath(d) for d in directories]


def series(path: str, label: str) -> Run:
    """The curves of the run whose metrics.jsonl is `path`, as the run stands: after each "start" record
    only the earlier records up to its iteration (angpt.telemetry.metrics_reader.current_records), and where an
    iteration is still logged twice (files written before start records), its last record. Train records by
    iteration; validation records by iteration, placed at the tokens consumed by then."""
    kinds = ("train", "eval", "start")
    records = read_records(path)
    if not records:
        raise MetricsError(f"{path}: empty, no records to plot")
    known = [(number, record) for number, record in records if record["kind"] in kinds]
    for number, record in known:
        _field(path, number, record, "iteration", int)
    line = {id(record): number for number, record in known}
    train, validation = {}, {}
    for record in current_records([record for _, record in known]):
        if record["kind"] == "train":
            train[int(record["iteration"])] = (line[id(record)], record)
        elif record["kind"] == "eval" and record.get("split") == "validation":
            validation[int(record["iteration"])] = (line[id(record)], record)
    if not train:
        raise MetricsError(f"{path}: no training records (\"kind\": \"train\") to plot")
    run = Run(label, path)
    iterations = sorted(train)
    names = ["consumed_tokens", "lm_loss", "lr", "grad_norm"]
    names += sorted({name for _, record in train.values() for name in record if name.startswith(HEALTH)})
    run.train["iteration"] = np.array(iterations)
    for name in names:
        run.train[name] = np.array([_field(path, *train[i], name) for i in iterations])
    # Eval records hold no token count; it grows linearly between the train records around them (a
    # constant global batch), and at the last train record's rate past it.
    steps = np.concatenate([[0], run.train["iteration"]])
    tokens = np.concatenate([[0.0], run.train["consumed_tokens"]])
    rate = tokens[-1] / steps[-1]
    evaluated = np.array(sorted(validation))
    run.validation["iteration"] = evaluated
    run.validation["consumed_tokens"] = np.where(evaluated <= steps[-1], np.interp(evaluated, steps, tokens),
                                                 evaluated * rate)
    run.validation["lm_loss"] = np.array([_field(path, *validation[i], "lm_loss") for i in evaluated])
    return run


def _layer(name: str) -> int:
    """The layer number of a per-layer health field (0 for a whole-model one): runs of different depths
    pad it to different widths, so it sorts as a number."""
    match = LAYER_SUFFIX.search(name)
    return int(match[1]) if match else 0


def health_panels(runs: list[Run]) -> dict[str, list[str]]:
    """{panel: its fields in layer order} of the health signals any run logged, in HEALTH_TITLES' order."""
    panels: dict[str, set] = {}
    for run in runs:
        for name in run.train:
            if name.startswith(HEALTH):
                panels.setdefault(LAYER_SUFFIX.sub("", name[len(HEALTH):]), set()).add(name)
    order = list(HEALTH_TITLES)
    return {panel: sorted(panels[panel], key=_layer)
            for panel in sorted(panels, key=lambda p: (order.index(p) if p in order else len(order), p))}


def figure(runs: list[Run]):
    """A matplotlib Figure of the runs: loss, lr and grad norm against consumed tokens, then one panel per
    health signal (per layer for one run, each run's mean over layers for several)."""
    # A bare Figure draws without pyplot or a display.
    from matplotlib import colormaps  # noqa: PLC0415 (optional: matplotlib)
    from matplotlib.figure import Figure  # noqa: PLC0415 (optional: matplotlib)

    health = health_panels(runs)
    titles = {"loss": "loss", "lr": "learning rate", "grad_norm": "grad norm",
              **{panel: HEALTH_TITLES.get(panel, panel) for panel in health}}
    several = len(runs) > 1
    if several:
        titles.update({panel: f"{titles[panel]} (mean over layers)" for panel, names in health.items()
                       if len(names) > 1})
    columns = min(3, len(titles))
    rows = -(-len(titles) // columns)
    fig = Figure(figsize=(5.5 * columns, 3.8 * rows), layout="constrained")
    grid = fig.subplots(rows, columns, squeeze=False).flat
    axes = dict(zip(titles, grid))
    for unused in grid:  # the empty cells of the last row
        unused.remove()
    for i, run in enumerate(runs):
        color = f"C{i % 10}"
        label = run.label if several else None
        tokens = run.train["consumed_tokens"]
        prefix = f"{run.label}, " if several else ""
        axes["loss"].plot(tokens, run.train["lm_loss"], color=color, label=f"{prefix}train")
        if len(run.validation["iteration"]):
            axes["loss"].plot(run.validation["consumed_tokens"], run.validation["lm_loss"], color=color,
                              linestyle="--", marker="o", label=f"{prefix}validation")
        axes["lr"].plot(tokens, run.train["lr"], color=color, label=label)
        axes["grad_norm"].plot(tokens, run.train["grad_norm"], color=color, label=label)
        for panel, names in health.items():
            present = [name for name in names if name in run.train]
            if several and present:
                axes[panel].plot(tokens, np.mean([run.train[name] for name in present], axis=0), color=color,
                                 label=label)
            elif present:
                for depth, name in enumerate(present):
                    per_layer = LAYER_SUFFIX.search(name) is not None
                    # Shaded from the first layer (dark) to the last; only those two are in the legend.
                    shade = colormaps["viridis"](depth / max(len(present) - 1, 1)) if per_layer else color
                    named = per_layer and depth in (0, len(present) - 1)
                    axes[panel].plot(tokens, run.train[name], color=shade,
                                     label=f"layer {_layer(name)}" if named else None)
    axes["grad_norm"].set_yscale("log")
    for panel, ax in axes.items():
        ax.set(title=titles[panel], xlabel="consumed tokens")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
    if not several:  # several runs are named in the legends
        fig.suptitle(runs[0].path)
    return fig


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", metavar="RUN", help="a metrics.jsonl, or the run directory holding it")
    parser.add_argument("--labels", nargs="+", help="one label per run (default: each run's directory name)")
    parser.add_argument("--output", help="the PNG to write (default, with one run: metrics.png beside its "
                        "metrics.jsonl)")
    args = parser.parse_args(argv)
    if args.labels and len(args.labels) != len(args.runs):
        parser.error(f"{len(args.labels)} --labels for {len(args.runs)} runs")
    if not args.output and len(args.runs) > 1:
        parser.error("several runs need --output")
    paths = [os.path.join(run, "metrics.jsonl") if os.path.isdir(run) else run for run in args.runs]
    output = args.output or os.path.join(os.path.dirname(os.path.abspath(paths[0])), "metrics.png")
    try:
        runs = [series(path, label) for path, label in zip(paths, args.labels or default_labels(paths))]
        fig = figure(runs)
    except MetricsError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    except ImportError as error:
        print(f"error: plotting needs matplotlib ({error}): pip install 'angpt[bench]'", file=sys.stderr)
        return 1
    try:
        fig.savefig(output, dpi=100)
    except OSError as error:
        print(f"error: {output}: cannot be written ({error})", file=sys.stderr)
        return 1
    print(f"wrote {output} ({', '.join(run.label for run in runs)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
