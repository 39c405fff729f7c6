#!/usr/bin/env python
"""Tokenize a text corpus into megatron-core's indexed dataset: a drop-in for Megatron-LM's script.

    python tools/preprocess_data.py --input 'corpus/*.jsonl.gz' --output-prefix data/corpus \\
        --tokenizer-type HuggingFaceTokenizer --tokenizer-model tokenizer.json --append-eod --workers 2

Input: JSON lines (`.jsonl`, `.jsonl.gz`; one document per line, its text under each --json-keys key) and
`.txt` files (one document per file); --input takes several paths and glob patterns. For each key it writes
{output-prefix}_{key}_document.bin/.idx, byte-identical to Megatron-LM's output with the same tokenizer, and
{output-prefix}_{key}_document.json, which records the tokenizer, its EOD id and the counts.

As Megatron-LM's tool, it writes a document of no tokens (an empty text) as a zero-length document (no EOD
even with --append-eod), and encodes special-token text in a document as that token: a literal
"<|endoftext|>" becomes the end-of-document token. Web text can hold that string; --special-tokens-as-text
encodes it as ordinary text, so that only --append-eod ends a document (the .json records the choice).

Documents are tokenized in batches by --workers processes and written in input order while the input streams
through, so memory stays flat as the corpus grows. --partitions N splits the input into N contiguous parts
processed side by side (--workers // N workers each) and merges them in order: the result is the same.
A bad line (not UTF-8, not JSON, lacking a key, a non-string, a string with a lone surrogate such as
"\\ud800") stops the run with its file and line number, unless --skip-bad-lines; outputs appear under their
final names only when the run succeeds.
"""

import argparse
import multiprocessing
import os
import shutil
import signal
import sys
import tempfile
import time
import warnings
from collections import Counter, deque
from dataclasses import dataclass, field
from itertools import chain, islice
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
    iter_records,
    parse_record,
)
from angpt.data.tokenizers import TOKENIZER_TYPES, build_tokenizer

with warnings.catch_warnings():  # megatron-core warns at import about GPU libraries this tool does not use
    warnings.simplefilter("ignore")
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder  # noqa: E402

    from angpt.data.indexed import write_metadata  # noqa: E402

# A batch is ~0.3 s of one core's tokenization: large enough that the tokenizer's threads share it evenly
# and inter-process traffic is amortized (128 KB batches cost HF tokenizers 20% here), small enough to keep
# the workers evenly loaded up to the last batch and memory bounded (4 batches per worker in flight).
BATCH_BYTES = 1 << 20
BATCH_DOCUMENTS = 1024
BATCHES_IN_FLIGHT_PER_WORKER = 4  # bounds memory: reading waits for writing
SKIPPED_LINES_SHOWN = 10


@dataclass
class Stats:
    documents: Counter = field(default_factory=Counter)  # per key, the empty ones included
    tokens: Counter = field(default_factory=Counter)  # per key
    empty: Counter = field(default_factory=Counter)  # per key: documents of no tokens, written as Megatron-LM does
    bad_lines: Counter = field(default_factory=Counter)  # per reason, skipped with --skip-bad-lines
    max_token_id: dict = field(default_factory=dict)  # per key, once it has tokens
    bytes: int = 0

    def add(self, other: "Stats") -> None:
        for name in ("documents", "tokens", "empty", "bad_lines"):
            getattr(self, name).update(getattr(other, name))
        for key, largest in other.max_token_id.items():
            self.max_token_id[key] = max(largest, self.max_token_id.get(key, largest))
        self.bytes += other.bytes


@dataclass
class EncodedBatch:
    tokens: dict  # key -> all the batch's tokens, concatenated
    lengths: dict  # key -> tokens per good record, in order (0: empty document)
    bad_lines: list
    bytes: int


@dataclass
class PartitionJob:
    paths: list
    start: int  # records [start, stop) of the input, in order; stop None: to the end
    stop: Optional[int]
    output_prefixes: dict  # key -> prefix of this partition's .bin/.idx
    tokenizer: object  # built once by the parent; forked workers inherit it
    keys: list
    append_eod: bool
    dtype: type
    workers: int
    threads_per_worker: int
    skip_bad_lines: bool
    log_interval: int
    position: int


_worker = {}


def init_worker(tokenizer, keys: list, append_eod: bool, dtype: type, threads: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and ends the pool
    # The parent's SIGTERM handler would run only in this process's main thread, but the signal may be
    # delivered to one of the tokenizer's threads while the main thread waits on the task queue, which
    # then never wakes: Pool.terminate() hung. Die at once instead.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    tokenizer.set_threads(threads)
    _worker.update(tokenizer=tokenizer, keys=keys,
                   append_eod=append_eod, dtype=dtype)


def encode_batch(records: list) -> EncodedBatch:
    tokenizer, keys = _worker["tokenizer"], _worker["keys"]
    texts = {key: [] for key in keys}
    bad_lines = []
    for record in records:
        parsed = parse_record(record, keys)
        if isinstance(parsed, BadLine):
            bad_lines.append(parsed)
            continue
        for key in keys:
            texts[key].append(parsed[key])
    tokens, lengths = {}, {}
    for key in keys:
        encoded = tokenizer.encode_batch(texts[key]) if texts[key] else []
        if _worker["append_eod"]:
            for ids in encoded:
                if ids:  # as Megatron-LM: an empty document stays empty
                    ids.append(tokenizer.eod)
        lengths[key] = [len(ids) for ids in encoded]
        tokens[key] = numpy.fromiter(chain.from_iterable(encoded), dtype=_worker["dtype"], count=sum(lengths[key]))
    return EncodedBatch(tokens, lengths, bad_lines, sum(len(record.raw) for record in records))


def batches(records, max_bytes: int = BATCH_BYTES, max_documents: int = BATCH_DOCUMENTS):
    batch, size = [], 0
    for record in records:
        batch.append(record)
        size += len(record.raw)
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
        tokens, offset = batch.tokens[key], 0
        for length in batch.lengths[key]:
            # As Megatron-LM writes a document of no tokens: a document index and no sequence (lengths []).
            builder.add_document(tokens[offset:offset + length], [length] if length else [])
            offset += length
        stats.empty[key] += batch.lengths[key].count(0)
        stats.documents[key] += len(batch.lengths[key])
        stats.tokens[key] += len(tokens)
        if len(tokens):
            stats.max_token_id[key] = max(int(tokens.max()), stats.max_token_id.get(key, 0))
    stats.bytes += batch.bytes


def tokenize_partition(job: PartitionJob) -> Stats:
    """Tokenize records [start, stop) into the job's .bin/.idx files, in order."""
    context = multiprocessing.get_context("fork")
    pool = context.Pool(job.workers, initializer=init_worker, initargs=(
        job.tokenizer, job.keys, job.append_eod, job.dtype, job.threads_per_worker))
    builders = {key: IndexedDatasetBuilder(prefix + ".bin", dtype=job.dtype)
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
        bar.update(len(encoded.lengths[key]) + len(encoded.bad_lines))
        bar.set_postfix_str(f"{stats.tokens[key]:,} tokens, {stats.bytes / seconds / 1e6:.2f} MB/s", refresh=False)
        if stats.documents[key] // job.log_interval > logged:
            logged = stats.documents[key] // job.log_interval
            bar.write(f"Processed {stats.documents[key]} documents ({stats.documents[key] / seconds:.1f} docs/s, "
                      f"{stats.bytes / seconds / 1e6:.2f} MB/s).", file=sys.stderr)

    with pool:
        pending = deque()
        for records in batches(islice(iter_records(job.paths), job.start, job.stop)):
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
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for part in parts:
        builder.add_index(part)
    builder.finalize(prefix + ".idx")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    group = parser.add_argument_group("input data")
    group.add_argument("--input", nargs="+", required=True,
                       help="input files or glob patterns: .jsonl, .jsonl.gz, .txt (one document per file)")
    group.add_argument("--json-keys", nargs="+", default=["text"], help="keys to extract from each JSON line")
    group.add_argument("--skip-bad-lines", action="store_true",
                       help="skip lines that are not UTF-8/JSON, lack a string under a key or hold a lone surrogate "
                            "(\"\\ud800\"), instead of stopping; they are counted in the .json")
    group = parser.add_argument_group("tokenizer")
    group.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES)
    group.add_argument("--tokenizer-model", help="tokenizer.json (or its directory), or a .tiktoken ranks file")
    group.add_argument("--vocab-file", help="GPT-2 vocab.json (GPT2BPETokenizer)")
    group.add_argument("--merge-file", help="GPT-2 merges.txt (GPT2BPETokenizer)")
    group.add_argument("--append-eod", action="store_true",
                       help="append the end-of-document token to each document (not to an empty one, as Megatron-LM)")
    group.add_argument("--special-tokens-as-text", action="store_true",
                       help="encode special-token text in a document (a literal <|endoftext|>) as ordinary text. "
                            "By default it is that special token, as Megatron-LM encodes it, so a document "
                            "holding the string is cut in two by an end-of-document token; use this on "
                            "untrusted (web) text, so that it cannot inject document boundaries and only "
                            "--append-eod ends a document")
    group = parser.add_argument_group("output data")
    group.add_argument("--output-prefix", required=True, help="path prefix of the output files")
    group = parser.add_argument_group("runtime")
    group.add_argument("--workers", type=int, default=1, help="tokenizing processes (in all partitions together)")
    group.add_argument("--partitions", type=int, default=1, help="contiguous parts of the input run side by side")
    group.add_argument("--log-interval", type=int, default=1000, help="log progress every this many documents")
    args = parser.parse_args(argv)
    for flag in ("workers", "partitions", "log_interval"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1")
    if args.workers < args.partitions:
        parser.error(f"--workers {args.workers} is fewer than --partitions {args.partitions}: each needs one")
    if (args.vocab_file is None) != (args.merge_file is None):
        parser.error("--vocab-file and --merge-file go together")
    return args


def preprocess(args: argparse.Namespace) -> dict:
    """Write the dataset of every key; returns each key's metadata."""
    started = time.monotonic()
    paths = expand_inputs(args.input)
    if len(args.json_keys) > 1 and any(is_text_file(path) for path in paths):
        raise InputError("a .txt input is one document of one text: give a single --json-keys key")
    tokenizer = build_tokenizer(args.tokenizer_type, args.tokenizer_model, args.vocab_file, args.merge_file,
                                special_tokens_as_text=args.special_tokens_as_text)
    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    final_prefixes = {key: f"{args.output_prefix}_{key}_document" for key in args.json_keys}
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
                paths=paths, start=start, stop=stop,
                output_prefixes={key: os.path.join(scratch, part_name + key) for key in args.json_keys},
                tokenizer=tokenizer, keys=args.json_keys, append_eod=args.append_eod, dtype=dtype,
                workers=workers_per_partition, threads_per_worker=threads_per_worker,
                skip_bad_lines=args.skip_bad_lines, log_interval=args.log_interval, position=index)

        stats = Stats()
        if args.partitions == 1:
            stats.add(tokenize_partition(job(0, 0, None, part_name="")))
        else:
            records = sum(1 for _ in iter_records(paths))
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
                "tokenizer": tokenizer.description, "vocab_size": tokenizer.vocab_size, "eod": tokenizer.eod,
                "append_eod": args.append_eod, "special_tokens_as_text": args.special_tokens_as_text,
                # documents: the .idx's, the empty_documents (zero-length, as Megatron-LM writes them) included.
                # (Metadata written before they were kept counted only the others and the skipped empty ones.)
                "documents": stats.documents[key], "tokens": stats.tokens[key],
                # Training checks it against the vocabulary instead of scanning the .bin.
                "max_token_id": stats.max_token_id.get(key),
                "dtype": dtype.__name__, "json_key": key, "empty_documents": stats.empty[key],
                "skipped_lines": dict(stats.bad_lines), "input": [os.path.abspath(path) for path in paths],
            }
            write_metadata(scratch_prefix + ".json", metadata[key])
        for key, prefix in final_prefixes.items():
            for suffix in (".bin", ".idx", ".json"):  # the .json last: it marks a complete dataset
                os.replace(os.path.join(scratch, key) + suffix, prefix + suffix)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    for key, prefix in final_prefixes.items():
        print(f"{prefix}.bin/.idx/.json: {stats.documents[key]:,} documents, {stats.tokens[key]:,} tokens "
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
    args = parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # unwind, so the scratch files go too
    try:
        preprocess(args)
    except (InputError, OSError, ValueError) as error:
        sys.exit(f"error: {error}")


if __name__ == "__main__":
    main()
