"""Record how long the test suite took, from pytest's JUnit XML, in docs/results/suite_times.json, which
tools/docs_figures.py writes into the README (region `suite-times`).

    .venv/bin/python -m pytest -q -n auto --dist loadgroup -m "not long" --junitxml=/tmp/suite.xml   # make test's run
    python tools/suite_times.py /tmp/suite.xml --command "make test"
    python tools/docs_figures.py

The time is pytest's own (its session's wall clock, from collection to the last report; with pytest-xdist, all
workers together), not the set-up of .venv/. A run of the same command replaces the earlier one.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import xml.etree.ElementTree as ElementTree

OUTPUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs", "results", "suite_times.json")


def run_record(junit_xml: str, command: str, cores: int) -> dict:
    root = ElementTree.parse(junit_xml).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    if suite is None:
        raise SystemExit(f"{junit_xml}: no <testsuite> (not pytest's --junitxml output)")
    counts = {key: int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")}
    return {"command": command, "seconds": round(float(suite.get("time")), 1), **counts, "cores": cores,
            "date": (suite.get("timestamp") or "")[:10], "host": suite.get("hostname", "")}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("junit_xml", help="the file of pytest --junitxml=FILE")
    parser.add_argument("--command", required=True, help="what was run, as the README names it: 'make test'")
    parser.add_argument("--cores", type=int, default=os.cpu_count(), help="the machine's cores (default: this one's)")
    parser.add_argument("--output", default=OUTPUT)
    args = parser.parse_args(argv)
    record = run_record(args.junit_xml, args.command, args.cores)
    runs = []
    if os.path.exists(args.output):
        with open(args.output) as file:
            runs = [run for run in json.load(file)["runs"] if run["command"] != args.command]
    with open(args.output, "w") as file:
        json.dump({"runs": [*runs, record]}, file, indent=1)
        file.write("\n")
    print(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
