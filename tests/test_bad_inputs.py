"""Bad inputs, one matrix (issue 51): every kind of data-side file angpt reads (the preprocessing tool's corpora,
tokenizer files of each type, indexed datasets and blends, tools/merge_datasets.py's shards, --config YAML, the
Hugging Face directory tools/convert_from_hf.py imports) x each damage (empty, truncated, a flipped byte, the wrong
kind of file, missing). Each refused case ends in one line that names the file (and its line where it has
lines), with no traceback, nothing written under the output names and no process left behind.

The tools' main() runs in this process (a traceback would be an exception escaping it, which fails the test), so
the module stays fast; one subprocess checks the command line itself. Rows marked WRITES are damage the input
cannot reveal (a .txt cut at a character boundary holds text all the same); the comments say why. Checkpoints
have their own matrix (tests/test_checkpoint_integrity.py). Cases tested elsewhere are referred to, not repeated:
- a missing corpus, a glob matching nothing, a directory: test_preprocess_data.py::test_missing_inputs_are_clear_errors
- a Parquet file that is not Parquet: test_preprocess_data.py::test_parquet_column_errors_name_the_file_and_column
- a bad line of a .jsonl (not JSON, not UTF-8, ...): test_preprocess_data.py::test_bad_line_stops_with_file_and_line
- a truncated .bin, a truncated .idx and one whose header is corrupted (magic, version, dtype, counts), a .json
  that is not JSON or disagrees with the .bin/.idx: test_preprocess_data.py::test_truncated_bin_is_named,
  ::test_corrupted_idx_is_named, ::test_metadata_errors_name_the_file; the trainer's one line for them:
  test_pretrain.py::test_a_truncated_dataset_is_refused_when_training_opens_it
- a tokenizer file changed since the dataset was written (its sha256):
  test_preprocess_data.py::test_metadata_is_checked_against_the_tokenizer_it_names
- a token id past the vocabulary (a flipped high byte in a .bin): test_faults.py, at opening
  (::test_token_ids_beyond_the_vocabulary_stop_a_tensor_parallel_run_before_it_trains) and in the batches
  (check_batch_token_ids: ::test_a_max_token_id_that_understates_the_bin_is_caught_by_the_batches)
- a missing tokenizer file: test_tokenizers.py::test_missing_files_and_flags_are_named
- a --config file that is not YAML or holds unknown keys or bad values:
  test_pretrain.py::test_a_bad_config_file_is_refused_by_name
"""

import base64
import gzip
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys

import psutil
import pyarrow
import pyarrow.parquet
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from angpt.config.arguments import parse_args
from angpt.config.sections import DataSection
from angpt.data.gpt_datasets import dataset_vocabulary
from angpt.data.indexed import IndexedDatasetError

from conftest import ROOT, write_megatron_tiktoken

# The start of a PNG image, then bytes of every value: the wrong kind of file under each name.
PNG = bytes.fromhex("89504e470d0a1a0a0000000d49484452") + bytes(range(256)) * 2
DAMAGES = ("empty", "truncated", "flipped", "wrong kind", "missing")
WRITES = "writes"  # the damage cannot be seen in the file: the run succeeds


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
    assert left == []  # no worker left behind
    return status, capsys.readouterr().err


def assert_refused(status, stderr: str, pattern: str) -> str:
    """The tool exited with one line (sys.exit's message) that matches pattern."""
    assert isinstance(status, str), f"exit status {status!r}, stderr:\n{stderr}"
    assert "\n" not in status.strip() and "Traceback" not in stderr, status
    assert re.search(pattern, status), status
    return status


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


@pytest.fixture(scope="module")
def byte_ranks(tmp_path_factory):
    return write_byte_ranks(tmp_path_factory.mktemp("ranks") / "bytes.tiktoken")


CORPUS_CASES = [
    # An empty file holds no document: it is said, by name, and the others are written.
    ("jsonl", "empty", None, (WRITES, r"^warning: {path}: an empty file$")),
    ("jsonl", "truncated", None, r"^error: {path}:\d+: not JSON: .* \(--skip-bad-lines skips such lines\)$"),
    ("jsonl", "flipped", None, r"^error: {path}:\d+: not UTF-8: byte 0x[0-9a-f]{{2}} "),
    ("jsonl", "wrong kind", None, r"^error: {path}:1: not UTF-8: byte 0x89 "),
    ("jsonl.gz", "empty", None, (WRITES, r"^warning: {path}: an empty file$")),
    ("jsonl.gz", "truncated", None, r"^error: {path}: truncated: its gzip data ends early \(after line \d+\)$"),
    ("jsonl.gz", "flipped", None, r"^error: {path}: not readable gzip data \(.*; after line \d+\)$"),
    ("jsonl.gz", "wrong kind", None, r"^error: {path}: not readable gzip data \(Not a gzipped file .*after line 0\)$"),
    ("txt", "empty", None, (WRITES, r"^warning: {path}: an empty file$")),
    # A .txt cut between characters is text all the same: nothing shows that it was cut.
    ("txt", "truncated", 100, (WRITES, None)),
    ("txt", "flipped", None, r"^error: {path}:\d+: not UTF-8: byte 0x[0-9a-f]{{2}} "),
    ("txt", "wrong kind", None, r"^error: {path}:1: not UTF-8: byte 0x89 "),
    ("parquet", "empty", None, r"^error: {path}: not a readable Parquet file: "),
    ("parquet", "truncated", None, r"^error: {path}: not a readable Parquet file: "),
    # In the page of strings (written dictionary-encoded and compressed by default).
    ("parquet", "flipped", 300, r"^error: {path}, rows from 0: a --json-keys column is not UTF-8: byte 0x"),
]


@pytest.mark.parametrize("kind, how, at, expected", CORPUS_CASES, ids=[f"{c[0]}-{c[1]}" for c in CORPUS_CASES])
def test_corpus(tmp_path, tools, byte_ranks, monkeypatch, capsys, kind, how, at, expected):
    good, path = tmp_path / "good.jsonl", tmp_path / f"corpus.{kind}"
    write_corpus(good, "jsonl")
    write_corpus(path, kind)
    damage(path, how, at)
    out = tmp_path / "out"
    status, stderr = run_main(tools["preprocess_data"], [
        "--input", good, path, "--output-prefix", out / "data", "--tokenizer-type", "TikTokenizer",
        "--tokenizer-model", byte_ranks, "--tokenizer-backend", "tokenizers"], monkeypatch, capsys)
    if isinstance(expected, tuple):
        assert status == 0, stderr
        warning = expected[1]
        if warning:
            assert any(re.search(warning.format(path=name(path)), line) for line in stderr.splitlines()), stderr
        assert sorted(os.listdir(out)) == [f"data_text_document{suffix}" for suffix in (".bin", ".idx", ".json")]
        return
    assert_refused(status, stderr, expected.format(path=name(path)))
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
    # Within a piece's text or score, or the normalizer's tables: another valid model, nothing can tell.
    ("sentencepiece", "flipped", 40, WRITES),
    ("sentencepiece", "wrong kind", None, NOT_SENTENCEPIECE),
    ("megatron tiktoken", "empty", None, NOT_MEGATRON),
    ("megatron tiktoken", "truncated", None, NOT_MEGATRON),
    ("megatron tiktoken", "flipped", None, NOT_MEGATRON),
    ("megatron tiktoken", "wrong kind", None, NOT_MEGATRON),
]


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
    status, stderr = run_main(tools["preprocess_data"], [
        "--input", tmp_path / "corpus.jsonl", "--output-prefix", tmp_path / "out" / "data", *flags,
        "--tokenizer-backend", "tokenizers"], monkeypatch, capsys)
    if expected == WRITES:
        assert status == 0, stderr
        return
    assert_refused(status, stderr, expected.format(path=name(tmp_path / damaged)))
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
DATASET_CASES = [
    (".bin", "empty", None, r"^{prefix}\.bin: 0 bytes, but {prefix}\.idx indexes \d+: truncated or corrupted$"),
    (".bin", "wrong kind", None, r"^{prefix}\.bin: \d+ bytes, but {prefix}\.idx indexes \d+: truncated or corrupted$"),
    (".bin", "missing", None, r"^{prefix}\.bin: no such file$"),
    # A token id changed within the vocabulary is a valid token: nothing can tell (an id past it: test_faults.py).
    (".bin", "flipped", 0, WRITES),
    (".idx", "empty", None, r"^{prefix}\.idx: truncated index \(0 bytes, header needs 34\)$"),
    (".idx", "wrong kind", None, r"^{prefix}\.idx: not a megatron-core index \(magic "),
    (".idx", "missing", None, r"^{prefix}\.idx: no such file$"),
    # A sequence's length (the 10th's high byte), then its pointer: the pointers no longer follow the lengths.
    (".idx", "flipped", 34 + 9 * 4 + 1, r"^{prefix}\.idx: sequence 9 has \d+ tokens, but its pointers are \d+ "
                                        r"bytes apart: corrupted$"),
    (".idx", "flipped", 34 + SEQUENCES * 4 + 10 * 8 + 1, r"^{prefix}\.idx: sequence 9 has \d+ tokens, but its "
                                                          r"pointers are \d+ bytes apart: corrupted$"),
    # A document index (the 11th's high byte): out of order.
    (".idx", "flipped", 34 + SEQUENCES * 12 + 10 * 8 + 7, r"^{prefix}\.idx: document indices out of order at "
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
    if expected == WRITES:
        assert dataset_vocabulary(data).vocab_size == 257
        return
    with pytest.raises(IndexedDatasetError) as error:
        dataset_vocabulary(data)
    assert "\n" not in str(error.value) and re.search(expected.format(prefix=name(prefix)), str(error.value)), \
        str(error.value)


TRAIN = ["--train-iters", "10", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "2"]
BLEND_CASES = [
    # A blend cut after a weight: weight/prefix pairs no longer.
    (["0.5", "{a}", "0.5"], r"--data-path takes one prefix or weight/prefix pairs"),
    (["0.5", "{a}", "0.5x", "{b}"], r"--data-path takes one prefix or weight/prefix pairs"),
    (["0.5", "{a}", "-0.5", "{b}"], r"--data-path: the weight -0\.5 of .*b_text_document is not a finite number >= 0"),
    (["0.5", "{a}", "nan", "{b}"], r"--data-path: the weight nan of .*b_text_document is not a finite number >= 0"),
    (["0", "{a}", "0", "{b}"], r"--data-path: the weights sum to 0"),
    (["1", "{a}", "1", "{missing}"], r"--data-path .*missing_text_document: no .*missing_text_document\.bin"),
]


@pytest.mark.parametrize("values, expected", BLEND_CASES, ids=["truncated", "weight not a number", "negative weight",
                                                               "nan weight", "zero weights", "missing prefix"])
def test_blend(tmp_path, written_dataset, capsys, values, expected):
    paths = {key: copy_dataset(written_dataset, str(tmp_path / f"{key}_text_document")) for key in "ab"}
    paths["missing"] = str(tmp_path / "missing_text_document")
    with pytest.raises(SystemExit) as exit:
        parse_args([*TRAIN, "--data-path", *(value.format(**paths) for value in values)])
    assert exit.value.code == 2
    error = capsys.readouterr().err
    assert len(error.splitlines()) == 1 and re.search(expected, error), error


MERGE_CASES = [
    ("1.idx", "empty", r"^error: {shard}\.idx: truncated index"),
    ("1.idx", "truncated", r"^error: {shard}\.idx: \d+ bytes, but its header's"),
    ("1.idx", "wrong kind", r"^error: {shard}\.idx: not a megatron-core index"),
    ("1.idx", "missing", r"^error: {shard}\.bin: no \.idx beside it$"),
    ("1.bin", "truncated", r"^error: {shard}\.bin: \d+ bytes, but {shard}\.idx indexes \d+: truncated or corrupted$"),
    ("1.json", "flipped", r"^error: {shard}\.json: invalid dataset metadata: line \d+: not UTF-8"),
    ("1.json", "empty", r"^error: {shard}\.json: invalid dataset metadata: line 1 column 1: not JSON"),
]


@pytest.mark.parametrize("damaged, how, expected", MERGE_CASES, ids=[f"{c[0]}-{c[1]}" for c in MERGE_CASES])
def test_merge_datasets_shard(tmp_path, tools, written_dataset, monkeypatch, capsys, damaged, how, expected):
    (tmp_path / "shards").mkdir()
    (tmp_path / "out").mkdir()
    for shard in ("0", "1"):
        copy_dataset(written_dataset, str(tmp_path / "shards" / shard))
    damage(tmp_path / "shards" / damaged, how)
    status, stderr = run_main(tools["merge_datasets"], ["--input", tmp_path / "shards", "--output-prefix",
                                                        tmp_path / "out" / "merged"], monkeypatch, capsys)
    assert_refused(status, stderr, expected.format(shard=name(tmp_path / "shards" / "1")))
    assert os.listdir(tmp_path / "out") == []


# ---------------------------------------------------------------------------------------------------------------
# --config YAML (the trainer's parser.error: one line, exit status 2).

YAML_CASES = [
    ("empty", None, None),  # an empty file sets no flag: the command line's stand
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
    if expected is None:
        assert parse_args(flags).model.num_layers == 2
        return
    with pytest.raises(SystemExit):
        parse_args(flags)
    error = capsys.readouterr().err
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
                   "vocab_size": 258, "eos_token_id": 257}, file, indent=2)
    save_file({"model.embed_tokens.weight": torch.zeros(258, 64), "model.norm.weight": torch.ones(64)},
              directory / "model.safetensors")
    write_hf_tokenizer(directory / "tokenizer")
    shutil.move(directory / "tokenizer" / "tokenizer.json", directory / "tokenizer.json")
    shutil.rmtree(directory / "tokenizer")
    return directory


HF_CASES = [
    ("config.json", "empty", r"^convert_from_hf: {path}: line 1 column 1: not JSON: "),
    ("config.json", "truncated", r"^convert_from_hf: {path}: line \d+ column \d+: not JSON: "),
    ("config.json", "flipped", r"^convert_from_hf: {path}: line \d+: not UTF-8: byte 0x"),
    ("config.json", "wrong kind", r"^convert_from_hf: {path}: line 1: not UTF-8: byte 0x89"),
    ("config.json", "missing", r"^convert_from_hf: {directory} is not a Hugging Face model directory: it has no "
                               r"config\.json$"),
    ("model.safetensors", "empty", r"^convert_from_hf: {path}: not a safetensors file: "),
    ("model.safetensors", "truncated", r"^convert_from_hf: {path}: not a safetensors file: "),
    ("model.safetensors", "flipped", r"^convert_from_hf: {path}: not a safetensors file: "),  # in its JSON header
    ("model.safetensors", "wrong kind", r"^convert_from_hf: {path}: not a safetensors file: "),
    ("model.safetensors", "missing", r"^convert_from_hf: {directory} has no safetensors weights"),
    ("tokenizer.json", "empty", r"^convert_from_hf: {path}: not a Hugging Face tokenizer: "),
    ("tokenizer.json", "flipped", r"^convert_from_hf: {path}: line \d+: not UTF-8"),
    ("tokenizer.json", "wrong kind", r"^convert_from_hf: {path}: line 1: not UTF-8"),
]


@pytest.mark.parametrize("damaged, how, expected", HF_CASES, ids=[f"{c[0]}-{c[1]}" for c in HF_CASES])
def test_hf_directory(tmp_path, tools, hf_directory, monkeypatch, capsys, damaged, how, expected):
    directory = tmp_path / "hf"
    shutil.copytree(hf_directory, directory)
    damage(directory / damaged, how, 20 if damaged == "model.safetensors" and how == "flipped" else None)
    status, stderr = run_main(tools["convert_from_hf"], ["--input", directory, "--save", tmp_path / "save"],
                              monkeypatch, capsys)
    assert_refused(status, stderr, expected.format(path=name(directory / damaged), directory=name(directory)))
    assert not os.path.exists(tmp_path / "save")


def test_the_matrix_covers_every_damage():
    """Each kind meets each damage here or in the test the module's docstring names."""
    assert {case[1] for case in CORPUS_CASES} | {"missing"} == set(DAMAGES)
    assert {case[1] for case in TOKENIZER_CASES} | {"missing"} == set(DAMAGES)
    assert {case[1] for case in DATASET_CASES} | {"truncated"} == set(DAMAGES)
    assert {case[1] for case in HF_CASES} == set(DAMAGES)
    assert {case[0] for case in YAML_CASES} == set(DAMAGES)
