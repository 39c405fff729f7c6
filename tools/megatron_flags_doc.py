"""Write docs/megatron.md: every flag of Megatron-LM's pretraining parser and what angpt.pretrain does with it,
from the parser (angpt.config.arguments) and the table of angpt.config.megatron_lm, so that it cannot drift
(tests/test_megatron_lm_flags.py checks the file is what this writes).

    python tools/megatron_flags_doc.py [--output docs/megatron.md]
"""

from __future__ import annotations

import argparse
import collections
import os

from angpt.config.megatron_lm import IGNORED, IMPLEMENTED, IMPLIED, REFUSED, Refuse, decide, megatron_lm_flags
from angpt.config.megatron_lm_flags import COMMIT, SOURCE
from angpt.config.parser import build_parser

OUTPUT = os.path.join(os.path.dirname(__file__), "..", "docs", "megatron.md")


def flag_rows(parser: argparse.ArgumentParser) -> list[tuple[str, str, str, str]]:
    """(Megatron-LM group, flag, status, what angpt does) for every flag of Megatron-LM's parser."""
    actions = {name: action for action in parser._actions for name in action.option_strings}
    rows = []
    for group, (flag, spellings, _, _, default) in megatron_lm_flags():
        action = actions[flag]
        if isinstance(action, Refuse) or action.dest.startswith("megatron_"):
            decision = decide(group, flag, spellings)
            note = decision.why
            if decision.status == REFUSED and action.nargs != 0 and default is not None:
                note += f" (Megatron-LM's default, {default!r}, is accepted)"
            rows.append((group, flag, decision.status, note))
            continue
        ours = action.default
        # None on either side is a value derived from other flags (the family's recipe here; see --help).
        differs = action.nargs != 0 and None not in (ours, default) and ours != default
        note = f"default {ours!r} here, {default!r} in Megatron-LM" if differs else ""
        rows.append((group, flag, IMPLEMENTED, note))
    return rows


def document(parser: argparse.ArgumentParser) -> str:
    rows = flag_rows(parser)
    counts = collections.Counter(status for _, _, status, _ in rows)
    lines = [
        "# Megatron-LM's flags in angpt.pretrain",
        "",
        f"Every flag of Megatron-LM's pretraining parser ({SOURCE}, `megatron/training/arguments.py` at {COMMIT[:12]}),"
        " by its argument group, and what `angpt.pretrain` does with it. Written by "
        "`tools/megatron_flags_doc.py` from the parser and `angpt/config/megatron_lm.py`; do not edit.",
        "",
        f"{len(rows)} flags: {counts[IMPLEMENTED]} implemented, {counts[IMPLIED]} implied by the family, "
        f"{counts[IGNORED]} ignored as in Megatron-LM, {counts[REFUSED]} refused; none unrecognized.",
        "",
        "- **implemented**: a flag of `angpt.pretrain` with Megatron-LM's meaning (`--help` says more); where our "
        "default differs, the note says so.",
        "- **implied**: the family implies or replaces what it asks for: accepted, and refused with a value or a "
        "family that asks for something else.",
        "- **ignored**: Megatron-LM accepts it without effect (deprecated there): accepted, and the run says so in "
        "one log line.",
        "- **refused**: stops the run with one line saying why, unless given Megatron-LM's default value, which "
        "asks for nothing.",
    ]
    group = None
    for megatron_group, flag, status, note in rows:
        if megatron_group != group:
            group = megatron_group
            lines += ["", f"## {group}", "", "| flag | status | note |", "|---|---|---|"]
        lines.append(f"| `{flag}` | {status} | {note.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", default=OUTPUT)
    args = parser.parse_args()
    text = document(build_parser())
    with open(args.output, "w") as file:
        file.write(text)
    print(f"{args.output}: {text.count(chr(10))} lines")


if __name__ == "__main__":
    main()
