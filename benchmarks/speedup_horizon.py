#!/usr/bin/env python
"""The speed-up over GPT+ against the training horizon, from reports of benchmarks/convergence.py run at
several --train-iters (issue 19): a Markdown table and a plot, with the paper's figures drawn in.

    python benchmarks/speedup_horizon.py docs/results/convergence.json docs/results/horizon640/convergence.json \\
        docs/results/horizon2560/convergence.json --output docs/results/speedup_horizon

Each report's speed-up is the one it states (GPT+'s seed-mean final validation loss L*, and the step at
which each family's seed-mean curve reaches it), with the mean and spread of the per-seed speed-ups
(seed s against GPT+'s seed s) where a report has more than one seed.
"""

import argparse
import json
import sys

FAMILIES = {"angpt": "anGPT", "ngpt": "nGPT"}


def horizon_rows(paths: list[str]) -> list[dict]:
    """One row per report, sorted by horizon: steps, seeds, speed-up and per-seed spread of each family."""
    rows = []
    for path in paths:
        try:
            with open(path) as file:
                report = json.load(file)
            row = {"report": path, "steps": report["settings"]["train_iters"], "seeds": len(report["seeds"]),
                   "paper": report["paper"]["speedup"]}
            for family in FAMILIES:
                speedup = report["speedup"][family]
                row[family] = speedup["speedup"]
                row[f"{family}_per_seed"] = speedup.get("per_seed") or []
        except (OSError, ValueError, KeyError) as error:
            raise SystemExit(f"speedup_horizon.py: {path}: not a convergence.py report ({error!r})") from None
        rows.append(row)
    return sorted(rows, key=lambda row: row["steps"])


def markdown(rows: list[dict]) -> str:
    def cell(row, family):
        value, seeds = row[family], row[f"{family}_per_seed"]
        text = "not reached" if value is None else f"{value:.2f}x"
        if len(seeds) > 1:
            mean = sum(seeds) / len(seeds)
            std = (sum((s - mean) ** 2 for s in seeds) / (len(seeds) - 1)) ** 0.5
            text += f" (per seed {mean:.2f} ± {std:.2f})"
        return text

    lines = ["| steps | seeds | anGPT over GPT+ | nGPT over GPT+ |", "|---:|---:|---|---|"]
    lines += [f"| {row['steps']} | {row['seeds']} | {cell(row, 'angpt')} | {cell(row, 'ngpt')} |" for row in rows]
    paper = rows[-1]["paper"]
    lines.append(f"| paper | | {paper['angpt']:.2f}x | {paper['ngpt']:.2f}x |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: str) -> None:
    import matplotlib  # noqa: PLC0415 (optional: the plot)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    figure, axis = plt.subplots(figsize=(6, 4))
    steps = [row["steps"] for row in rows]
    for (family, name), color in zip(FAMILIES.items(), ("C0", "C2")):
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
