"""The package's folders are layers (README, Where things are): a module may import its own folder and the
folders of lower layers, never a higher layer or another folder of its own layer. Every import counts,
deferred ones inside functions included, since they run too."""

import ast
import pathlib
import shutil

import pytest

from conftest import ROOT

PACKAGE = pathlib.Path(ROOT) / "angpt"
# Lowest first. The top-level modules of angpt/ (the entry point, angpt.pretrain) are above them all.
LAYERS = [
    {"kernels", "config"},
    {"data"},
    {"models"},
    {"megatron_compat", "telemetry"},
    {"training"},
    {"hf", "experiments"},
]
RANK = {folder: rank for rank, folders in enumerate(LAYERS) for folder in folders}


def imports(path: pathlib.Path, package: str) -> list[tuple[int, str]]:
    """(line, dotted name) of every import of angpt in the module `path` of `package`, relative ones
    resolved; `from angpt import x` names angpt.x."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            parts = package.split(".")[:len(package.split(".")) + 1 - node.level] if node.level else []
            base = ".".join([*parts, *([node.module] if node.module else [])])
            found += [(node.lineno, f"{base}.{alias.name}" if base == "angpt" else base) for alias in node.names]
    return [(line, name) for line, name in found if name == "angpt" or name.startswith("angpt.")]


def layering_violations(package_dir: pathlib.Path) -> list[str]:
    """'file:line: what it imports' for each import that breaks the layering, in the package at package_dir."""
    def folder(name: str) -> str:  # "angpt.models.gpt" -> "models"; "" for a top-level module
        parts = name.split(".")
        return parts[1] if len(parts) > 1 and (package_dir / parts[1]).is_dir() else ""

    violations = []
    for path in sorted(package_dir.rglob("*.py")):
        relative = path.relative_to(package_dir.parent)
        own = folder(".".join(relative.with_suffix("").parts))
        own_rank = RANK.get(own, len(LAYERS))
        for line, name in imports(path, ".".join(relative.parts[:-1])):
            other = folder(name)
            if other != own and (other not in RANK or RANK[other] >= own_rank):
                violations.append(f"{relative}:{line}: imports {name}")
    return violations


def test_every_folder_is_in_a_layer():
    folders = {path.name for path in PACKAGE.iterdir() if (path / "__init__.py").is_file()}
    assert folders == set(RANK), "a new folder goes into LAYERS and the README's Where things are"


def test_no_module_imports_a_higher_layer_or_a_sibling_folder():
    assert layering_violations(PACKAGE) == []


@pytest.mark.parametrize("importer, statement, allowed", [
    ("models/gpt.py", "import angpt.training.trainer", False),            # a higher layer
    ("models/gpt.py", "from angpt import training", False),               # the same, as a folder
    ("telemetry/metrics.py", "from angpt.megatron_compat import cpu", False),  # a sibling of the same layer
    ("data/corpus.py", "from angpt import pretrain", False),              # the entry point
    ("hf/export.py", "from ..kernels import reference", True),           # lower, relatively
    ("hf/export.py", "from . import verify", True),                       # its own folder
    ("models/gpt.py", "from angpt.config import choices", True),          # exactly one layer lower
])
def test_an_import_deferred_into_a_function_is_judged_by_its_layers(tmp_path, importer, statement, allowed):
    copy = tmp_path / "angpt"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    target = copy / importer
    text = target.read_text() + f"\n\ndef _deferred():\n    {statement}\n"
    target.write_text(text)
    line = text.count("\n")
    expected = [] if allowed else [f"angpt/{importer}:{line}: imports {statement.split()[1]}"
                                   + (f".{statement.split()[3]}" if statement.split()[1] == "angpt" else "")]
    assert layering_violations(copy) == expected
