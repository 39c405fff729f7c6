#!/usr/bin/env python
"""Megatron-LM's own GPT configurations through tools/check_megatron_config.py: how many of its GPT functional
tests' pretraining configurations `angpt.pretrain` would start, per family, and what stops the others.

    python benchmarks/megatron_configs.py [--checkout MEGATRON_LM_GIT_DIR] [--tag core_v0.16.1]
    python benchmarks/megatron_configs.py --recorded   # the configurations tests/data records, no checkout

The configurations are MODEL_ARGS of `tests/functional_tests/test_cases/gpt/*/model_config.yaml` at --tag whose
MODE is absent or `pretraining` and MODEL_ARGS not empty (the others are inference and RL tests, and one test
that runs a script of its own; a test with MODEL_ARGS_2... for its later runs is checked with MODEL_ARGS, its
first). --checkout is a Megatron-LM clone, bare or not (read with `git show`). Each configuration runs through
the checker's `check` for every family, as the checker runs by default: placeholders given stand-ins, the world
size from the layout, Transformer Engine taken as importable. A refused configuration runs again without the
flag its error names, until it starts or the error names no flag given: so every refusal that stops it is
counted, not only the first (but for errors that follow from a flag dropped before: `--fp8-format hybrid needs
--bf16` once --bf16 is), and the configurations it alone stops (which would start were it lifted).

Prints a line per configuration and the tables, and writes docs/results/megatron_configs.json (per family:
accepted of total, the first refusals and every refusal with counts, each configuration's first refusal) and
tests/data/megatron_gpt_configs.json (each configuration's MODEL_ARGS, derived flag names and values, and the
accepted configurations per family: tests/test_check_megatron_config.py holds the checker to them, so that a
change either way reruns this benchmark; --recorded reads the configurations from it, tag and commit included).
"""

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import time

import yaml

from angpt.config.choices import MODEL_FAMILIES

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))

import check_megatron_config as checker  # noqa: E402 (a tool, not a package)

CHECKOUT = "/work/.mirror/NVIDIA+Megatron-LM/repo"
TAG = "core_v0.16.1"
CASES = "tests/functional_tests/test_cases/gpt"
RESULT = os.path.join(ROOT, "docs", "results", "megatron_configs.json")
RECORD = os.path.join(ROOT, "tests", "data", "megatron_gpt_configs.json")
PREFIX, SUFFIX = "angpt.pretrain: error: ", " (see --help)"
UNRECOGNIZED = "unrecognized arguments: "
FLAG = re.compile(r"--[A-Za-z0-9][\w-]*")


def git(checkout: str, *args: str) -> str:
    return subprocess.run(["git", "-C", checkout, *args], check=True, capture_output=True, text=True).stdout


def read_checkout(checkout: str, tag: str) -> tuple[dict[str, dict], str]:
    """({test name: MODEL_ARGS} of the pretraining tests, the tag's commit)."""
    configs = {}
    for path in git(checkout, "ls-tree", "-r", "--name-only", tag, CASES).split():
        if os.path.basename(path) != "model_config.yaml":
            continue
        config = yaml.safe_load(git(checkout, "show", f"{tag}:{path}"))
        if config.get("MODE", "pretraining") == "pretraining" and config.get("MODEL_ARGS"):
            configs[path.split("/")[-2]] = config["MODEL_ARGS"]
    return dict(sorted(configs.items())), git(checkout, "rev-parse", f"{tag}^{{commit}}").strip()


def reason(error: str) -> str:
    """The error's reason, as one counts it: parse_args' line without its frame; of argparse's unrecognized
    arguments, the first flag."""
    text = error.removeprefix(PREFIX).removesuffix(SUFFIX).removeprefix("argument ")
    if text.startswith(UNRECOGNIZED):
        return UNRECOGNIZED + text.removeprefix(UNRECOGNIZED).split()[0]
    return text


def same_flag(name: str, flag: str) -> bool:
    """Whether two spellings name one flag of angpt.pretrain (or are one unknown flag)."""
    return name == flag or (checker.action_of(name) is not None and checker.action_of(name) is checker.action_of(flag))


def named_flag(error: str, argv: list[str]) -> str | None:
    """The first flag the error names that `argv` gives (in any spelling), or None."""
    given = [flag for flag, _ in checker.segments(argv)]
    return next((flag for name in FLAG.findall(reason(error)) for flag in given if same_flag(name, flag)), None)


def without(argv: list[str], flag: str) -> list[str]:
    """`argv` without `flag` (every spelling of it) and its values."""
    return [token for name, values in checker.segments(argv) if not same_flag(name, flag) for token in [name, *values]]


def refusals(argv: list[str], family: str) -> tuple[list[str], bool, int]:
    """Every reason that stops the run, dropping the flag each names in turn; whether it starts then; and the
    checks that took. An error naming a flag dropped before follows from the dropping (`--fp8-format hybrid
    needs --bf16` once --bf16 is dropped): not counted."""
    found, dropped = [], []
    while True:
        report = checker.check(argv, family)
        if report.starts:
            return found, True, len(dropped) + 1
        text = reason(report.error)
        if not any(same_flag(name, flag) for name in FLAG.findall(text) for flag in dropped):
            found.append(text)
        flag = named_flag(report.error, argv)
        if flag is None:
            return found, False, len(dropped) + 1
        dropped.append(flag)
        argv = without(argv, flag)


def table(counter: collections.Counter, only: collections.Counter | None = None) -> list[dict]:
    """Rows of reason and configurations, most first; with `only`, the configurations it alone stops too."""
    rows = sorted(counter.items(), key=lambda item: (-item[1], item[0]))
    return [{"reason": text, "configs": count, **({"only_refusal": only[text]} if only is not None else {})}
            for text, count in rows]


def main() -> None:
    cli = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    cli.add_argument("--checkout", default=CHECKOUT, help="a Megatron-LM git clone (bare or not)")
    cli.add_argument("--tag", default=TAG)
    cli.add_argument("--recorded", action="store_true", help=f"the configurations of {os.path.relpath(RECORD, ROOT)}"
                     " instead of a checkout's")
    cli.add_argument("--output", default=RESULT)
    cli.add_argument("--record", default=RECORD, help="the configurations and counts the test holds the checker to")
    args = cli.parse_args()
    if args.recorded:
        recorded = read_record(args.record)
        configs, tag, commit = recorded["configs"], recorded["tag"], recorded["commit"]
    else:
        if not os.path.isdir(args.checkout):
            cli.error(f"--checkout {args.checkout}: no such directory (clone NVIDIA/Megatron-LM, or use --recorded)")
        tag = args.tag
        configs, commit = read_checkout(args.checkout, tag)
    print(f"{len(configs)} pretraining configurations of Megatron-LM {tag} ({commit[:12]}), families "
          f"{', '.join(MODEL_FAMILIES)}")

    results = {family: {"first": collections.Counter(), "every": collections.Counter(), "only": collections.Counter(),
                        "accepted": [], "after_dropping": 0, "first_by_config": {}} for family in MODEL_FAMILIES}
    checks, start = 0, time.perf_counter()
    for number, (name, model_args) in enumerate(configs.items(), start=1):
        argv, _ = checker.yaml_argv(model_args)
        outcome = []
        for family in MODEL_FAMILIES:
            found, starts, runs = refusals(argv, family)
            checks += runs
            result = results[family]
            if not found:
                result["accepted"].append(name)
                outcome.append(f"{family} starts")
                continue
            result["first"][found[0]] += 1
            result["every"].update(set(found))
            result["after_dropping"] += starts
            if starts and len(set(found)) == 1:
                result["only"][found[0]] += 1
            result["first_by_config"][name] = found[0]
            outcome.append(f"{family} {len(found)} refusal{'s' * (len(found) > 1)}")
        print(f"[{number:3d}/{len(configs)}] {name}: {', '.join(outcome)}", flush=True)
    seconds = time.perf_counter() - start

    summary = {}
    for family, result in results.items():
        accepted = len(result["accepted"])
        print(f"\n{family}: {accepted} of {len(configs)} would start; {result['after_dropping']} more would without "
              "the flags their errors name")
        print("  first refusal (configurations):")
        for row in table(result["first"])[:15]:
            print(f"    {row['configs']:4d}  {row['reason'][:150]}")
        print("  every refusal (configurations it stops, and of them those it alone stops):")
        for row in table(result["every"], result["only"])[:15]:
            print(f"    {row['configs']:4d} {row['only_refusal']:4d}  {row['reason'][:150]}")
        summary[family] = {"accepted": accepted, "total": len(configs),
                           "accepted_after_dropping_named_flags": accepted + result["after_dropping"],
                           "accepted_configs": result["accepted"], "first_refusals": table(result["first"]),
                           "every_refusal": table(result["every"], result["only"]),
                           "first_refusal_by_config": result["first_by_config"]}
    print(f"\n{checks} checks in {seconds:.1f} s ({1000 * seconds / checks:.0f} ms each)")

    source = {"repository": "NVIDIA/Megatron-LM", "tag": tag, "commit": commit,
              "configurations": f"{CASES}/*/model_config.yaml, MODE absent or pretraining: MODEL_ARGS",
              "checked": "as tools/check_megatron_config.py checks by default: placeholders given stand-ins, the "
                         "world size from the layout, Transformer Engine taken as importable"}
    os.makedirs(os.path.dirname(args.output), exist_ok=True)
    with open(args.output, "w") as file:
        json.dump({**source, "written_by": "benchmarks/megatron_configs.py", "families": summary,
                   "checks": checks, "seconds": round(seconds, 1)}, file, indent=1)
        file.write("\n")
    print(f"wrote {os.path.relpath(args.output, ROOT)}")
    write_record(args.record, source, configs, summary)
    print(f"wrote {os.path.relpath(args.record, ROOT)}")


def write_record(path: str, source: dict, configs: dict[str, dict], summary: dict) -> None:
    """The configurations and what the checker accepted of them per family. Compact: each flag and value that
    at least half the configurations give is written once, in "common", and a configuration, one a line, is its
    flags in its file's order: an index into "common", or [flag, value]."""
    shared = collections.Counter((flag, json.dumps(value)) for args in configs.values() for flag, value in args.items())
    common = [(flag, value) for (flag, value), count in shared.items() if 2 * count >= len(configs)]
    index = {pair: number for number, pair in enumerate(common)}
    record = {**source, "written_by": "benchmarks/megatron_configs.py (derived: flag names and values)",
              "accepted": {family: {"count": result["accepted"], "configs": result["accepted_configs"]}
                           for family, result in summary.items()}}
    head = json.dumps(record, indent=1)[:-2]  # without its closing brace, to go on with the configurations
    pairs = ",\n".join(f"  [{json.dumps(flag)}, {value}]" for flag, value in common)
    lines = []
    for name, args in configs.items():
        items = [index.get((flag, json.dumps(value)), [flag, value]) for flag, value in args.items()]
        lines.append(f"  {json.dumps(name)}: {json.dumps(items, separators=(',', ':'))}")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as file:
        file.write(f'{head},\n "common": [\n{pairs}\n ],\n "configs": {{\n' + ",\n".join(lines) + "\n }\n}\n")


def read_record(path: str) -> dict:
    """write_record's file, with each configuration's MODEL_ARGS whole again."""
    with open(path) as file:
        record = json.load(file)
    common = record.pop("common")
    record["configs"] = {name: dict(common[item] if isinstance(item, int) else item for item in items)
                         for name, items in record["configs"].items()}
    return record


if __name__ == "__main__":
    main()
