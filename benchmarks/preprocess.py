#!/usr/bin/env python
"""Throughput of tools/preprocess_data.py against the tokenizer's own ceiling, side by side in one run.

    python benchmarks/preprocess.py [--work-dir DIR] [--megabytes 60] [--megatron-lm CHECKOUT] [--steady-state]

First, the backends side by side (--tokenizer-backend), on --megabytes of distinct text: the `.py` files of
this Python's site-packages, one document each (no corpus copies: gigatoken's caches would make repeated text
mostly cache hits). For the 32k byte-level BPE below, each row gives wall time, MB/s and tokens/s of text,
peak memory (PSS over the process tree) and the ratio to the fastest bare call: the tokenizer alone, encoding
every document in this process (`tokenizers`' encode_batch, gigatoken's), then the tool with each backend and
1 or 2 workers, and the tool on 4x as much distinct text (peak memory flat in the corpus size). "wall" is the
whole command, start-up included (imports, loading the tokenizer twice: its own library and gigatoken). Every
document's ids are compared between the two backends (the count of documents compared is printed).
With --megatron-lm CHECKOUT (a Megatron-LM source tree: `git clone https://github.com/NVIDIA/Megatron-LM`, or
`git -C MIRROR archive main | tar -x -C CHECKOUT`), its tools/preprocess_data.py with the same tokenizer and
--workers 2 is a row too, and its tools/preprocess_data_fast.py (--use-gigatoken; Megatron-LM's main branch
after core_v0.16.1) where the checkout has it; each row says whether its .bin/.idx equal ours byte for byte.
They run on the checkout's megatron-core, under --megatron-lm-python: an interpreter whose environment also has
what Megatron-LM's tools import beyond ours (triton: `python -m venv V`, a .pth file naming our venv's
site-packages, `V/bin/pip install triton`). Megatron-LM's main imports Python 3.12's typing.override (a
decorator that only marks a method); under Python 3.11 the benchmark backports it from typing_extensions in
a sitecustomize.py on the tools' PYTHONPATH, and says so.

--simulate-workers N measures what N processes on N cores of one node would take (`--shard I/N`, one core
each): the N shards run one after another, each on one core and one encoding thread, and the node's wall
time is the slowest shard's; MB/s is the whole text over it.

With --steady-state, the table below follows:

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
import filecmp
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from typing import Optional

import numpy
import psutil
import pyarrow
import pyarrow.parquet

from angpt.data.tokenizers import build_tokenizer, select_backend
from angpt.megatron_compat import quiet_known_warnings

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


def prepare_bpe(work_dir: str) -> tuple:
    """(the example corpus's directory, the 32k byte-level BPE trained on it)."""
    corpus = os.path.join(work_dir, "corpus")
    if not os.path.isfile(os.path.join(corpus, "train.jsonl")):
        run_tool("fetch_example_corpus.py", "--output-dir", corpus)
    bpe = os.path.join(work_dir, "bpe32k")
    if not os.path.isfile(os.path.join(bpe, "tokenizer.json")):
        run_tool("train_tokenizer.py", "--input", os.path.join(corpus, "train.jsonl"), "--vocab-size", "32000",
                 "--output-dir", bpe)
    return corpus, bpe


def prepare(work_dir: str, document_bytes: int) -> tuple:
    corpus, bpe = prepare_bpe(work_dir)
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


def site_packages_texts(megabytes: float) -> list:
    """The distinct `.py` files of this Python's site-packages, in path order, up to `megabytes` of text."""
    import glob  # noqa: PLC0415 (this function only)
    import site  # noqa: PLC0415 (as glob)

    texts, seen, size = [], set(), 0
    for root in site.getsitepackages():
        for path in sorted(glob.glob(os.path.join(root, "**", "*.py"), recursive=True)):
            try:
                with open(path, encoding="utf-8") as file:
                    text = file.read()
            except (UnicodeDecodeError, OSError):
                continue
            if text in seen:
                continue
            seen.add(text)
            texts.append(text)
            size += len(text.encode())
            if size >= megabytes * 1e6:
                return texts
    return texts


def measure(command: list, env: Optional[dict] = None, cores: Optional[list] = None) -> tuple:
    """(wall seconds, peak PSS summed over the process tree) of a command, on `cores` if given."""
    started = time.perf_counter()
    process = psutil.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
                           preexec_fn=(lambda: os.sched_setaffinity(0, cores)) if cores else None)
    peak = 0
    while process.poll() is None:
        try:
            peak = max(peak, sum(member.memory_full_info().pss
                                 for member in [process, *process.children(recursive=True)]))
        except psutil.NoSuchProcess:
            pass
        time.sleep(0.05)
    wall = time.perf_counter() - started
    stderr = process.stderr.read()
    if process.returncode:
        raise RuntimeError(f"{' '.join(command)} failed:\n{stderr[-3000:]}")
    return wall, peak


def bare_call(encode, texts: list, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        encode(texts)
        best = min(best, time.perf_counter() - started)
    return best


def compare_backends(args, bpe: str) -> None:
    texts = site_packages_texts(args.megabytes)
    large = site_packages_texts(4 * args.megabytes)
    megabytes = sum(len(text.encode()) for text in texts) / 1e6
    large_megabytes = sum(len(text.encode()) for text in large) / 1e6
    documents = write_documents(os.path.join(args.work_dir, "site.jsonl"), texts)
    large_documents = write_documents(os.path.join(args.work_dir, "site_x4.jsonl"), large)
    flags = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", bpe]
    reference = build_tokenizer("HuggingFaceTokenizer", bpe)
    fast, _ = select_backend(reference, "gigatoken")
    ids, lengths = fast.encode_flat(texts)
    expected = reference.encode_batch(texts)
    same = sum(part.tolist() == document for part, document
               in zip(numpy.split(ids, numpy.cumsum(lengths)[:-1]), expected))
    tokens = len(ids)
    print(f"\n{len(texts):,} distinct documents, {megabytes:.1f} MB (site-packages .py files), {tokens:,} tokens; "
          f"gigatoken's ids equal tokenizers' for {same:,} of {len(texts):,} documents; {os.cpu_count()} cores; "
          f"load average {os.getloadavg()[0]:.1f}")
    rows = [("tokenizers encode_batch, bare", bare_call(reference.encode_batch, texts, 1), None, megabytes),
            ("gigatoken encode_batch, bare", bare_call(fast.encode_flat, texts, args.repeats), None, megabytes)]
    out = os.path.join(args.work_dir, "out")
    command = [sys.executable, os.path.join(TOOLS, "preprocess_data.py"), *flags, "--append-eod"]
    tool = [*command, "--output-prefix", out]
    for backend in ("tokenizers", "gigatoken"):
        for workers in (1, 2):
            runs = [measure(tool + ["--input", documents, "--tokenizer-backend", backend, "--workers", str(workers)])
                    for _ in range(1 if backend == "tokenizers" else args.repeats)]
            rows.append((f"ours, {backend}, --workers {workers}", min(runs)[0], max(run[1] for run in runs), megabytes))
    rows.append(("ours, gigatoken, --workers 1, x4 text", *measure(
        [*command, "--output-prefix", out + "_x4", "--input", large_documents, "--workers", "1"]),
        large_megabytes))
    if args.simulate_workers:
        rows.append((f"ours, gigatoken, {args.simulate_workers} shards (simulated)",
                     *simulated_node([*command, "--input", documents], out, args.simulate_workers), megabytes))
    if args.megatron_lm:
        rows.extend(megatron_lm_rows(args, documents, flags, out, megabytes))
    fastest = rows[1][1] / megabytes  # seconds per MB of the fastest bare call
    header = f"{'run':46} {'wall s':>7} {'MB/s':>7} {'tokens/s':>10} {'peak PSS':>9} {'÷ fastest bare':>14}"
    print(header)
    print("-" * len(header))
    for label, seconds, peak, size in rows:
        memory = f"{peak / 2**20:6.0f} MB" if peak else ""
        print(f"{label:46} {seconds:7.2f} {size / seconds:7.2f} {tokens * size / megabytes / seconds:10.0f} "
              f"{memory:>9} {seconds / (fastest * size):14.2f}")


def simulated_node(command: list, out: str, shards: int) -> tuple:
    """(the slowest shard's wall seconds, its peak PSS) of `command --shard I/shards` for every I, one after
    another, each pinned to one core with one encoding thread: N processes on N cores of one node."""
    env = {**os.environ, "RAYON_NUM_THREADS": "1"}
    core = sorted(os.sched_getaffinity(0))[:1]
    runs = [measure([*command, "--output-prefix", f"{out}_shard{shard}", "--shard", f"{shard}/{shards}"], env, core)
            for shard in range(shards)]
    return max(run[0] for run in runs), max(run[1] for run in runs)


def megatron_lm_rows(args, documents: str, flags: list, out: str, megabytes: float) -> list:
    """Rows of Megatron-LM's tools on the same documents and tokenizer, each followed by whether its dataset's
    bytes equal ours (`out`, written with --append-eod)."""
    shim = os.path.join(args.work_dir, "typing_override_backport")
    os.makedirs(shim, exist_ok=True)
    with open(os.path.join(shim, "sitecustomize.py"), "w") as file:
        file.write("import typing\n\nimport typing_extensions\n\n"
                   "if not hasattr(typing, 'override'):  # Python 3.11: Megatron-LM's main imports it\n"
                   "    typing.override = typing_extensions.override\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([args.megatron_lm, shim])}
    python = args.megatron_lm_python or sys.executable
    if subprocess.run([python, "-c", "import typing; typing.override"], capture_output=True).returncode:
        print(f"{python} lacks typing.override (Python 3.11): backported from typing_extensions for Megatron-LM")
    commands = {"Megatron-LM preprocess_data.py, --workers 2": [
        os.path.join(args.megatron_lm, "tools", "preprocess_data.py"), "--workers", "2"]}
    if os.path.isfile(os.path.join(args.megatron_lm, "tools", "preprocess_data_fast.py")):
        commands["Megatron-LM preprocess_data_fast.py"] = [
            os.path.join(args.megatron_lm, "tools", "preprocess_data_fast.py"), "--use-gigatoken"]
    rows, prefix = [], out + "_megatron"
    for label, (script, *extra) in commands.items():
        try:
            rows.append((label, *measure([python, script, "--input", documents, "--output-prefix", prefix, *flags,
                                          "--append-eod", *extra], env), megabytes))
        except RuntimeError as error:  # e.g. an environment without triton
            print(f"{label}: failed: {str(error).strip().splitlines()[-1]}")
            continue
        ours, theirs = f"{out}_text_document", f"{prefix}_text_document"
        if all(filecmp.cmp(ours + suffix, theirs + suffix, shallow=False) for suffix in (".bin", ".idx")):
            print(f"{label}: .bin/.idx equal to ours, byte for byte")
        else:
            print(f"{label}: .bin/.idx differ from ours: {dataset_difference(ours, theirs)}")
    return rows


def dataset_difference(ours: str, theirs: str) -> str:
    """What differs between two indexed datasets, document by document."""
    quiet_known_warnings()
    from megatron.core.datasets.indexed_dataset import IndexedDataset  # noqa: PLC0415 (only when they differ)

    def documents(prefix: str) -> list:
        dataset = IndexedDataset(prefix)
        bounds = dataset.document_indices
        return [numpy.concatenate([dataset[i] for i in range(start, stop)] or [numpy.zeros(0, numpy.int64)])
                for start, stop in zip(bounds[:-1], bounds[1:])]

    mine, other = documents(ours), documents(theirs)
    if len(mine) != len(other):
        return f"{len(other):,} documents against our {len(mine):,}"
    differing = [index for index, (a, b) in enumerate(zip(mine, other)) if not numpy.array_equal(a, b)]
    with open(ours + ".json") as file:
        eod = json.load(file)["eod"]
    empty_as_eod = [index for index in differing if len(mine[index]) == 0 and other[index].tolist() == [eod]]
    if not differing:
        return "the same tokens in every document, in other bytes (the dtype, or documents cut into other sequences)"
    if empty_as_eod == differing:
        return (f"the same tokens in every document but the {len(differing)} empty one(s), which it writes as a lone "
                f"end-of-document token (ours, as Megatron-LM's preprocess_data.py: a document of no tokens)")
    return f"{len(differing)} of {len(mine):,} documents differ, the first document {differing[0]}"


def cache_growth(bpe: str, megabytes: int) -> None:
    """gigatoken's resident memory over `megabytes` of random words (1 MB batches, nearly every piece new: the
    worst case of its caches), without a bound and with the tool's (GigatokenTokenizer)."""
    reference = build_tokenizer("HuggingFaceTokenizer", bpe)
    rng = numpy.random.default_rng(0)
    alphabet = numpy.frombuffer(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789     ", numpy.uint8)
    bounded, _ = select_backend(reference, "gigatoken")
    unbounded = bounded.build()
    process = psutil.Process()
    for label in ("unbounded", "bounded"):
        encode = unbounded.encode_batch if label == "unbounded" else bounded.encode_flat
        start = process.memory_info().rss
        for step in range(1, megabytes + 1):
            text = alphabet[rng.integers(0, len(alphabet), 1_000_000)].tobytes().decode()
            encode([text[offset:offset + 10_000] for offset in range(0, len(text), 10_000)])
            if step % 20 == 0:
                print(f"gigatoken caches, {label}: {step} MB of random words, resident memory "
                      f"+{(process.memory_info().rss - start) / 2**20:.0f} MiB")
        unbounded = encode = None  # its caches go before the bounded run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work-dir", default=os.path.join(tempfile.gettempdir(), "angpt-preprocess-benchmark"))
    parser.add_argument("--megabytes", type=float, default=60, help="distinct text of the backends' comparison")
    parser.add_argument("--megatron-lm", help="a Megatron-LM checkout, whose tools run beside ours")
    parser.add_argument("--megatron-lm-python", help="the interpreter of Megatron-LM's tools (one with triton); "
                                                     "this one when not given")
    parser.add_argument("--simulate-workers", type=int, metavar="N",
                        help="also N shards run one by one on one core each: a node of N workers")
    parser.add_argument("--steady-state", action="store_true", help="then the table of the example corpus")
    parser.add_argument("--cache-growth", type=int, metavar="MB",
                        help="only gigatoken's memory over this many MB of random words, bounded or not")
    parser.add_argument("--document-bytes", type=int, default=2000)
    parser.add_argument("--copies", type=int, default=4, help="copies of the corpus in the larger runs")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each measurement; the best counts")
    args = parser.parse_args()
    os.makedirs(args.work_dir, exist_ok=True)
    if args.cache_growth:
        cache_growth(prepare_bpe(args.work_dir)[1], args.cache_growth)
        return
    compare_backends(args, prepare_bpe(args.work_dir)[1])
    if not args.steady_state:
        return
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
