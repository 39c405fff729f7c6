"""Reading metrics.jsonl back (angpt.telemetry.metrics writes it): the one reader of the file, which knows about
restarts, and imports nothing heavy (the sweep's and the benchmarks' coordinators read runs' files).

A run appends to metrics.jsonl; a resumed run first appends a {"kind": "start", "iteration": s, ...} record,
then logs again every step after its checkpoint's iteration s. The first run's records past s describe
steps that were trained again (or never saved), so the records of the run as it stands are the earlier
ones up to s and everything from the start record on (current_records).
"""

from __future__ import annotations

import json
import sys


def current_records(records: list[dict]) -> list[dict]:
    """The records of the run as it stands: each start record drops the earlier records past its iteration."""
    kept: list[dict] = []
    for record in records:
        if record.get("kind") == "start":
            kept = [r for r in kept if r.get("iteration", 0) <= record["iteration"]]
        kept.append(record)
    return kept


class MetricsError(ValueError):
    """A metrics.jsonl that cannot be read as one; the message names the file (and line)."""


def read_records(path: str, warn: bool = True) -> list[tuple[int, dict]]:
    """(line number, record) of every line of a metrics.jsonl, the one reader of the file. A last line cut
    short by a kill (no newline, not JSON) is left out (with a warning on stderr when `warn`); any other
    line that is not a JSON object with a "kind" is a MetricsError naming the file and line."""
    try:
        with open(path, encoding="utf-8") as file:
            lines = file.readlines()
    except FileNotFoundError:
        raise MetricsError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as error:
        raise MetricsError(f"{path}: cannot be read ({error})") from None
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as error:
            if number == len(lines) and not line.endswith("\n"):
                if warn:
                    print(f"warning: {path}:{number}: an unfinished last line (the run was killed while writing "
                          "it?); left out", file=sys.stderr)
                continue
            raise MetricsError(f"{path}:{number}: not JSON ({error})") from None
        if not isinstance(record, dict) or "kind" not in record:
            raise MetricsError(f"{path}:{number}: not a metrics record (a JSON object with a \"kind\")")
        records.append((number, record))
    return records


def read_metrics(path: str, warn: bool = True) -> list[dict]:
    """The current records of a metrics.jsonl (see current_records and read_records)."""
    return current_records([record for _, record in read_records(path, warn)])
