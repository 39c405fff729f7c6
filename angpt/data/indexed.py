"""The tokenized dataset on disk: megatron-core's `.bin/.idx` pair plus our `.json` metadata beside it.

The metadata records the tokenizer and its end-of-document id, so that training and conversion use the
EOD the data was written with, and the largest token id written (`max_token_id`, absent from datasets
written before it was recorded). `check_indexed_dataset` catches a truncated or corrupted pair before
megatron-core memory-maps it (which would otherwise fail obscurely, or not at all); `check_token_ids`,
ids beyond the vocabulary, which megatron-core's embedding would index out of range at TP 1 and mask to
zeros at TP > 1.
"""

import hashlib
import json
import os
import struct
from typing import Optional

import numpy
from megatron.core.datasets.indexed_dataset import _INDEX_HEADER, DType

METADATA_KEYS = ("tokenizer", "vocab_size", "eod", "append_eod", "documents", "tokens")
# magic, version (<Q), dtype code (<B), sequence count (<Q), document count (<Q)
_HEADER = struct.Struct("<9sQBQQ")
_LENGTH, _POINTER, _DOCUMENT_INDEX = 4, 8, 8  # int32, int64, int64 per entry


class IndexedDatasetError(ValueError):
    """A dataset file that is missing, truncated or corrupted; the message names the file."""


def metadata_path(prefix: str) -> str:
    return prefix + ".json"


def write_metadata(path: str, metadata: dict) -> None:
    missing = [key for key in METADATA_KEYS if key not in metadata]
    assert not missing, f"metadata lacks {missing}"
    with open(path, "w") as file:
        json.dump(metadata, file, indent=2)
        file.write("\n")


def read_metadata(prefix: str) -> dict:
    """The metadata written with the dataset at prefix (the path without .bin/.idx)."""
    path = metadata_path(prefix)
    try:
        with open(path) as file:
            metadata = json.load(file)
    except FileNotFoundError:
        raise IndexedDatasetError(f"{path}: no dataset metadata (write the dataset with tools/preprocess_data.py)")
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise IndexedDatasetError(f"{path}: invalid dataset metadata: {error}") from error
    if not isinstance(metadata, dict):
        raise IndexedDatasetError(f"{path}: invalid dataset metadata: not a JSON object")
    missing = [key for key in METADATA_KEYS if key not in metadata]
    if missing:
        raise IndexedDatasetError(f"{path}: invalid dataset metadata: missing {', '.join(missing)}")
    for key in ("vocab_size", "eod", "documents", "tokens"):
        if not isinstance(metadata[key], int) or isinstance(metadata[key], bool) or metadata[key] < 0:
            raise IndexedDatasetError(f"{path}: invalid dataset metadata: {key} is {metadata[key]!r}")
    if metadata["eod"] >= metadata["vocab_size"]:
        raise IndexedDatasetError(f"{path}: eod {metadata['eod']} is outside vocab_size {metadata['vocab_size']}")
    max_id = metadata.get("max_token_id")
    if max_id is not None and (not isinstance(max_id, int) or isinstance(max_id, bool) or max_id < 0):
        raise IndexedDatasetError(f"{path}: invalid dataset metadata: max_token_id is {max_id!r}")
    if max_id is not None and max_id >= metadata["vocab_size"]:
        raise IndexedDatasetError(f"{path}: token ids reach {max_id} (max_token_id), outside its vocab_size "
                                  f"{metadata['vocab_size']}")
    return metadata


def max_token_id(prefix: str) -> Optional[int]:
    """The largest token id in prefix.bin (None when it holds no tokens), in the dtype prefix.idx records.
    numpy's reduction streams through the memory map without a copy (reading it in chunks measured the
    same time and memory: the pages read are the page cache's, not the process's)."""
    with open(prefix + ".idx", "rb") as idx:
        dtype = DType.dtype_from_code(_HEADER.unpack(idx.read(_HEADER.size))[2])
    if os.path.getsize(prefix + ".bin") == 0:  # numpy cannot map an empty file
        return None
    return int(numpy.memmap(prefix + ".bin", dtype=dtype, mode="r").max())


def cached_max_token_id(prefix: str, cache_dir: Optional[str] = None) -> Optional[int]:
    """max_token_id, kept in `cache_dir` (--data-cache-path; default megatron-core's place for a dataset's
    caches, `<prefix>/cache`) for as long as prefix.bin keeps its size and modification time: a dataset
    without our .json (Megatron-LM's tool writes none) is scanned once, not at every start. A cache that
    cannot be written is skipped: the scan's result is the same."""
    stat = os.stat(prefix + ".bin")
    key = {"bin": os.path.abspath(prefix + ".bin"), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    name = f"{os.path.basename(prefix)}-{hashlib.sha1(key['bin'].encode()).hexdigest()[:12]}.max_token_id.json"
    path = os.path.join(cache_dir or os.path.join(prefix, "cache"), name)
    try:
        with open(path) as file:
            cached = json.load(file)
        if {k: cached.get(k) for k in key} == key:
            return cached["max_token_id"]
    except (OSError, ValueError, KeyError, AttributeError):
        pass  # none yet, another version of the .bin, or unreadable: scan
    largest = max_token_id(prefix)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        partial = f"{path}.{os.getpid()}.tmp"  # ranks writing at once each rename a whole file
        with open(partial, "w") as file:
            json.dump({**key, "max_token_id": largest}, file)
        os.replace(partial, path)
    except OSError:
        pass
    return largest


def check_token_ids(prefix: str, metadata: dict, source: Optional[str] = None, cache_dir: Optional[str] = None):
    """Refuse a dataset whose token ids reach beyond its metadata's vocab_size. The max_token_id that
    tools/preprocess_data.py records is trusted here (read_metadata compares it); a dataset without one has
    its .bin scanned (per 100M tokens: about 0.05 s from the page cache, 0.2 to 2 s from disk), once
    (cached_max_token_id). The trainer checks the ids of every batch it reads as well, which catches a
    max_token_id that does not match the .bin. `source`: where the vocab_size comes from, for a dataset
    without a .json (the tokenizer flags)."""
    if "max_token_id" in metadata:
        return
    largest = cached_max_token_id(prefix, cache_dir)
    if largest is not None and largest >= metadata["vocab_size"]:
        raise IndexedDatasetError(f"{prefix}.bin holds token id {largest}, outside the vocab_size "
                                  f"{metadata['vocab_size']} of {source or metadata_path(prefix)}")


def check_indexed_dataset(prefix: str) -> dict:
    """Check that prefix.idx is a whole megatron-core index and prefix.bin holds exactly the tokens it
    indexes (and, when prefix.json exists, that both agree with it); returns the counts."""
    idx_path, bin_path = prefix + ".idx", prefix + ".bin"
    for path in (idx_path, bin_path):
        if not os.path.isfile(path):
            raise IndexedDatasetError(f"{path}: no such file")
    idx_size, bin_size = os.path.getsize(idx_path), os.path.getsize(bin_path)
    with open(idx_path, "rb") as idx:
        header = idx.read(_HEADER.size)
        if len(header) < _HEADER.size:
            raise IndexedDatasetError(f"{idx_path}: truncated index ({idx_size} bytes, header needs {_HEADER.size})")
        magic, version, dtype_code, sequences, documents = _HEADER.unpack(header)
        if magic != _INDEX_HEADER:
            raise IndexedDatasetError(f"{idx_path}: not a megatron-core index (magic {magic!r})")
        if version != 1:
            raise IndexedDatasetError(f"{idx_path}: index version {version}, expected 1")
        if dtype_code not in {dtype.value for dtype in DType}:
            raise IndexedDatasetError(f"{idx_path}: unknown dtype code {dtype_code}")
        expected = _HEADER.size + sequences * (_LENGTH + _POINTER) + documents * _DOCUMENT_INDEX
        if idx_size != expected:
            raise IndexedDatasetError(
                f"{idx_path}: {idx_size} bytes, but its header's {sequences} sequences and {documents} document "
                f"indices need {expected}: truncated or corrupted")
        itemsize = DType.size(dtype_code)
        if sequences:
            idx.seek(_HEADER.size + (sequences - 1) * _LENGTH)
            (last_length,) = struct.unpack("<i", idx.read(_LENGTH))
            idx.seek(_HEADER.size + sequences * _LENGTH + (sequences - 1) * _POINTER)
            (last_pointer,) = struct.unpack("<q", idx.read(_POINTER))
            expected_bin = last_pointer + last_length * itemsize
        else:
            expected_bin = 0
        if documents:
            indices_start = _HEADER.size + sequences * (_LENGTH + _POINTER)
            idx.seek(indices_start)
            (first_index,) = struct.unpack("<q", idx.read(_DOCUMENT_INDEX))
            idx.seek(indices_start + (documents - 1) * _DOCUMENT_INDEX)
            (last_index,) = struct.unpack("<q", idx.read(_DOCUMENT_INDEX))
            if first_index != 0 or last_index != sequences:
                raise IndexedDatasetError(f"{idx_path}: document indices run from {first_index} to {last_index}, "
                                          f"expected 0 to {sequences}: corrupted")
    if bin_size != expected_bin:
        raise IndexedDatasetError(
            f"{bin_path}: {bin_size} bytes, but {idx_path} indexes {expected_bin}: truncated or corrupted")
    counts = {"documents": max(documents - 1, 0), "sequences": sequences, "tokens": bin_size // itemsize,
              "dtype": DType.dtype_from_code(dtype_code).__name__}
    if os.path.isfile(metadata_path(prefix)):
        metadata = read_metadata(prefix)
        for key in ("documents", "tokens"):
            if metadata[key] != counts[key]:
                raise IndexedDatasetError(
                    f"{metadata_path(prefix)}: records {metadata[key]} {key}, but {prefix}.bin/.idx hold {counts[key]}")
    return counts


def add_documents(builder, tokens: numpy.ndarray, lengths: numpy.ndarray, sequences: numpy.ndarray) -> None:
    """Append documents to megatron-core's IndexedDatasetBuilder in one write: the bytes of its add_document
    called per document (each document's `sequences` sequences, of `lengths` tokens each, 0 sequences for an
    empty document), without its per-document Python work (2-3 us each: seconds on millions of short
    documents), as Megatron-LM's own add_documents (main, after core_v0.16.1) writes them."""
    assert not builder.multimodal, "a text dataset has no sequence modes"
    builder.data_file.write(numpy.asarray(tokens, dtype=builder.dtype).tobytes(order="C"))
    offset = len(builder.sequence_lengths)
    builder.sequence_lengths.extend(lengths.tolist())
    builder.document_indices.extend((offset + numpy.cumsum(sequences)).tolist())
