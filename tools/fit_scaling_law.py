#!/usr/bin/env python
"""Fit scaling laws to a sweep's results (tools/sweep.py collect): the loss as a function of compute,
L(C) = E + A C^-alpha, on the compute frontier, and the optimal learning rate and global batch size as
power laws of the model size N, lr_opt = a N^b; every fit with bootstrap confidence intervals. Writes
plots (PNG) and a summary (Markdown and JSON), and prints the summary.

    python tools/fit_scaling_law.py runs/sweeps/cpu_scaling/results.json [more results files] \\
        --out-dir docs/results --prefix scaling [--bootstrap 1000 --seed 0]

What is fitted:
  * The frontier: for each (shape, tokens) the best final validation loss over lr and batch; of those,
    the points that no point of less or equal compute beats (C = 6 N D; N without embeddings). With
    --points all, every (shape, tokens) optimum is fitted instead.
  * L(C) = E + A C^-alpha by least squares on log L (each point counts by its relative error), started
    from the best of a grid of E values (for a fixed E, log(L - E) is linear in log C). C is divided by
    its geometric mean while fitting, for conditioning; A is reported for C in FLOPs.
  * lr_opt(N): for each shape, at one token budget (--hparams-tokens, default the largest one every shape
    ran), the loss of each lr is the best over batch sizes; the optimum is the vertex of a parabola in
    log lr through the best grid point and its two neighbours (the grid point itself, marked "at edge",
    when the best lr is the smallest or largest of the grid). Then log lr_opt = log a + b log N by least
    squares. The same for the batch size (the best over lr for each batch size).
  * With --baseline (another family's PREFIX_fit.json, say GPT+'s): for each of the baseline's frontier
    points whose loss this frontier spans, the compute this family needs to reach that loss (log C
    interpolated linearly in log L between frontier points) and the ratio, the baseline's compute over it.
    Under "the same exponent, a smaller coefficient" the ratio is the same at every loss.
  * Confidence intervals: percentile bootstrap (default 1000 resamples, 95 %). L(C): the frontier points
    are resampled with replacement and refitted (resamples with fewer than 3 distinct points are
    dropped). lr_opt and batch_opt: the shapes are resampled (fewer than 2 distinct N: dropped). With
    fewer than 2 shapes there is nothing to fit; with 2, the line goes through both and has no interval.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import sys
from typing import Optional, Sequence

import numpy as np

SHAPE_FIELDS = ("num_layers", "hidden_size", "num_attention_heads")


# ---------------------------------------------------------------------------------------------------------
# L(C) = E + A C^-alpha


def loss_power_law(compute, E, A, alpha):
    return E + A * np.power(compute, -alpha)


def fit_loss_compute(compute: Sequence[float], loss: Sequence[float]) -> dict:
    """Least squares on log L of L = E + A C^-alpha; E in [0, min L), alpha in [0, 3]."""
    from scipy.optimize import least_squares  # noqa: PLC0415 (optional: scipy)

    compute, loss = np.asarray(compute, float), np.asarray(loss, float)
    if len(compute) < 3 or len(np.unique(compute)) < 3:
        raise ValueError(f"L(C) needs at least 3 points of different compute, got {len(np.unique(compute))}")
    scale = float(np.exp(np.mean(np.log(compute))))
    x = np.log(compute / scale)
    log_loss = np.log(loss)
    ceiling = float(loss.min())

    def residuals(theta):
        E, log_A, alpha = theta
        return np.log(E + np.exp(log_A - alpha * x)) - log_loss

    def jacobian(theta):
        E, log_A, alpha = theta
        power = np.exp(log_A - alpha * x)
        inverse = 1.0 / (E + power)
        return np.stack([inverse, power * inverse, -x * power * inverse], axis=1)

    # Start: for each E on a grid below min L, log(L - E) = log A - alpha x is a line.
    best = None
    for fraction in np.linspace(0.0, 0.98, 25):
        E = fraction * ceiling
        slope, intercept = np.polyfit(x, np.log(loss - E), 1)
        theta = np.array([E, intercept, min(max(-slope, 1e-3), 2.9)])
        cost = float(np.sum(residuals(theta) ** 2))
        if best is None or cost < best[0]:
            best = (cost, theta)
    theta0 = best[1]
    bounds = ([0.0, -50.0, 0.0], [ceiling * (1 - 1e-9), 50.0, 3.0])
    result = least_squares(residuals, theta0, jac=jacobian, bounds=bounds, x_scale=[max(ceiling, 1e-3), 1.0, 0.1],
                           method="trf")
    E, log_A, alpha = result.x
    rms = float(np.sqrt(np.mean(result.fun ** 2)))
    # A for C in FLOPs: A' (C / scale)^-alpha = A' scale^alpha C^-alpha.
    return dict(E=float(E), A=float(math.exp(log_A + alpha * math.log(scale))), alpha=float(alpha),
                A_at_reference=float(math.exp(log_A)), reference_compute=scale, rms_log_residual=rms,
                points=int(len(compute)))


def percentile_interval(samples, level: float = 0.95) -> Optional[list]:
    samples = np.asarray([s for s in samples if s is not None and np.isfinite(s)], float)
    if len(samples) < 2:
        return None
    tail = 100 * (1 - level) / 2
    return [float(np.percentile(samples, tail)), float(np.percentile(samples, 100 - tail))]


def bootstrap_loss_compute(compute, loss, resamples: int = 1000, seed: int = 0, level: float = 0.95) -> dict:
    """The fit and percentile bootstrap intervals of E, A and alpha (the points resampled with replacement)."""
    compute, loss = np.asarray(compute, float), np.asarray(loss, float)
    fit = fit_loss_compute(compute, loss)
    rng = np.random.default_rng(seed)
    draws = {"E": [], "A": [], "alpha": []}
    dropped = 0
    for _ in range(resamples):
        pick = rng.integers(0, len(compute), len(compute))
        if len(np.unique(compute[pick])) < 3:
            dropped += 1
            continue
        try:
            again = fit_loss_compute(compute[pick], loss[pick])
        except (ValueError, np.linalg.LinAlgError):
            dropped += 1
            continue
        for key in draws:
            draws[key].append(again[key])
    fit["ci"] = {key: percentile_interval(values, level) for key, values in draws.items()}
    fit.update(bootstrap_resamples=resamples, bootstrap_used=resamples - dropped, ci_level=level, seed=seed)
    fit["_draws"] = draws
    return fit


# ---------------------------------------------------------------------------------------------------------
# Power laws y = a N^b


def fit_power_law(n: Sequence[float], y: Sequence[float]) -> dict:
    """log y = log a + b log N by least squares."""
    n, y = np.asarray(n, float), np.asarray(y, float)
    if len(np.unique(n)) < 2:
        raise ValueError("a power law of N needs at least 2 different N")
    b, log_a = np.polyfit(np.log(n), np.log(y), 1)
    return dict(a=float(math.exp(log_a)), b=float(b), points=int(len(n)))


def bootstrap_power_law(n, y, resamples: int = 1000, seed: int = 0, level: float = 0.95) -> dict:
    n, y = np.asarray(n, float), np.asarray(y, float)
    fit = fit_power_law(n, y)
    distinct = len(np.unique(n))
    if distinct < 3:
        fit.update(ci={"a": None, "b": None}, bootstrap_resamples=0, bootstrap_used=0, ci_level=level, seed=seed,
                   note=f"{distinct} model sizes: the line goes through them, no confidence interval "
                        "(needs at least 3)")
        return fit
    rng = np.random.default_rng(seed)
    draws = {"a": [], "b": []}
    for _ in range(resamples):
        pick = rng.integers(0, len(n), len(n))
        if len(np.unique(n[pick])) < 2:
            continue
        again = fit_power_law(n[pick], y[pick])
        draws["a"].append(again["a"])
        draws["b"].append(again["b"])
    fit["ci"] = {key: percentile_interval(values, level) for key, values in draws.items()}
    fit.update(bootstrap_resamples=resamples, bootstrap_used=len(draws["b"]), ci_level=level, seed=seed)
    if distinct < 5:
        fit["note"] = (f"only {distinct} model sizes: the bootstrap resamples these few points, so the interval "
                       "is coarse (it is at most the range of the slopes between pairs of them)")
    return fit


# ---------------------------------------------------------------------------------------------------------
# From the sweep's records


def load_records(paths: Sequence[str]) -> list[dict]:
    """Finished runs with a validation loss from `tools/sweep.py collect` (JSON or CSV); several files merge."""
    records = []
    for path in paths:
        if path.endswith(".csv"):
            with open(path, newline="") as file:
                rows = list(csv.DictReader(file))
            for row in rows:
                for key, value in row.items():
                    if value == "":
                        row[key] = None
                    elif key in ("N", "D", "C", "lr", "valid_loss", "train_loss", "seconds"):
                        row[key] = float(value)
                    elif key in (*SHAPE_FIELDS, "global_batch_size", "seq_length", "train_iters", "index"):
                        row[key] = int(value)
            rows = [dict(row, sweep=path) for row in rows]
        else:
            with open(path) as file:
                data = json.load(file)
            rows = [dict(row, sweep=data.get("sweep", path)) for row in data["records"]]
        records += [r for r in rows if r.get("status") == "finished" and r.get("valid_loss") is not None
                    and math.isfinite(r["valid_loss"])]
    if not records:
        raise ValueError(f"no finished runs with a validation loss in {', '.join(paths)}")
    return records


def shape_key(record: dict) -> tuple:
    return tuple(record[key] for key in SHAPE_FIELDS)


def best_per_shape_and_tokens(records: list[dict]) -> list[dict]:
    """For each (shape, tokens): the run with the lowest validation loss over lr and batch."""
    best = {}
    for record in records:
        key = (shape_key(record), record["D"])
        if key not in best or record["valid_loss"] < best[key]["valid_loss"]:
            best[key] = record
    return sorted(best.values(), key=lambda r: r["C"])


def compute_frontier(points: list[dict]) -> list[dict]:
    """The points that no point of less or equal compute beats (the lower envelope of L against C)."""
    frontier = []
    for point in sorted(points, key=lambda r: (r["C"], r["valid_loss"])):
        if not frontier or point["valid_loss"] < frontier[-1]["valid_loss"]:
            frontier.append(point)
    return frontier


def compute_to_reach(frontier: list[dict], loss: float) -> Optional[float]:
    """The compute at which a frontier (sorted by C, its loss falling) reaches `loss`: log C interpolated
    linearly in log L between the two frontier points around it; None outside the frontier's losses."""
    for low, high in zip(frontier, frontier[1:]):
        if high["valid_loss"] <= loss <= low["valid_loss"]:
            if low["valid_loss"] == high["valid_loss"]:
                return low["C"]
            t = math.log(low["valid_loss"] / loss) / math.log(low["valid_loss"] / high["valid_loss"])
            return math.exp(math.log(low["C"]) + t * math.log(high["C"] / low["C"]))
    return None


def compute_multipliers(baseline_frontier: list[dict], frontier: list[dict]) -> list[dict]:
    """For each baseline frontier point whose loss `frontier` spans: the compute `frontier` needs for that
    loss and the ratio of the baseline's compute to it (above 1: this family needs less)."""
    rows = []
    for point in baseline_frontier:
        needed = compute_to_reach(frontier, point["valid_loss"])
        if needed is not None:
            rows.append(dict(run_id=point["run_id"], C=point["C"], valid_loss=point["valid_loss"], C_needed=needed,
                             multiplier=point["C"] / needed))
    return rows


def optimum_on_grid(values: Sequence[float], losses: Sequence[float]) -> tuple[float, bool]:
    """The minimizing value: a parabola's vertex in log value through the best grid point and its two
    neighbours, or the grid point itself when it is at the edge (second flag True) or the parabola is not
    convex."""
    order = np.argsort(values)
    values, losses = np.asarray(values, float)[order], np.asarray(losses, float)[order]
    i = int(np.argmin(losses))
    if len(values) < 3 or i == 0 or i == len(values) - 1:
        return float(values[i]), bool(len(values) > 1)
    x = np.log(values[i - 1:i + 2])
    c2, c1, _ = np.polyfit(x, losses[i - 1:i + 2], 2)
    if c2 <= 0:
        return float(values[i]), False
    vertex = float(np.clip(-c1 / (2 * c2), x[0], x[2]))
    return float(math.exp(vertex)), False


def optimal_hyperparameter(records: list[dict], name: str, tokens: Optional[float] = None) -> list[dict]:
    """Per shape: the optimal `name` ("lr" or "global_batch_size") at a token budget (default: the largest
    one every shape has), the loss of each value being the best over the other hyperparameter."""
    shapes = sorted({shape_key(r) for r in records}, key=lambda s: min(r["N"] for r in records if shape_key(r) == s))
    if tokens is None:
        common = set.intersection(*({r["D"] for r in records if shape_key(r) == s} for s in shapes))
        if not common:
            raise ValueError("no token budget that every shape ran: give --hparams-tokens")
        tokens = max(common)
    rows = []
    for shape in shapes:
        runs = [r for r in records if shape_key(r) == shape and r["D"] == tokens]
        if not runs:
            continue
        best = {}
        for run in runs:
            value = run[name]
            if value not in best or run["valid_loss"] < best[value]:
                best[value] = run["valid_loss"]
        values = sorted(best)
        losses = [best[v] for v in values]
        optimum, at_edge = optimum_on_grid(values, losses)
        rows.append(dict(shape=dict(zip(SHAPE_FIELDS, shape)), N=runs[0]["N"], D=tokens, grid=values,
                         losses=losses, best_on_grid=values[int(np.argmin(losses))],
                         optimum=optimum, at_edge=at_edge, grid_points=len(values)))
    return rows


def fit_hyperparameter(records: list[dict], name: str, tokens: Optional[float], resamples: int, seed: int) -> dict:
    try:
        rows = optimal_hyperparameter(records, name, tokens)
    except ValueError as error:
        return dict(name=name, fit=None, note=str(error), per_shape=[])
    result = dict(name=name, per_shape=rows, D=rows[0]["D"] if rows else None, fit=None)
    if len({r["N"] for r in rows}) < 2:
        result["note"] = f"{len(rows)} model size(s) at this token budget: too few shapes to fit a power law of N"
        return result
    if all(r["grid_points"] < 2 for r in rows):
        result["note"] = f"one {name} in the grid: nothing to optimize"
        return result
    if all(r["at_edge"] for r in rows):
        result["note"] = (f"the best {name} is at the edge of the grid for every shape: the optima are outside the "
                          "grid, nothing to fit (widen the grid)")
        return result
    result["fit"] = bootstrap_power_law([r["N"] for r in rows], [r["optimum"] for r in rows], resamples, seed)
    edges = [r for r in rows if r["at_edge"]]
    if edges:
        result["edge_note"] = (f"the best {name} is at the edge of the grid for {len(edges)} of {len(rows)} shapes "
                               "(the true optimum may lie outside it)")
    return result


# ---------------------------------------------------------------------------------------------------------
# Plots and summary


def _format_ci(ci, fmt="{:.3g}") -> str:
    return "n/a" if not ci else f"[{fmt.format(ci[0])}, {fmt.format(ci[1])}]"


def plot_loss_compute(records, points, frontier, fit, path: str) -> None:
    import matplotlib  # noqa: PLC0415 (optional: matplotlib)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415 (optional, and after choosing the Agg back end)

    figure, axes = plt.subplots(figsize=(6.4, 4.4))
    shapes = sorted({shape_key(r) for r in records}, key=lambda s: min(r["N"] for r in records if shape_key(r) == s))
    colors = plt.cm.viridis(np.linspace(0, 0.9, len(shapes)))
    for shape, color in zip(shapes, colors):
        runs = [r for r in records if shape_key(r) == shape]
        n = runs[0]["N"]
        axes.scatter([r["C"] for r in runs], [r["valid_loss"] for r in runs], s=10, color=color, alpha=0.35)
        best = sorted([p for p in points if shape_key(p) == shape], key=lambda r: r["C"])
        axes.plot([r["C"] for r in best], [r["valid_loss"] for r in best], "o-", color=color, ms=4,
                  label=f"L{shape[0]} d{shape[1]} (N={n / 1e6:.2g}M)")
    axes.plot([r["C"] for r in frontier], [r["valid_loss"] for r in frontier], "s", mfc="none", mec="red", ms=9,
              label="frontier")
    if fit:
        grid = np.logspace(math.log10(min(r["C"] for r in records)) - 0.1,
                           math.log10(max(r["C"] for r in records)) + 0.1, 200)
        draws = fit.get("_draws")
        if draws and len(draws["E"]) > 10:
            curves = np.array([loss_power_law(grid, E, A, alpha)
                               for E, A, alpha in zip(draws["E"], draws["A"], draws["alpha"])])
            low, high = np.percentile(curves, [2.5, 97.5], axis=0)
            axes.fill_between(grid, low, high, color="red", alpha=0.12, lw=0, label="95% bootstrap band")
        axes.plot(grid, loss_power_law(grid, fit["E"], fit["A"], fit["alpha"]), "r-", lw=1.5,
                  label=f"$L = {fit['E']:.2f} + {fit['A']:.3g}\\,C^{{-{fit['alpha']:.3f}}}$")
    axes.set_xscale("log")
    axes.set_yscale("log")
    axes.set_xlabel("compute C = 6ND (FLOPs)")
    axes.set_ylabel("final validation loss")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(fontsize=7)
    axes.set_title("loss against compute (best over lr and batch per point)", fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def plot_hyperparameters(results: list[dict], path: str) -> None:
    import matplotlib  # noqa: PLC0415 (optional: matplotlib)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415 (optional, and after choosing the Agg back end)

    figure, all_axes = plt.subplots(1, len(results), figsize=(5.2 * len(results), 4.0), squeeze=False)
    for axes, result in zip(all_axes[0], results):
        rows = result["per_shape"]
        label = {"lr": "learning rate", "global_batch_size": "global batch size"}[result["name"]]
        if not rows or all(r["grid_points"] < 2 for r in rows):
            axes.text(0.5, 0.5, f"not fitted: {result.get('note', 'no runs')}", ha="center", va="center", wrap=True,
                      transform=axes.transAxes, fontsize=9)
            axes.set_title(label, fontsize=10)
            axes.set_axis_off()
            continue
        for row in rows:
            axes.scatter([row["N"]] * len(row["grid"]), row["grid"], s=12, color="gray", alpha=0.4)
        inside = [r for r in rows if not r["at_edge"]]
        edge = [r for r in rows if r["at_edge"]]
        if inside:
            axes.scatter([r["N"] for r in inside], [r["optimum"] for r in inside], color="C0", zorder=3,
                         label="optimum (parabola in log)")
        if edge:
            axes.scatter([r["N"] for r in edge], [r["optimum"] for r in edge], color="C1", marker="^", zorder=3,
                         label="best at the grid's edge")
        fit = result.get("fit")
        if fit:
            n = np.logspace(math.log10(min(r["N"] for r in rows)) - 0.1,
                            math.log10(max(r["N"] for r in rows)) + 0.1, 50)
            ci = fit.get("ci", {}).get("b")
            axes.plot(n, fit["a"] * n ** fit["b"], "C0-",
                      label=f"{fit['a']:.3g} N^{fit['b']:.3f}" + (f", b in {_format_ci(ci)}" if ci else ""))
        axes.set_xscale("log")
        axes.set_yscale("log")
        axes.set_xlabel("non-embedding parameters N")
        axes.set_ylabel(f"optimal {label}")
        axes.grid(True, which="both", alpha=0.3)
        axes.set_title(f"optimal {label} at D = {result['D']:.3g} tokens" if result.get("D") else label, fontsize=10)
        if rows:
            axes.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def summarize(records, points, frontier, loss_fit, hparams, sources, fit_on: str) -> dict:
    public_fit = {k: v for k, v in loss_fit.items() if not k.startswith("_")} if loss_fit else None
    return dict(
        sources=list(sources), runs=len(records), shapes=len({shape_key(r) for r in records}),
        token_budgets=sorted({r["D"] for r in records}), fit_on=fit_on,
        loss_compute=public_fit,
        frontier=[dict(run_id=r["run_id"], N=r["N"], D=r["D"], C=r["C"], lr=r["lr"],
                       global_batch_size=r["global_batch_size"], valid_loss=r["valid_loss"]) for r in frontier],
        best_per_shape_and_tokens=[dict(run_id=r["run_id"], N=r["N"], D=r["D"], C=r["C"], lr=r["lr"],
                                        global_batch_size=r["global_batch_size"], valid_loss=r["valid_loss"])
                                   for r in points],
        **{f"{h['name']}_opt": h for h in hparams},
    )


def markdown(summary: dict, plot_names: dict) -> str:
    lines = [f"Scaling-law fits of {summary['runs']} finished runs ({summary['shapes']} shapes, token budgets "
             f"{', '.join(f'{d:.3g}' for d in summary['token_budgets'])}) from {', '.join(summary['sources'])}.", ""]
    fit = summary["loss_compute"]
    if fit:
        ci = fit["ci"]
        lines += [f"**L(C) = E + A C^-alpha** on {fit['points']} points ({summary['fit_on']}), "
                  f"{int(fit['ci_level'] * 100)} % bootstrap intervals ({fit['bootstrap_used']} of "
                  f"{fit['bootstrap_resamples']} resamples usable, seed {fit['seed']}):", "",
                  "| parameter | fit | 95 % CI |", "|---|---|---|",
                  f"| E | {fit['E']:.4g} | {_format_ci(ci['E'], '{:.4g}')} |",
                  f"| A | {fit['A']:.4g} | {_format_ci(ci['A'], '{:.4g}')} |",
                  f"| alpha | {fit['alpha']:.4g} | {_format_ci(ci['alpha'], '{:.4g}')} |", "",
                  f"RMS residual of log L: {fit['rms_log_residual']:.4f}.", ""]
    else:
        lines += [f"**L(C)**: not fitted ({summary.get('loss_compute_note', 'too few points')}).", ""]
    for key, label in (("lr_opt", "lr_opt(N) = a N^b"), ("global_batch_size_opt", "batch_opt(N) = a N^b")):
        result = summary.get(key)
        if not result:
            continue
        lines.append(f"**{label}**" + (f" at D = {result['D']:.3g} tokens" if result.get("D") else "") + ":")
        fit = result.get("fit")
        if fit:
            ci = fit.get("ci", {})
            lines += ["", "| parameter | fit | 95 % CI |", "|---|---|---|",
                      f"| a | {fit['a']:.4g} | {_format_ci(ci.get('a'), '{:.4g}')} |",
                      f"| b | {fit['b']:.4g} | {_format_ci(ci.get('b'), '{:.4g}')} |", ""]
            if fit.get("note"):
                lines += [f"Note: {fit['note']}.", ""]
        else:
            lines += [" not fitted: " + result.get("note", "too few shapes") + ".", ""]
        if result.get("edge_note"):
            lines += [f"Note: {result['edge_note']}.", ""]
        if result["per_shape"]:
            lines += ["| N | grid | loss per grid value | best on grid | optimum |", "|---|---|---|---|---|"]
            for row in result["per_shape"]:
                lines.append(f"| {row['N']:.3g} | {', '.join(f'{v:g}' for v in row['grid'])} | "
                             f"{', '.join(f'{v:.4f}' for v in row['losses'])} | {row['best_on_grid']:g} | "
                             f"{row['optimum']:.3g}{' (edge)' if row['at_edge'] else ''} |")
            lines.append("")
    if "compute_multiplier" in summary:
        comparison = summary["compute_multiplier"]
        lines += [f"**Compute to reach the frontier losses of {comparison['baseline']}**: "
                  f"{len(comparison['rows'])} of its {comparison['baseline_points']} frontier points lie within "
                  "this frontier's losses.", ""]
        if comparison["rows"]:
            lines += ["| baseline run | baseline C | loss | C needed here | multiplier |", "|---|---|---|---|---|"]
            lines += [f"| {row['run_id']} | {row['C']:.3g} | {row['valid_loss']:.4f} | {row['C_needed']:.3g} "
                      f"| {row['multiplier']:.2f}x |" for row in comparison["rows"]]
            lines.append("")
    lines += ["Frontier (compute-optimal points):", "", "| run | N | D | C | loss |", "|---|---|---|---|---|"]
    for row in summary["frontier"]:
        lines.append(f"| {row['run_id']} | {row['N']:.3g} | {row['D']:.3g} | {row['C']:.3g} "
                     f"| {row['valid_loss']:.4f} |")
    lines += ["", *[f"![{name}]({path})" for name, path in plot_names.items()], ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="tools/fit_scaling_law.py", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="+", help="results.json or .csv of tools/sweep.py collect")
    parser.add_argument("--out-dir", default=".", help="where the plots and summaries go")
    parser.add_argument("--prefix", default="scaling", help="file names: PREFIX_fit.json, PREFIX_fit.md, "
                        "PREFIX_loss_compute.png, PREFIX_hparams.png")
    parser.add_argument("--points", choices=("frontier", "all"), default="frontier",
                        help="fit L(C) to the frontier (default) or to every (shape, tokens) optimum")
    parser.add_argument("--hparams-tokens", type=float, help="token budget of the lr and batch optima "
                        "(default: the largest one every shape ran)")
    parser.add_argument("--bootstrap", type=int, default=1000, help="resamples (default 1000)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot-link-prefix", default="", help="prefix of the plot links in the Markdown")
    parser.add_argument("--baseline", help="another family's PREFIX_fit.json: the compute this family needs to "
                        "reach that family's frontier losses")
    args = parser.parse_args(argv)

    try:
        records = load_records(args.results)
    except (OSError, ValueError, KeyError) as error:
        print(f"tools/fit_scaling_law.py: {error}", file=sys.stderr)
        return 2
    points = best_per_shape_and_tokens(records)
    frontier = compute_frontier(points)
    fitted = frontier if args.points == "frontier" else points
    loss_fit, note = None, None
    try:
        loss_fit = bootstrap_loss_compute([r["C"] for r in fitted], [r["valid_loss"] for r in fitted],
                                          args.bootstrap, args.seed)
    except ValueError as error:
        note = str(error)
    hparams = [fit_hyperparameter(records, name, args.hparams_tokens, args.bootstrap, args.seed)
               for name in ("lr", "global_batch_size")]
    summary = summarize(records, points, frontier, loss_fit, hparams, args.results,
                        "the frontier" if args.points == "frontier" else "every (shape, tokens) optimum")
    if note:
        summary["loss_compute_note"] = note
    if args.baseline:
        try:
            with open(args.baseline) as file:
                baseline = json.load(file)["frontier"]
        except (OSError, ValueError, KeyError) as error:
            print(f"tools/fit_scaling_law.py: --baseline {args.baseline}: {error!r}", file=sys.stderr)
            return 2
        summary["compute_multiplier"] = dict(baseline=args.baseline, baseline_points=len(baseline),
                                             rows=compute_multipliers(baseline, frontier))

    os.makedirs(args.out_dir, exist_ok=True)
    names = {"loss against compute": f"{args.prefix}_loss_compute.png",
             "optimal lr and batch size against N": f"{args.prefix}_hparams.png"}
    plot_loss_compute(records, points, frontier, loss_fit, os.path.join(args.out_dir, names["loss against compute"]))
    plot_hyperparameters(hparams, os.path.join(args.out_dir, names["optimal lr and batch size against N"]))
    text = markdown(summary, {k: args.plot_link_prefix + v for k, v in names.items()})
    with open(os.path.join(args.out_dir, f"{args.prefix}_fit.md"), "w") as file:
        file.write(text)
    with open(os.path.join(args.out_dir, f"{args.prefix}_fit.json"), "w") as file:
        json.dump(summary, file, indent=1)
        file.write("\n")
    print(text)
    written = [*names.values(), args.prefix + "_fit.md", args.prefix + "_fit.json"]
    print(f"wrote {', '.join(os.path.join(args.out_dir, n) for n in written)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
