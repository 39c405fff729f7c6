"""Run docs/scaling.md's example, the dry run of a 70B model at 32k tokens of context on 256 GPUs with
--suggest-layout, for anGPT and for GPT+ of the same shape, and record what each prints in
docs/results/layout_example.json, from which tools/docs_figures.py writes the doc's command, output and verdict.

    python tools/layout_example.py      # a few minutes on a laptop; the model is built on the meta device
    python tools/docs_figures.py

The first anGPT dry run of the shape computes its SwiGLU factor by Monte Carlo (a minute, then cached).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
OUTPUT = os.path.join(ROOT, "docs", "results", "layout_example.json")
FAMILIES = ("angpt", "gptplus")
# The example's flags after --model-family: Llama 3 70B's shape, the user's layout (TP 8 x PP 8), no GPU here.
FLAGS = ["--num-layers", "80", "--hidden-size", "8192", "--num-attention-heads", "64", "--num-query-groups", "8",
         "--ffn-hidden-size", "28672", "--seq-length", "32768", "--max-position-embeddings", "32768",
         "--micro-batch-size", "1", "--global-batch-size", "256", "--mock-data", "--vocab-size", "128256",
         "--train-iters", "1000", "--bf16", "--use-distributed-optimizer", "--overlap-grad-reduce",
         "--overlap-param-gather", "--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "8",
         "--sequence-parallel", "--dry-run", "256", "--suggest-layout"]


def dry_run(family: str) -> list[str]:
    """The lines `python -m angpt.pretrain --model-family FAMILY FLAGS` prints."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    env.pop("WORLD_SIZE", None)  # the dry run's world size is its argument
    done = subprocess.run([sys.executable, "-m", "angpt.pretrain", "--model-family", family, *FLAGS], cwd=ROOT,
                          env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"the dry run of {family} failed:\n{done.stderr[-4000:]}")
    return done.stdout.splitlines()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", default=OUTPUT)
    args = parser.parse_args(argv)
    record = {"flags": FLAGS, "output": {family: dry_run(family) for family in FAMILIES}}
    with open(args.output, "w") as file:
        json.dump(record, file, indent=1)
        file.write("\n")
    print(f"wrote {os.path.relpath(args.output, ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
