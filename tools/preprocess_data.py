#!/usr/bin/env python
"""Tokenize a text corpus into megatron-core's indexed dataset: a drop-in for Megatron-LM's script.

    python tools/preprocess_data.py --input 'corpus/*.jsonl.gz' --output-prefix data/corpus \\
        --tokenizer-type HuggingFaceTokenizer --tokenizer-model tokenizer.json --append-eod --workers 2

--tokenizer-type takes Megatron-LM's HuggingFaceTokenizer, TikTokenizer (a Megatron-LM .json vocabulary, with
--tiktoken-pattern, --tiktoken-num-special-tokens and --vocab-size as Megatron-LM reads them; or angpt's
.tiktoken ranks file), GPT2BPETokenizer, SentencePieceTokenizer, GPTSentencePieceTokenizer, Llama2Tokenizer, and
BertWordPieceLowerCase and BertWordPieceCase (--vocab-file vocab.txt).

Input: JSON lines (`.jsonl`, `.jsonl.gz`; one document per line, its text under each --json-keys key),
`.txt` files (one document per file) and Parquet files (`.parquet`; one document per row, its text in each
--json-keys column, read in batches of rows so that memory stays flat however large the file); --input takes
several paths and glob patterns. For each key it writes {output-prefix}_{key}_document.bin/.idx,
byte-identical to Megatron-LM's output with the same tokenizer, and {output-prefix}_{key}_document.json,
which records the tokenizer, its EOD id and the counts.

--split-sentences writes each sentence of a document as its own sequence, the document's sentences under one
document index, as Megatron-LM's --split-sentences does (and names the outputs {output-prefix}_{key}_sentence
as it does); --append-eod then ends the document's last sentence only. The sentences are Punkt's (nltk's
PunktSentenceTokenizer, as Megatron-LM's), but without trained parameters, which Megatron-LM downloads: it
splits after every abbreviation ("Mr.", "e.g."). The whitespace between sentences is dropped, unless
--keep-newlines, which keeps it at the end of the sentence before it, newlines included.

As Megatron-LM's tool, it writes a document of no tokens (an empty text) as a zero-length document (no EOD
even with --append-eod), and encodes special-token text in a document as that token: a literal
"<|endoftext|>" (with Megatron-LM's TikTokenizer, "</s>") becomes the end-of-document token (SentencePiece
never reads it from text). Web text can hold that string; --special-tokens-as-text encodes it as ordinary text,
so that only --append-eod ends a document (the .json records the choice).

--tokenizer-backend: gigatoken encodes, where its ids are the tokenizer's own (HuggingFaceTokenizer,
GPT2BPETokenizer, a .tiktoken ranks file; checked at start-up, else the tokenizer's own library encodes and the
log says why); the log and the .json name the backend. --shard I/N writes the I-th of N shards of the input for
N processes on N machines; tools/merge_datasets.py merges them into the bytes of one run.

Documents are tokenized in batches by --workers processes and written in input order while the input streams
through, so memory stays flat as the corpus grows. --partitions N splits the input into N contiguous parts
processed side by side (--workers // N workers each) and merges them in order: the result is the same.
A bad line (not UTF-8, not JSON, lacking a key, a non-string, a string with a lone surrogate such as
"\\ud800") stops the run with its file and line number, unless --skip-bad-lines; outputs appear under their
final names only when the run succeeds.
"""

import argparse
import importlib.metadata
import multiprocessing
import os
import re
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from itertools import islice
from multiprocessing.connection import wait
from typing import Optional

import numpy
from tqdm import tqdm

from angpt.data.corpus import (
    BAD_LINE_REASONS,
    BadLine,
    InputError,
    expand_inputs,
    is_text_file,
    iter_file_records,
    parse_record,
    shard_inputs,
)
from angpt.data.indexed import DatasetWriter, optimal_dtype, write_metadata
from angpt.data.tokenizers import (
    BERT_TYPES,
    TIKTOKEN_NUM_SPECIAL_TOKENS,
    TIKTOKEN_PATTERNS,
    TOKENIZER_BACKENDS,
    TOKENIZER_TYPES,
    GigatokenTokenizer,
    TokenizerBackendError,
    build_tokenizer,
    select_backend,
)
from angpt.megatron_compat import quiet_known_warnings

# A batch is ~0.3 s of one core's tokenization: large enough that the tokenizer's threads share it evenly
# and inter-process traffic is amortized (128 KB batches cost HF tokenizers 20% here), small enough to keep
# the workers evenly loaded up to the last batch and memory bounded (4 batches per worker in flight).
BATCH_BYTES = 1 << 20
BATCH_DOCUMENTS = 1024
BATCHES_IN_FLIGHT_PER_WORKER = 4  # bounds memory: reading waits for writing
SKIPPED_LINES_SHOWN = 10
# Rows of a Parquet file decoded at a time: few enough that a batch of long documents stays small beside the
# batches in flight, enough to amortize Arrow's per-batch work.
PARQUET_BATCH_ROWS = 256
NO_IDS = numpy.zeros(0, dtype=numpy.int64)
# Megatron-LM splits a document's text into sentences a million characters at a time (a sentence never spans
# two such pieces); so does this tool, to write the same sentences.
SENTENCE_SPLIT_CHARS = 1_000_000


class BadRow(BadLine):
    """A Parquet row that holds no document; line is the row's index in its file, counted from 0 as Arrow
    counts rows."""

    def __str__(self) -> str:
        return f"{self.path}, row {self.line}: {self.reason}: {self.detail}"


@dataclass(frozen=True)
class ParquetRow:
    """One document of a Parquet file: its text in each --json-keys column, in their order (None: null)."""

    path: str
    row: int
    texts: tuple
    size: int  # UTF-8 bytes of the texts, for the throughput shown


def is_parquet(path: str) -> bool:
    return path.endswith(".parquet")


def open_parquet(path: str, keys: list):
    """The file, once its --json-keys columns are checked to be columns of strings."""
    import pyarrow  # noqa: PLC0415 (only for Parquet inputs)
    import pyarrow.parquet  # noqa: PLC0415 (as pyarrow)

    try:
        # pre_buffer (pyarrow's default) keeps the row groups read: Arrow's peak memory grew 4 MB per row group
        # of 1,000 rows, 61 MB for a 49 MB file, against 17 MB flat without it.
        parquet = pyarrow.parquet.ParquetFile(path, pre_buffer=False)
    except (pyarrow.ArrowException, OSError) as error:
        raise InputError(f"{path}: not a readable Parquet file: {error}") from error
    schema = parquet.schema_arrow
    text_types = (pyarrow.string(), pyarrow.large_string(), pyarrow.string_view())
    for key in keys:
        if key not in schema.names:
            raise InputError(f"{path}: no column {key!r} (--json-keys); its columns are "
                             f"{', '.join(map(repr, schema.names))}")
        column_type = schema.field(key).type
        if column_type not in text_types and not (pyarrow.types.is_dictionary(column_type)
                                                  and column_type.value_type in text_types):
            raise InputError(f"{path}: column {key!r} (--json-keys) holds {column_type}, not strings")
    return parquet


def iter_parquet_rows(path: str, keys: list):
    """The rows of a Parquet file in order, PARQUET_BATCH_ROWS decoded at a time."""
    import pyarrow  # noqa: PLC0415 (only for Parquet inputs)
    import pyarrow.compute  # noqa: PLC0415 (as pyarrow)

    parquet, first = open_parquet(path, keys), 0
    try:
        for batch in parquet.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=keys):
            columns = [batch.column(key) for key in keys]
            sizes = sum(pyarrow.compute.binary_length(column).fill_null(0).to_numpy() for column in columns)
            for index, (texts, size) in enumerate(zip(zip(*(column.to_pylist() for column in columns)), sizes)):
                yield ParquetRow(path, first + index, texts, int(size))
            first += batch.num_rows
    except pyarrow.ArrowException as error:
        raise InputError(f"{path}: {error}") from error
    except UnicodeDecodeError as error:  # a damaged string column: Arrow checks no UTF-8 when reading
        raise InputError(f"{path}, rows from {first}: a --json-keys column is not UTF-8: byte "
                         f"{error.object[error.start]:#04x}") from None


def parse_row(row: ParquetRow, keys: list) -> "dict[str, str] | BadRow":
    """The text in each column; a null is the row's missing key, as a JSON line lacking the key is."""
    for key, text in zip(keys, row.texts):
        if text is None:
            return BadRow(row.path, row.row, "missing key", f"{key!r} is null")
    return dict(zip(keys, row.texts))


def iter_inputs(parts: list, keys: list):
    """The documents of every input part (path, start, stop) in order: JSON lines and `.txt` files as Records,
    Parquet rows as ParquetRows."""
    for path, start, stop in parts:
        yield from iter_parquet_rows(path, keys) if is_parquet(path) else iter_file_records(path, start, stop)


def count_inputs(parts: list, keys: list) -> int:
    """The documents of every input part (and bad lines): a Parquet file's footer counts its rows."""
    return sum(open_parquet(path, keys).metadata.num_rows if is_parquet(path)
               else sum(1 for _ in iter_file_records(path, start, stop)) for path, start, stop in parts)


def record_bytes(record) -> int:
    return record.size if isinstance(record, ParquetRow) else len(record.raw)


class SentenceSplitter:
    """A document's text as Megatron-LM's --split-sentences cuts it: nltk's Punkt on every million characters.
    Punkt is pure Python (no download without trained parameters, unlike Megatron-LM's english.pickle, and no
    platform binary) and splits 2.5-5 MB/s per core here, the tokenizers' own order (a 32k BPE encodes ~1.5 MB/s,
    tiktoken 2-8); pysbd splits 0.3 MB/s, and blingfire, at most 2x faster through its Python wrapper, ships a
    99 MB x86-only library that fails on an empty text."""

    def __init__(self, keep_newlines: bool):
        from nltk.tokenize.punkt import PunktLanguageVars, PunktSentenceTokenizer  # noqa: PLC0415 (1.7 s to import: only with --split-sentences)

        language_vars = PunktLanguageVars()
        # nltk (3.10) runs this pattern under a 5 s wall-clock limit for a whole text, which a million characters
        # of short sentences exceed (Punkt takes ~25 us per candidate): a busy machine would fail a run at
        # random. The pattern is linear (nltk dropped the word before the period from it for that), so it is
        # compiled without the limit, by the standard library, which also matches it faster.
        language_vars._re_period_context = re.compile(language_vars.period_context_re().pattern,
                                                      re.UNICODE | re.VERBOSE)
        self.punkt = PunktSentenceTokenizer(lang_vars=language_vars)
        self.keep_newlines = keep_newlines
        self.description = {"name": "nltk.tokenize.punkt.PunktSentenceTokenizer, no trained parameters",
                            "nltk": importlib.metadata.version("nltk"), "keep_newlines": keep_newlines}

    def __call__(self, text: str) -> list:
        sentences = []
        for offset in range(0, len(text), SENTENCE_SPLIT_CHARS):
            piece = text[offset:offset + SENTENCE_SPLIT_CHARS]
            spans = list(self.punkt.span_tokenize(piece))
            if self.keep_newlines and spans:
                # Each sentence runs to the next one's start, so the whitespace after it stays with it: what
                # Megatron-LM's CustomLanguageVars does to Punkt's pattern (\s* after the period), whose leading
                # \S* makes it quadratic in a word's length (0.55 s for a word of 10,000 characters; nltk 3.10
                # stops it at 40,000). The last sentence ends where Punkt ends it, before trailing whitespace.
                ends = [start for start, _ in spans[1:]] + [spans[-1][1]]
                spans = [(start, end) for (start, _), end in zip(spans, ends)]
            sentences.extend(piece[start:end] for start, end in spans)
        return sentences


@dataclass
class Stats:
    documents: Counter = field(default_factory=Counter)  # per key, the empty ones included
    sequences: Counter = field(default_factory=Counter)  # per key: the documents' sentences, or the documents
    tokens: Counter = field(default_factory=Counter)  # per key
    empty: Counter = field(default_factory=Counter)  # per key: documents of no tokens, written as Megatron-LM does
    bad_lines: Counter = field(default_factory=Counter)  # per reason, skipped with --skip-bad-lines
    max_token_id: dict = field(default_factory=dict)  # per key, once it has tokens
    bytes: int = 0

    def add(self, other: "Stats") -> None:
        for name in ("documents", "sequences", "tokens", "empty", "bad_lines"):
            getattr(self, name).update(getattr(other, name))
        for key, largest in other.max_token_id.items():
            self.max_token_id[key] = max(largest, self.max_token_id.get(key, largest))
        self.bytes += other.bytes


@dataclass
class EncodedBatch:
    tokens: dict  # key -> all the batch's tokens, concatenated
    lengths: dict  # key -> the tokens of each sequence written, in order (sequences of no tokens dropped)
    sequences: dict  # key -> per good record, in order: its count of sequences written (0: an empty document)
    bad_lines: list
    bytes: int


@dataclass
class PartitionJob:
    parts: list  # (path, start, stop) of the inputs: this shard's (--shard), or every file whole
    start: int  # records [start, stop) of the input, in order; stop None: to the end
    stop: Optional[int]
    output_prefixes: dict  # key -> prefix of this partition's .bin/.idx
    tokenizer: object  # built once by the parent; forked workers inherit it
    splitter: Optional[SentenceSplitter]  # with --split-sentences; inherited as the tokenizer is
    keys: list
    append_eod: bool
    dtype: type
    workers: int
    threads_per_worker: int
    skip_bad_lines: bool
    log_interval: int
    position: int


_worker = {}


def init_worker(tokenizer, splitter, keys: list, append_eod: bool, dtype: type, threads: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and ends the pool
    # The parent's SIGTERM handler would run only in this process's main thread, but the signal may be
    # delivered to one of the tokenizer's threads while the main thread waits on the task queue, which
    # then never wakes: Pool.terminate() hung. Die at once instead. The pool forks with SIGTERM blocked
    # (fork_pool): one sent before this line stays pending until here, and then ends the worker.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    configure_encoding(tokenizer, splitter, keys, append_eod, dtype, threads)


def fork_pool(workers: int, initargs: tuple):
    """The workers, forked with SIGTERM blocked: a process whose SIGTERM handler records a request and returns (a
    trainer's, in a test's process) would pass it to a worker that Pool.terminate() signals before init_worker has
    run, and that worker then waited on the task queue forever (a test hung in a fresh-clone CI run)."""
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        return multiprocessing.get_context("fork").Pool(workers, initializer=init_worker, initargs=initargs)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


def configure_encoding(tokenizer, splitter, keys: list, append_eod: bool, dtype: type, threads: int) -> None:
    """What encode_batch encodes with, in this process."""
    tokenizer.set_threads(threads)
    _worker.update(tokenizer=tokenizer, splitter=splitter, keys=keys,
                   append_eod=append_eod, dtype=dtype)


class InProcess:
    """The worker pool's interface, encoding each batch in this process when its result is asked for: for
    gigatoken with one worker, which encodes a batch on every core here (in a forked worker, on one core only)
    and spares the copies of every batch to and from a worker."""

    def __init__(self, *initargs):
        configure_encoding(*initargs)

    def apply_async(self, function, args: tuple):
        return InProcessResult(lambda: function(*args))

    def close(self) -> None:
        pass

    join = terminate = close

    def __enter__(self):
        return self

    def __exit__(self, *_) -> None:
        pass


@dataclass
class InProcessResult:
    get: object  # computes the result


def encode_batch(records: list) -> EncodedBatch:
    tokenizer, splitter, keys = _worker["tokenizer"], _worker["splitter"], _worker["keys"]
    texts = {key: [] for key in keys}  # every sequence's text: a document's sentences, or the document
    counts = {key: [] for key in keys}  # sequences per document
    bad_lines = []
    for record in records:
        parsed = parse_row(record, keys) if isinstance(record, ParquetRow) else parse_record(record, keys)
        if isinstance(parsed, BadLine):
            bad_lines.append(parsed)
            continue
        for key in keys:
            sequences = splitter(parsed[key]) if splitter else [parsed[key]]
            texts[key].extend(sequences)
            counts[key].append(len(sequences))
    tokens, lengths, sequences = {}, {}, {}
    eod = tokenizer.eod if _worker["append_eod"] else None
    for key in keys:
        ids, sequence_lengths = tokenizer.encode_flat(texts[key]) if texts[key] else (NO_IDS, NO_IDS)
        tokens[key], lengths[key], sequences[key] = assemble_documents(
            ids, sequence_lengths, numpy.array(counts[key], dtype=numpy.int64), eod, _worker["dtype"])
    return EncodedBatch(tokens, lengths, sequences, bad_lines, sum(map(record_bytes, records)))


def assemble_documents(ids, lengths, counts, eod: Optional[int], dtype: type) -> tuple:
    """The documents of a batch as Megatron-LM writes them, from the ids of its sequences (their lengths in
    order) and each document's count of sequences: a sequence of no tokens is dropped, so a document of none has
    no sequence, and eod (unless None) ends the last sequence of each document that has tokens. Returns (the
    tokens, each sequence's length, each document's count of sequences)."""
    document = numpy.repeat(numpy.arange(len(counts)), counts)
    kept = lengths > 0
    lengths, document = lengths[kept], document[kept]
    if eod is not None and len(lengths):
        last = numpy.append(document[1:] != document[:-1], True)  # the last sequence of its document
        lengths = lengths + last
        # Into one array of the output dtype, the EODs at the ends of the documents' last sequences: 0.6x
        # numpy.insert's time on 12M ids (it copies the ids in their own dtype first, then converts).
        is_eod = numpy.zeros(int(lengths.sum()), dtype=bool)
        is_eod[numpy.cumsum(lengths)[last] - 1] = True
        out = numpy.empty(len(is_eod), dtype=dtype)
        out[is_eod] = eod
        out[~is_eod] = ids
        return out, lengths, numpy.bincount(document, minlength=len(counts))
    return ids.astype(dtype, copy=False), lengths, numpy.bincount(document, minlength=len(counts))


def batches(records, max_bytes: int = BATCH_BYTES, max_documents: int = BATCH_DOCUMENTS):
    batch, size = [], 0
    for record in records:
        batch.append(record)
        size += record_bytes(record)
        if size >= max_bytes or len(batch) >= max_documents:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def write_batch(builders: dict, batch: EncodedBatch, stats: Stats, skip_bad_lines: bool, report) -> None:
    if batch.bad_lines:
        if not skip_bad_lines:
            raise InputError(f"{batch.bad_lines[0]} (--skip-bad-lines skips such lines)")
        for bad_line in batch.bad_lines:
            if sum(stats.bad_lines.values()) < SKIPPED_LINES_SHOWN:
                report(f"skipping {bad_line}")
            stats.bad_lines[bad_line.reason] += 1
    for key, builder in builders.items():
        tokens, sequences = batch.tokens[key], batch.sequences[key]
        builder.add_documents(tokens, batch.lengths[key], sequences)
        stats.empty[key] += int((sequences == 0).sum())
        stats.documents[key] += len(sequences)
        stats.sequences[key] += len(batch.lengths[key])
        stats.tokens[key] += len(tokens)
        if len(tokens):
            stats.max_token_id[key] = max(int(tokens.max()), stats.max_token_id.get(key, 0))
    stats.bytes += batch.bytes


def tokenize_partition(job: PartitionJob) -> Stats:
    """Tokenize records [start, stop) into the job's .bin/.idx files, in order."""
    initargs = (job.tokenizer, job.splitter, job.keys, job.append_eod, job.dtype, job.threads_per_worker)
    if job.workers == 1 and isinstance(job.tokenizer, GigatokenTokenizer):
        pool = InProcess(*initargs)
    else:
        pool = fork_pool(job.workers, initargs)
    builders = {key: DatasetWriter(prefix + ".bin", dtype=job.dtype)
                for key, prefix in job.output_prefixes.items()}
    stats, started, logged = Stats(), time.monotonic(), 0
    total = None if job.stop is None else job.stop - job.start
    bar = tqdm(total=total, unit="doc", desc=f"partition {job.position}" if job.position else None,
               position=job.position, file=sys.stderr, disable=None, dynamic_ncols=True)
    key = job.keys[0]

    def write(encoded: EncodedBatch) -> None:
        nonlocal logged
        # tqdm.write goes to stdout unless told: the skipped lines go with the other diagnostics, on stderr.
        write_batch(builders, encoded, stats, job.skip_bad_lines, lambda line: bar.write(line, file=sys.stderr))
        seconds = max(time.monotonic() - started, 1e-9)
        bar.update(len(encoded.sequences[key]) + len(encoded.bad_lines))
        bar.set_postfix_str(f"{stats.tokens[key]:,} tokens, {stats.bytes / seconds / 1e6:.2f} MB/s", refresh=False)
        if stats.documents[key] // job.log_interval > logged:
            logged = stats.documents[key] // job.log_interval
            bar.write(f"Processed {stats.documents[key]} documents ({stats.documents[key] / seconds:.1f} docs/s, "
                      f"{stats.bytes / seconds / 1e6:.2f} MB/s).", file=sys.stderr)

    with pool:
        pending = deque()
        for records in batches(islice(iter_inputs(job.parts, job.keys), job.start, job.stop)):
            pending.append(pool.apply_async(encode_batch, (records,)))
            if len(pending) >= BATCHES_IN_FLIGHT_PER_WORKER * job.workers:
                write(pending.popleft().get())
        while pending:
            write(pending.popleft().get())
        pool.close()  # let the workers finish on their own; terminate() is for failures
        pool.join()
    bar.close()
    for key, builder in builders.items():
        builder.finalize(job.output_prefixes[key] + ".idx")
    return stats


def run_partition(job: PartitionJob, sender) -> None:
    """A partition's process: send back its stats, or the error that stopped it."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # unwind, so the pool ends its workers too
    try:
        sender.send(("ok", tokenize_partition(job)))
    except (InputError, OSError) as error:
        sender.send(("error", str(error)))


def run_partitions(jobs: list) -> list:
    """Run each job in its own process; on the first failure, stop the others and raise it."""
    context = multiprocessing.get_context("fork")
    running = {}
    for index, job in enumerate(jobs):
        receiver, sender = context.Pipe(duplex=False)
        process = context.Process(target=run_partition, args=(job, sender))
        process.start()
        sender.close()
        running[receiver] = (index, process)
    results = [None] * len(jobs)
    try:
        while running:
            for receiver in wait(list(running)):
                index, process = running.pop(receiver)
                try:
                    status, value = receiver.recv()
                except EOFError:
                    process.join()
                    status, value = "error", f"partition {index} died (exit code {process.exitcode})"
                process.join()
                if status == "error":
                    raise InputError(value)
                results[index] = value
    finally:
        for _, process in running.values():
            process.terminate()
            process.join()
    return results


def merge_partitions(parts: list, prefix: str, dtype: type) -> None:
    """Concatenate partial datasets in order, as Megatron-LM merges its partitions."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder  # noqa: PLC0415 (after parsing)

    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for part in parts:
        builder.add_index(part)
    builder.finalize(prefix + ".idx")


def shard_spec(text: str) -> tuple:
    """--shard I/N: (I, N), 0 <= I < N."""
    try:
        shard, shards = map(int, text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give I/N, e.g. 0/8") from None
    if not 0 <= shard < shards:
        raise argparse.ArgumentTypeError(f"{text!r}: I counts from 0 and is below N")
    return shard, shards


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    group = parser.add_argument_group("input data")
    group.add_argument("--input", nargs="+", required=True,
                       help="input files or glob patterns: .jsonl, .jsonl.gz, .txt (one document per file), "
                            ".parquet (one document per row)")
    group.add_argument("--json-keys", nargs="+", default=["text"],
                       help="keys to extract from each JSON line; the columns of string to read from Parquet")
    group.add_argument("--skip-bad-lines", action="store_true",
                       help="skip lines that are not UTF-8/JSON, lack a string under a key or hold a lone surrogate "
                            "(\"\\ud800\"), and Parquet rows holding a null, instead of stopping; they are counted "
                            "in the .json")
    group.add_argument("--split-sentences", action="store_true",
                       help="write each sentence of a document as its own sequence (Punkt without trained "
                            "parameters), to {output-prefix}_{key}_sentence.bin/.idx")
    group.add_argument("--keep-newlines", action="store_true",
                       help="with --split-sentences: keep the whitespace between sentences, newlines included, at "
                            "the end of the sentence before it (as Megatron-LM, ignored without --split-sentences)")
    group = parser.add_argument_group("tokenizer")
    group.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES)
    group.add_argument("--tokenizer-model", help="tokenizer.json (or its directory); TikTokenizer's Megatron-LM .json "
                            "vocabulary or .tiktoken ranks file; or a SentencePiece .model")
    group.add_argument("--tiktoken-pattern", choices=TIKTOKEN_PATTERNS,
                       help="TikTokenizer's split pattern with a Megatron-LM .json vocabulary (v2 when not given)")
    group.add_argument("--tiktoken-num-special-tokens", type=int, default=TIKTOKEN_NUM_SPECIAL_TOKENS,
                       help="the special tokens before the ranks of TikTokenizer's Megatron-LM .json vocabulary")
    group.add_argument("--vocab-size", type=int,
                       help="TikTokenizer's ids with a Megatron-LM .json vocabulary (131072 when not given)")
    group.add_argument("--vocab-file", help="GPT-2 vocab.json (GPT2BPETokenizer); BERT's vocab.txt (the BERT types)")
    group.add_argument("--merge-file", help="GPT-2 merges.txt (GPT2BPETokenizer)")
    group.add_argument("--tokenizer-special-tokens", nargs="+",
                       help="special tokens, as Megatron-LM's: HuggingFaceTokenizer, GPT2BPETokenizer "
                            "(vocab/merges) and BertWordPieceLowerCase add each as a special token, matched whole in "
                            "the text (the vocabulary grows by those it lacks); TikTokenizer's Megatron-LM .json "
                            "vocabulary puts them first, in place of <unk> <s> </s> <mask> <pad> <cls> <sep> (which "
                            "they must hold); BertWordPieceCase takes <extra_id_0> ... <extra_id_99> in their place, "
                            "as Megatron-LM")
    group.add_argument("--tiktoken-special-tokens", nargs="+",
                       help="Megatron-LM's deprecated spelling of --tokenizer-special-tokens, read when that is not "
                            "given")
    group.add_argument("--tokenizer-hf-include-special-tokens", action="store_true",
                       help="HuggingFaceTokenizer, GPT2BPETokenizer and the BERT types: encode with the "
                            "tokenizer's post-processor too (transformers' tokenizer(text), e.g. <s> before each "
                            "document, BERT's [CLS] ... [SEP]), as Megatron-LM's")
    group.add_argument("--tokenizer-metadata",
                       help="megatron-core's tokenizer metadata (JSON), which Megatron-LM reads in place of the "
                            "tokenizer type's library: checked to name that library")
    group.add_argument("--append-eod", action="store_true",
                       help="append the end-of-document token to each document (not to an empty one, as Megatron-LM; "
                            "with --split-sentences, to its last sentence)")
    group.add_argument("--special-tokens-as-text", action="store_true",
                       help="encode special-token text in a document (a literal <|endoftext|>; </s> with Megatron-LM's "
                            "TikTokenizer) as ordinary text. "
                            "By default it is that special token, as Megatron-LM encodes it, so a document "
                            "holding the string is cut in two by an end-of-document token; use this on "
                            "untrusted (web) text, so that it cannot inject document boundaries and only "
                            "--append-eod ends a document")
    group.add_argument("--tokenizer-backend", choices=TOKENIZER_BACKENDS,
                       help="the library that encodes: the tokenizer's own (tokenizers: Hugging Face tokenizers, "
                            "tiktoken or SentencePiece), or gigatoken, which encodes the same vocabulary many times "
                            "faster where it encodes exactly as the tokenizer's own library (HuggingFaceTokenizer, "
                            "GPT2BPETokenizer, TikTokenizer with a .tiktoken ranks file; checked at start-up). "
                            "Without it: gigatoken where it encodes exactly so, else the tokenizer's own; the log and "
                            "the .json name the choice, and why gigatoken was not used")
    group = parser.add_argument_group("output data")
    group.add_argument("--output-prefix", required=True, help="path prefix of the output files")
    group = parser.add_argument_group("runtime")
    group.add_argument("--workers", type=int, default=1, help="tokenizing processes (in all partitions together)")
    group.add_argument("--partitions", type=int, default=1, help="contiguous parts of the input run side by side")
    group.add_argument("--log-interval", type=int, default=1000, help="log progress every this many documents")
    group.add_argument("--shard", type=shard_spec, default=(0, 1), metavar="I/N",
                       help="write shard I (from 0) of N: the documents that begin in the I-th of N equal byte ranges "
                            "of the inputs (an uncompressed .jsonl cut between lines, any other file whole), for N "
                            "processes on N machines; tools/merge_datasets.py concatenates the N datasets into the "
                            "one a single run writes (examples/preprocess.slurm)")
    args = parser.parse_args(argv)
    for flag in ("workers", "partitions", "log_interval"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1")
    if args.workers < args.partitions:
        parser.error(f"--workers {args.workers} is fewer than --partitions {args.partitions}: each needs one")
    if args.tokenizer_type not in BERT_TYPES and (args.vocab_file is None) != (args.merge_file is None):
        parser.error("--vocab-file and --merge-file go together")
    if args.tokenizer_type in BERT_TYPES and args.merge_file is not None:
        parser.error(f"--merge-file: {args.tokenizer_type} reads --vocab-file alone (BERT's vocab.txt)")
    if args.tokenizer_type == "BertWordPieceCase" and (args.tokenizer_special_tokens or args.tiktoken_special_tokens):
        print("warning: --tokenizer-special-tokens: ignored with BertWordPieceCase, as in Megatron-LM (its "
              "build_tokenizer gives it <extra_id_0> ... <extra_id_99> in their place)", file=sys.stderr)
    return args


def preprocess(args: argparse.Namespace) -> dict:
    """Write the dataset of every key; returns each key's metadata."""
    started = time.monotonic()
    paths = expand_inputs(args.input)
    for path in paths:  # a valid input (Parquet aside, refused below), but likely a failed download or copy
        if os.path.getsize(path) == 0 and not is_parquet(path):
            print(f"warning: {path}: an empty file", file=sys.stderr)
    if len(args.json_keys) > 1 and any(is_text_file(path) for path in paths):
        raise InputError("a .txt input is one document of one text: give a single --json-keys key")
    shard, shards = args.shard
    parts = shard_inputs(paths, shard, shards) if shards > 1 else [(path, None, None) for path in paths]
    for path in paths:  # a missing column stops the run before it starts, not when the file's turn comes
        if is_parquet(path):
            open_parquet(path, args.json_keys)
    tokenizer = build_tokenizer(args.tokenizer_type, args.tokenizer_model, args.vocab_file, args.merge_file,
                                special_tokens_as_text=args.special_tokens_as_text,
                                tiktoken_pattern=args.tiktoken_pattern, vocab_size=args.vocab_size,
                                tiktoken_num_special_tokens=args.tiktoken_num_special_tokens,
                                # Megatron-LM's validate_args copies the deprecated spelling when the other is absent.
                                special_tokens=args.tokenizer_special_tokens or args.tiktoken_special_tokens,
                                include_special_tokens=args.tokenizer_hf_include_special_tokens,
                                metadata=args.tokenizer_metadata)
    tokenizer, backend = select_backend(tokenizer, args.tokenizer_backend)
    print(f"tokenizer backend: {backend['name']} ({backend.get('library', 'gigatoken')} {backend['version']}, "
          f"{backend['chosen']})" + (f"; gigatoken not used: {backend['gigatoken_not_used']}"
                                     if "gigatoken_not_used" in backend else ""), file=sys.stderr)
    splitter = SentenceSplitter(args.keep_newlines) if args.split_sentences else None
    dtype = optimal_dtype(tokenizer.vocab_size)
    level = "sentence" if args.split_sentences else "document"  # as Megatron-LM names its outputs
    final_prefixes = {key: f"{args.output_prefix}_{key}_{level}" for key in args.json_keys}
    output_dir = os.path.dirname(os.path.abspath(args.output_prefix))
    os.makedirs(output_dir, exist_ok=True)
    # Everything is written under a temporary directory beside the outputs and renamed at the end, so a
    # failed or killed run leaves nothing under the final names.
    scratch = tempfile.mkdtemp(prefix=f".{os.path.basename(args.output_prefix)}.", suffix=".tmp", dir=output_dir)
    try:
        workers_per_partition = args.workers // args.partitions
        cores = len(os.sched_getaffinity(0))
        # Twice as many encoding threads as cores in all (at most all cores per worker), so that no core
        # idles while a worker does its Python-side work (parsing JSON, packing tokens) between batches.
        threads_per_worker = max(1, min(cores, round(2 * cores / args.workers)))

        def job(index: int, start: int, stop: Optional[int], part_name: str) -> PartitionJob:
            return PartitionJob(
                parts=parts, start=start, stop=stop,
                output_prefixes={key: os.path.join(scratch, part_name + key) for key in args.json_keys},
                tokenizer=tokenizer, splitter=splitter, keys=args.json_keys, append_eod=args.append_eod, dtype=dtype,
                workers=workers_per_partition, threads_per_worker=threads_per_worker,
                skip_bad_lines=args.skip_bad_lines, log_interval=args.log_interval, position=index)

        stats = Stats()
        if args.partitions == 1:
            stats.add(tokenize_partition(job(0, 0, None, part_name="")))
        else:
            records = count_inputs(parts, args.json_keys)
            bounds = [records * index // args.partitions for index in range(args.partitions + 1)]
            jobs = [job(index, bounds[index], bounds[index + 1], f"part{index}_") for index in range(args.partitions)]
            for partition_stats in run_partitions(jobs):
                stats.add(partition_stats)
            for key in args.json_keys:
                merge_partitions([job.output_prefixes[key] for job in jobs], os.path.join(scratch, key), dtype)
        metadata = {}
        for key in args.json_keys:
            scratch_prefix = os.path.join(scratch, key)
            metadata[key] = {
                "tokenizer": tokenizer.description, "tokenizer_backend": backend,
                "vocab_size": tokenizer.vocab_size, "eod": tokenizer.eod,
                # Training masks it as Megatron-LM's GPTDataset does, also where the tokenizer's files are not at hand.
                "pad": tokenizer.pad,
                "append_eod": args.append_eod, "special_tokens_as_text": args.special_tokens_as_text,
                # documents: the .idx's, the empty_documents (zero-length, as Megatron-LM writes them) included.
                # (Metadata written before they were kept counted only the others and the skipped empty ones.)
                "documents": stats.documents[key], "tokens": stats.tokens[key],
                # Training checks it against the vocabulary instead of scanning the .bin.
                "max_token_id": stats.max_token_id.get(key),
                "dtype": dtype.__name__, "json_key": key, "empty_documents": stats.empty[key],
                "skipped_lines": dict(stats.bad_lines), "input": [os.path.abspath(path) for path in paths],
                "shard": f"{shard}/{shards}",
                # sequences: the .idx's, one per sentence with --split-sentences (sentences of no tokens dropped).
                "split_sentences": args.split_sentences, "sequences": stats.sequences[key],
            }
            if splitter:
                metadata[key]["sentence_splitter"] = splitter.description
            write_metadata(scratch_prefix + ".json", metadata[key])
        for key, prefix in final_prefixes.items():
            for suffix in (".bin", ".idx", ".json"):  # the .json last: it marks a complete dataset
                os.replace(os.path.join(scratch, key) + suffix, prefix + suffix)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    for key, prefix in final_prefixes.items():
        sentences = f" in {stats.sequences[key]:,} sentences" if args.split_sentences else ""
        print(f"{prefix}.bin/.idx/.json: {stats.documents[key]:,} documents{sentences}, {stats.tokens[key]:,} tokens "
              f"({dtype.__name__}, vocab {tokenizer.vocab_size}, eod {tokenizer.eod}), "
              f"{stats.empty[key]:,} of the documents empty", file=sys.stderr)
    seconds = time.monotonic() - started
    documents = sum(stats.documents.values())
    print(f"done in {seconds:.2f} s: {documents / seconds:.1f} docs/s, {stats.bytes / seconds / 1e6:.3f} MB/s, "
          f"{sum(stats.tokens.values()) / seconds:.0f} tokens/s", file=sys.stderr)
    if stats.bad_lines:
        reasons = ", ".join(f"{stats.bad_lines[reason]} {reason}" for reason in BAD_LINE_REASONS
                            if stats.bad_lines[reason])
        print(f"skipped {sum(stats.bad_lines.values())} bad lines: {reasons}", file=sys.stderr)
    return metadata


def main() -> None:
    args = parse_args()  # before megatron-core (and torch) are imported: --help and flag errors are instant
    quiet_known_warnings()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # unwind, so the scratch files go too
    try:
        preprocess(args)
    except (InputError, OSError, ValueError, TokenizerBackendError) as error:
        sys.exit(f"error: {error}")


if __name__ == "__main__":
    main()
