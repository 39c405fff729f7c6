"""Bad inputs, one matrix (issue 51): every kind of data-side file angpt reads (the preprocessing tool's corpora,
tokenizer files of each type, indexed datasets and blends, tools/merge_datasets.py's shards, --config YAML, the
Hugging Face directory tools/convert_from_hf.py imports) x each damage (empty, truncated, a flipped byte, the wrong
kind of file, missing). Each refused case ends in one line that names the file (and its line where it has
lines), with no traceback, nothing written under the output names and no process left behind.

The tools' main() runs in this process (a traceback would be an exception escaping it, which fails the test), so
the module stays fast; one subprocess checks the command line itself. Cases marked Writes are damage the input
cannot reveal (a .txt cut at a character boundary holds text all the same), each with why. Checkpoints have their
own matrix (tests/test_bad_checkpoints.py), and torchrun's one line its module (tests/test_bad_inputs_torchrun.py).
Each case records what it printed (`cell`) when tools/bad_inputs.py runs the matrices for docs/bad-inputs.md.
Cases tested elsewhere are referred to, not repeated (ELSEWHERE, for the table), and so are neighbours of them:
- a glob matching nothing, a directory: test_preprocess_data.py::test_missing_inputs_are_clear_errors
- a bad line of a .jsonl (not JSON, not UTF-8, ...): test_preprocess_data.py::test_bad_line_stops_with_file_and_line
- a .idx whose header is corrupted (magic, version, dtype, counts), a .json that disagrees with the .bin/.idx:
  test_preprocess_data.py::test_corrupted_idx_is_named, ::test_metadata_errors_name_the_file
- a tokenizer file changed since the dataset was written (its sha256):
  test_preprocess_data.py::test_metadata_is_checked_against_the_tokenizer_it_names
- a token id past the vocabulary (a flipped high byte in a .bin): test_faults.py, at opening
  (::test_token_ids_beyond_the_vocabulary_stop_a_tensor_parallel_run_before_it_trains) and in the batches
  (check_batch_token_ids: ::test_a_max_token_id_that_understates_the_bin_is_caught_by_the_batches)
- a --config file that holds unknown keys or bad values: test_pretrain.py::test_a_bad_config_file_is_refused_by_name
"""

import base64
import contextlib
import gzip
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from typing import NamedTuple, Optional

import psutil
import pyarrow
import pyarrow.parquet
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from angpt.config.arguments import parse_args
from angpt.config.sections import DataSection
from angpt.data.gpt_datasets import dataset_vocabulary
from angpt.data.indexed import IndexedDatasetError
from angpt.training import trainer
from angpt.training.checkpoint_store import CheckpointError

from conftest import ROOT, write_megatron_tiktoken

# The start of a PNG image, then bytes of every value: the wrong kind of file under each name.
PNG = bytes.fromhex("89504e470d0a1a0a0000000d49484452") + bytes(range(256)) * 2
DAMAGES = ("empty", "truncated", "flipped", "wrong kind", "missing")
# Where each case appends its outcome, one JSON line, when tools/bad_inputs.py runs the matrix to write
# docs/results/bad_inputs.json (the table of docs/bad-inputs.md).
RECORD = "ANGPT_BAD_INPUTS_RECORD"


class Writes(NamedTuple):
    """The damage cannot be seen in the file (`why`): the run succeeds, saying `warning` (a pattern) if given."""
    why: str
    warning: Optional[str] = None


class Elsewhere(NamedTuple):
    """A case whose test is another module's (`test`, file::name)."""
    group: str
    kind: str
    damage: str
    test: str


def record(entry: dict) -> None:
    if os.environ.get(RECORD):
        with open(os.environ[RECORD], "a") as file:  # one write per line: the pytest-xdist workers append alike
            file.write(json.dumps(entry) + "\n")


def record_elsewhere(case: Elsewhere) -> None:
    record({**case._asdict(), "where": None, "line": None, "accepted": None, "traceback": False, "elsewhere": True})


@contextlib.contextmanager
def cell(group: str, kind: str, how: str, where: Optional[str] = None):
    """Record the case (its group and kind of file, its damage and `where` in the file where it says more): the
    test sets `line` (the one line printed) or `accepted` (why it runs); an exception other than a failed
    assertion escaping the code under test is the traceback a user would see, recorded as such (and the test
    fails on it as ever)."""
    outcome = {"group": group, "kind": kind, "damage": how, "where": where, "line": None, "accepted": None,
               "traceback": False, "test": os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" ", 1)[0]}
    try:
        yield outcome
    except AssertionError:
        raise
    except Exception as error:
        outcome["traceback"] = True
        outcome["line"] = f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[-1]}"
        raise
    finally:
        record(outcome)


def damage(path, how: str, at=None) -> None:
    """Damage the file: empty it, cut it (at `at`, default its middle), flip the top bit of one byte (at `at`,
    default the middle one), put a PNG image in its place, or remove it."""
    data = open(path, "rb").read()
    if how == "missing":
        os.remove(path)
        return
    if how == "empty":
        data = b""
    elif how == "truncated":
        data = data[:len(data) // 2 if at is None else at]
    elif how == "flipped":
        index = (len(data) // 2 if at is None else at) % len(data)
        data = data[:index] + bytes([data[index] ^ 0x80]) + data[index + 1:]
    elif how == "wrong kind":
        data = PNG
    with open(path, "wb") as file:
        file.write(data)


def load_tool(name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "tools", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # the worker pool pickles its functions by module name
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tools():
    return {name: load_tool(name) for name in ("preprocess_data", "merge_datasets", "convert_from_hf")}


def run_main(tool, argv, monkeypatch, capsys) -> tuple:
    """(exit status or message, stderr) of the tool's main() on argv, in this process; an exception other
    than SystemExit escapes (the traceback the command line would print)."""
    monkeypatch.setattr(sys, "argv", [tool.__file__, *map(str, argv)])
    handler = signal.getsignal(signal.SIGTERM)
    before = {child.pid for child in psutil.Process().children(recursive=True)}  # an earlier test's helpers
    try:
        tool.main()
        status = 0
    except SystemExit as exit:
        status = exit.code
    finally:
        signal.signal(signal.SIGTERM, handler)  # preprocess_data's main installs its own
    left = [child for child in psutil.Process().children(recursive=True) if child.pid not in before]
    # No worker left behind by a refusal (a save keeps megatron-core's results queue for the process's life).
    assert status == 0 or left == []
    return status, capsys.readouterr().err


def assert_refused(status, stderr: str, pattern: str, outcome: dict) -> None:
    """The tool exited with one line (sys.exit's message) that matches pattern; the line is the cell's."""
    assert isinstance(status, str), f"exit status {status!r}, stderr:\n{stderr}"
    outcome["line"] = status
    assert "\n" not in status.strip() and "Traceback" not in stderr, status
    assert re.search(pattern, status), status


def name(path) -> str:
    return re.escape(str(path))


# ---------------------------------------------------------------------------------------------------------------
# The preprocessing tool's inputs: .jsonl, .jsonl.gz, .txt, .parquet.

DOCUMENTS = [f"document {i}: the rain in Spain falls mainly on the plain, ünïcødé ✓" for i in range(60)]


def write_corpus(path, kind: str) -> None:
    if kind == "jsonl":
        path.write_text("".join(json.dumps({"text": text}) + "\n" for text in DOCUMENTS), encoding="utf-8")
    elif kind == "jsonl.gz":
        path.write_bytes(gzip.compress("".join(json.dumps({"text": text}) + "\n" for text in DOCUMENTS).encode()))
    elif kind == "txt":
        path.write_text("\n".join(DOCUMENTS), encoding="utf-8")
    elif kind == "parquet":
        pyarrow.parquet.write_table(pyarrow.table({"text": DOCUMENTS}), path)


def write_byte_ranks(path) -> str:
    """A .tiktoken ranks file of the 256 bytes (id = byte; EOD 256)."""
    with open(path, "w") as file:
        file.writelines(f"{base64.b64encode(bytes([value])).decode()} {value}\n" for value in range(256))
    return str(path)


def write_dataset(directory) -> str:
    """A jsonl corpus preprocessed with the byte tokenizer into `directory`: the dataset's prefix."""
    write_corpus(directory / "corpus.jsonl", "jsonl")
    tool = load_tool("preprocess_data")
    tool.preprocess(tool.parse_args([
        "--input", str(directory / "corpus.jsonl"), "--output-prefix", str(directory / "corpus"), "--tokenizer-type",
        "TikTokenizer", "--tokenizer-model", write_byte_ranks(directory / "bytes.tiktoken"), "--append-eod",
        "--tokenizer-backend", "tokenizers"]))
    return str(directory / "corpus_text_document")


@pytest.fixture(scope="module")
def byte_ranks(tmp_path_factory):
    return write_byte_ranks(tmp_path_factory.mktemp("ranks") / "bytes.tiktoken")


EMPTY_CORPUS = Writes("an empty file holds no document: it is said, by name, and the others are written",
                      r"^warning: {path}: an empty file$")
CORPUS_CASES = [
    ("jsonl", "empty", None, EMPTY_CORPUS),
    ("jsonl", "truncated", None, r"^error: {path}:\d+: not JSON: .* \(--skip-bad-lines skips such lines\)$"),
    ("jsonl", "flipped", None, r"^error: {path}:\d+: not UTF-8: byte 0x[0-9a-f]{{2}} "),
    ("jsonl", "wrong kind", None, r"^error: {path}:1: not UTF-8: byte 0x89 "),
    ("jsonl", "missing", None, r"^error: --input '{path}': no such file$"),
    ("jsonl.gz", "empty", None, EMPTY_CORPUS),
    ("jsonl.gz", "truncated", None, r"^error: {path}: truncated: its gzip data ends early \(after line \d+\)$"),
    ("jsonl.gz", "flipped", None, r"^error: {path}: not readable gzip data \(.*; after line \d+\)$"),
    ("jsonl.gz", "wrong kind", None, r"^error: {path}: not readable gzip data \(Not a gzipped file .*after line 0\)$"),
    ("jsonl.gz", "missing", None, r"^error: --input '{path}': no such file$"),
    ("txt", "empty", None, EMPTY_CORPUS),
    ("txt", "truncated", 100, Writes("a .txt cut between characters is text all the same: nothing shows that it was "
                                     "cut")),
    ("txt", "flipped", None, r"^error: {path}:\d+: not UTF-8: byte 0x[0-9a-f]{{2}} "),
    ("txt", "wrong kind", None, r"^error: {path}:1: not UTF-8: byte 0x89 "),
    ("txt", "missing", None, r"^error: --input '{path}': no such file$"),
    ("parquet", "empty", None, r"^error: {path}: not a readable Parquet file: "),
    ("parquet", "truncated", None, r"^error: {path}: not a readable Parquet file: "),
    # In the page of strings (written dictionary-encoded and compressed by default).
    ("parquet", "flipped", 300, r"^error: {path}, rows from 0: a --json-keys column is not UTF-8: byte 0x"),
    ("parquet", "missing", None, r"^error: --input '{path}': no such file$"),
]


@pytest.mark.parametrize("kind, how, at, expected", CORPUS_CASES, ids=[f"{c[0]}-{c[1]}" for c in CORPUS_CASES])
def test_corpus(tmp_path, tools, byte_ranks, monkeypatch, capsys, kind, how, at, expected):
    good, path = tmp_path / "good.jsonl", tmp_path / f"corpus.{kind}"
    write_corpus(good, "jsonl")
    write_corpus(path, kind)
    damage(path, how, at)
    out = tmp_path / "out"
    with cell("preprocessing input", f".{kind}", how) as outcome:
        status, stderr = run_main(tools["preprocess_data"], [
            "--input", good, path, "--output-prefix", out / "data", "--tokenizer-type", "TikTokenizer",
            "--tokenizer-model", byte_ranks, "--tokenizer-backend", "tokenizers"], monkeypatch, capsys)
        if isinstance(expected, Writes):
            assert status == 0, stderr
            warnings = [line for line in stderr.splitlines() if line.startswith("warning: ")]
            outcome["accepted"], outcome["line"] = expected.why, warnings[-1] if warnings else None
            if expected.warning:
                assert any(re.search(expected.warning.format(path=name(path)), line) for line in warnings), stderr
            assert sorted(os.listdir(out)) == [f"data_text_document{suffix}" for suffix in (".bin", ".idx", ".json")]
            return
        assert_refused(status, stderr, expected.format(path=name(path)), outcome)
    assert not os.path.exists(out) or os.listdir(out) == []  # neither outputs nor scratch


def test_a_truncated_gzip_ends_in_one_line_on_the_command_line(tmp_path, byte_ranks):
    """The case the issue found: Python's EOFError and its traceback, the file unnamed."""
    path = tmp_path / "corpus.jsonl.gz"
    write_corpus(path, "jsonl.gz")
    damage(path, "truncated")
    done = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "preprocess_data.py"), "--input", str(path),
                           "--output-prefix", str(tmp_path / "out" / "data"), "--tokenizer-type", "TikTokenizer",
                           "--tokenizer-model", byte_ranks, "--tokenizer-backend", "tokenizers", "--workers", "2"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.splitlines()[-1].startswith(f"error: {path}: truncated: "), done.stderr
    assert os.listdir(tmp_path / "out") == []


# ---------------------------------------------------------------------------------------------------------------
# Tokenizer files of each type, given to the preprocessing tool (the trainer builds them with the same code,
# angpt.data.tokenizers.build_tokenizer).

def write_hf_tokenizer(directory) -> None:
    """tokenizer.json of a byte-level BPE (256 bytes, one merge, <|endoftext|>), and its vocab.json and
    merges.txt as GPT-2's tokenizer files."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {symbol: index for index, symbol in enumerate(alphabet)}
    vocab.update({"Ġt": 256, "<|endoftext|>": 257})
    tokenizer = Tokenizer(models.BPE(vocab, [("Ġ", "t")]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.add_special_tokens(["<|endoftext|>"])
    os.makedirs(directory, exist_ok=True)
    tokenizer.save(os.path.join(directory, "tokenizer.json"))
    tokenizer.model.save(str(directory))  # vocab.json, merges.txt
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as file:
        json.dump({"eos_token": "<|endoftext|>"}, file)


@pytest.fixture(scope="module")
def tokenizer_files(tmp_path_factory, sentencepiece_model):
    directory = tmp_path_factory.mktemp("tokenizers")
    write_hf_tokenizer(directory / "hf")
    write_megatron_tiktoken(directory / "megatron.json", [b"ab", b"cd"])
    return {"hf": directory / "hf", "megatron": directory / "megatron.json", "sentencepiece": sentencepiece_model}


# kind: (the file damaged, relative to the copied files; the tokenizer flags)
TOKENIZER_KINDS = {
    "tiktoken ranks": ("bytes.tiktoken", ["--tokenizer-type", "TikTokenizer", "--tokenizer-model", "@bytes.tiktoken"]),
    "tokenizer.json": ("hf/tokenizer.json", ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
                                             "@hf/tokenizer.json"]),
    "tokenizer_config.json": ("hf/tokenizer_config.json", ["--tokenizer-type", "HuggingFaceTokenizer",
                                                           "--tokenizer-model", "@hf"]),
    "vocab.json": ("hf/vocab.json", ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "@hf/vocab.json",
                                     "--merge-file", "@hf/merges.txt"]),
    "merges.txt": ("hf/merges.txt", ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "@hf/vocab.json",
                                     "--merge-file", "@hf/merges.txt"]),
    "sentencepiece": ("sp.model", ["--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model", "@sp.model"]),
    "megatron tiktoken": ("megatron.json", ["--tokenizer-type", "TikTokenizer", "--tokenizer-model", "@megatron.json",
                                            "--vocab-size", "1258"]),
}
NOT_JSON = r"^error: {path}: .*line \d+ column \d+: not JSON: "
NOT_UTF8 = r"^error: {path}: .*line \d+: not UTF-8: byte 0x[0-9a-f]{{2}}"
NOT_SENTENCEPIECE = r"^error: --tokenizer-model {path}: not a SentencePiece model "
NOT_MEGATRON = r"^error: --tokenizer-model {path}: not a Megatron-LM tiktoken vocabulary "
TOKENIZER_CASES = [
    ("tiktoken ranks", "empty", None, r"^error: {path}: no ranks \(an empty file\)$"),
    ("tiktoken ranks", "truncated", None, r"^error: {path}:\d+: not a base64 token and its rank: "),
    ("tiktoken ranks", "flipped", None, r"^error: {path}:\d+: not a base64 token and its rank: "),
    ("tiktoken ranks", "wrong kind", None, r"^error: {path}:1: not a base64 token and its rank: "),
    ("tokenizer.json", "empty", None, r"^error: {path}: not a Hugging Face tokenizer: .*line 1 column 0$"),
    ("tokenizer.json", "truncated", None, r"^error: {path}: not a Hugging Face tokenizer: EOF while parsing .*line"),
    ("tokenizer.json", "flipped", None, NOT_UTF8),
    ("tokenizer.json", "wrong kind", None, r"^error: {path}: .*line 1: not UTF-8: byte 0x89"),
    ("tokenizer_config.json", "empty", None, NOT_JSON),
    ("tokenizer_config.json", "truncated", None, NOT_JSON),
    ("tokenizer_config.json", "flipped", None, NOT_UTF8),
    ("tokenizer_config.json", "wrong kind", None, NOT_UTF8),
    ("vocab.json", "empty", None, NOT_JSON),
    ("vocab.json", "truncated", None, NOT_JSON),
    ("vocab.json", "flipped", None, NOT_UTF8),
    ("vocab.json", "wrong kind", None, NOT_UTF8),
    ("merges.txt", "empty", None, r"^error: {path}: no merges \(an empty file\)$"),
    # Cut inside its one merge ("Ġ t"): one token on the line.
    ("merges.txt", "truncated", -2, r"^error: {path}:2: not a merge of two tokens of .*vocab.json: "),
    ("merges.txt", "flipped", -2, NOT_UTF8),
    ("merges.txt", "wrong kind", None, r"^error: {path}: line 1: not UTF-8: byte 0x89"),
    ("sentencepiece", "empty", None, NOT_SENTENCEPIECE),
    ("sentencepiece", "truncated", None, NOT_SENTENCEPIECE),
    # A field's tag of the model's protobuf: it no longer parses.
    ("sentencepiece", "flipped", 0, NOT_SENTENCEPIECE),
    ("sentencepiece", "flipped", 40, Writes("a byte within a piece's text or score, or the normalizer's tables: "
                                            "another valid model, nothing can tell")),
    ("sentencepiece", "wrong kind", None, NOT_SENTENCEPIECE),
    ("megatron tiktoken", "empty", None, NOT_MEGATRON),
    ("megatron tiktoken", "truncated", None, NOT_MEGATRON),
    ("megatron tiktoken", "flipped", None, NOT_MEGATRON),
    ("megatron tiktoken", "wrong kind", None, NOT_MEGATRON),
    *((kind, "missing", None, r"^error: --(tokenizer-model|vocab-file|merge-file) {path}: no such file$")
      for kind in TOKENIZER_KINDS if kind != "tokenizer_config.json"),
    ("tokenizer_config.json", "missing", None, Writes("optional beside tokenizer.json: the end-of-document token is "
                                                      "then <|endoftext|>, refused if the tokenizer has none")),
]


TOKENIZER_WHERE = {("sentencepiece", 0): "a field's tag", ("sentencepiece", 40): "a piece's text"}


@pytest.mark.parametrize("kind, how, at, expected", TOKENIZER_CASES,
                         ids=[f"{c[0]}-{c[1]}-{c[2]}" for c in TOKENIZER_CASES])
def test_tokenizer_file(tmp_path, tools, tokenizer_files, byte_ranks, monkeypatch, capsys, kind, how, at, expected):
    shutil.copytree(tokenizer_files["hf"], tmp_path / "hf")
    shutil.copy(tokenizer_files["megatron"], tmp_path / "megatron.json")
    shutil.copy(tokenizer_files["sentencepiece"], tmp_path / "sp.model")
    shutil.copy(byte_ranks, tmp_path / "bytes.tiktoken")
    damaged, flags = TOKENIZER_KINDS[kind]
    damage(tmp_path / damaged, how, at)
    write_corpus(tmp_path / "corpus.jsonl", "jsonl")
    flags = [str(tmp_path / flag[1:]) if flag.startswith("@") else flag for flag in flags]
    with cell("tokenizer file", kind, how, TOKENIZER_WHERE.get((kind, at))) as outcome:
        status, stderr = run_main(tools["preprocess_data"], [
            "--input", tmp_path / "corpus.jsonl", "--output-prefix", tmp_path / "out" / "data", *flags,
            "--tokenizer-backend", "tokenizers"], monkeypatch, capsys)
        if isinstance(expected, Writes):
            assert status == 0, stderr
            outcome["accepted"] = expected.why
            return
        assert_refused(status, stderr, expected.format(path=name(tmp_path / damaged)), outcome)
    assert not os.path.exists(tmp_path / "out") or os.listdir(tmp_path / "out") == []


# ---------------------------------------------------------------------------------------------------------------
# Indexed datasets (.bin/.idx/.json) as training opens them, blends, and tools/merge_datasets.py's shards.

@pytest.fixture(scope="module")
def written_dataset(tmp_path_factory, tools, byte_ranks):
    directory = tmp_path_factory.mktemp("dataset")
    write_corpus(directory / "corpus.jsonl", "jsonl")
    tool = tools["preprocess_data"]
    tool.preprocess(tool.parse_args(["--input", str(directory / "corpus.jsonl"), "--output-prefix",
                                     str(directory / "out"), "--tokenizer-type", "TikTokenizer", "--tokenizer-model",
                                     byte_ranks, "--append-eod", "--tokenizer-backend", "tokenizers"]))
    return str(directory / "out_text_document")


def copy_dataset(source: str, prefix: str) -> str:
    for suffix in (".bin", ".idx", ".json"):
        shutil.copy(source + suffix, prefix + suffix)
    return prefix


# The .idx: a 34-byte header, then the int32 length and int64 pointer of each sequence, then the document indices.
SEQUENCES = len(DOCUMENTS)
IDX_LENGTH, IDX_POINTER = 34 + 9 * 4 + 1, 34 + SEQUENCES * 4 + 10 * 8 + 1
IDX_DOCUMENT = 34 + SEQUENCES * 12 + 10 * 8 + 7
IDX_WHERE = {IDX_LENGTH: "a sequence's length", IDX_POINTER: "a sequence's pointer", IDX_DOCUMENT: "a document index"}
DATASET_CASES = [
    (".bin", "empty", None, r"^{prefix}\.bin: 0 bytes, but {prefix}\.idx indexes \d+: truncated or corrupted$"),
    (".bin", "wrong kind", None, r"^{prefix}\.bin: \d+ bytes, but {prefix}\.idx indexes \d+: truncated or corrupted$"),
    (".bin", "missing", None, r"^{prefix}\.bin: no such file$"),
    (".bin", "flipped", 0, Writes("a token id changed within the vocabulary is a valid token: nothing can tell (an id "
                                  "past it: test_faults.py)")),
    (".idx", "empty", None, r"^{prefix}\.idx: truncated index \(0 bytes, header needs 34\)$"),
    (".idx", "wrong kind", None, r"^{prefix}\.idx: not a megatron-core index \(magic "),
    (".idx", "missing", None, r"^{prefix}\.idx: no such file$"),
    # A sequence's length (the 10th's high byte), then its pointer: the pointers no longer follow the lengths.
    (".idx", "flipped", IDX_LENGTH, r"^{prefix}\.idx: sequence 9 has \d+ tokens, but its pointers are \d+ "
                                        r"bytes apart: corrupted$"),
    (".idx", "flipped", IDX_POINTER, r"^{prefix}\.idx: sequence 9 has \d+ tokens, but its "
                                                          r"pointers are \d+ bytes apart: corrupted$"),
    # A document index (the 11th's high byte): out of order.
    (".idx", "flipped", IDX_DOCUMENT, r"^{prefix}\.idx: document indices out of order at "
                                                           r"document 10: corrupted$"),
    (".json", "empty", None, r"^{prefix}\.json: invalid dataset metadata: line 1 column 1: not JSON: "),
    (".json", "truncated", None, r"^{prefix}\.json: invalid dataset metadata: line \d+ column \d+: not JSON: "),
    (".json", "flipped", None, r"^{prefix}\.json: invalid dataset metadata: line \d+: not UTF-8: byte 0x"),
    (".json", "wrong kind", None, r"^{prefix}\.json: invalid dataset metadata: line 1: not UTF-8: byte 0x89"),
    (".json", "missing", None, r"^{prefix}\.json: no dataset metadata: give the tokenizer"),
]


@pytest.mark.parametrize("suffix, how, at, expected", DATASET_CASES,
                         ids=[f"{c[0]}-{c[1]}-{c[2]}" for c in DATASET_CASES])
def test_indexed_dataset(tmp_path, written_dataset, suffix, how, at, expected):
    """As the trainer opens its data (angpt.pretrain prints the error's one line: test_pretrain.py)."""
    prefix = copy_dataset(written_dataset, str(tmp_path / "data_text_document"))
    damage(prefix + suffix, how, at)
    data = DataSection(train_data_path=(prefix,), data_cache_path=str(tmp_path / "cache"))
    with cell("indexed dataset", suffix, how, IDX_WHERE.get(at) if suffix == ".idx" else None) as outcome:
        if isinstance(expected, Writes):
            assert dataset_vocabulary(data).vocab_size == 257
            outcome["accepted"] = expected.why
            return
        with pytest.raises(IndexedDatasetError) as error:
            dataset_vocabulary(data)
        outcome["line"] = str(error.value)
    assert "\n" not in str(error.value) and re.search(expected.format(prefix=name(prefix)), str(error.value)), \
        str(error.value)


TRAIN = ["--train-iters", "10", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "2"]
BLEND_CASES = [
    # (the damage, its values; what is refused)
    ("empty", [], r"--data-path: expected at least one argument"),
    # Cut after a weight, or a weight spelled wrong: Megatron-LM reads the values as prefixes without weights.
    ("truncated", ["0.5", "{a}", "0.5"], r"--data-path 0\.5: no 0\.5\.bin or 0\.5\.idx \(read as a prefix: "
                                         r"Megatron-LM reads an odd count of values"),
    ("flipped", ["0.5", "{a}", "0.5x", "{b}"], r"--data-path 0\.5: no 0\.5\.bin or 0\.5\.idx \(read as a prefix"),
    ("wrong kind", ["{a}", "0.5", "{b}", "0.5"], r"--data-path 0\.5: no 0\.5\.bin or 0\.5\.idx \(read as a prefix"),
    ("missing", ["1", "{a}", "1", "{missing}"],
     r"--data-path .*missing_text_document: no .*missing_text_document\.bin"),
    ("negative weight", ["0.5", "{a}", "-0.5", "{b}"],
     r"--data-path: the weight -0\.5 of .*b_text_document is not a finite number >= 0"),
    ("nan weight", ["0.5", "{a}", "nan", "{b}"],
     r"--data-path: the weight nan of .*b_text_document is not a finite number >= 0"),
    ("zero weights", ["0", "{a}", "0", "{b}"], r"--data-path: the weights sum to 0"),
]


@pytest.mark.parametrize("how, values, expected", BLEND_CASES, ids=[case[0] for case in BLEND_CASES])
def test_blend(tmp_path, written_dataset, capsys, how, values, expected):
    paths = {key: copy_dataset(written_dataset, str(tmp_path / f"{key}_text_document")) for key in "ab"}
    paths["missing"] = str(tmp_path / "missing_text_document")
    with cell("blend", "--data-path weights and prefixes", how) as outcome:
        with pytest.raises(SystemExit) as exit:
            parse_args([*TRAIN, "--data-path", *(value.format(**paths) for value in values)])
        error = capsys.readouterr().err
        outcome["line"] = error.strip()
    assert exit.value.code == 2
    assert len(error.splitlines()) == 1 and re.search(expected, error), error


SHARD_FILES = {".bin": "1.bin", ".idx": "1.idx", ".json": "1.json"}
MERGE_CASES = [
    (".bin", "empty", r"^error: {shard}\.bin: 0 bytes, but {shard}\.idx indexes \d+: truncated or corrupted$"),
    (".bin", "truncated", r"^error: {shard}\.bin: \d+ bytes, but {shard}\.idx indexes \d+: truncated or corrupted$"),
    (".bin", "flipped", Writes("a token id changed within the vocabulary is a valid token: nothing can tell")),
    (".bin", "wrong kind", r"^error: {shard}\.bin: \d+ bytes, but {shard}\.idx indexes \d+: truncated or corrupted$"),
    (".bin", "missing", r"^error: {shard}\.idx: no \.bin beside it$"),
    (".idx", "empty", r"^error: {shard}\.idx: truncated index"),
    (".idx", "truncated", r"^error: {shard}\.idx: \d+ bytes, but its header's"),
    (".idx", "flipped", r"^error: {shard}\.idx: sequence 9 has \d+ tokens, but its pointers are \d+ bytes apart: "
                        r"corrupted$"),
    (".idx", "wrong kind", r"^error: {shard}\.idx: not a megatron-core index"),
    (".idx", "missing", r"^error: {shard}\.bin: no \.idx beside it$"),
    (".json", "empty", r"^error: {shard}\.json: invalid dataset metadata: line 1 column 1: not JSON"),
    (".json", "truncated", r"^error: {shard}\.json: invalid dataset metadata: line \d+ column \d+: not JSON"),
    (".json", "flipped", r"^error: {shard}\.json: invalid dataset metadata: line \d+: not UTF-8"),
    (".json", "wrong kind", r"^error: {shard}\.json: invalid dataset metadata: line 1: not UTF-8: byte 0x89"),
    (".json", "missing", r"^error: {shard}: no \.json beside its \.bin/\.idx, which the other datasets have$"),
]


@pytest.mark.parametrize("suffix, how, expected", MERGE_CASES, ids=[f"{c[0]}-{c[1]}" for c in MERGE_CASES])
def test_merge_datasets_shard(tmp_path, tools, written_dataset, monkeypatch, capsys, suffix, how, expected):
    (tmp_path / "shards").mkdir()
    (tmp_path / "out").mkdir()
    for shard in ("0", "1"):
        copy_dataset(written_dataset, str(tmp_path / "shards" / shard))
    damage(tmp_path / "shards" / f"1{suffix}", how, IDX_LENGTH if suffix == ".idx" else None)
    with cell("tools/merge_datasets.py shard", suffix, how) as outcome:
        status, stderr = run_main(tools["merge_datasets"], ["--input", tmp_path / "shards", "--output-prefix",
                                                            tmp_path / "out" / "merged"], monkeypatch, capsys)
        if isinstance(expected, Writes):
            assert status == 0, stderr
            outcome["accepted"] = expected.why
            return
        assert_refused(status, stderr, expected.format(shard=name(tmp_path / "shards" / "1")), outcome)
    assert os.listdir(tmp_path / "out") == []


# ---------------------------------------------------------------------------------------------------------------
# --config YAML (the trainer's parser.error: one line, exit status 2).

YAML_CASES = [
    ("empty", None, Writes("an empty YAML document sets no flag: the command line's flags stand")),
    ("truncated", 20, r"--config {path}: line \d+ column \d+: not valid YAML: "),
    ("flipped", None, r"--config {path}: line \d+ column \d+: not valid YAML: .*not UTF-8"),
    ("wrong kind", None, r"--config {path}: line 1 column 1: not valid YAML: .*not UTF-8"),
    ("missing", None, r"--config {path}: No such file or directory"),
]


@pytest.mark.parametrize("how, at, expected", YAML_CASES, ids=[case[0] for case in YAML_CASES])
def test_yaml_config(tmp_path, capsys, monkeypatch, how, at, expected):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    path = tmp_path / "run.yaml"
    path.write_text("model-family: ngpt\nnum-layers: 2\nhidden-size: 64\nmock-data: true\nvocab-size: 256\n")
    damage(path, how, at)
    flags = ["--config", str(path), *TRAIN, "--mock-data", "--vocab-size", "256"]
    with cell("--config YAML", "run.yaml", how) as outcome:
        if isinstance(expected, Writes):
            assert parse_args(flags).model.num_layers == 2
            outcome["accepted"] = expected.why
            return
        with pytest.raises(SystemExit):
            parse_args(flags)
        error = capsys.readouterr().err
        outcome["line"] = error.strip()
    assert len(error.splitlines()) == 1 and re.search(expected.format(path=name(path)), error), error


# ---------------------------------------------------------------------------------------------------------------
# The Hugging Face directory tools/convert_from_hf.py imports. Every damage is found before anything is written
# under --save. A flipped byte among a tensor's values is another valid number: nothing can tell.

@pytest.fixture(scope="module")
def hf_directory(tmp_path_factory):
    import torch  # noqa: PLC0415
    from safetensors.torch import save_file  # noqa: PLC0415

    directory = tmp_path_factory.mktemp("hf_model")
    with open(directory / "config.json", "w") as file:
        json.dump({"model_type": "qwen3", "num_hidden_layers": 1, "hidden_size": 64, "num_attention_heads": 4,
                   "num_key_value_heads": 4, "intermediate_size": 128, "max_position_embeddings": 64,
                   "vocab_size": 258, "eos_token_id": 257, "tie_word_embeddings": True}, file, indent=2)
    # A whole Qwen3 layer, so that an intact directory imports.
    layer = {"self_attn.q_proj": (64, 64), "self_attn.k_proj": (64, 64), "self_attn.v_proj": (64, 64),
             "self_attn.o_proj": (64, 64), "self_attn.q_norm": (16,), "self_attn.k_norm": (16,),
             "input_layernorm": (64,), "post_attention_layernorm": (64,), "mlp.gate_proj": (128, 64),
             "mlp.up_proj": (128, 64), "mlp.down_proj": (64, 128)}
    weights = {"model.embed_tokens.weight": torch.zeros(258, 64), "model.norm.weight": torch.ones(64),
               **{f"model.layers.0.{key}.weight": torch.full(shape, 0.01) for key, shape in layer.items()}}
    save_file(weights, directory / "model.safetensors")
    write_hf_tokenizer(directory / "tokenizer")
    shutil.move(directory / "tokenizer" / "tokenizer.json", directory / "tokenizer.json")
    shutil.rmtree(directory / "tokenizer")
    # The same weights in two shards and their index, as larger models are published.
    sharded = tmp_path_factory.mktemp("hf_sharded")
    for file in ("config.json", "tokenizer.json"):
        shutil.copy(directory / file, sharded / file)
    weight_map = {key: f"model-0000{1 + ('layers' in key)}-of-00002.safetensors" for key in weights}
    for file in set(weight_map.values()):
        save_file({key: tensor for key, tensor in weights.items() if weight_map[key] == file}, sharded / file)
    with open(sharded / "model.safetensors.index.json", "w") as file:
        json.dump({"metadata": {}, "weight_map": weight_map}, file, indent=2)
    # Another model's weights: the same names at hidden size 32.
    other = tmp_path_factory.mktemp("hf_other") / "model.safetensors"
    save_file({key: torch.zeros([32 if size == 64 else size for size in tensor.shape]) for key, tensor in
               weights.items()}, other)
    # Query rows that the config's 4 heads do not split.
    heads = tmp_path_factory.mktemp("hf_heads") / "model.safetensors"
    save_file({**weights, "model.layers.0.self_attn.q_proj.weight": torch.zeros(30, 64)}, heads)
    # The embedding with as many rows as the vocabulary padded for the model (258 to 384), and one more.
    rows = {}
    for count in (PADDED_ROWS, PADDED_ROWS + 1):
        rows[count] = tmp_path_factory.mktemp(f"hf_rows{count}") / "model.safetensors"
        save_file({**weights, "model.embed_tokens.weight": torch.zeros(count, 64)}, rows[count])
    return {"single": directory, "sharded": sharded, "other": other, "heads": heads, "rows": rows}


PADDED_ROWS = 384  # the vocabulary of 258 padded to a multiple of 128 (--make-vocab-size-divisible-by)
NOT_SAFETENSORS = r"^convert_from_hf: {path}: not a safetensors file: "
INDEX = "model.safetensors.index.json"
OTHER, HEADS = "other", "heads"  # valid files of another model: at another width, or with other heads
SHARD = "model-00002-of-00002.safetensors"
HF_CASES = [
    ("config.json", "empty", None, r"^convert_from_hf: {path}: line 1 column 1: not JSON: "),
    ("config.json", "truncated", None, r"^convert_from_hf: {path}: line \d+ column \d+: not JSON: "),
    ("config.json", "flipped", None, r"^convert_from_hf: {path}: line \d+: not UTF-8: byte 0x"),
    ("config.json", "wrong kind", None, r"^convert_from_hf: {path}: line 1: not UTF-8: byte 0x89"),
    ("config.json", "missing", None, r"^convert_from_hf: {directory} is not a Hugging Face model directory: it has "
                                     r"no config\.json$"),
    ("model.safetensors", "empty", None, NOT_SAFETENSORS),
    ("model.safetensors", "truncated", None, NOT_SAFETENSORS),
    ("model.safetensors", "flipped", 20, NOT_SAFETENSORS),
    ("model.safetensors", "flipped", -5, Writes("a byte among a tensor's values is another valid number: nothing can "
                                                "tell (safetensors has no checksum)")),
    ("model.safetensors", "wrong kind", None, NOT_SAFETENSORS),
    ("model.safetensors", "missing", None, r"^convert_from_hf: {directory} has no safetensors weights"),
    (INDEX, "empty", None, r"^convert_from_hf: {path}: line 1 column 1: not JSON: "),
    (INDEX, "truncated", None, r"^convert_from_hf: {path}: line \d+ column \d+: not JSON: "),
    (INDEX, "flipped", None, r"^convert_from_hf: {path}: line \d+: not UTF-8: byte 0x"),
    (INDEX, "wrong kind", None, r"^convert_from_hf: {path}: line 1: not UTF-8: byte 0x89"),
    (INDEX, "missing", None, r"^convert_from_hf: {directory} has no safetensors weights"),
    (SHARD, "empty", None, NOT_SAFETENSORS),
    (SHARD, "truncated", None, NOT_SAFETENSORS),
    (SHARD, "flipped", 20, NOT_SAFETENSORS),
    (SHARD, "wrong kind", None, NOT_SAFETENSORS),
    (SHARD, "missing", None, r"^convert_from_hf: {path}: no such file \(its index names it\)$"),
    # A valid file of another model: at hidden size 32, or the other shard's tensors in this one's place.
    ("model.safetensors", "wrong kind", OTHER, r"^convert_from_hf: {directory}: its tensors do not fit the model its "
                                               r"config\.json describes \(.*\): embedding\.word_embeddings\.weight "
                                               r"\(258, 32\), the model's \(\d+, 64\); "),
    ("model.safetensors", "wrong kind", HEADS, r"^convert_from_hf: {directory}: its tensors do not fit the model its "
                                               r"config\.json describes \(.*\): shape '\[4, -1, 64\]' is invalid "
                                               r"for input of size 1920$"),
    (SHARD, "wrong kind", OTHER, r"^convert_from_hf: {directory}: its safetensors files have no tensor "
                                 r"model\.layers\.0\.self_attn\.\w+\.weight, which its config\.json's model has$"),
    ("tokenizer.json", "empty", None, r"^convert_from_hf: {path}: not a Hugging Face tokenizer: "),
    ("tokenizer.json", "truncated", None, r"^convert_from_hf: {path}: not a Hugging Face tokenizer: EOF while "
                                          r"parsing .*line"),
    ("tokenizer.json", "flipped", None, r"^convert_from_hf: {path}: line \d+: not UTF-8"),
    ("tokenizer.json", "wrong kind", None, r"^convert_from_hf: {path}: line 1: not UTF-8"),
    ("tokenizer.json", "missing", None, Writes("a model directory may have no tokenizer.json (a SentencePiece "
                                               "tokenizer.model, or none): the checkpoint records no tokenizer")),
]
HF_WHERE = {20: "in its JSON header", -5: "in a tensor's values", OTHER: "another model's weights",
            HEADS: "query rows the config's heads do not split"}


@pytest.mark.parametrize("damaged, how, at, expected", HF_CASES, ids=[f"{c[0]}-{c[1]}-{c[2]}" for c in HF_CASES])
def test_hf_directory(tmp_path, tools, hf_directory, monkeypatch, capsys, damaged, how, at, expected):
    directory = tmp_path / "hf"
    shutil.copytree(hf_directory["sharded" if damaged in (INDEX, SHARD) else "single"], directory)
    if at in (OTHER, HEADS):
        shutil.copy(hf_directory[at] if damaged == "model.safetensors" else
                    directory / "model-00001-of-00002.safetensors", directory / damaged)
    else:
        damage(directory / damaged, how, at % os.path.getsize(directory / damaged) if at else None)
    kind = "model-0000N-of-0000M.safetensors" if damaged == SHARD else damaged
    with cell("Hugging Face directory (tools/convert_from_hf.py)", kind, how, HF_WHERE.get(at)) as outcome:
        status, stderr = run_main(tools["convert_from_hf"], ["--input", directory, "--save", tmp_path / "save"],
                                  monkeypatch, capsys)
        if isinstance(expected, Writes):
            assert status == 0 and os.path.isdir(tmp_path / "save" / "iter_0000000"), stderr
            outcome["accepted"] = expected.why
            return
        assert_refused(status, stderr, expected.format(path=name(directory / damaged), directory=name(directory)),
                       outcome)
    assert not os.path.exists(tmp_path / "save")


# ---------------------------------------------------------------------------------------------------------------
# On torchrun (tests/test_bad_inputs_torchrun.py): a save's refusal that every rank raised is said by rank 0 alone.

class FailingTrainer:
    """A trainer whose run raises `error`."""

    def __init__(self, error: Exception):
        self.error = error

    def run(self):
        raise self.error


@pytest.mark.parametrize("every_rank, rank, said", [(True, "0", True), (True, "1", False), (False, "1", True)])
def test_a_save_refused_on_every_rank_is_said_by_rank_0_alone(monkeypatch, capsys, every_rank, rank, said):
    """A verdict rank 0 broadcast (every_rank) once, by rank 0; a rank's own failure by the rank that met it."""
    error = CheckpointError("no space left in run for the checkpoint of iteration 4", every_rank=every_rank)
    monkeypatch.setattr(trainer, "Trainer", lambda config: FailingTrainer(error))
    monkeypatch.setenv("RANK", rank)
    assert trainer.pretrain(None) == 1
    assert capsys.readouterr().err == (f"angpt.pretrain: {error}\n" if said else "")


@pytest.mark.parametrize("rows", [PADDED_ROWS, PADDED_ROWS + 1])
def test_an_imported_vocabulary_has_at_most_the_padded_rows(tmp_path, tools, hf_directory, monkeypatch, capsys, rows):
    """The embedding's rows beyond the config's vocabulary are padding's, up to the model's padded size."""
    directory = tmp_path / "hf"
    shutil.copytree(hf_directory["single"], directory)
    shutil.copy(hf_directory["rows"][rows], directory / "model.safetensors")
    status, stderr = run_main(tools["convert_from_hf"], ["--input", directory, "--save", tmp_path / "save"],
                              monkeypatch, capsys)
    if rows == PADDED_ROWS:
        assert status == 0, stderr
        return
    assert_refused(status, stderr, rf"^convert_from_hf: {name(directory)}: its tensors do not fit the model its "
                   rf"config\.json describes \(.*\): embedding\.word_embeddings\.weight \(385, 64\), the model's "
                   rf"\(384, 64\)$", {})
    assert not os.path.exists(tmp_path / "save")


# The cases whose test is another module's (the docstring's list).
ELSEWHERE = [
    Elsewhere("preprocessing input", ".parquet", "wrong kind",
              "tests/test_preprocess_data.py::test_parquet_column_errors_name_the_file_and_column"),
    Elsewhere("indexed dataset", ".bin", "truncated", "tests/test_preprocess_data.py::test_truncated_bin_is_named, "
              "tests/test_pretrain.py::test_a_truncated_dataset_is_refused_when_training_opens_it"),
    Elsewhere("indexed dataset", ".idx", "truncated", "tests/test_preprocess_data.py::test_corrupted_idx_is_named"),
]


def test_the_matrix_covers_every_damage():
    """Each kind meets each damage here or in the test ELSEWHERE names."""
    elsewhere = {(case.kind, case.damage) for case in ELSEWHERE}
    for group, cases in (("preprocessing input", CORPUS_CASES), ("tokenizer file", TOKENIZER_CASES),
                         ("indexed dataset", DATASET_CASES), ("tools/merge_datasets.py shard", MERGE_CASES),
                         ("Hugging Face directory", HF_CASES)):
        kinds = {case[0] if group != "preprocessing input" else f".{case[0]}" for case in cases}
        covered = {(kind if group != "preprocessing input" else f".{kind}", how) for kind, how, *_ in cases}
        missing = {(kind, how) for kind in kinds for how in DAMAGES} - covered - elsewhere
        assert missing == set(), group
    assert {case[0] for case in BLEND_CASES} >= set(DAMAGES)
    assert {case[0] for case in YAML_CASES} == set(DAMAGES)
    for case in ELSEWHERE:
        record_elsewhere(case)
