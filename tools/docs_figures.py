"""Write the figures of README.md and docs/*.md from the committed result files, so that they cannot go stale
(tests/test_docs_figures.py checks that the committed text is what this writes, as docs/megatron.md is held).

A figure lives in a marked region, `<!-- figures:NAME -->...<!-- /figures -->`, inline or over lines; this
replaces what is between the marks with what FIGURES[NAME] writes from its source file. To change a figure,
commit a new result file and run

    python tools/docs_figures.py            # rewrite the regions in place
    python tools/docs_figures.py --check    # exit 1 naming each file whose regions are out of date

Every source is a file under docs/results/ (the H200's throughput, the convergence reports, the suite's times,
the dry runs of docs/scaling.md's example, the matrix of bad inputs) or docs/megatron.md (written from the parser by
tools/megatron_flags_doc.py and held by its own test).
Stdlib only, and benchmarks/speedup_horizon.py (stdlib too), so the test runs in a fraction of a second.
"""

from __future__ import annotations

import argparse
import collections
import functools
import glob
import importlib.util
import json
import os
import re
import sys
from typing import Callable

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
RESULTS = os.path.join(ROOT, "docs", "results")
THROUGHPUT = "docs/results/gpu/throughput.json"
H200_TESTS = "docs/results/gpu/2026-11-30-rmsnorm/tests.log"
FIRST_H200 = "docs/results/gpu/2026-11-29/throughput.json"
HORIZONS = ("docs/results/convergence.json", "docs/results/horizon640/convergence.json",
            "docs/results/horizon2560/convergence.json", "docs/results/horizon2560/gptplus.json")
SUITE_TIMES = "docs/results/suite_times.json"
BAD_INPUTS = "docs/results/bad_inputs.json"
LAYOUT_EXAMPLE = "docs/results/layout_example.json"
REGION = re.compile(r"(<!-- figures:([a-z0-9-]+) -->)(.*?)(<!-- /figures -->)", re.S)
FAMILIES = {"gptplus": "GPT+", "angpt": "anGPT", "ngpt": "nGPT"}
SHAPES = {"0.5b": "0.5B", "1b": "1B"}


@functools.lru_cache(maxsize=None)
def load(path: str) -> dict:
    with open(os.path.join(ROOT, path)) as file:
        return json.load(file)


def link(path: str, doc: str) -> str:
    """`path` as a Markdown link from the folder of `doc` (a path from the root)."""
    return f"[`{path}`]({os.path.relpath(os.path.join(ROOT, path), os.path.join(ROOT, os.path.dirname(doc)))})"


# The H200 (docs/results/gpu/throughput.json: one run of benchmarks/gpu_checks.sh, the date in its note)

def h200_date() -> str:
    return load(THROUGHPUT)["note"].split(",")[0]


def h200_row(shape: str, family: str, micro_batch: int, global_batch: int | None = None,
             variant: str = "default") -> dict:
    rows = [row for row in load(THROUGHPUT)["rows"]
            if (row["shape"], row["family"], row["variant"], row["micro_batch_size"]) ==
            (shape, family, variant, micro_batch) and row["global_batch_size"] == (global_batch or micro_batch)]
    assert len(rows) == 1, (shape, family, micro_batch, global_batch, variant)
    return rows[0]


def h200_global(shape: str, family: str) -> dict:
    """The row at the global batch (128 x 2048), micro-batch as large as the run measured."""
    data = load(THROUGHPUT)
    rows = [row for row in data["rows"] if row["shape"] == shape and row["family"] == family
            and row["variant"] == "default" and row["global_batch_size"] == data["global_batch_size"]]
    assert len(rows) == 1, (shape, family)
    return rows[0]


def h200_status() -> str:
    """The status table's row of the H200."""
    a05, a1 = h200_global("0.5b", "angpt"), h200_global("1b", "angpt")
    g05, g1 = h200_global("0.5b", "gptplus"), h200_global("1b", "gptplus")
    m05, m1 = h200_row("0.5b", "angpt", 4), h200_row("1b", "angpt", 4)
    return (f"anGPT's step {a05['vs_gptplus']:.3f}x GPT+'s at 0.5B and {a1['vs_gptplus']:.3f}x at 1B (global batch "
            f"{load(THROUGHPUT)['global_batch_size']} x {load(THROUGHPUT)['seq_length']}, BF16), "
            f"{m05['vs_gptplus']:.3f}x and {m1['vs_gptplus']:.3f}x at micro-batch 4; GPT+'s MFU "
            f"{g05['mfu']:.3f} / {g1['mfu']:.3f}, anGPT's {a05['mfu']:.3f} / {a1['mfu']:.3f}")


def h200_mfu_1b() -> str:
    """The MFU the layout search assumes (angpt/training/layout_search.py), as measured at 1B."""
    return ", ".join(f"{FAMILIES[family]} {h200_global('1b', family)['mfu']:.3f}" for family in FAMILIES)


def h200_memory() -> str:
    gptplus, angpt = h200_row("0.5b", "gptplus", 16), h200_row("0.5b", "angpt", 16)
    return (f"anGPT's peak memory {angpt['peak_memory_gib']:.1f} GiB against GPT+'s "
            f"{gptplus['peak_memory_gib']:.1f} ({angpt['peak_memory_gib'] / gptplus['peak_memory_gib']:.2f}x, 0.5B, "
            f"micro-batch 16)")


def h200_table() -> str:
    """docs/gpu.md's table of run B."""
    data = load(THROUGHPUT)
    lines = ["| shape | micro-batch x steps | GPT+ ms | GPT+ MFU | anGPT / GPT+ | nGPT / GPT+ | "
             "peak GiB GPT+ / anGPT / nGPT |",
             "|---|---|---:|---:|---:|---:|---:|"]
    keys = sorted({(row["shape"], row["micro_batch_size"], row["global_batch_size"]) for row in data["rows"]
                   if row["variant"] == "default"}, key=lambda key: (float(key[0][:-1]), key[2], key[1]))
    for shape, micro, total in keys:
        rows = {family: h200_row(shape, family, micro, total) for family in FAMILIES}
        steps = total // micro
        batch = f"{micro} x {steps}" + (f" (global batch {total} x {data['seq_length']})" if steps > 1 else "")
        mfu = f"{rows['gptplus']['mfu']:.3f}"
        memory = " / ".join(f"{rows[f]['peak_memory_gib']:.1f}" for f in FAMILIES) if steps == 1 else ""
        lines.append(f"| {SHAPES[shape]} | {batch} | {rows['gptplus']['ms_per_step']:.1f} | "
                     f"{f'**{mfu}**' if steps > 1 else mfu} | {rows['angpt']['vs_gptplus']:.3f} | "
                     f"{rows['ngpt']['vs_gptplus']:.3f} | {memory} |")
    return table(lines)


def h200_tests() -> str:
    """The `gpu` tests' summary line of the run whose throughput is THROUGHPUT."""
    with open(os.path.join(ROOT, H200_TESTS)) as file:
        lines = file.readlines()
    summary = [line for line in lines if re.search(r"\d+ passed", line)][-1].strip("= \n")
    summary = re.sub(r",? ?\d+ deselected| in [\d.]+s", "", summary)
    failed = collections.Counter(re.match(r"FAILED \S+::(\w+)", line).group(1) for line in lines
                                 if line.startswith("FAILED "))
    return summary + (f" (failed: {', '.join(f'{name} x{count}' for name, count in failed.items())})" if failed else "")


def h200_first() -> str:
    """The first H200 run's ratios at the global batch (docs/results/gpu/2026-11-30/), which the later run replaced."""
    ratios = []
    for shape in ("0.5b", "1b"):
        data = load(f"docs/results/gpu/2026-11-30/throughput-{shape}.json")
        rows = {row["family"]: row for row in data["rows"] if row["global_batch_size"] == data["global_batch_size"]
                and row.get("variant", "after") == "after"}
        ratios.append(f"{rows['angpt']['ms_per_step'] / rows['gptplus']['ms_per_step']:.3f}")
    return " and ".join(ratios)


def h200_first_table() -> str:
    """docs/gpu.md's table of the first session of 2026-11-30 (the "after" rows: with the fused cross-entropy)."""
    lines = ["| shape | micro-batch x steps accumulated | GPT+ ms/step | GPT+ MFU | anGPT ms/step | anGPT MFU | "
             "anGPT / GPT+ | paper |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for shape in ("0.5b", "1b"):
        data = load(f"docs/results/gpu/2026-11-30/throughput-{shape}.json")
        rows = [row for row in data["rows"] if row["variant"] == "after"]
        for micro, total in sorted({(row["micro_batch_size"], row["global_batch_size"]) for row in rows},
                                   key=lambda key: (key[1], key[0])):
            pair = {row["family"]: row for row in rows if (row["micro_batch_size"], row["global_batch_size"]) ==
                    (micro, total)}
            gptplus, angpt = pair["gptplus"], pair["angpt"]
            steps = total // micro
            batch = f"{micro} x {steps}" + (f" (global batch {total} x {data['seq_length']})" if steps > 1 else "")
            paper = "1.0275" if (shape, micro, steps) == ("0.5b", 4, 1) else ""
            lines.append(f"| {SHAPES[shape]} | {batch} | {gptplus['ms_per_step']:.1f} | {gptplus['mfu']:.3f} | "
                         f"{angpt['ms_per_step']:.1f} | {angpt['mfu']:.3f} | "
                         f"{angpt['ms_per_step'] / gptplus['ms_per_step']:.3f} | {paper} |")
    return table(lines)


def h200_2026_11_29_table() -> str:
    """docs/gpu.md's table of the first H200 run (2026-11-29)."""
    rows = load(FIRST_H200)["rows"]
    lines = ["| shape | family | fused kernels | ms/step | tokens/s/GPU | MFU | vs GPT+ | peak memory |",
             "|---|---|---|---:|---:|---:|---:|---:|"]
    for shape in ("0.5b", "1b"):
        for family, kernels in (("gptplus", "on"), ("angpt", "on"), ("angpt", "off"), ("ngpt", "on"),
                                ("ngpt", "off")):
            row = next(row for row in rows if (row["shape"], row["family"], row["kernels"]) == (shape, family, kernels))
            base = next(row for row in rows if (row["shape"], row["family"], row["kernels"]) ==
                        (shape, "gptplus", kernels))
            tokens = f"{row['tokens_per_s_per_gpu']:,.0f}".replace(",", " ")
            lines.append(f"| {SHAPES[shape]} | {FAMILIES[family]} | {kernels} | {row['ms_per_step']:.1f} | {tokens} | "
                         f"{row['mfu']:.3f} | {row['ms_per_step'] / base['ms_per_step']:.3f} | "
                         f"{row['peak_memory_gib']:.1f} GiB |")
    return table(lines)


def h200_1b_tokens() -> str:
    """docs/guide.md's arithmetic for 20B tokens on 16 GPUs at the 1B shape."""
    row = h200_global("1b", "angpt")
    tokens = row["tokens_per_s_per_gpu"]
    hours = 20.0e9 / (16 * tokens) / 3600
    return (f"one H200 measured {tokens:,.0f} tokens/s per GPU for this shape in BF16 at TP 1, micro-batch "
            f"{row['micro_batch_size']} and a global batch of {row['global_batch_size']} x "
            f"{load(THROUGHPUT)['seq_length']} ({h200_date()}, {link(THROUGHPUT, 'docs/guide.md')}). The config's "
            f"layout (TP 2, micro-batch 2, two nodes) has not been measured. If each GPU matched that figure, 20.0B "
            f"tokens on 16 GPUs would take 20.0e9 / (16 x {tokens:,.0f}) s, about {hours:.1f} hours")


# Convergence at small scale (benchmarks/convergence.py reports, combined by benchmarks/speedup_horizon.py)

@functools.lru_cache(maxsize=None)
def horizon_rows() -> tuple:
    spec = importlib.util.spec_from_file_location("speedup_horizon", os.path.join(ROOT, "benchmarks",
                                                                                  "speedup_horizon.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return tuple(module.horizon_rows([os.path.join(ROOT, path) for path in HORIZONS]))


def convergence_status() -> str:
    rows = horizon_rows()
    longest, paper = rows[-1], load(HORIZONS[-2])["paper"]["speedup"]
    return (f"anGPT reaches GPT+'s final loss {longest['angpt']:.2f}x sooner at {longest['steps']} steps (3 seeds; "
            f"{', '.join(format(row['angpt'], '.2f') + 'x' for row in rows)} at "
            f"{', '.join(str(row['steps']) for row in rows)} steps), nGPT {longest['ngpt']:.2f}x; the paper: "
            f"{paper['angpt']:.2f}x and {paper['ngpt']:.2f}x")


def convergence_ours() -> str:
    """One sentence of our small-scale speed-ups, for the pages that quote the paper's."""
    rows = horizon_rows()
    return (f"ours, at {convergence_size()}: anGPT {rows[-1]['angpt']:.2f}x and nGPT {rows[-1]['ngpt']:.2f}x at "
            f"{rows[-1]['steps']} steps ({rows[0]['angpt']:.2f}x and {rows[0]['ngpt']:.2f}x at {rows[0]['steps']} "
            f"steps)")


def convergence_size() -> str:
    """The shape of the convergence runs, with its weights counted as the shape gives them: embedding and untied
    head 2Vd, and per layer W_qkv and W_p 4d^2 and the SwiGLU's three 4d x d matrices 12d^2 (scales left out)."""
    report = load(HORIZONS[-2])
    d, layers = report["settings"]["hidden_size"], report["settings"]["num_layers"]
    parameters = 2 * report["vocab_size"] * d + layers * 16 * d * d
    return f"d={d}, {layers} layers, {parameters / 1e6:.1f}M parameters"


def alpha_range() -> str:
    """anGPT's mean alphas at the end of the three horizons' runs (seed 0's health probe)."""
    ends = [curve[-1][1] for path in HORIZONS[:3] for curve in load(path)["norm_health"]["angpt"]["alpha"].values()]
    return f"{min(ends):.2f}-{max(ends):.2f}"


# docs/scaling.md's example (docs/results/layout_example.json: what tools/layout_example.py's dry runs printed)

# a row of --suggest-layout's ranking
RANKED = re.compile(r"^  (.+?) +(--\S+|Megatron-FSDP \S+) +([\d.]+) +([\d.]+)  (\S+)$")
OVERLAPPED = re.compile(r"overlapped data-parallel collectives: ([\d.]+) s beside ([\d.]+) s of compute")


def layout_output(family: str) -> list[str]:
    return load(LAYOUT_EXAMPLE)["output"][family]


def layout_rows(family: str) -> list[dict]:
    """The ranked layouts of the family's dry run, fastest first."""
    return [dict(layout=m[1], sharding=m[2], gib=float(m[3]), seconds=float(m[4]))
            for m in map(RANKED.match, layout_output(family)) if m]


def layout_example_command() -> str:
    """The anGPT dry run, as a shell command of lines under 112 characters, each flag with its values."""
    groups = ["python -m angpt.pretrain", "--model-family angpt"]
    for word in load(LAYOUT_EXAMPLE)["flags"]:
        if word.startswith("--"):
            groups.append(word)
        else:
            groups[-1] += f" {word}"
    lines = [groups[0]]
    for group in groups[1:]:
        if len(lines[-1]) + len(group) + 3 > 112:
            lines.append("   ")
        lines[-1] += f" {group}"
    return "```bash\n" + " \\\n".join(lines) + "\n```"


def layout_example_output() -> str:
    """The anGPT dry run's memory table (the first two stages and the last) and the head of its ranking."""
    lines = layout_output("angpt")
    start, layouts = next(i for i, line in enumerate(lines) if line.startswith("memory per GPU")), \
        lines.index(next(line for line in lines if line.startswith("layouts of")))
    fullest = next(i for i in range(start, layouts) if lines[i].startswith("  the fullest GPU"))
    verdict = lines[fullest].split(": does NOT fit: ")[0] + (": does NOT fit: ..." if "NOT fit" in lines[fullest]
                                                              else "")
    stages = lines[start + 2:fullest]
    table = [*lines[start:start + 4], "      ...", stages[-1], verdict] if len(stages) > 3 else lines[start:fullest + 1]
    ranking = lines[layouts:]
    first = next(i for i, line in enumerate(ranking) if RANKED.match(line))
    overlapped = [line for line in ranking if OVERLAPPED.search(line)]
    return "```\n" + "\n".join([*table, "", *ranking[:first + 4], "  ...", *overlapped]) + "\n```"


def layout_comparison(family: str) -> tuple[dict, dict | None, float | None]:
    """The family's first layout, the fastest of the other sharding (if listed), and the first's seconds a step of
    overlapped data-parallel collectives (if any)."""
    rows = layout_rows(family)
    other = next((row for row in rows if row["sharding"] != rows[0]["sharding"]), None)
    match = next(filter(None, map(OVERLAPPED.search, layout_output(family))), None)
    return rows[0], other, float(match[1]) if match else None


def layout_example_verdict() -> str:
    """What the search puts first for anGPT, against the other sharding's fastest, and for GPT+ of the shape."""
    first, other, overlapped = layout_comparison("angpt")
    text = f"`{first['sharding']}` at {first['layout']}: {first['gib']:.1f} GiB and {first['seconds']:.2f} s a step"
    if other:
        text += (f", against {other['seconds']:.2f} s ({other['seconds'] / first['seconds'] - 1:.1%} more) and "
                 f"{other['gib']:.1f} GiB for the fastest with `{other['sharding']}`, {other['layout']}")
    if overlapped and other:
        text += (f". Its data-parallel collectives take {overlapped:.1f} s a step beside the compute: were "
                 f"{(other['seconds'] - first['seconds']) / overlapped:.0%} of them left exposed, the gain would be "
                 "gone")
    listed = layout_rows("angpt")
    if not any(row["sharding"].startswith("Megatron-FSDP") for row in listed):
        text += f". No Megatron-FSDP strategy is among the {len(listed)} listed"
    first, other, _ = layout_comparison("gptplus")
    return text + (f". For GPT+ of the same shape: `{first['sharding']}` at {first['layout']}, {first['seconds']:.2f} s"
                   + (f" against {other['seconds']:.2f} s with `{other['sharding']}`" if other else ""))


# The flags (docs/megatron.md, written from the parser and held by tests/test_megatron_lm_flags.py)

def megatron_flags() -> str:
    with open(os.path.join(ROOT, "docs", "megatron.md")) as file:
        match = re.search(r"^(\d+) flags: (\d+) implemented, (\d+) implied by the family, (\d+) ignored as in "
                          r"Megatron-LM, (\d+) refused", file.read(), re.M)
    total, implemented, implied, ignored, refused = match.groups()
    return (f"{total} flags of Megatron-LM's pretraining parser: {implemented} implemented, {implied} implied by the "
            f"family, {ignored} ignored as Megatron-LM does, {refused} refused in one line saying why")


def megatron_flags_count() -> str:
    return megatron_flags().split()[0]


# The suite (docs/results/suite_times.json, written by tools/suite_times.py from pytest's --junitxml)

def suite_times() -> str:
    if not os.path.exists(os.path.join(ROOT, SUITE_TIMES)):
        return "not yet recorded (`tools/suite_times.py` writes `docs/results/suite_times.json`)"
    def one(run: dict) -> str:
        failed = run["failures"] + run["errors"]
        return (f"`{run['command']}`: {int(run['seconds']) // 60}:{int(run['seconds']) % 60:02d} (pytest's time) for "
                f"{run['tests']} tests{f', {failed} failed' if failed else ''} on {run['cores']} cores ({run['date']}, "
                f"`{SUITE_TIMES}`)")
    return "; ".join(one(run) for run in load(SUITE_TIMES)["runs"])


# The matrix of bad inputs (docs/results/bad_inputs.json, written by tools/bad_inputs.py from the tests' records)

def bad_inputs_summary() -> str:
    data = load(BAD_INPUTS)
    cells = data["cells"]
    counts = collections.Counter(cell["outcome"] for cell in cells)
    return (f"{len(cells)} cases ({data['date']}, `{BAD_INPUTS}`, pytest: {data['pytest']}): {counts['refused']} "
            f"refused in one line, {counts['accepted']} accepted (the damage cannot be seen, or is harmless: the "
            f"table says why), {counts['elsewhere']} tested in another module; {counts['traceback']} printed a "
            f"traceback" + (f", {counts['failed']} failed their test" if counts["failed"] else ""))


def bad_inputs_table() -> str:
    """One table per group of files, headed by its tests: file, damage, what is printed (or why it runs, or the test
    elsewhere), whether a traceback was."""
    def escaped(text: str) -> str:
        return text.replace("|", "\\|")

    def code(text: str) -> str:
        return "`" + escaped(text.replace("`", "'")) + "`"

    sections, groups = [], {}
    for cell in load(BAD_INPUTS)["cells"]:
        groups.setdefault(cell["group"], []).append(cell)
    for group, cells in groups.items():
        tests = sorted({cell["test"].split("[")[0] for cell in cells if cell["outcome"] != "elsewhere"})
        lines = [f"**{group}** ({', '.join(f'`{test}`' for test in tests)})", "",
                 "| file | damage | printed | traceback |", "|---|---|---|---|"]
        for cell in cells:
            damage = cell["damage"] + (f" ({cell['where']})" if cell["where"] else "")
            if cell["outcome"] == "failed":
                printed = "**failed its test**" + (f": {code(cell['line'])}" if cell["line"] else "")
            elif cell["accepted"]:
                printed = f"runs: {escaped(cell['accepted'])}" + (f"; {code(cell['line'])}" if cell["line"] else "")
            elif cell["line"]:
                printed = code(cell["line"])
            else:
                printed = "tested in " + ", ".join(f"`{test.strip()}`" for test in cell["test"].split(","))
            traceback = "**yes**" if cell["traceback"] else "no"
            lines.append(f"| {code(cell['kind'])} | {damage} | {printed} | {traceback} |")
        sections.append(table(lines))
    return "\n\n".join(sections)


FIGURES: dict[str, Callable[[], str]] = {
    "h200-date": h200_date,
    "h200-status": h200_status,
    "h200-memory": h200_memory,
    "h200-mfu-1b": h200_mfu_1b,
    "h200-table": h200_table,
    "h200-tests": h200_tests,
    "h200-first": h200_first,
    "h200-first-table": h200_first_table,
    "h200-2026-11-29-table": h200_2026_11_29_table,
    "h200-1b-tokens": h200_1b_tokens,
    "convergence-status": convergence_status,
    "convergence-size": convergence_size,
    "convergence-ours": convergence_ours,
    "alpha-range": alpha_range,
    "megatron-flags": megatron_flags,
    "megatron-flags-count": megatron_flags_count,
    "suite-times": suite_times,
    "layout-example-command": layout_example_command,
    "layout-example-output": layout_example_output,
    "layout-example-verdict": layout_example_verdict,
    "bad-inputs-summary": bad_inputs_summary,
    "bad-inputs-table": bad_inputs_table,
}


def table(lines: list[str]) -> str:
    """Markdown table rows, an empty cell written `| |`."""
    return "\n".join(re.sub(r"\| {2}(?=\|)", "| ", line) for line in lines)


def render(text: str) -> str:
    """`text` with every region's contents written anew; a region of an unknown name is an error."""
    def fill(match: re.Match) -> str:
        start, name, old, end = match.groups()
        if name not in FIGURES:
            raise KeyError(f"no figure named {name!r} (tools/docs_figures.py, FIGURES)")
        new = FIGURES[name]()
        if "\n" in old:  # a block region keeps its contents on lines of their own
            new = f"\n{new}\n"
        return f"{start}{new}{end}"
    return REGION.sub(fill, text)


def documents() -> list[str]:
    return ["README.md", *sorted(os.path.relpath(path, ROOT) for path in glob.glob(os.path.join(ROOT, "docs", "*.md")))]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a file is out of date")
    args = parser.parse_args(argv)
    stale = []
    for path in documents():
        with open(os.path.join(ROOT, path)) as file:
            text = file.read()
        new = render(text)
        if new != text:
            stale.append(path)
            if not args.check:
                with open(os.path.join(ROOT, path), "w") as file:
                    file.write(new)
    for path in stale:
        print(f"{path}: {'out of date' if args.check else 'rewritten'}")
    return 1 if stale and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
