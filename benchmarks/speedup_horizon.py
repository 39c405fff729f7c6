#!/usr/bin/env python
"""The speed-up over GPT+ against the training horizon, from reports of benchmarks/convergence.py run at
several --train-iters (issue 19): a Markdown table and a plot, with the paper's figures drawn in.

    python benchmarks/speedup_horizon.py docs/results/convergence.json docs/results/horizon640/convergence.json \\
        docs/results/horizon2560/convergence.json docs/results/horizon2560/gptplus.json \\
        --output docs/results/speedup_horizon

Reports with the same settings (shape, steps, validation) and corpus make one horizon. Each family is taken
from the last of them that has it, so a report of one family (convergence.py --families) replaces that
family's runs in an earlier report, e.g. GPT+ at a better lr found later. Speed-ups are computed from the
families' seed-mean validation curves as convergence.py computes them (GPT+'s final loss L*, the steps each
curve needs to reach it); per seed (seed s against GPT+'s seed s) where the reports keep each run's curve or
where both families come from one report, which states them.
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from convergence import NAMES, speedup_over_gptplus  # noqa: E402

MODELS = ("angpt", "ngpt")


def load(path: str) -> dict:
    try:
        with open(path) as file:
            report = json.load(file)
        if not isinstance(report["families"], dict) or not isinstance(report["settings"]["train_iters"], int):
            raise ValueError("no families or no train_iters")
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise SystemExit(f"speedup_horizon.py: {path}: not a convergence.py report ({error!r})") from None
    return report


def seed_runs(report: dict, family: str) -> list[dict]:
    """The family's runs at its best lr with their curves (reports before curves were kept: none)."""
    lr = report["families"][family]["best_lr"]
    return [r for r in report.get("runs", []) if r["family"] == family and r["lr"] == lr
            and not r["name"].startswith("ablation_") and r.get("curve")]


def horizon_row(group: list[tuple[str, dict]]) -> dict:
    """One horizon from its reports: each family from the last report that has it."""
    source = {}
    for path, report in group:
        for family in report["families"]:
            source[family] = (path, report)
    missing = [NAMES[f] for f in ("gptplus", *MODELS) if f not in source]
    if missing:
        raise SystemExit(f"speedup_horizon.py: {group[0][1]['settings']['train_iters']} steps: no run of "
                         f"{', '.join(missing)} in {', '.join(path for path, _ in group)}")
    gpt_path, gpt_report = source["gptplus"]
    gpt = gpt_report["families"]["gptplus"]
    row = {"steps": gpt_report["settings"]["train_iters"], "paper": gpt_report["paper"]["speedup"],
           "lr": {f: report["families"][f]["best_lr"] for f, (_, report) in source.items()},
           "seeds": {f: len(report["families"][f]["finals_by_seed"]) for f, (_, report) in source.items()},
           "sources": {f: path for f, (path, _) in source.items()}}
    for family in MODELS:
        path, report = source[family]
        speedup = speedup_over_gptplus(gpt["mean_curve"], report["families"][family]["mean_curve"],
                                       seed_runs(gpt_report, "gptplus"), seed_runs(report, family))
        if not speedup["per_seed"] and path == gpt_path and "speedup" in report:
            speedup["per_seed"] = report["speedup"][family].get("per_seed") or []
        row[family] = speedup["speedup"]
        row[f"{family}_per_seed"] = [s for s in speedup["per_seed"] if s is not None]
    return row


def horizon_rows(paths: list[str]) -> list[dict]:
    """One row per horizon, sorted by steps."""
    groups = {}
    for path in paths:
        report = load(path)
        key = json.dumps([report["settings"], report.get("corpus")], sort_keys=True)
        groups.setdefault(key, []).append((path, report))
    return sorted((horizon_row(group) for group in groups.values()), key=lambda row: row["steps"])


def markdown(rows: list[dict]) -> str:
    def cell(row, family):
        value, seeds = row[family], row[f"{family}_per_seed"]
        text = "not reached" if value is None else f"{value:.2f}x"
        if len(seeds) > 1:
            mean = sum(seeds) / len(seeds)
            std = (sum((s - mean) ** 2 for s in seeds) / (len(seeds) - 1)) ** 0.5
            text += f" (per seed {mean:.2f} ± {std:.2f})"
        elif row["seeds"][family] > 1:
            text += " (per seed: n/a, the runs' curves are not in the reports)"
        return text

    def seeds(row):
        counts = {row["seeds"][f] for f in ("angpt", "gptplus", "ngpt")}
        return str(counts.pop()) if len(counts) == 1 else "/".join(str(row["seeds"][f]) for f in NAMES)

    lines = ["| steps | seeds | lr anGPT / GPT+ / nGPT | anGPT over GPT+ | nGPT over GPT+ |", "|---:|---:|---|---|---|"]
    lines += [f"| {row['steps']} | {seeds(row)} | {' / '.join(format(row['lr'][f], 'g') for f in NAMES)} | "
              f"{cell(row, 'angpt')} | {cell(row, 'ngpt')} |" for row in rows]
    paper = rows[-1]["paper"]
    lines.append(f"| paper | | | {paper['angpt']:.2f}x | {paper['ngpt']:.2f}x |")
    merged = [row for row in rows if len(set(row["sources"].values())) > 1]
    if merged:
        lines.append("")
    for row in merged:
        by_path = {}
        for family, name in NAMES.items():
            by_path.setdefault(row["sources"][family], []).append(name)
        lines.append(f"- {row['steps']} steps: " + "; ".join(f"{', '.join(names)} from {path}"
                                                           for path, names in by_path.items()) + ".")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: str) -> None:
    import matplotlib  # noqa: PLC0415 (optional: the plot)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    figure, axis = plt.subplots(figsize=(6, 4))
    steps = [row["steps"] for row in rows]
    for family, color in zip(MODELS, ("C0", "C2")):
        name = NAMES[family]
        axis.plot(steps, [row[family] for row in rows], "o-", color=color, label=f"{name} over GPT+")
        for row in rows:
            if len(row[f"{family}_per_seed"]) > 1:
                axis.plot([row["steps"]] * len(row[f"{family}_per_seed"]), row[f"{family}_per_seed"], ".",
                          color=color, alpha=0.4)
        axis.axhline(rows[-1]["paper"][family], color=color, linestyle="--", linewidth=1,
                     label=f"paper, {name}: {rows[-1]['paper'][family]:.2f}x")
    axis.axhline(1.0, color="gray", linewidth=0.8)
    axis.set_xscale("log")
    axis.minorticks_off()
    axis.set_xticks(steps, [str(s) for s in steps])
    axis.set_xlabel("training steps (horizon)")
    axis.set_ylabel("speed-up over GPT+ (steps to GPT+'s final loss)")
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("reports", nargs="+", help="convergence.json of benchmarks/convergence.py runs")
    parser.add_argument("--output", required=True, help="writes OUTPUT.md, and OUTPUT.png with matplotlib")
    args = parser.parse_args(argv)
    rows = horizon_rows(args.reports)
    text = markdown(rows)
    with open(args.output + ".md", "w") as file:
        file.write(text)
    try:
        plot(rows, args.output + ".png")
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
    print(text)


if __name__ == "__main__":
    main()
