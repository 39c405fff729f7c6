"""The figures of README.md and docs/ are what tools/docs_figures.py writes from the committed result files,
the README starts with its two commands, and its links into docs/ land on a file and a heading that exist.
In process, stdlib only: a fraction of a second."""

import json
import os
import re
import sys

import pytest

from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "tools"))
import docs_figures  # noqa: E402 (a tool, not a package)
import suite_times  # noqa: E402


def read(path: str) -> str:
    with open(os.path.join(ROOT, path)) as file:
        return file.read()


@pytest.mark.parametrize("path", docs_figures.documents())
def test_the_committed_figures_are_what_the_generator_writes(path):
    text = read(path)
    assert docs_figures.render(text) == text, f"{path}'s figures are out of date: run python tools/docs_figures.py"


def test_every_figure_is_used_and_every_region_has_a_figure():
    used = {name for path in docs_figures.documents() for _, name, _, _ in docs_figures.REGION.findall(read(path))}
    assert used == set(docs_figures.FIGURES)
    with pytest.raises(KeyError, match="no figure named 'nonesuch'"):
        docs_figures.render("<!-- figures:nonesuch -->1<!-- /figures -->")


def test_a_region_is_rewritten_inline_or_as_a_block():
    assert docs_figures.render("a <!-- figures:h200-date -->old<!-- /figures --> b") == \
        f"a <!-- figures:h200-date -->{docs_figures.h200_date()}<!-- /figures --> b"
    block = docs_figures.render("<!-- figures:h200-table -->\nold\n<!-- /figures -->")
    assert block.startswith("<!-- figures:h200-table -->\n| shape |") and block.endswith("|\n<!-- /figures -->")


def test_the_layout_verdict_says_when_no_megatron_fsdp_strategy_is_listed(monkeypatch):
    def row(layout, sharding, gib, seconds):  # as --suggest-layout's ranking prints one
        return f"  {layout:68} {sharding:32} {gib:6.1f} {seconds:8.2f}  1.00/0.00/0.00/0.00/0.00/0.00"

    rows = [row("TP 4 x PP 1 x CP 4 x DP 16, SP", "--use-torch-fsdp2", 57.4, 46.53),
            row("TP 4 x PP 4 x CP 4 x DP 4, SP", "--use-distributed-optimizer", 78.1, 48.61)]
    monkeypatch.setattr(docs_figures, "layout_output", lambda family: rows)
    assert "No Megatron-FSDP strategy is among the 2 listed." in docs_figures.layout_example_verdict()
    rows.append(row("TP 8 x PP 1 x CP 2 x DP 16, SP", "Megatron-FSDP optim_grads_params", 61.5, 49.40))
    assert "Megatron-FSDP" not in docs_figures.layout_example_verdict()


def test_the_readme_starts_with_make_quickstart_and_make_test():
    commands = [line.split("#")[0].strip() for line in read("README.md").split("```")[1].splitlines()[1:]]
    assert [command for command in commands if command][:2] == ["make quickstart", "make test"]


def slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("path", ["README.md", "docs/reference.md", "docs/suite.md"])
def test_links_land_on_a_file_and_a_heading(path):
    folder = os.path.dirname(os.path.join(ROOT, path))
    for target, anchor in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]+))?\)", read(path)):
        if target.startswith("http"):
            continue
        file = os.path.normpath(os.path.join(folder, target)) if target else os.path.join(ROOT, path)
        assert os.path.exists(file), f"{path}: link to {target}, which does not exist"
        if anchor:
            with open(file) as linked:
                headings = {slug(line.lstrip("#")) for line in linked if line.startswith("#")}
            assert anchor in headings, f"{path}: no heading #{anchor} in {target or path}"


def test_suite_times_records_a_junit_file(tmp_path):
    xml = tmp_path / "suite.xml"
    xml.write_text('<?xml version="1.0"?><testsuites><testsuite name="pytest" errors="0" failures="1" skipped="3" '
                   'tests="40" time="568.25" timestamp="2026-12-03T20:11:02.1" hostname="ci"/></testsuites>')
    output = tmp_path / "suite_times.json"
    suite_times.main([str(xml), "--command", "make test", "--cores", "2", "--output", str(output)])
    suite_times.main([str(xml), "--command", "make test", "--cores", "4", "--output", str(output)])
    runs = json.loads(output.read_text())["runs"]
    assert runs == [{"command": "make test", "seconds": 568.2, "tests": 40, "failures": 1, "errors": 0,
                     "skipped": 3, "cores": 4, "date": "2026-12-03", "host": "ci"}]


def test_the_suite_times_figure_reads_what_suite_times_records(tmp_path, monkeypatch):
    output = tmp_path / "suite_times.json"
    output.write_text(json.dumps({"runs": [
        {"command": "make test", "seconds": 568.2, "tests": 1040, "failures": 0, "errors": 0, "skipped": 9,
         "cores": 2, "date": "2026-12-03", "host": "ci"},
        {"command": "make test-fast", "seconds": 52.9, "tests": 700, "failures": 1, "errors": 0, "skipped": 0,
         "cores": 2, "date": "2026-12-03", "host": "ci"}]}))
    monkeypatch.setattr(docs_figures, "SUITE_TIMES", str(output))
    assert docs_figures.suite_times() == (
        f"`make test`: 9:28 (pytest's time) for 1040 tests on 2 cores (2026-12-03, `{output}`); "
        f"`make test-fast`: 0:52 (pytest's time) for 700 tests, 1 failed on 2 cores (2026-12-03, `{output}`)")
