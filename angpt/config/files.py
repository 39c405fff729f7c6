"""Files read whole (JSON, tokenizer files, the files --data-args-path names) and a file's SHA-256: a file that is
not UTF-8 or not JSON is reported by its line, not by a byte offset or a traceback. The caller names the file, in its
own error (read_json_object names it itself)."""

import hashlib
import json


def read_text(path: str) -> str:
    """The file's text; a ValueError names the line of the first byte that is not UTF-8."""
    with open(path, "rb") as file:
        return decode_text(file.read())


def decode_text(data: bytes) -> str:
    """read_text of bytes read otherwise (an object in object storage)."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data.count(b"\n", 0, error.start) + 1
        raise ValueError(f"line {line}: not UTF-8: byte {data[error.start]:#04x}") from None


def read_json(path: str):
    """The file's JSON value; a ValueError says the line (and column) where it is not UTF-8 or not JSON."""
    with open(path, "rb") as file:
        return parse_json(file.read())


def parse_json(data: bytes):
    """read_json of bytes read otherwise (an object in object storage)."""
    text = decode_text(data)
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"line {error.lineno} column {error.colno}: not JSON: {error.msg}") from None


def read_json_object(path: str) -> dict:
    """The file's JSON object; a ValueError names the file, and the line where it is not UTF-8 or not JSON."""
    try:
        value = read_json(path)
    except ValueError as error:
        raise ValueError(f"{path}: {error}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path}: not a JSON object")
    return value


def sha256_of(path: str) -> str:
    """The SHA-256 of a file's bytes, read a MiB at a time."""
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
