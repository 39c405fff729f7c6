"""Raw text corpora: the one reader of `.jsonl`, `.jsonl.gz` and `.txt` inputs.

`tools/preprocess_data.py` and `tools/train_tokenizer.py` both read their input here, so both accept the
same files and report bad input the same way: by file, line number and reason.
"""

import glob
import gzip
import json
import os
import zlib
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

BAD_LINE_REASONS = ("not UTF-8", "not JSON", "not a JSON object", "missing key", "not a string", "lone surrogate")


class InputError(ValueError):
    """Input that cannot be read as documents: a missing file, a directory, an empty glob or a bad line."""


@dataclass(frozen=True)
class Record:
    """One raw document: a line of a JSON-lines file, or a whole `.txt` file (line is then None)."""

    path: str
    line: Optional[int]
    raw: bytes


@dataclass(frozen=True)
class BadLine:
    """Why a record could not be read; picklable so worker processes can report it."""

    path: str
    line: Optional[int]
    reason: str
    detail: str

    def __str__(self) -> str:
        where = self.path if self.line is None else f"{self.path}:{self.line}"
        return f"{where}: {self.reason}: {self.detail}"


def expand_inputs(patterns: Sequence[str]) -> list[str]:
    """Every input file, in the order given; a glob pattern expands to its matches, sorted."""
    paths = []
    for pattern in patterns:
        if glob.has_magic(pattern):
            matches = sorted(path for path in glob.glob(pattern, recursive=True) if os.path.isfile(path))
            if not matches:
                raise InputError(f"--input {pattern!r} matches no file")
            paths.extend(matches)
        elif os.path.isfile(pattern):
            paths.append(pattern)
        elif os.path.isdir(pattern):
            example = os.path.join(pattern, "*.jsonl")
            raise InputError(f"--input {pattern!r} is a directory: give its files, or a glob pattern such as "
                             f"{example!r}")
        else:
            raise InputError(f"--input {pattern!r}: no such file")
    return paths


def is_text_file(path: str) -> bool:
    """A `.txt` file is one document; anything else is JSON lines (gzip-compressed if it ends in `.gz`)."""
    return path.endswith(".txt")


def is_splittable(path: str) -> bool:
    """Whether a byte range of the file can be read on its own: JSON lines, uncompressed."""
    return not is_text_file(path) and not path.endswith((".gz", ".parquet"))


def shard_inputs(paths: Sequence[str], shard: int, shards: int) -> list[tuple]:
    """The parts (path, start, stop) of the inputs that shard `shard` of `shards` reads: the inputs' bytes, files
    in order, are cut into `shards` equal ranges, and a document belongs to the range holding its first byte. An
    uncompressed JSON-lines file is cut between lines (start, stop: byte offsets); any other file (.gz, .txt,
    Parquet) goes whole to the shard holding its first byte (start, stop: None). Every document is in exactly
    one shard, and the shards in order hold the documents in input order."""
    sizes = [os.path.getsize(path) for path in paths]
    total = sum(sizes)
    low, high = total * shard // shards, total * (shard + 1) // shards
    parts, base = [], 0
    for path, size in zip(paths, sizes):
        if is_splittable(path):
            start, stop = max(low - base, 0), min(high - base, size)
            if start < stop:
                parts.append((path, start, stop))
        elif low <= base < high or (base == total and shard == shards - 1):  # an empty last file: the last shard
            parts.append((path, None, None))
        base += size
    return parts


def iter_records(paths: Sequence[str]) -> Iterator[Record]:
    """Stream the documents of all files in order, one line at a time; blank lines hold no document."""
    for path in paths:
        yield from iter_file_records(path)


def iter_file_records(path: str, start: Optional[int] = None, stop: Optional[int] = None) -> Iterator[Record]:
    """The documents of a file in order; with start and stop (a JSON-lines file), those of the lines that begin
    in bytes [start, stop), numbered as in the whole file (the newlines before start are counted)."""
    if is_text_file(path):
        with open(path, "rb") as file:
            yield Record(path, None, file.read())
        return
    opener = gzip.open if path.endswith(".gz") else open
    line_number = 1
    try:
        with opener(path, "rb") as file:
            position = 0
            if start:
                file.seek(start - 1)
                skipped = file.readline()  # the rest of the line that begins before start
                position = start - 1 + len(skipped)
                file.seek(0)
                for _ in range(0, position, 1 << 24):  # the line number, counted at memory speed
                    line_number += file.read(min(1 << 24, position - file.tell())).count(b"\n")
            for line in file:
                if stop is not None and position >= stop:
                    break
                if line.strip():
                    yield Record(path, line_number, line)
                line_number += 1
                position += len(line)
    # Only a .gz raises these: its stream ends early (EOFError), or is not gzip or fails its checks.
    except EOFError:
        raise InputError(f"{path}: truncated: its gzip data ends early (after line {line_number - 1})") from None
    except (gzip.BadGzipFile, zlib.error) as error:
        raise InputError(f"{path}: not readable gzip data ({error}; after line {line_number - 1})") from None


def parse_record(record: Record, keys: Sequence[str]) -> "dict[str, str] | BadLine":
    """The text under each key, or the reason the record has none. A `.txt` record is the text of keys[0].
    A JSON string holding half of a UTF-16 surrogate pair ("\\ud800" alone) is not text any tokenizer can
    encode (Hugging Face's refuses it, tiktoken's replaces it): the line is bad."""
    try:
        text = record.raw.decode("utf-8")
    except UnicodeDecodeError as error:
        line = record.line if record.line is not None else record.raw.count(b"\n", 0, error.start) + 1
        return BadLine(record.path, line, "not UTF-8", f"byte {error.object[error.start]:#04x}")
    if record.line is None:
        return {keys[0]: text}
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as error:
        return BadLine(record.path, record.line, "not JSON", str(error))
    if not isinstance(obj, dict):
        return BadLine(record.path, record.line, "not a JSON object", f"a {type(obj).__name__}")
    texts = {}
    for key in keys:
        if key not in obj:
            return BadLine(record.path, record.line, "missing key", repr(key))
        if not isinstance(obj[key], str):
            return BadLine(record.path, record.line, "not a string", f"{key!r} holds a {type(obj[key]).__name__}")
        texts[key] = obj[key]
    # Only a \u escape makes a lone surrogate (strict UTF-8 decoding refuses an encoded one): the rest of the
    # lines skip the check.
    if b"\\ud" in record.raw or b"\\uD" in record.raw:
        for key, text in texts.items():
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as error:
                return BadLine(record.path, record.line, "lone surrogate",
                               f"{key!r} holds {text[error.start]!r} at character {error.start}")
    return texts
