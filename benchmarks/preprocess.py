#!/usr/bin/env python
"""Throughput of tools/preprocess_data.py against the tokenizer's own ceiling, side by side in one run.

    python benchmarks/preprocess.py [--work-dir DIR] [--document-bytes 2000]

On the example corpus (tools/fetch_example_corpus.py, cut into documents of about --document-bytes) and for
a 32k byte-level BPE (tools/train_tokenizer.py) and tiktoken with GPT-2's ranks (tools/fetch_gpt2_bpe.py),
it prints documents/s, MB/s and tokens/s of the tool with 1 and 2 workers (and with 1, on the same documents
as a Parquet file, and with --split-sentences), its peak memory (PSS summed over the tool's processes), and
the ceiling: the same tokenizer batch-encoding the same documents in one process, with no I/O. "tool" rates
exclude the tool's start-up (importing torch and megatron-core, a fixed few
seconds), which "wall" includes. Runs on --copies concatenated copies of the corpus show the steady state,
where the fixed costs of a run (worker pool, tokenizer loading) are amortized as on a real corpus, and that
peak memory stays flat as the input grows. Each figure is the best of --repeats runs (this machine is noisy).
Downloads and the trained tokenizer are cached in --work-dir.
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

import psutil
import pyarrow
import pyarrow.parquet

from angpt.data.tokenizers import build_tokenizer

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
TOOLS = os.path.join(ROOT, "tools")
DONE = re.compile(r"done in ([\d.]+) s")


def run_tool(script: str, *args: str) -> None:
    subprocess.run([sys.executable, os.path.join(TOOLS, script), *args], check=True, stdout=subprocess.DEVNULL)


def write_documents(target: str, texts: list, copies: int = 1) -> str:
    with open(target, "w") as file:
        for _ in range(copies):
            for text in texts:
                file.write(json.dumps({"text": text}) + "\n")
    return target


def write_parquet(target: str, texts: list, copies: int = 1) -> str:
    """The documents of write_documents as the rows of a Parquet file, in row groups of 10,000 rows."""
    with pyarrow.parquet.ParquetWriter(target, pyarrow.schema([("text", pyarrow.string())])) as writer:
        for _ in range(copies):
            writer.write_table(pyarrow.table({"text": texts}), row_group_size=10_000)
    return target


def cut_documents(source: str, document_bytes: int) -> list:
    """Cut every text of source into documents of about document_bytes, at line ends."""
    documents = []
    with open(source) as file:
        for line in file:
            piece = []
            size = 0
            for text_line in json.loads(line)["text"].splitlines(keepends=True):
                piece.append(text_line)
                size += len(text_line.encode())
                if size >= document_bytes:
                    documents.append("".join(piece))
                    piece, size = [], 0
            if piece:
                documents.append("".join(piece))
    return documents


def prepare(work_dir: str, document_bytes: int) -> tuple:
    corpus = os.path.join(work_dir, "corpus")
    if not os.path.isfile(os.path.join(corpus, "train.jsonl")):
        run_tool("fetch_example_corpus.py", "--output-dir", corpus)
    bpe = os.path.join(work_dir, "bpe32k")
    if not os.path.isfile(os.path.join(bpe, "tokenizer.json")):
        run_tool("train_tokenizer.py", "--input", os.path.join(corpus, "train.jsonl"), "--vocab-size", "32000",
                 "--output-dir", bpe)
    gpt2 = os.path.join(work_dir, "gpt2.tiktoken")
    if not os.path.isfile(gpt2):
        run_tool("fetch_gpt2_bpe.py", "--output", gpt2)
    texts = cut_documents(os.path.join(corpus, "train.jsonl"), document_bytes)
    return texts, {
        "32k byte-level BPE (HF tokenizers)": ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", bpe],
        "GPT-2 ranks (tiktoken)": ["--tokenizer-type", "GPT2BPETokenizer", "--tokenizer-model", gpt2],
    }


def ceiling(tokenizer_flags: list, texts: list, repeats: int) -> tuple:
    """(seconds, tokens) of the best of a few batch encodings of all texts in this process; threads: default."""
    options = dict(zip((flag.lstrip("-").replace("-", "_") for flag in tokenizer_flags[::2]), tokenizer_flags[1::2]))
    tokenizer = build_tokenizer(**options)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        tokens = sum(map(len, tokenizer.encode_batch(texts)))
        best = min(best, time.perf_counter() - started)
    return best, tokens


def run_preprocess(documents_path: str, tokenizer_flags: list, workers: int, output_prefix: str) -> tuple:
    """(wall seconds, tool seconds, peak memory: proportional set size summed over the tool's processes, so that
    pages the forked workers share with their parent count once)."""
    command = [sys.executable, os.path.join(TOOLS, "preprocess_data.py"), "--input", documents_path,
               "--output-prefix", output_prefix, *tokenizer_flags, "--append-eod", "--workers", str(workers)]
    started = time.perf_counter()
    process = psutil.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    peak = 0
    while process.poll() is None:
        try:
            tree = [process, *process.children(recursive=True)]
            peak = max(peak, sum(member.memory_full_info().pss for member in tree))
        except psutil.NoSuchProcess:
            pass
        time.sleep(0.2)
    wall = time.perf_counter() - started
    stderr = process.stderr.read()
    if process.returncode:
        raise RuntimeError(f"preprocess_data.py failed:\n{stderr}")
    return wall, float(DONE.search(stderr).group(1)), peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work-dir", default=os.path.join(tempfile.gettempdir(), "angpt-preprocess-benchmark"))
    parser.add_argument("--document-bytes", type=int, default=2000)
    parser.add_argument("--copies", type=int, default=4, help="copies of the corpus in the larger runs")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each measurement; the best counts")
    args = parser.parse_args()
    os.makedirs(args.work_dir, exist_ok=True)
    texts, tokenizers = prepare(args.work_dir, args.document_bytes)
    documents_path = write_documents(os.path.join(args.work_dir, "documents.jsonl"), texts)
    copies_path = write_documents(os.path.join(args.work_dir, f"documents_x{args.copies}.jsonl"), texts, args.copies)
    parquet_paths = {copies: write_parquet(os.path.join(args.work_dir, f"documents_x{copies}.parquet"), texts, copies)
                     for copies in (1, args.copies)}
    megabytes = sum(len(text.encode()) for text in texts) / 1e6  # of document text, as the ceiling sees it
    print(f"corpus: {len(texts):,} documents, {megabytes:.2f} MB of text; {os.cpu_count()} cores; "
          f"rates per copy of the corpus, each the best of {args.repeats} runs")
    header = f"{'tokenizer':36} {'run':24} {'docs/s':>8} {'MB/s':>7} {'tokens/s':>9} {'÷ceiling':>8} {'peak PSS':>9}"
    print(header)
    print("-" * len(header))
    for name, flags in tokenizers.items():
        for copies, path in ((1, documents_path), (args.copies, copies_path)):
            seconds, tokens = ceiling(flags, texts * copies, args.repeats)
            rows = [(f"ceiling (1 process), x{copies}", seconds, None)]
            for workers in (1, 2):
                runs = [run_preprocess(path, flags, workers, os.path.join(args.work_dir, "out"))
                        for _ in range(args.repeats)]
                wall, tool, peak = min(runs, key=lambda run: run[1])
                rows.append((f"tool, {workers} worker(s), x{copies}", tool, max(run[2] for run in runs)))
                if copies == 1:
                    rows.append((f"  wall, {workers} worker(s), x{copies}", wall, None))
            # The same documents from Parquet, and split into sentences (as many documents; the tokens differ
            # a little, as each sentence is encoded on its own): their cost beside the 1-worker run.
            for label, input_path, extra in (("parquet", parquet_paths[copies], []),
                                             ("sentences", path, ["--split-sentences"])):
                runs = [run_preprocess(input_path, flags + extra, 1, os.path.join(args.work_dir, "out"))
                        for _ in range(args.repeats)]
                rows.append((f"{label}, 1 worker, x{copies}", min(run[1] for run in runs), max(run[2] for run in runs)))
            for label, elapsed, peak in rows:
                memory = f"{peak / 2**20:7.0f} MB" if peak else ""
                per_copy = elapsed / copies
                print(f"{name:36} {label:24} {len(texts) / per_copy:8.0f} {megabytes / per_copy:7.2f} "
                      f"{tokens / copies / per_copy:9.0f} {seconds / elapsed:8.2f} {memory:>9}")

if __name__ == "__main__":
    main()
