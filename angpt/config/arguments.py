"""The flags of `angpt.pretrain` as a user gives them: the command line, a `--config file.yaml` whose keys are the
same names, and the settings of a sweep turned back into a command line. `parse_args` reads them and returns the
run's configuration (angpt.config.validation); the flags themselves are the fields of angpt.config.sections
(Megatron-LM's names and meanings for everything shared with Megatron, `--model-family` and the `--angpt-*`
switches), made into a parser by angpt.config.parser.
"""

from __future__ import annotations

import argparse
import os
from typing import Callable, Optional

import yaml

from angpt.config import megatron_lm
from angpt.config.parser import build_parser, flag_actions
from angpt.config.saved import checkpoint_args
from angpt.config.sections import RunConfig, option_of
from angpt.config.validation import default, validate

# Reads the flags recorded by --load's checkpoint (of --ckpt-step's iteration, else the latest; with
# --non-persistent-ckpt-type global, the non-persistent one where it is newer, given whether that type is global and
# --non-persistent-global-ckpt-dir): (its directory, its flags), or None where there is none; a ValueError or
# RuntimeError of one line where it cannot be read.
RecordedFlags = Callable[[str, Optional[int], bool, Optional[str]], Optional[tuple[str, dict]]]


def parse_args(argv: Optional[list[str]] = None, world_size: Optional[int] = None,
               recorded_flags: Optional[RecordedFlags] = None) -> RunConfig:
    """The run's configuration from the command line (and the --config file it names), validated for
    `world_size` processes (default: --dry-run's WORLD_SIZE, else $WORLD_SIZE, else 1). With --use-checkpoint-args
    the flags `recorded_flags` reads from --load's checkpoint are taken first (angpt.training.checkpointing's, which
    angpt.pretrain gives: this layer reads no checkpoint)."""
    parser = build_parser()
    known, _ = _config_only_parser().parse_known_args(argv)
    from_file = read_config(parser, known.config) if known.config else {}
    parser.set_defaults(**from_file)
    args = parser.parse_args(argv)
    if args.use_checkpoint_args and args.load:  # without --load validation refuses it
        _take_checkpoint_args(parser, args, set(from_file) | _on_command_line(argv), recorded_flags)
    if world_size is None:  # --dry-run 0 (--dry-run alone) is this job's world size
        world_size = max(args.dry_run or 0, 0) or int(os.environ.get("WORLD_SIZE", 1))
    return validate(parser, args, world_size)


def _on_command_line(argv: Optional[list[str]]) -> set[str]:
    """The destinations of the flags `argv` gives (a parser whose flags default to nothing)."""
    probe = build_parser()
    for action in probe._actions:
        action.default = argparse.SUPPRESS
    return set(vars(probe.parse_known_args(argv)[0]))


def _take_checkpoint_args(parser: argparse.ArgumentParser, args: argparse.Namespace, given: set[str],
                          recorded_flags: Optional[RecordedFlags]) -> None:
    """--use-checkpoint-args: set in `args`, before validation, what angpt.config.saved.checkpoint_args takes from the
    flags --load's checkpoint recorded, and what was taken for the run's log (`flags_from_checkpoint`)."""
    if recorded_flags is None:
        parser.error("--use-checkpoint-args reads --load's checkpoint, which only angpt.pretrain does")
    try:
        found = recorded_flags(args.load, args.ckpt_step, args.non_persistent_ckpt_type == "global",
                               args.non_persistent_global_ckpt_dir)
        if found is None:
            args.flags_from_checkpoint = f"no checkpoint in {args.load}: the flags given stand (as in Megatron-LM)"
            return
        path, recorded = found
        taken = checkpoint_args(recorded, given, args.use_tokenizer_model_from_checkpoint_args,
                                args.use_mp_args_from_checkpoint_args)
    except (ValueError, RuntimeError, OSError) as error:
        parser.error(f"--use-checkpoint-args: {error}")
    shown = []
    for dest, value in taken.items():
        before = getattr(args, dest)
        before = list(before) if isinstance(before, tuple) else before
        if value != before:
            shown.append(f"{option_of(dest)} {_shown(dest, value)}"
                         + (f" (given: {_shown(dest, before)})" if dest in given else ""))
        setattr(args, dest, value)
    args.flags_from_checkpoint = f"took from {path}: {', '.join(shown) or 'nothing the flags do not already say'}"


def _shown(dest: str, value) -> str:
    """A flag's value in a log line; an on/off one as on or off (--disable-bias-linear sets its field False)."""
    return ("on" if value != default(dest) else "off") if isinstance(value, bool) else str(value)


def _config_only_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--config")
    return parser


def read_config(parser: argparse.ArgumentParser, path: str) -> dict:
    """{dest: value} of a YAML file of flag names, each checked against the parser."""
    try:
        with open(path, "rb") as file:  # bytes: YAML's reader names the position of a byte that is not UTF-8
            values = yaml.safe_load(file) or {}
    except OSError as error:
        parser.error(f"--config {path}: {error.strerror}")
    except yaml.YAMLError as error:
        parser.error(f"--config {path}: {yaml_error(path, error)}")
    if not isinstance(values, dict):
        parser.error(f"--config {path}: expected a mapping of flag names to values")
    actions = flag_actions(parser)
    # A key is a flag's destination or the flag itself (Megatron-LM's flags here have destinations of their own).
    actions.update({action.option_strings[0].lstrip("-").replace("-", "_"): action for action in actions.values()
                    if action.dest.startswith("megatron_")})
    defaults = {}
    for key, value in values.items():
        action = actions.get(str(key).lstrip("-").replace("-", "_"))
        if action is None:
            parser.error(f"--config {path}: unknown key {key!r} (not a flag of angpt.pretrain)")
        if isinstance(action, megatron_lm.Refuse):
            why = action.refusal(value)
            if why is None:
                continue
            parser.error(f"--config {path}: {key}: not supported: {why}")
        try:
            defaults[action.dest] = setting_value(action, value)
        except ValueError as error:
            parser.error(f"--config {path}: {key}: {error}")
    return defaults


def yaml_error(path: str, error: yaml.YAMLError) -> str:
    """A YAML error in one line: where (line and column, counted from 1) and what (PyYAML's own is several lines,
    the file named in each)."""
    if isinstance(error, yaml.reader.ReaderError):  # a byte that is not UTF-8, or a character YAML refuses
        with open(path, "rb") as file:
            before = file.read()[:error.position]
        line, column = before.count(b"\n") + 1, error.position - before.rfind(b"\n")
        what = f"character {chr(error.character)!r}: {error.reason}" if error.encoding == "unicode" else \
            f"not UTF-8: byte {error.character:#04x}"
        return f"line {line} column {column}: not valid YAML: {what}"
    mark = getattr(error, "problem_mark", None)
    where = f"line {mark.line + 1} column {mark.column + 1}: " if mark is not None else ""
    what = " ".join(part for part in (getattr(error, "context", None), getattr(error, "problem", None)) if part)
    return f"{where}not valid YAML: {what or error}"


def setting_value(action: argparse.Action, value):
    """A flag's value given in YAML (a --config file, a sweep's settings), checked and converted as the
    command line would convert it; a ValueError names the flag."""
    flag = action.option_strings[0]
    if action.nargs == "+":
        values = value if isinstance(value, list) else [value]
        if not values or any(isinstance(v, (dict, list)) or v is None for v in values):
            raise ValueError(f"expected a value or a list of values ({flag})")
        return [str(v) for v in values]
    if isinstance(action, (argparse._StoreTrueAction, argparse.BooleanOptionalAction)):
        if not isinstance(value, bool):
            raise ValueError(f"expected true or false ({flag})")
        return value
    if action.choices is not None and value not in action.choices:
        raise ValueError(f"{value!r} is not one of {list(action.choices)} ({flag})")
    if isinstance(value, (dict, list, bool)) or value is None:
        raise ValueError(f"expected a single {getattr(action.type, '__name__', 'value')} ({flag})")
    if action.type is not None:
        if action.type is int and isinstance(value, float) and not value.is_integer():
            raise ValueError(f"{value!r} is not a valid int ({flag})")
        try:
            return action.type(value)
        except (TypeError, ValueError):
            raise ValueError(f"{value!r} is not a valid {action.type.__name__} ({flag})") from None
    return value


def settings_to_argv(values: dict) -> list[str]:
    """The command line of angpt.pretrain that sets `values` ({dest: value}, as setting_value returns them)."""
    actions = flag_actions()
    argv = []
    for dest, value in values.items():
        action = actions[dest]
        flag = action.option_strings[0]
        if isinstance(action, argparse.BooleanOptionalAction):
            argv.append(flag if value else "--no-" + flag[2:])
        elif isinstance(action, argparse._StoreTrueAction):
            if value:
                argv.append(flag)
        elif isinstance(value, list):
            argv += [flag, *value]
        else:
            argv += [flag, str(value)]
    return argv
