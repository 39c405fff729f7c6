"""Reading metrics.jsonl back (angpt.reporting writes it): the one reader that knows about restarts.

A run appends to the file; a resumed run first appends a {"kind": "start", "iteration": s, ...} record,
then logs again every step after its checkpoint's iteration s. The first run's records past s describe
steps that were trained again (or never saved), so the records of the run as it stands are the earlier
ones up to s and everything from the start record on.
"""

from __future__ import annotations

import json


def current_records(records: list[dict]) -> list[dict]:
    """The records of the run as it stands: each start record drops the earlier records past its iteration."""
    kept: list[dict] = []
    for record in records:
        if record.get("kind") == "start":
            kept = [r for r in kept if r.get("iteration", 0) <= record["iteration"]]
        kept.append(record)
    return kept


def read_metrics(path: str) -> list[dict]:
    """The current records of a metrics.jsonl (see current_records); a line cut by a kill is left out."""
    records = []
    with open(path) as file:
        for line in file:
            try:
                records.append(json.loads(line))
            except ValueError:
                pass
    return current_records(records)
