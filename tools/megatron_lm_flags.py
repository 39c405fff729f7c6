"""Write angpt/config/megatron_lm_flags.py: every flag of Megatron-LM's pretraining parser, by argument group, with
its arity, type and default, read from a Megatron-LM checkout by building its own parser (with the ModelOpt flags
pretrain_gpt.py adds where nvidia-modelopt is installed).

    git clone https://github.com/NVIDIA/Megatron-LM && git -C Megatron-LM checkout core_v0.16.1
    python tools/megatron_lm_flags.py --megatron-lm Megatron-LM

The tag is the one of the megatron-core we pin (angpt.megatron_compat.WRITTEN_FOR). angpt/config/megatron_lm.py
decides each of these flags, and docs/megatron.md lists them (tools/megatron_flags_doc.py).
"""

from __future__ import annotations

import argparse
import enum
import importlib.util
import os
import pprint
import subprocess
import sys
import types
import warnings

OUTPUT = os.path.join(os.path.dirname(__file__), "..", "angpt", "config", "megatron_lm_flags.py")


def megatron_lm_parser(checkout: str) -> argparse.ArgumentParser:
    """Megatron-LM's `add_megatron_arguments` parser. megatron/training/__init__.py imports the whole trainer
    (triton, the legacy models, global state), which the parser does not use: arguments.py is loaded alone,
    under a stand-in package whose names are placeholders."""
    import megatron.core  # noqa: PLC0415 (the installed megatron-core, which arguments.py imports)

    def placeholder(name):
        if name.startswith("__"):
            raise AttributeError(name)
        return lambda *args, **kwargs: None

    for name in ("megatron.training", "megatron.legacy", "megatron.legacy.model", "megatron.legacy.model.module"):
        module = types.ModuleType(name)
        module.__path__ = [os.path.join(checkout, *name.split(".")[:2])] if name == "megatron.training" else []
        module.__getattr__ = placeholder
        sys.modules[name] = module
    path = os.path.join(checkout, "megatron", "training", "arguments.py")
    spec = importlib.util.spec_from_file_location("megatron.training.arguments", path)
    arguments = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = arguments
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        spec.loader.exec_module(arguments)
    print(f"megatron-core {megatron.core.__version__} imported", file=sys.stderr)
    parser = arguments.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    # pretrain_gpt.py's extra_args_provider where nvidia-modelopt is installed (its post-training flags).
    path = os.path.join(checkout, "megatron", "post_training", "arguments.py")
    spec = importlib.util.spec_from_file_location("megatron_post_training_arguments", path)
    post_training = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(post_training)
    return post_training.add_modelopt_args(parser)


def flags_by_group(parser: argparse.ArgumentParser) -> dict[str, list[tuple]]:
    """{group title: [(flag, other spellings, arity, type name, default)]}; arity is argparse's nargs (0 for a
    flag without a value, None for one value)."""
    groups = {}
    for group in parser._action_groups:
        rows = []
        for action in group._group_actions:
            if not action.option_strings or action.dest == "help":
                continue
            flag, *others = action.option_strings
            kind = getattr(action.type, "__name__", None) if action.nargs != 0 else None
            default = action.default
            if isinstance(default, enum.Enum):
                default = default.name
            elif isinstance(default, (list, tuple)) and all(type(v) in (int, float, str) for v in default):
                default = list(default)
            elif type(default) not in (bool, int, float, str, type(None)):
                default = repr(default)
            rows.append((flag, tuple(others), action.nargs, kind, default))
        if rows:
            groups[group.title] = rows
    return groups


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--megatron-lm", required=True, help="a Megatron-LM checkout")
    parser.add_argument("--output", default=OUTPUT)
    args = parser.parse_args()
    checkout = os.path.abspath(args.megatron_lm)
    described = subprocess.run(["git", "-C", checkout, "describe", "--tags", "--always"], capture_output=True,
                               text=True).stdout.strip() or "unknown"
    commit = subprocess.run(["git", "-C", checkout, "rev-parse", "HEAD"], capture_output=True,
                            text=True).stdout.strip() or "unknown"
    groups = flags_by_group(megatron_lm_parser(checkout))
    with open(args.output, "w") as file:
        file.write(f'"""Megatron-LM\'s pretraining flags, by argument group: (flag, other spellings, nargs, type, '
                   f'default).\nWritten by tools/megatron_lm_flags.py from a Megatron-LM checkout; do not edit."""\n\n'
                   f'SOURCE = {described!r}\nCOMMIT = {commit!r}\n\n'
                   f'GROUPS = {pprint.pformat(groups, width=118, sort_dicts=False)}\n')
    count = sum(map(len, groups.values()))
    print(f"{args.output}: {count} flags in {len(groups)} groups of Megatron-LM {described}")


if __name__ == "__main__":
    main()
