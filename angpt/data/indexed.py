"""The tokenized dataset on disk: megatron-core's `.bin/.idx` pair plus our `.json` metadata beside it.

`DatasetWriter` writes the pair with numpy alone: megatron-core's IndexedDatasetBuilder writes the same bytes
(tests/test_tokenizer_backends.py compares them), but importing it imports torch and all of megatron-core, 7-10 s
of start-up for a tool whose tokenizing of 60 MB takes under one (tools/preprocess_data.py). The format's
constants are megatron-core's (megatron/core/datasets/indexed_dataset.py: _INDEX_HEADER, DType).

The metadata records the tokenizer and its end-of-document id, so that training and conversion use the
EOD the data was written with, and the largest token id written (`max_token_id`, absent from datasets
written before it was recorded). `check_indexed_dataset` catches a truncated or corrupted pair before
megatron-core memory-maps it (which would otherwise fail obscurely, or not at all); `check_token_ids`,
ids beyond the vocabulary, which megatron-core's embedding would index out of range at TP 1 and mask to
zeros at TP > 1.
"""

import hashlib
import json
import logging
import os
import struct
from typing import Optional

import numpy

from angpt.config import object_storage
from angpt.config.files import parse_json, read_json

METADATA_KEYS = ("tokenizer", "vocab_size", "eod", "append_eod", "documents", "tokens")
# magic, version (<Q), dtype code (<B), sequence count (<Q), document count (<Q)
_HEADER = struct.Struct("<9sQBQQ")
_LENGTH, _POINTER, _DOCUMENT_INDEX = 4, 8, 8  # int32, int64, int64 per entry
_INDEX_HEADER = b"MMIDIDX\x00\x00"
# megatron-core's DType: the code of the token dtype in the header.
DTYPE_CODES = {numpy.dtype(name): code for code, name in enumerate(
    ("uint8", "int8", "int16", "int32", "int64", "float64", "float32", "uint16"), start=1)}
DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}


def optimal_dtype(vocab_size: int) -> type:
    """The token dtype megatron-core's DType.optimal_dtype picks for a vocabulary of this size."""
    return numpy.uint16 if vocab_size < 65500 else numpy.int32


class IndexedDatasetError(ValueError):
    """A dataset file that is missing, truncated or corrupted; the message names the file."""


def metadata_path(prefix: str) -> str:
    return prefix + ".json"


def has_metadata(prefix: str) -> bool:
    """Whether prefix.json exists (a local file, or an object beside an object-storage prefix's .bin)."""
    if object_storage.is_object_storage_path(prefix):
        return object_storage.exists(metadata_path(prefix))
    return os.path.isfile(metadata_path(prefix))


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
        if object_storage.is_object_storage_path(prefix):
            metadata = parse_json(object_storage.read_bytes(path))
        else:
            metadata = read_json(path)
    except FileNotFoundError:
        raise IndexedDatasetError(f"{path}: no dataset metadata (write the dataset with tools/preprocess_data.py)")
    except object_storage.ObjectStorageError as error:  # before ValueError: it is one, and names the object
        raise IndexedDatasetError(str(error)) from None
    except ValueError as error:
        raise IndexedDatasetError(f"{path}: invalid dataset metadata: {error}") from None
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
    pad = metadata.get("pad")  # recorded since the pad token is masked as Megatron-LM masks it (absent before)
    if pad is not None and (type(pad) is not int or not -1 <= pad < metadata["vocab_size"]):
        raise IndexedDatasetError(f"{path}: invalid dataset metadata: pad is {pad!r} (a token id, or -1 for none)")
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
        dtype = DTYPES[_HEADER.unpack(idx.read(_HEADER.size))[2]]
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
    if object_storage.is_object_storage_path(prefix):
        # Scanning would download the whole .bin, which megatron-core reads in ranges for a reason.
        if int(os.environ.get("RANK", "0")) == 0:
            logging.getLogger(__name__).info(
                "%s.bin: its token ids are not scanned before training (in object storage, and no max_token_id in "
                "a .json): the trainer checks those of every batch it reads", prefix)
        return
    largest = cached_max_token_id(prefix, cache_dir)
    if largest is not None and largest >= metadata["vocab_size"]:
        raise IndexedDatasetError(f"{prefix}.bin holds token id {largest}, outside the vocab_size "
                                  f"{metadata['vocab_size']} of {source or metadata_path(prefix)}")


def index_header(prefix: str) -> tuple[int, int, int]:
    """(dtype code, sequences, document indices) of a whole prefix.idx's header (check_indexed_dataset checks it)."""
    with open(prefix + ".idx", "rb") as idx:
        return _HEADER.unpack(idx.read(_HEADER.size))[2:]


def check_indexed_dataset(prefix: str, object_storage_cache_path: Optional[str] = None) -> dict:
    """Check that prefix.idx is a whole megatron-core index and prefix.bin holds exactly the tokens it
    indexes (and, when prefix.json exists, that both agree with it); returns the counts. A prefix in object
    storage is checked on the .idx megatron-core caches under `object_storage_cache_path` and the .bin's size."""
    idx_path, bin_path = prefix + ".idx", prefix + ".bin"
    if object_storage.is_object_storage_path(prefix):
        try:
            bin_size = object_storage.object_size(bin_path)
            idx_file = object_storage.cached_index(prefix, object_storage_cache_path)
        except object_storage.ObjectStorageError as error:
            raise IndexedDatasetError(str(error)) from None
    else:
        for path in (idx_path, bin_path):
            if not os.path.isfile(path):
                raise IndexedDatasetError(f"{path}: no such file")
        idx_file, bin_size = idx_path, os.path.getsize(bin_path)
    idx_size = os.path.getsize(idx_file)
    with open(idx_file, "rb") as idx:
        header = idx.read(_HEADER.size)
        if len(header) < _HEADER.size:
            raise IndexedDatasetError(f"{idx_path}: truncated index ({idx_size} bytes, header needs {_HEADER.size})")
        magic, version, dtype_code, sequences, documents = _HEADER.unpack(header)
        if magic != _INDEX_HEADER:
            raise IndexedDatasetError(f"{idx_path}: not a megatron-core index (magic {magic!r})")
        if version != 1:
            raise IndexedDatasetError(f"{idx_path}: index version {version}, expected 1")
        if dtype_code not in DTYPES:
            raise IndexedDatasetError(f"{idx_path}: unknown dtype code {dtype_code}")
        expected = _HEADER.size + sequences * (_LENGTH + _POINTER) + documents * _DOCUMENT_INDEX
        if idx_size != expected:
            raise IndexedDatasetError(
                f"{idx_path}: {idx_size} bytes, but its header's {sequences} sequences and {documents} document "
                f"indices need {expected}: truncated or corrupted")
        itemsize = DTYPES[dtype_code].itemsize
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
    _check_index_arrays(idx_file, idx_path, sequences, documents, DTYPES[dtype_code].itemsize)
    if bin_size != expected_bin:
        raise IndexedDatasetError(
            f"{bin_path}: {bin_size} bytes, but {idx_path} indexes {expected_bin}: truncated or corrupted")
    counts = {"documents": max(documents - 1, 0), "sequences": sequences, "tokens": bin_size // itemsize,
              "dtype": DTYPES[dtype_code].name}
    if has_metadata(prefix):
        metadata = read_metadata(prefix)
        for key in ("documents", "tokens"):
            if metadata[key] != counts[key]:
                raise IndexedDatasetError(
                    f"{metadata_path(prefix)}: records {metadata[key]} {key}, but {prefix}.bin/.idx hold {counts[key]}")
    return counts


def _check_index_arrays(idx_file: str, idx_path: str, sequences: int, documents: int, itemsize: int) -> None:
    """`idx_file` (`idx_path`, or megatron-core's cached copy of that object) checked, errors naming `idx_path`.
    Each sequence's pointer is the one before plus its length, and the document indices do not decrease: a
    flipped byte in a length or a pointer breaks the first (megatron-core would read outside the sequence, or
    past the .bin), in a document index most often the second. Read in chunks: about 0.1 s per 10M sequences."""
    chunk = 1 << 22
    if sequences:
        lengths = numpy.memmap(idx_file, dtype=numpy.int32, mode="r", offset=_HEADER.size, shape=(sequences,))
        pointers = numpy.memmap(idx_file, dtype=numpy.int64, mode="r", offset=_HEADER.size + sequences * _LENGTH,
                                shape=(sequences,))
        if pointers[0] != 0:
            raise IndexedDatasetError(f"{idx_path}: the first sequence starts at byte {pointers[0]}, not 0: corrupted")
        for start in range(0, sequences - 1, chunk):
            stop = min(start + chunk, sequences - 1)  # sequence i ends where sequence i + 1 starts
            ends = pointers[start:stop] + lengths[start:stop].astype(numpy.int64) * itemsize
            bad = numpy.flatnonzero(ends != pointers[start + 1:stop + 1])
            if len(bad):
                index = start + int(bad[0])
                raise IndexedDatasetError(
                    f"{idx_path}: sequence {index} has {lengths[index]} tokens, but its pointers are "
                    f"{pointers[index + 1] - pointers[index]} bytes apart: corrupted")
    if documents > 1:
        indices = numpy.memmap(idx_file, dtype=numpy.int64, mode="r",
                               offset=_HEADER.size + sequences * (_LENGTH + _POINTER), shape=(documents,))
        for start in range(0, documents - 1, chunk):
            stop = min(start + chunk, documents - 1)
            bad = numpy.flatnonzero(indices[start + 1:stop + 1] < indices[start:stop])
            if len(bad):
                raise IndexedDatasetError(f"{idx_path}: document indices out of order at document "
                                          f"{start + int(bad[0]) + 1}: corrupted")


class DatasetWriter:
    """prefix.bin/.idx of a text dataset, written as megatron-core's IndexedDatasetBuilder writes them (no
    sequence modes): the tokens appended to the .bin as they come, the index at `finalize`."""

    def __init__(self, bin_path: str, dtype: numpy.dtype):
        self.dtype = numpy.dtype(dtype)
        self.data_file = open(bin_path, "wb")
        self.lengths: list[numpy.ndarray] = []  # int32 tokens per sequence, a batch per array
        self.document_ends: list[numpy.ndarray] = []  # int64 sequence index after each document
        self.sequences = 0

    def add_documents(self, tokens: numpy.ndarray, lengths: numpy.ndarray, sequences: numpy.ndarray) -> None:
        """Append documents in one write: `tokens`, then each document's `sequences` sequences of `lengths`
        tokens each (0 sequences: an empty document), as add_document called per document."""
        self.data_file.write(numpy.asarray(tokens, dtype=self.dtype).tobytes(order="C"))
        self.lengths.append(numpy.asarray(lengths, dtype=numpy.int32))
        self.document_ends.append(self.sequences + numpy.cumsum(sequences, dtype=numpy.int64))
        self.sequences += int(numpy.sum(sequences))

    def finalize(self, idx_path: str) -> None:
        self.data_file.close()
        lengths = numpy.concatenate([numpy.zeros(0, numpy.int32), *self.lengths])
        pointers = numpy.zeros(len(lengths), dtype=numpy.int64)
        numpy.cumsum(lengths[:-1].astype(numpy.int64) * self.dtype.itemsize, out=pointers[1:])
        document_indices = numpy.concatenate([numpy.zeros(1, numpy.int64), *self.document_ends])
        with open(idx_path, "wb") as idx:
            idx.write(_HEADER.pack(_INDEX_HEADER, 1, DTYPE_CODES[self.dtype], len(lengths), len(document_indices)))
            for array in (lengths, pointers, document_indices):
                idx.write(array.tobytes(order="C"))
