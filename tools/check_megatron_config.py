#!/usr/bin/env python
"""Would a Megatron-LM GPT configuration run as `angpt.pretrain`? For every flag of it, what angpt does with it
(implemented; implied by the family, with the reason; refused, with the reason; or given Megatron-LM's default
value, which asks for nothing: angpt.config.megatron_lm), then whether the run would start: the flags through
`angpt.config.arguments.parse_args`, as `python -m angpt.pretrain --model-family F` would read them.

    python tools/check_megatron_config.py examples/gpt3/train_gpt3_175b_distributed.sh [--model-family angpt]
    python tools/check_megatron_config.py tests/functional_tests/test_cases/gpt/NAME/model_config.yaml

The configuration is a launch script or a functional test's model_config.yaml. Of a script, the command line of
`pretrain_gpt.py` (or `-m angpt.pretrain`): continued lines, variables and bash arrays (`ARGS=( ... )`,
`ARGS+=(...)`, `"${ARGS[@]}"`) expanded, `${1:-default}` as its default; of an `if`, the branch its condition
takes where the condition compares known values, else the first branch (said). Of a yaml, MODEL_ARGS as
Megatron-LM's test harness passes them: `true` is a switch given, `"[a b]"` the values a and b, "" leaves the
flag off; `false` leaves it off too (the harness would pass `--flag false`, which Megatron-LM's parser refuses).
Unresolved variables (`${DATA_PATH}/...`) are placeholders: a path that must exist gets a stand-in in a
temporary directory (a dataset prefix: empty .bin and .idx files; a tokenizer's file; a directory), and a number
its default; a data prefix not found here gets one too, so that the data flags are checked as written.
Every stand-in is listed. The world size is TP x PP x CP x the smallest data-parallel size that splits the
global batch into micro-batches (and holds the expert-parallel ranks), unless --world-size is given.
Transformer Engine is taken as importable, as on a GPU node (--no-assume-transformer-engine: check this machine).

Exit status 0 if the run would start, 1 if not, 2 if the configuration cannot be read.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import io
import os
import re
import shlex
import sys
import tempfile
from typing import Optional
from unittest import mock

import yaml

from angpt.config import transformer_engine_support
from angpt.config.arguments import parse_args
from angpt.config.blend import parse_blend
from angpt.config.choices import MODEL_FAMILIES
from angpt.config.megatron_lm import Refuse, decide, megatron_lm_flags
from angpt.config.megatron_lm_flags import SOURCE
from angpt.config.parser import build_parser

# `gpt` where a family of that name exists; GPT+ otherwise (Megatron-LM's GPT with QK-norm and SwiGLU).
DEFAULT_FAMILY = "gpt" if "gpt" in MODEL_FAMILIES else "gptplus"
ENTRY_POINT = "pretrain_gpt.py"
DATA_FLAGS = ("data_path", "train_data_path", "valid_data_path", "test_data_path")
FILE_FLAGS = ("tokenizer_model", "vocab_file", "merge_file")
DIRECTORY_FLAGS = ("save", "load", "tensorboard_dir", "data_cache_path", "wandb_save_dir")

ARRAY_START = re.compile(r"^(?:export\s+)?([A-Za-z_]\w*)(\+?)=\((.*)$", re.S)
ASSIGNMENT = re.compile(r"^(?:export\s+)?([A-Za-z_]\w*)=")
ARRAY_REF = re.compile(r'(")?\$\{([A-Za-z_]\w*)\[[@*]\]\}(")?')
VARIABLE = re.compile(r"\$\{([A-Za-z_]\w*|\d+)(?::?-([^}]*))?\}|\$([A-Za-z_]\w*|\d)")
# A redirection (`2>&1`, `> log`) ends the command line: made a `;` so that its file descriptor is no flag's value.
REDIRECTION = re.compile(r"(?<=\s)\d*(?:>>?|<)(?:&\d+)?")
OPERATOR = set("();|&<>")


class ConfigError(ValueError):
    """The file is not a configuration this tool reads (the message names the file)."""


def words(text: str) -> list[str]:
    """bash's words of `text`: quotes removed, comments dropped, operators (`(`, `|`, `;` ...) words of their own."""
    lexer = shlex.shlex(text, posix=True, punctuation_chars="".join(sorted(OPERATOR)))
    lexer.whitespace_split = True
    return list(lexer)


def expand(text: str, variables: dict[str, str], arrays: dict[str, list[str]]) -> str:
    """`text` with the known variables and arrays substituted; unknown ones are left as they are (placeholders)."""
    def array(match):
        if match.group(2) not in arrays:
            return match.group(0)
        elements = arrays[match.group(2)]
        # Quoted, each element is one word; unquoted, bash splits the elements again at spaces.
        return " ".join(map(shlex.quote, elements)) if match.group(1) and match.group(3) else " ".join(elements)

    def scalar(match):
        name = match.group(1) or match.group(3)
        if name in variables:
            return variables[name]
        return match.group(2) if match.group(2) is not None else match.group(0)

    return VARIABLE.sub(scalar, ARRAY_REF.sub(array, text))


def _condition(tokens: list[str]) -> Optional[bool]:
    """The value of an `if`'s test of known strings (`[[ a == b ]] || [ -z c ]`), or None where it is not one."""
    value, combine = None, None
    clauses = [[]]
    for token in tokens:
        if token in ("||", "&&"):
            clauses.append(token)
            clauses.append([])
        elif token not in ("[[", "]]", "[", "]", ";", "then"):
            clauses[-1].append(token)
    for clause in clauses:
        if clause in ("||", "&&"):
            combine = clause
            continue
        negate = clause[:1] == ["!"]
        clause = clause[1:] if negate else clause
        if any("$" in token for token in clause):
            return None
        if len(clause) == 3 and clause[1] in ("==", "=", "!="):
            holds = (clause[0] == clause[2]) != (clause[1] == "!=")
        elif len(clause) == 2 and clause[0] in ("-z", "-n"):
            holds = (clause[1] == "") == (clause[0] == "-z")
        else:
            return None
        holds = holds != negate
        value = holds if combine is None else (value or holds) if combine == "||" else (value and holds)
    return value


def _logical_lines(text: str) -> list[tuple[int, str]]:
    """[(the number of its first line, a line with its continuations joined)] of a script, stripped."""
    lines, pending, first = [], "", None
    for number, line in enumerate(text.splitlines(), start=1):
        first = first or number
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        lines.append((first, (pending + line).strip()))
        pending, first = "", None
    if pending:
        lines.append((first, pending.strip()))
    return lines


def script_argv(text: str, name: str = "script") -> tuple[list[str], list[str]]:
    """The flags of the launch script's `pretrain_gpt.py` (or `-m angpt.pretrain`) command line, and notes on
    what was assumed to read it. A ConfigError where it has none."""
    lines = _logical_lines(text)
    variables: dict[str, str] = {}
    arrays: dict[str, list[str]] = {}
    branches: list[list[bool]] = []  # per open `if`: [this branch is taken, a branch was taken]
    notes: list[str] = []
    index = 0
    while index < len(lines):
        number, line = lines[index]
        index += 1
        try:
            tokens = words(expand(line, variables, arrays))
        except ValueError:  # a quote left open: part of a construct this reader does not follow
            continue
        if not tokens:
            continue
        if tokens[0] == "export":
            tokens = tokens[1:] or [""]
        keyword = tokens[0]
        active = all(taken for taken, _ in branches)
        if keyword == "if" and tokens[-1] == "fi":  # an `if` of one line sets nothing this reader follows
            continue
        if keyword == "if" or keyword == "elif" and branches:
            if keyword == "if":
                branches.append([False, not active])  # inside a branch not taken, none of these is taken
            taken_before = branches[-1][1]
            decided = _condition(tokens[1:])
            if decided is None and not taken_before:
                notes.append(f"line {number}: `{line}` is not decided here: its first branch taken")
            branches[-1][0] = not taken_before and decided is not False
            branches[-1][1] |= branches[-1][0]
            continue
        if keyword == "else" and branches:
            branches[-1][0] = not branches[-1][1]
            continue
        if keyword == "fi" and branches:
            branches.pop()
            continue
        if not active:
            continue
        start = ARRAY_START.match(line)
        if start:
            body = start.group(3)
            while True:
                try:
                    elements = words(expand(body, variables, arrays))
                except ValueError:
                    elements = []
                if ")" in elements or index >= len(lines):
                    break
                body += "\n" + lines[index][1]
                index += 1
            elements = elements[:elements.index(")")] if ")" in elements else elements
            arrays[start.group(1)] = (arrays.get(start.group(1), []) if start.group(2) else []) + elements
            continue
        assignment = ASSIGNMENT.match(line)
        if assignment and tokens[0].startswith(assignment.group(1) + "="):
            value = tokens[0].split("=", 1)[1]
            if "$" in value:  # still a placeholder: its name reads better in the flags than `$1`
                variables.pop(assignment.group(1), None)
            else:
                variables[assignment.group(1)] = value
            continue
        command = words(REDIRECTION.sub(" ; ", expand(line, variables, arrays)))
        for position, token in enumerate(command):
            if os.path.basename(token) == ENTRY_POINT or command[position - 1:position + 1] == ["-m", "angpt.pretrain"]:
                flags = command[position + 1:]
                end = next((i for i, word in enumerate(flags) if word and set(word) <= OPERATOR), len(flags))
                return flags[:end], [*notes, f"line {number}: the command line of {token}"]
    raise ConfigError(f"{name}: no command line of {ENTRY_POINT} (or python -m angpt.pretrain) found")


def yaml_argv(model_args: dict) -> tuple[list[str], list[str]]:
    """MODEL_ARGS of a functional test as Megatron-LM's test harness passes them, and the flags left off: true is a
    switch given, "[a b]" the values a and b; false, "" and null leave the flag off."""
    argv, left_off = [], []
    for flag, value in model_args.items():
        flag = str(flag)
        if value is True:
            argv.append(flag)
        elif value is False or value is None or value == "":
            left_off.append(flag)
        elif isinstance(value, list):
            argv += [flag, *map(str, value)]
        elif isinstance(value, str) and value.startswith("[") and value.endswith("]"):
            argv += [flag, *value[1:-1].split()]
        else:
            argv += [flag, str(value)]
    return argv, left_off


def read_config(path: str) -> tuple[list[str], list[str]]:
    """(the flags, notes) of a launch script or a model_config.yaml."""
    try:
        with open(path) as file:
            text = file.read()
    except OSError as error:
        raise ConfigError(f"{path}: {error.strerror}") from None
    if not path.endswith((".yaml", ".yml")):
        return script_argv(text, path)
    try:
        config = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise ConfigError(f"{path}: not valid YAML: {error}") from None
    if not isinstance(config, dict) or not isinstance(config.get("MODEL_ARGS"), dict):
        raise ConfigError(f"{path}: no MODEL_ARGS mapping (a Megatron-LM functional test's model_config.yaml)")
    argv, left_off = yaml_argv(config["MODEL_ARGS"])
    notes = ["MODEL_ARGS, as Megatron-LM's test harness passes them"]
    notes += [f"{flag} {str(config['MODEL_ARGS'][flag]).lower() or 'empty'}: left off" for flag in left_off]
    return argv, notes


def segments(argv: list[str]) -> list[tuple[str, list[str]]]:
    """[(flag, its values)] of a command line; `--flag=value` is the flag and the value."""
    result = []
    for token in argv:
        if token.startswith("--"):
            flag, equals, value = token.partition("=")
            result.append((flag, [value] if equals else []))
        elif result:
            result[-1][1].append(token)
        else:
            result.append(("", [token]))  # a value before any flag: argparse says it is unrecognized
    return result


@functools.cache
def parser() -> argparse.ArgumentParser:
    return build_parser()


@functools.cache
def _megatron_flag_names() -> frozenset[str]:
    return frozenset(name for _, (flag, spellings, *_) in megatron_lm_flags() for name in (flag, *spellings))


def action_of(flag: str) -> Optional[argparse.Action]:
    return parser()._option_string_actions.get(flag)


def _converted(action: argparse.Action, flag: str, values: list[str]):
    """A flag's value as argparse stores it (a switch: True, or False for its --no- form); as given where it
    does not convert."""
    if action.nargs == 0:
        if isinstance(action, argparse._StoreFalseAction):
            return False
        return not (isinstance(action, argparse.BooleanOptionalAction) and flag.startswith("--no-"))
    convert = action.type or str
    try:
        converted = [convert(value) for value in values]
    except (TypeError, ValueError):
        converted = list(values)
    return converted if action.nargs in ("+", "*") else (converted[0] if converted else None)


def flag_status(flag: str, values: list[str], family: str, given: argparse.Namespace) -> str:
    """What angpt does with `flag` given `values`; `given`: the values of the flags given, which an implied flag's
    check may read."""
    action = action_of(flag)
    if action is None:
        return f"not a flag of Megatron-LM ({SOURCE}) or angpt.pretrain"
    if isinstance(action, Refuse):
        why = action.refusal(True if action.nargs == 0 else list(values) if action.nargs in ("+", "*")
                             else " ".join(values))
        return "Megatron-LM's default value: asks for nothing" if why is None else f"refused: {why}"
    if action.dest.startswith("megatron_"):
        decision = decide("", action.option_strings[0])
        reason = decision.check(given, _converted(action, flag, values)) if decision.check else None
        return f"implied: {decision.why}" if reason is None else f"refused with --model-family {family}: {reason}"
    return "implemented" if flag in _megatron_flag_names() else "implemented (angpt's own flag)"


def _given(flags: list[tuple[str, list[str]]], family: str) -> argparse.Namespace:
    values = {action.dest: action.default for action in parser()._actions if action.default != argparse.SUPPRESS}
    for flag, args in flags:
        action = action_of(flag)
        if action is not None and not isinstance(action, Refuse):
            values[action.dest] = _converted(action, flag, args)
    values["model_family"] = family
    return argparse.Namespace(**values)


def default_world_size(flags: list[tuple[str, list[str]]]) -> tuple[int, str]:
    """TP x PP x CP x DP, DP the smallest that splits the global batch into micro-batches and holds the
    expert-parallel ranks (Megatron-LM forms them from CP x DP), the distributed optimizer's instances (of CP x DP)
    and the expert tensor-parallel groups (of the world over PP); and how it was reckoned."""
    def size(name: str, default: Optional[int]) -> Optional[int]:
        given = [values for flag, values in flags if action_of(flag) is action_of(name) and values]
        try:
            return int(given[-1][0]) if given else default
        except ValueError:  # a placeholder
            return default

    tp, pp, cp = size("--tensor-model-parallel-size", 1), size("--pipeline-model-parallel-size", 1), \
        size("--context-parallel-size", 1)
    ep, micro = size("--expert-model-parallel-size", 1), size("--micro-batch-size", 1)
    instances, etp = size("--num-distributed-optimizer-instances", 1), size("--expert-tensor-parallel-size", tp)
    batch = size("--global-batch-size", None)
    micro_batches = batch // micro if batch and micro and batch % micro == 0 else 1

    def fits(d: int) -> bool:
        return (micro_batches % d == 0 and cp * d % max(ep, 1) == 0 and cp * d % max(instances, 1) == 0
                and tp * cp * d % max(etp, 1) == 0)
    dp = next((d for d in range(1, micro_batches + 1) if fits(d)), 1)
    return tp * pp * cp * dp, f"TP {tp} x PP {pp} x CP {cp} x DP {dp}"


def _stand_in(directory: str, number: int, value: str) -> str:
    """The path of the stand-in for the `number`th flag's `value`: the value's last part, placeholders'
    punctuation dropped, in a folder of that flag's own."""
    folder = os.path.join(directory, str(number))
    os.makedirs(folder, exist_ok=True)
    return os.path.join(folder, re.sub(r"[^\w.-]", "", os.path.basename(value.rstrip("/"))) or "stand_in")


def stand_ins(flags: list[tuple[str, list[str]]], directory: str) -> tuple[list[tuple[str, list[str]]], list[str]]:
    """The flags with stand-ins (in `directory`) for the paths that must exist and the placeholders, and a line
    for each."""
    result, lines = [], []
    for number, (flag, values) in enumerate(flags):
        action = action_of(flag)
        if action is None or isinstance(action, Refuse) or not values:
            result.append((flag, values))
            continue
        new = list(values)
        if action.dest in DATA_FLAGS:
            try:
                prefixes = set(parse_blend(values)[0])
            except ValueError:  # parse_args says what is wrong with the blend
                prefixes = set()
            for position, value in enumerate(values):
                prefix = value[:-4] if value.endswith((".bin", ".idx")) else value
                if value not in prefixes or (
                        "$" not in value and any(os.path.exists(prefix + ext) for ext in (".bin", ".idx"))):
                    continue
                new[position] = _stand_in(directory, number, prefix)
                for ext in (".bin", ".idx"):
                    open(new[position] + ext, "wb").close()
                what = "a placeholder" if "$" in value else "not found here"
                blend = ", one for what may be a blend" if VARIABLE.fullmatch(value) else ""
                lines.append(f"{flag} {value} ({what}): a dataset prefix with empty .bin and .idx files{blend}")
        else:
            for position, value in enumerate(values):
                if "$" not in value:
                    continue
                if action.type in (int, float):
                    default = action.default if action.default is not None else 1
                    new[position] = str(default)
                    lines.append(f"{flag} {value}: {default} (a placeholder; {flag}'s default)")
                elif action.choices is not None:
                    lines.append(f"{flag} {value}: a placeholder where one of {', '.join(map(str, action.choices))} "
                                 "is needed: no stand-in possible, left as it is")
                elif action.dest in DIRECTORY_FLAGS:
                    new[position] = _stand_in(directory, number, value)
                    os.makedirs(new[position], exist_ok=True)
                    lines.append(f"{flag} {value}: an empty directory (a placeholder)")
                elif action.dest in FILE_FLAGS:
                    new[position] = _stand_in(directory, number, value)
                    open(new[position], "wb").close()
                    lines.append(f"{flag} {value}: an empty file (a placeholder)")
        result.append((flag, new))
    return result, lines


@dataclasses.dataclass
class Report:
    family: str
    world_size: int
    layout: str  # how the world size was reckoned
    flags: list[tuple[str, list[str], str]]  # (flag, its values as given, what angpt does with it)
    stand_ins: list[str]
    error: Optional[str]  # parse_args' one line, or None: the run would start

    @property
    def starts(self) -> bool:
        return self.error is None


@contextlib.contextmanager
def _transformer_engine_importable():
    """Transformer Engine taken as importable and its FP8 recipes as runnable, as on a GPU node that has it."""
    with mock.patch.object(transformer_engine_support, "transformer_engine_error", lambda: None), \
            mock.patch.object(transformer_engine_support, "fp8_recipe_problem", lambda recipe: None):
        yield


def check(argv: list[str], family: Optional[str] = None, world_size: Optional[int] = None,
          assume_transformer_engine: bool = True) -> Report:
    """What angpt does with each flag of `argv` (Megatron-LM's flags) and whether `angpt.pretrain` would start
    with them under `--model-family family` (None: the one `argv` gives, else DEFAULT_FAMILY)."""
    flags = segments(argv)
    given_family = [values[-1] for flag, values in flags if flag == "--model-family" and values]
    family = family or (given_family[-1] if given_family else DEFAULT_FAMILY)
    given = _given(flags, family)
    rows = [(flag, values, flag_status(flag, values, family, given)) for flag, values in flags]
    layout = "given"
    if world_size is None:
        world_size, layout = default_world_size(flags)
    with tempfile.TemporaryDirectory(prefix="check_megatron_config_") as directory:
        standing, lines = stand_ins(flags, directory)
        command = [token for flag, values in standing for token in ([flag] if flag else []) + values]
        command += ["--model-family", family]  # the last of a flag given twice wins
        stderr = io.StringIO()
        assumption = _transformer_engine_importable() if assume_transformer_engine else contextlib.nullcontext()
        with assumption, contextlib.redirect_stderr(stderr), mock.patch.dict(os.environ, {"RANK": "0"}):
            try:
                parse_args(command, world_size=world_size)
                error = None
            except SystemExit:
                error = stderr.getvalue().strip()
    return Report(family, world_size, layout, rows, lines, error)


def render(report: Report, notes: list[str], assume_transformer_engine: bool) -> str:
    lines = [*notes, ""]
    for flag, values, status in report.flags:
        lines.append(f"{' '.join([flag, *values]).strip()}: {status}")
    if report.stand_ins:
        lines += ["", "stand-ins (in a temporary directory):", *("  " + line for line in report.stand_ins)]
    te = ("Transformer Engine taken as importable (as on a GPU node; --no-assume-transformer-engine: this machine)"
          if assume_transformer_engine else "Transformer Engine as this machine has it")
    layout = "--world-size" if report.layout == "given" else f"{report.layout}; --world-size to change it"
    lines += ["", f"--model-family {report.family}, world size {report.world_size} ({layout}), {te}"]
    lines.append("would start" if report.starts else f"would not start: {report.error}")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    cli = argparse.ArgumentParser(prog="check_megatron_config.py", description=__doc__.split("\n\n")[0],
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    cli.add_argument("config", help="a Megatron-LM launch script (.sh) or a functional test's model_config.yaml")
    cli.add_argument("--model-family", choices=MODEL_FAMILIES, default=None,
                     help=f"the family to run (default: the configuration's --model-family, else {DEFAULT_FAMILY})")
    cli.add_argument("--world-size", type=int, default=None,
                     help="processes (default: TP x PP x CP x the smallest data-parallel size the batch allows)")
    cli.add_argument("--assume-transformer-engine", action=argparse.BooleanOptionalAction, default=True,
                     help="take Transformer Engine as importable, as on a GPU node (default: on)")
    args = cli.parse_args(argv)
    if args.world_size is not None and args.world_size < 1:
        cli.error(f"--world-size {args.world_size} must be at least 1")
    try:
        flags, notes = read_config(args.config)
    except ConfigError as error:  # status 2, as argparse's errors: 1 says the run would not start
        print(f"{cli.prog}: error: {error}", file=sys.stderr)
        return 2
    report = check(flags, args.model_family, args.world_size, args.assume_transformer_engine)
    print(render(report, [f"{args.config}: {len(segments(flags))} flags", *notes], args.assume_transformer_engine))
    return 0 if report.starts else 1


if __name__ == "__main__":
    sys.exit(main())
