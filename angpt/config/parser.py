"""The command line of `angpt.pretrain`, built from the configuration's sections (angpt.config.sections), as
Megatron-LM's main builds argument groups from its config dataclasses: each section is an argument group, each
of its flag fields a flag whose name, type, default and help come from the field. Then every Megatron-LM flag we
do not define, from its decision table (angpt.config.megatron_lm).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from typing import Optional

from angpt.config import megatron_lm
from angpt.config.sections import SECTIONS

# On/off settings a --config file may switch on get a --no-... form to switch them off again.
SWITCH = argparse.BooleanOptionalAction
DESCRIPTION = ("Pretrain anGPT, GPT+, nGPT or Megatron-LM's GPT with Megatron-style flags, under torchrun. Required: "
               "the length of training (--train-iters or --train-samples) and the data (--data-path, "
               "--train-data-path or --mock-data with --vocab-size).")


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser with failures of one line: what is wrong with which flag, then "see --help",
    printed by one process of a torchrun job (rank 0); every process exits with status 2."""

    def error(self, message: str):
        if int(os.environ.get("RANK", "0")) == 0:
            self.exit(2, f"{self.prog}: error: {message} (see --help)\n")
        self.exit(2)


class HelpFormatter(argparse.HelpFormatter):
    """Every flag's default in --help (argparse's ArgumentDefaultsHelpFormatter would also print the
    defaults that are None or False, and none for flags without a help text)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if not _shows_default(action) or "%(default)" in action.help:
            return action.help
        return f"{action.help} (default: %(default)s)"


def _shows_default(action: argparse.Action) -> bool:
    # By identity: a default of 0 or 0.0 is shown (it equals False).
    return not any(action.default is hidden for hidden in (None, False, argparse.SUPPRESS))


def flag_actions(parser: Optional[argparse.ArgumentParser] = None) -> dict[str, argparse.Action]:
    """{dest: action} of angpt.pretrain's flags (of `parser`, default build_parser()), --help and --config aside."""
    parser = parser or build_parser()
    return {action.dest: action for action in parser._actions if action.dest not in ("help", "config")}


def _argparse_kwargs(field: dataclasses.Field, annotation) -> dict:
    """add_argument's keywords for a flag field: its action, or its type and number of values, from the
    annotation (Optional[X] is X; tuple[X, ...] takes one or more X)."""
    spec = field.metadata["flag"]
    kwargs = dict(spec["argparse"])
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        annotation = next(arg for arg in typing.get_args(annotation) if arg is not type(None))
    if annotation is bool:
        if spec["switch"]:
            return dict(kwargs, action=SWITCH)
        return dict(kwargs, action="store_false" if field.default else "store_true")
    if typing.get_origin(annotation) is tuple:
        kwargs.setdefault("nargs", "+")
        annotation = typing.get_args(annotation)[0]
    if annotation in (int, float):
        kwargs["type"] = annotation
    return kwargs


def build_parser() -> argparse.ArgumentParser:
    # No abbreviations, as Megatron-LM: `--train-iter 5` is an unknown flag, not --train-iters.
    parser = ArgumentParser(prog="angpt.pretrain", description=DESCRIPTION, formatter_class=HelpFormatter,
                            allow_abbrev=False)
    parser.add_argument("--config", help="YAML file of flag names (dashes or underscores) to values; "
                        "flags on the command line override it")
    groups: dict[str, argparse._ArgumentGroup] = {}
    exclusive: dict[str, argparse._MutuallyExclusiveGroup] = {}
    for section in SECTIONS.values():
        group = groups.get(section.GROUP) or groups.setdefault(section.GROUP, parser.add_argument_group(section.GROUP))
        annotations = typing.get_type_hints(section)
        for field in dataclasses.fields(section):
            spec = field.metadata.get("flag")
            if spec is None:  # derived by validation
                continue
            target = group
            if spec["exclusive"]:
                target = exclusive.get(spec["exclusive"]) or exclusive.setdefault(
                    spec["exclusive"], group.add_mutually_exclusive_group())
            default = list(field.default) if isinstance(field.default, tuple) else field.default
            target.add_argument(spec["option"] or "--" + field.name.replace("_", "-"), dest=field.name,
                                default=default, help=spec["help"],
                                **_argparse_kwargs(field, annotations[field.name]))
    megatron_lm.add_megatron_lm_flags(parser)
    for action in parser._actions:
        if action.help is None and _shows_default(action):
            action.help = "default: %(default)s"  # argparse shows no default where there is no help text
    return parser
