#!/usr/bin/env python
"""Run the matrix of bad inputs (issue 51: tests/test_bad_inputs.py, tests/test_bad_checkpoints.py and the torchrun
case of tests/test_bad_inputs_torchrun.py) and write what each case printed to docs/results/bad_inputs.json, from which
tools/docs_figures.py writes the tables of docs/bad-inputs.md:

    python tools/bad_inputs.py            # about 3 minutes on 2 cores
    python tools/docs_figures.py

Each case appends its outcome (tests/test_bad_inputs.py's `cell`): its file and damage, the one line printed or why
the damage cannot be seen, and whether an exception escaped (a traceback); the temporary directories are taken out of
the lines, leaving the file's name. A case whose test failed is recorded as such, and this exits 1.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
from xml.etree import ElementTree

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
RESULT = "docs/results/bad_inputs.json"
MODULES = ("tests/test_bad_inputs.py", "tests/test_bad_checkpoints.py", "tests/test_bad_inputs_torchrun.py")
DAMAGES = ("empty", "truncated", "flipped", "wrong kind", "missing")
# The tables' order: as a run meets its files.
GROUPS = ("preprocessing input", "tokenizer file", "tools/merge_datasets.py shard", "indexed dataset", "blend",
          "--config YAML", "Hugging Face directory (tools/convert_from_hf.py)", "checkpoint (torch_dist)",
          "checkpoint (torch)", "checkpoint (torch, distributed optimizer)", "torchrun, 2 ranks")


def order(cell: dict) -> tuple:
    group, damage = cell["group"], cell["damage"]
    return (GROUPS.index(group) if group in GROUPS else len(GROUPS), group, cell["kind"],
            DAMAGES.index(damage) if damage in DAMAGES else len(DAMAGES), damage, cell["where"] or "")


def node_id(name: str) -> str:
    """A test's id without the pytest-xdist group (`@group`) that --dist loadgroup appends."""
    return name.split("@")[0]


def failed_tests(junit: str) -> set[str]:
    """The node ids (tests/file.py::name[parameters]) of the tests that failed or erred."""
    failed = set()
    for case in ElementTree.parse(junit).iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            failed.add(node_id(f"{case.get('classname').replace('.', '/')}.py::{case.get('name')}"))
    return failed


def outcome(cell: dict, failed: set[str]) -> str:
    if cell.get("elsewhere"):
        return "elsewhere"
    if cell["traceback"]:
        return "traceback"
    if cell["test"] in failed or not (cell["line"] or cell["accepted"]):
        return "failed"
    return "accepted" if cell["accepted"] else "refused"


def cells_of(records: str, basetemp: str, failed: set[str]) -> list[dict]:
    """The recorded cases, sorted, each with its outcome and its line without the temporary directories (pytest's,
    per worker and test)."""
    temporary = re.compile(re.escape(basetemp) + r"/(?:popen-gw\d+/)?[^/\s']+/")
    cells = []
    with open(records) as file:
        for line in file:
            cell = json.loads(line)
            cell["test"] = node_id(cell["test"]) if not cell.get("elsewhere") else cell["test"]
            if cell["line"]:
                cell["line"] = temporary.sub("", cell["line"])
            cells.append({**cell, "outcome": outcome(cell, failed)})
    return sorted(cells, key=order)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", default="2", help="pytest-xdist's -n (default: %(default)s)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        records, basetemp, junit = (os.path.join(scratch, name) for name in ("records.jsonl", "t", "junit.xml"))
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", args.workers,
                               "--dist", "loadgroup", f"--basetemp={basetemp}", f"--junitxml={junit}", *MODULES],
                              cwd=ROOT, env={**os.environ, "ANGPT_BAD_INPUTS_RECORD": records},
                              capture_output=True, text=True)
        summary = (done.stdout.strip().splitlines() or [""])[-1].strip("= ")
        cells = cells_of(records, basetemp, failed_tests(junit)) if os.path.exists(records) else []
    result = {
        "command": "python tools/bad_inputs.py",
        "date": datetime.date.today().isoformat(),
        "pytest": re.sub(r",? \d+ warnings?| in [\d.]+s.*", "", summary),
        "cells": cells,
    }
    with open(os.path.join(ROOT, RESULT), "w") as file:
        json.dump(result, file, indent=1, ensure_ascii=False)
        file.write("\n")
    print(f"{RESULT}: {len(cells)} cases, {sum(cell['traceback'] for cell in cells)} with a traceback; pytest: "
          f"{summary}")
    if done.returncode != 0:
        print(done.stdout[-4000:], file=sys.stderr)
    return done.returncode


if __name__ == "__main__":
    sys.exit(main())
