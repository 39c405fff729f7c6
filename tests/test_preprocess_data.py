"""tools/preprocess_data.py and angpt.data.indexed: bytes on disk, equivalence across workers and partitions,
sentence splitting, Parquet input, bad input, and the checks the trainer runs before reading a dataset."""

import base64
import gzip
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys

import numpy
import pyarrow
import pyarrow.parquet
import pytest
from megatron.core.datasets.indexed_dataset import DType, IndexedDataset, IndexedDatasetBuilder
from nltk.tokenize.punkt import PunktLanguageVars, PunktSentenceTokenizer

from angpt.config.sections import DataSection
from angpt.data.corpus import Record
from angpt.data.gpt_datasets import dataset_vocabulary
from angpt.data.indexed import IndexedDatasetError, check_indexed_dataset, read_metadata
from angpt.data.tokenizers import build_tokenizer

from conftest import ROOT, load_benchmark, megatron_tokenizer, write_megatron_tiktoken

TOOL = os.path.join(ROOT, "tools", "preprocess_data.py")
GOLDEN_IDX = bytes.fromhex(
    "4d4d49444944580000 0100000000000000 08 0200000000000000 0300000000000000 03000000 02000000"
    " 0000000000000000 0600000000000000 0000000000000000 0100000000000000 0200000000000000".replace(" ", ""))
# Megatron-LM's tools/preprocess_data.py on "", "ab", "c<|endoftext|>", "" with --append-eod and the byte tokenizer
# (id = byte, EOD 256): an empty text is add_document([], []), a document index and no sequence (5 documents,
# 2 sequences, document indices 0 0 1 2 2), and "<|endoftext|>" in the text is the EOD (sequence lengths 3 and 3).
GOLDEN_EMPTY_IDX = bytes.fromhex(
    "4d4d49444944580000 0100000000000000 08 0200000000000000 0500000000000000 03000000 03000000"
    " 0000000000000000 0600000000000000"
    " 0000000000000000 0000000000000000 0100000000000000 0200000000000000 0200000000000000".replace(" ", ""))
GOLDEN_EMPTY_BIN = bytes([97, 0, 98, 0, 0, 1, 99, 0, 0, 1, 0, 1])
# The same with --special-tokens-as-text: "<|endoftext|>" is its 13 bytes (sequence lengths 3 and 15).
GOLDEN_AS_TEXT_IDX = GOLDEN_EMPTY_IDX.replace(bytes.fromhex("03000000 03000000"), bytes.fromhex("03000000 0f000000"))
GOLDEN_AS_TEXT_BIN = bytes([97, 0, 98, 0, 0, 1, 99, 0]) + b"".join(bytes([byte, 0]) for byte in b"<|endoftext|>") \
    + bytes([0, 1])


def load_tool():
    spec = importlib.util.spec_from_file_location("preprocess_data", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # the worker pool pickles its functions by module name
    spec.loader.exec_module(module)
    return module


def write_tiktoken(path, pair_tokens: bool = False) -> str:
    """Ranks of the 256 bytes (id = byte), and with pair_tokens every two-byte pair too (65,792 ids: int32)."""
    tokens = [bytes([value]) for value in range(256)]
    if pair_tokens:
        tokens += [bytes([first, second]) for first in range(256) for second in range(256)]
    with open(path, "w") as file:
        file.writelines(f"{base64.b64encode(token).decode()} {rank}\n" for rank, token in enumerate(tokens))
    return str(path)


def write_jsonl(path, lines) -> str:
    with open(path, "w", encoding="utf-8") as file:
        file.writelines((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines)
    return str(path)


def run_preprocess(*args, check=True):
    done = subprocess.run([sys.executable, TOOL, *map(str, args)], capture_output=True, text=True, timeout=300)
    if check:
        assert done.returncode == 0, done.stderr
    return done


def read_documents(prefix):
    """The sequences of prefix.bin: its documents, but the empty ones."""
    dataset = IndexedDataset(str(prefix))
    return [dataset[index].tolist() for index in range(len(dataset))]


@pytest.fixture(scope="module")
def byte_tokenizer(tmp_path_factory):
    return write_tiktoken(tmp_path_factory.mktemp("tokenizer") / "bytes.tiktoken")


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory):
    """A small byte-level BPE trained by tools/train_tokenizer.py."""
    directory = tmp_path_factory.mktemp("bpe")
    corpus = write_jsonl(directory / "corpus.jsonl", [{"text": f"document {i}: the rain in Spain falls mainly "
                                                               f"on the plain, {i * 7} times"} for i in range(200)])
    subprocess.run([sys.executable, os.path.join(ROOT, "tools", "train_tokenizer.py"), "--input", corpus,
                    "--vocab-size", "400", "--output-dir", directory / "tokenizer"], check=True, capture_output=True)
    return str(directory / "tokenizer")


BACKENDS = pytest.mark.parametrize("backend", ["tokenizers", "gigatoken"])


@pytest.mark.slow
@BACKENDS
def test_golden_bytes(tmp_path, byte_tokenizer, backend):
    corpus = write_jsonl(tmp_path / "corpus.jsonl", [{"text": "abc"}, {"text": "de"}])
    done = run_preprocess("--input", corpus, "--output-prefix", tmp_path / "out", "--tokenizer-type", "TikTokenizer",
                          "--tokenizer-model", byte_tokenizer, "--tokenizer-backend", backend)
    library = "tiktoken " if backend == "tokenizers" else "gigatoken "
    assert f"tokenizer backend: {backend} ({library}" in done.stderr
    prefix = tmp_path / "out_text_document"
    assert (tmp_path / "out_text_document.idx").read_bytes() == GOLDEN_IDX
    assert (tmp_path / "out_text_document.bin").read_bytes() == bytes([97, 0, 98, 0, 99, 0, 100, 0, 101, 0])
    metadata = read_metadata(str(prefix))
    assert (metadata["documents"], metadata["tokens"], metadata["eod"], metadata["vocab_size"]) == (2, 5, 256, 257)
    assert metadata["max_token_id"] == 101  # "e"
    assert metadata["tokenizer"]["type"] == "TikTokenizer" and metadata["append_eod"] is False
    assert metadata["special_tokens_as_text"] is False and metadata["empty_documents"] == 0
    assert check_indexed_dataset(str(prefix))["dtype"] == "uint16"
    assert metadata["tokenizer_backend"]["name"] == backend and metadata["tokenizer_backend"]["chosen"] == "by hand"


@pytest.mark.slow
@BACKENDS
@pytest.mark.parametrize("as_text", [False, True], ids=["as Megatron-LM", "special tokens as text"])
def test_golden_bytes_of_empty_documents_and_special_token_text(tmp_path, byte_tokenizer, as_text, backend):
    tool = load_tool()
    corpus = write_jsonl(tmp_path / "corpus.jsonl", [{"text": ""}, {"text": "ab"}, {"text": "c<|endoftext|>"},
                                                     {"text": ""}])
    prefix = str(tmp_path / "out_text_document")
    tool.preprocess(tool.parse_args(["--input", corpus, "--output-prefix", str(tmp_path / "out"), "--append-eod",
                                     "--tokenizer-type", "TikTokenizer", "--tokenizer-model", byte_tokenizer,
                                     "--tokenizer-backend", backend,
                                     *(["--special-tokens-as-text"] if as_text else [])]))
    assert (tmp_path / "out_text_document.idx").read_bytes() == (GOLDEN_AS_TEXT_IDX if as_text else GOLDEN_EMPTY_IDX)
    assert (tmp_path / "out_text_document.bin").read_bytes() == (GOLDEN_AS_TEXT_BIN if as_text else GOLDEN_EMPTY_BIN)
    metadata = read_metadata(prefix)
    assert (metadata["documents"], metadata["empty_documents"], metadata["tokens"]) == (4, 2, 18 if as_text else 6)
    assert metadata["special_tokens_as_text"] is as_text
    assert check_indexed_dataset(prefix)["documents"] == 4
    # Metadata written before special_tokens_as_text was recorded still reads, and still trains.
    del metadata["special_tokens_as_text"]
    with open(prefix + ".json", "w") as file:
        json.dump(metadata, file)
    assert "special_tokens_as_text" not in read_metadata(prefix)
    assert dataset_vocabulary(DataSection(train_data_path=(prefix,))).eod == 256


@pytest.mark.slow
def test_workers_and_partitions_write_the_same_tokens(tmp_path, hf_tokenizer):
    texts = [f"line {i} of the corpus, " * (i % 7) + "ünïcødé ✓" for i in range(300)]
    texts[5] = ""  # empty: a document of no tokens, as Megatron-LM writes it (no EOD even with --append-eod)
    texts[17] = "a literal <|endoftext|> ends a document"  # the EOD, as Megatron-LM encodes it
    first = write_jsonl(tmp_path / "a.jsonl", [{"text": text} for text in texts[:120]])
    with gzip.open(tmp_path / "b.jsonl.gz", "wt", encoding="utf-8") as file:
        file.writelines(json.dumps({"text": text}) + "\n" for text in texts[120:])
    (tmp_path / "c.txt").write_text("a whole file\nis one document\n", encoding="utf-8")
    texts.append("a whole file\nis one document\n")
    tokenizer = build_tokenizer("HuggingFaceTokenizer", hf_tokenizer)
    documents = [ids + [tokenizer.eod] if ids else [] for ids in tokenizer.encode_batch(texts)]
    assert documents[5] == [] and all(documents[:5] + documents[6:])
    before, after = tokenizer.encode_batch(["a literal ", " ends a document"])
    assert documents[17] == before + [tokenizer.eod] + after + [tokenizer.eod]
    expected = [ids for ids in documents if ids]  # the sequences: an empty document has none
    document_indices = [0, *numpy.cumsum([1 if ids else 0 for ids in documents]).tolist()]

    outputs = {}
    tool = load_tool()
    # gigatoken: in the tool's process (g1), in forked workers (g2), in forked partitions, one worker each (gp2);
    # run in this process (its start-up is the others'), and its "Processed" lines checked by the others.
    for name, flags in {"w1": ["--workers", 1, "--tokenizer-backend", "tokenizers"],
                        "w2": ["--workers", 2, "--tokenizer-backend", "tokenizers"],
                        "p2": ["--workers", 2, "--partitions", 2, "--tokenizer-backend", "tokenizers"],
                        "g1": ["--workers", 1], "g2": ["--workers", 2, "--tokenizer-backend", "gigatoken"],
                        "gp2": ["--workers", 2, "--partitions", 2, "--tokenizer-backend", "gigatoken"]}.items():
        prefix = tmp_path / name
        command = ["--input", first, tmp_path / "*.jsonl.gz", tmp_path / "c.txt", "--output-prefix", prefix,
                   "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", hf_tokenizer, "--append-eod",
                   "--log-interval", 100, *flags]
        if name.startswith("g"):
            tool.preprocess(tool.parse_args(list(map(str, command))))
        else:
            done = run_preprocess(*command)
            assert re.search(r"^Processed [1-9]\d* documents \(", done.stderr, re.MULTILINE)  # --log-interval
        document_prefix = f"{prefix}_text_document"
        assert read_documents(document_prefix) == expected, name
        assert IndexedDataset(document_prefix).document_indices.tolist() == document_indices, name
        metadata = read_metadata(document_prefix)
        assert metadata["documents"] == len(texts) and metadata["empty_documents"] == 1
        assert metadata["tokens"] == sum(map(len, expected)) and metadata["eod"] == tokenizer.eod
        assert metadata["max_token_id"] == max(map(max, expected))  # merged over partitions too
        assert dataset_vocabulary(DataSection(train_data_path=(document_prefix,))).vocab_size == tokenizer.vocab_size
        assert check_indexed_dataset(document_prefix)["dtype"] == "uint16"
        outputs[name] = [open(document_prefix + suffix, "rb").read() for suffix in (".bin", ".idx")]
        assert [path for path in os.listdir(tmp_path) if path.startswith(".")] == []  # no scratch left
        assert metadata["tokenizer_backend"]["name"] == ("gigatoken" if name.startswith("g") else "tokenizers")
    assert outputs["w1"] == outputs["w2"] == outputs["p2"] == outputs["g1"] == outputs["g2"] == outputs["gp2"]


@pytest.mark.slow
def test_large_vocabulary_writes_int32(tmp_path):
    pairs = write_tiktoken(tmp_path / "pairs.tiktoken", pair_tokens=True)
    corpus = write_jsonl(tmp_path / "corpus.jsonl", [{"text": "abcd"}, {"text": "xyz"}])
    run_preprocess("--input", corpus, "--output-prefix", tmp_path / "out", "--tokenizer-type", "TikTokenizer",
                   "--tokenizer-model", pairs, "--append-eod")
    prefix = str(tmp_path / "out_text_document")
    pair = lambda first, second: 256 + 256 * ord(first) + ord(second)  # noqa: E731
    eod = 256 + 65536
    assert read_documents(prefix) == [[pair("a", "b"), pair("c", "d"), eod], [pair("x", "y"), ord("z"), eod]]
    assert check_indexed_dataset(prefix)["dtype"] == "int32"
    assert read_metadata(prefix)["vocab_size"] == eod + 1


BAD_LINES = {
    "not UTF-8": b'{"text": "caf\xe9"}',
    "not JSON": b'{"text": "unterminated',
    "not a JSON object": b'["text"]',
    "missing key": b'{"body": "no text key"}',
    "not a string": b'{"text": 42}',
    "lone surrogate": b'{"text": "half a pair: \\ud800"}',  # json.loads makes it; no UTF-8 encodes it
}


def write_with_bad_line(path, bad: bytes) -> str:
    with open(path, "wb") as file:
        file.write(b'{"text": "good one"}\n\n{"text": "good two"}\n' + bad + b'\n{"text": "good three"}\n')
    return str(path)  # the bad line is line 4: line 2 is blank


@pytest.mark.slow
@BACKENDS
@pytest.mark.parametrize("reason", BAD_LINES)
def test_bad_line_stops_with_file_and_line(tmp_path, byte_tokenizer, reason, backend):
    tool = load_tool()
    corpus = write_with_bad_line(tmp_path / "corpus.jsonl", BAD_LINES[reason])
    args = tool.parse_args(["--input", corpus, "--output-prefix", str(tmp_path / "out" / "data"),
                            "--tokenizer-type", "TikTokenizer", "--tokenizer-model", byte_tokenizer,
                            "--tokenizer-backend", backend])
    with pytest.raises(tool.InputError, match=rf"^{tmp_path / 'corpus.jsonl'}:4: {reason}: .*--skip-bad-lines"):
        tool.preprocess(args)
    assert os.listdir(tmp_path / "out") == []  # neither outputs nor scratch


@pytest.mark.slow
def test_bad_line_run_exits_non_zero_and_leaves_nothing(tmp_path, byte_tokenizer):
    corpus = write_with_bad_line(tmp_path / "corpus.jsonl", BAD_LINES["not JSON"])
    done = run_preprocess("--input", corpus, "--output-prefix", tmp_path / "data", "--tokenizer-type",
                          "TikTokenizer", "--tokenizer-model", byte_tokenizer, "--workers", 2, "--partitions", 2,
                          check=False)
    assert done.returncode != 0 and f"{corpus}:4: not JSON" in done.stderr
    assert sorted(os.listdir(tmp_path)) == ["corpus.jsonl"]


@pytest.mark.slow
def test_skip_bad_lines_counts_per_reason_and_keeps_good_documents(tmp_path, byte_tokenizer):
    lines = []
    for reason, bad in BAD_LINES.items():
        lines += [b'{"text": "kept ' + reason.encode() + b'"}', bad]
    lines.append(b'{"text": ""}')
    (tmp_path / "corpus.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    done = run_preprocess("--input", tmp_path / "corpus.jsonl", "--output-prefix", tmp_path / "out",
                          "--tokenizer-type", "TikTokenizer", "--tokenizer-model", byte_tokenizer, "--skip-bad-lines")
    assert "skipped 6 bad lines: 1 not UTF-8, 1 not JSON, 1 not a JSON object, 1 missing key, 1 not a string, " \
        "1 lone surrogate" in done.stderr
    assert f"skipping {tmp_path / 'corpus.jsonl'}:12: lone surrogate: 'text' holds '\\ud800' at character 13" \
        in done.stderr
    prefix = str(tmp_path / "out_text_document")
    assert [bytes(ids).decode() for ids in read_documents(prefix)] == [f"kept {reason}" for reason in BAD_LINES]
    metadata = read_metadata(prefix)
    assert metadata["skipped_lines"] == {reason: 1 for reason in BAD_LINES} and metadata["empty_documents"] == 1
    assert metadata["documents"] == len(BAD_LINES) + 1  # the empty one too, written as Megatron-LM writes it


@pytest.mark.slow
@pytest.mark.parametrize("pattern, message", [
    ("missing.jsonl", "no such file"), ("none/*.jsonl", "matches no file"),
    ("corpus", r"corpus' is a directory: give its files, or a glob pattern such as '.*corpus/\*\.jsonl'$"),
])
def test_missing_inputs_are_clear_errors(tmp_path, byte_tokenizer, pattern, message):
    tool = load_tool()
    (tmp_path / "corpus").mkdir()
    args = tool.parse_args(["--input", str(tmp_path / pattern), "--output-prefix", str(tmp_path / "out"),
                            "--tokenizer-type", "TikTokenizer", "--tokenizer-model", byte_tokenizer])
    with pytest.raises(tool.InputError, match=message):
        tool.preprocess(args)


@pytest.fixture(scope="module")
def written_dataset(tmp_path_factory, byte_tokenizer):
    directory = tmp_path_factory.mktemp("dataset")
    corpus = write_jsonl(directory / "corpus.jsonl", [{"text": f"document number {i}"} for i in range(20)])
    run_preprocess("--input", corpus, "--output-prefix", directory / "out", "--tokenizer-type", "TikTokenizer",
                   "--tokenizer-model", byte_tokenizer, "--append-eod")
    return str(directory / "out_text_document")


@pytest.fixture
def dataset(tmp_path, written_dataset):
    """A fresh copy of a dataset written by the tool, to damage."""
    prefix = str(tmp_path / "out_text_document")
    for suffix in (".bin", ".idx", ".json"):
        shutil.copy(written_dataset + suffix, prefix + suffix)
    assert check_indexed_dataset(prefix)["documents"] == 20
    return prefix


@pytest.mark.slow
def test_truncated_bin_is_named(dataset):
    with open(dataset + ".bin", "r+b") as file:
        file.truncate(os.path.getsize(dataset + ".bin") - 2)
    with pytest.raises(IndexedDatasetError, match=rf"^{dataset}\.bin: .*truncated"):
        check_indexed_dataset(dataset)


@pytest.mark.slow
@pytest.mark.parametrize("corruption, message", [
    (lambda data: data[:-8], "truncated or corrupted"),
    (lambda data: b"XXIDIDX\x00\x00" + data[9:], "not a megatron-core index"),
    (lambda data: data[:9] + (2).to_bytes(8, "little") + data[17:], "version 2"),
    (lambda data: data[:17] + b"\x63" + data[18:], "unknown dtype code 99"),
    (lambda data: data[:18] + (21).to_bytes(8, "little") + data[26:], "truncated or corrupted"),
])
def test_corrupted_idx_is_named(dataset, corruption, message):
    with open(dataset + ".idx", "rb") as file:
        data = file.read()
    with open(dataset + ".idx", "wb") as file:
        file.write(corruption(data))
    with pytest.raises(IndexedDatasetError, match=rf"^{dataset}\.idx: .*{message}"):
        check_indexed_dataset(dataset)


@pytest.mark.slow
def test_metadata_errors_name_the_file(dataset):
    with pytest.raises(IndexedDatasetError, match=r"no_such_prefix\.json: no dataset metadata"):
        read_metadata(dataset.replace("out_text_document", "no_such_prefix"))
    with open(dataset + ".json") as file:
        metadata = json.load(file)
    with open(dataset + ".json", "w") as file:
        file.write(json.dumps({**metadata, "tokens": metadata["tokens"] + 1}))
    with pytest.raises(IndexedDatasetError, match=rf"^{dataset}\.json: records"):
        check_indexed_dataset(dataset)
    with open(dataset + ".json", "w") as file:
        file.write("{not json")
    with pytest.raises(IndexedDatasetError, match=rf"^{dataset}\.json: invalid dataset metadata"):
        read_metadata(dataset)


@pytest.mark.slow
def test_metadata_is_checked_against_the_tokenizer_it_names(dataset, tmp_path):
    with open(dataset + ".json") as file:
        metadata = json.load(file)
    data = DataSection(train_data_path=(dataset,))

    def write(**changes):
        with open(dataset + ".json", "w") as file:
            json.dump({**metadata, **changes}, file)

    write(vocab_size=300)  # overstated: every id fits, but the model would not match its tokenizer
    with pytest.raises(IndexedDatasetError, match=rf"^{dataset}\.json: records vocab_size 300 and eod 256, but its "
                                                  r"tokenizer has vocab_size 257 and eod 256$"):
        dataset_vocabulary(data)
    copy = tmp_path / "bytes.tiktoken"
    shutil.copy(metadata["tokenizer"]["model"]["path"], copy)
    write(tokenizer={**metadata["tokenizer"], "model": {**metadata["tokenizer"]["model"], "path": str(copy)}})
    assert dataset_vocabulary(data).vocab_size == 257
    with open(copy, "a") as file:
        file.write("YWI= 257\n")  # a token more: the checkpoints would carry a tokenizer the data never saw
    with pytest.raises(IndexedDatasetError, match=rf"^{dataset}\.json: its tokenizer file {copy} has changed"):
        dataset_vocabulary(data)


# Special-token text of both (</s>, <s>, <SPECIAL_9>; SentencePiece's user-defined <sep>), an empty document.
MEGATRON_TOKENIZER_TEXTS = ["the rain in Spain </s> falls mainly", "", "ünïcødé ✓ a<sep>b <s>", "<SPECIAL_9> the",
                            "  spaces\tand\nnewlines  "]


@pytest.mark.parametrize("tokenizer_type", ["GPTSentencePieceTokenizer", "TikTokenizer"])
def test_megatron_core_tokenizers_write_what_megatron_lm_writes(tmp_path, tokenizer_type, sentencepiece_model):
    """Megatron-LM's tools/preprocess_data.py --append-eod by its steps, with megatron-core's own tokenizer: each
    text's tokenize(), the EOD after a document that has tokens, add_document(ids, lengths) into an
    IndexedDatasetBuilder of optimal_dtype(vocab_size). The tool writes those bytes (from two forked workers,
    which inherit its tokenizer) and a .json the trainer rebuilds the tokenizer from."""
    if tokenizer_type == "TikTokenizer":
        model = write_megatron_tiktoken(tmp_path / "vocab.json", [b"th", b"the", b" the", b"ai", b"ain"])
        flags = ["--vocab-size", "1261", "--tiktoken-pattern", "v1"]
        theirs = megatron_tokenizer("tiktoken", model, pattern="v1", vocab_size=1261, num_special_tokens=1000,
                                    special_tokens=None)
    else:
        model, flags = sentencepiece_model, []
        theirs = megatron_tokenizer("sentencepiece", model, legacy=False, special_tokens=None)
    expected = str(tmp_path / "megatron_text_document")
    builder = IndexedDatasetBuilder(expected + ".bin", dtype=DType.optimal_dtype(theirs.vocab_size))
    for text in MEGATRON_TOKENIZER_TEXTS * 3:
        ids = theirs.tokenize(text)
        builder.add_document(ids + [theirs.eod] if ids else [], [len(ids) + 1] if ids else [])
    builder.finalize(expected + ".idx")
    corpus = write_jsonl(tmp_path / "corpus.jsonl", [{"text": text} for text in MEGATRON_TOKENIZER_TEXTS * 3])
    tool = load_tool()
    tool.preprocess(tool.parse_args(["--input", corpus, "--output-prefix", str(tmp_path / "out"), "--append-eod",
                                     "--workers", "2", "--tokenizer-type", tokenizer_type, "--tokenizer-model", model,
                                     *flags]))
    prefix = str(tmp_path / "out_text_document")
    for suffix in (".bin", ".idx"):
        assert open(prefix + suffix, "rb").read() == open(expected + suffix, "rb").read(), suffix
    metadata = read_metadata(prefix)
    assert (metadata["tokenizer"]["type"], metadata["vocab_size"], metadata["eod"]) == \
        (tokenizer_type, theirs.vocab_size, theirs.eod)
    flagged = {"tokenizer_type": tokenizer_type, "tokenizer_model": model}
    if tokenizer_type == "TikTokenizer":
        assert (metadata["tokenizer"]["pattern"], metadata["tokenizer"]["vocab_size"]) == ("v1", 1261)
        flagged.update(tiktoken_pattern="v1", vocab_size=1261)
    # The trainer rebuilds the tokenizer the .json records to check it, and agrees with the same flags.
    for data in (DataSection(train_data_path=(prefix,)), DataSection(train_data_path=(prefix,), **flagged)):
        vocabulary = dataset_vocabulary(data)
        assert (vocabulary.vocab_size, vocabulary.eod) == (theirs.vocab_size, theirs.eod)


class CustomLanguageVars(PunktLanguageVars):
    """Megatron-LM's tools/preprocess_data.py for --keep-newlines, verbatim: Punkt's pattern with the whitespace
    after a sentence's end matched into the sentence."""

    _period_context_fmt = r"""
        \S*                          # some word material
        %(SentEndChars)s             # a potential sentence ending
        \s*                       #  <-- THIS is what I changed
        (?=(?P<after_tok>
            %(NonWord)s              # either other punctuation
            |
            (?P<next_tok>\S+)     #  <-- Normally you would have \s+ here
        ))"""


# Sentences ending in a period, "!" or "?", whitespace and newlines between them (no closing quote or bracket
# after a sentence's end: there Megatron-LM's pattern drops the whitespace that follows), an empty text, one
# of whitespace only (no sentence: an empty document, as Megatron-LM writes it), and one without a final period.
SENTENCE_TEXTS = [
    "The first document opens here. It has a second sentence!\n\nA new paragraph asks a question? Yes.\n",
    "",
    "   \n",
    "One sentence without a final period",
    "  Leading spaces stay.   Then more text.\nLast line here.\n\n",
    "Ünïcødé text ✓ works too. Done?",
]


def megatron_sentence_dataset(prefix, texts, tokenizer, keep_newlines: bool) -> tuple:
    """What Megatron-LM's --split-sentences --append-eod writes, by its steps: Punkt's sentences of each text
    (with its CustomLanguageVars for --keep-newlines), each encoded, those of no tokens dropped, the EOD
    appended to the last, and add_document(ids, sentence_lens). Returns the sentences of each text."""
    punkt = PunktSentenceTokenizer(lang_vars=CustomLanguageVars()) if keep_newlines else PunktSentenceTokenizer()
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=DType.optimal_dtype(tokenizer.vocab_size))
    split = []
    for text in texts:
        sentences = punkt.tokenize(text)
        ids = [sentence_ids for sentence_ids in tokenizer.encode_batch(sentences) if sentence_ids] if sentences else []
        if ids:
            ids[-1] = ids[-1] + [tokenizer.eod]
        builder.add_document([token for sentence_ids in ids for token in sentence_ids], [len(part) for part in ids])
        split.append(sentences)
    builder.finalize(f"{prefix}.idx")
    return split


@pytest.mark.slow
@pytest.mark.parametrize("keep_newlines, flags", [(False, ["--workers", "1"]),
                                                  (True, ["--workers", "2", "--partitions", "2"])],
                         ids=["sentences", "keep newlines, partitions"])
def test_split_sentences_writes_what_megatron_lm_writes(tmp_path, hf_tokenizer, keep_newlines, flags):
    tool = load_tool()
    tokenizer = build_tokenizer("HuggingFaceTokenizer", hf_tokenizer)
    split = megatron_sentence_dataset(tmp_path / "megatron", SENTENCE_TEXTS, tokenizer, keep_newlines)
    if keep_newlines:  # the corpus exercises it: the whitespace after a sentence, newlines included, stays
        assert split[0][1] == "It has a second sentence!\n\n" and split[4][0] == "  Leading spaces stay.   "
        assert all("".join(sentences) == text.rstrip() for sentences, text in zip(split, SENTENCE_TEXTS))
    else:
        assert split[0][1] == "It has a second sentence!" and split[4][0] == "  Leading spaces stay."
    assert [len(sentences) for sentences in split] == [4, 0, 0, 1, 3, 2]

    corpus = write_jsonl(tmp_path / "corpus.jsonl", [{"text": text} for text in SENTENCE_TEXTS])
    metadata = tool.preprocess(tool.parse_args([
        "--input", corpus, "--output-prefix", str(tmp_path / "out"), "--tokenizer-type", "HuggingFaceTokenizer",
        "--tokenizer-model", hf_tokenizer, "--append-eod", "--split-sentences",
        *(["--keep-newlines"] if keep_newlines else []), *flags]))["text"]
    prefix = str(tmp_path / "out_text_sentence")  # Megatron-LM's name with --split-sentences
    assert not os.path.exists(tmp_path / "out_text_document.bin")
    for suffix in (".bin", ".idx"):
        assert open(prefix + suffix, "rb").read() == (tmp_path / f"megatron{suffix}").read_bytes(), suffix

    dataset = IndexedDataset(prefix)  # a sequence per sentence, a document index per document
    assert dataset.document_indices.tolist() == [0, *numpy.cumsum([len(sentences) for sentences in split])]
    sequences = [dataset[index].tolist() for index in range(len(dataset))]
    assert [tokenizer.decode([token for token in ids if token != tokenizer.eod]) for ids in sequences] \
        == [sentence for sentences in split for sentence in sentences]
    last_sentences = dataset.document_indices[1:][numpy.diff(dataset.document_indices) > 0] - 1
    assert [index for index, ids in enumerate(sequences) if ids[-1] == tokenizer.eod] == last_sentences.tolist()
    assert (metadata["documents"], metadata["sequences"], metadata["empty_documents"]) == (6, 10, 2)
    assert metadata["split_sentences"] is True and metadata["sentence_splitter"]["keep_newlines"] is keep_newlines
    assert check_indexed_dataset(prefix) == {"documents": 6, "sequences": 10, "tokens": metadata["tokens"],
                                             "dtype": "uint16"}


@pytest.mark.slow
def test_sentence_splitter_cuts_pieces_as_megatron_lm_and_has_no_time_limit(monkeypatch):
    tool = load_tool()
    splitter = tool.SentenceSplitter(keep_newlines=False)
    # nltk 3.10 would stop a long text's split at 5 s of wall-clock time: the tool compiles Punkt's pattern with
    # the standard library instead.
    assert isinstance(splitter.punkt._lang_vars.period_context_re(), re.Pattern)
    text = "A first sentence here. A second one that runs on. Third."
    monkeypatch.setattr(tool, "SENTENCE_SPLIT_CHARS", 20)
    punkt = PunktSentenceTokenizer()  # Megatron-LM's loop: Punkt on every max_len characters
    assert splitter(text) == [sentence for start in range(0, len(text), 20)
                              for sentence in punkt.tokenize(text[start:start + 20])]


def parquet_rows(index: int) -> dict:
    return {"text": ["", "ünïcødé ✓", "a literal <|endoftext|> too", f"row {index} of the table"][index % 4]
            + " word" * (index % 13), "title": f"title {index}"}


@pytest.mark.slow
def test_parquet_input_writes_the_bytes_of_the_same_jsonl(tmp_path, hf_tokenizer, capsys):
    tool = load_tool()
    rows = [parquet_rows(index) for index in range(700)]  # batches of PARQUET_BATCH_ROWS and a part of one
    (tmp_path / "json").mkdir()
    (tmp_path / "parquet").mkdir()
    write_jsonl(tmp_path / "json" / "part-0.jsonl", rows[:300])
    write_jsonl(tmp_path / "json" / "part-1.jsonl", rows[300:])
    # Row groups that do not fall on batches, and both string types (pandas writes large_string).
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist(rows[:300]), tmp_path / "parquet" / "part-0.parquet",
                                row_group_size=97)
    large = pyarrow.schema([("title", pyarrow.large_string()), ("text", pyarrow.large_string())])
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist(rows[300:], schema=large),
                                tmp_path / "parquet" / "part-1.parquet")
    common = ["--json-keys", "text", "title", "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
              hf_tokenizer, "--append-eod", "--log-interval", "100"]
    outputs = {}
    for name, pattern, flags in [("json", "json/*.jsonl", []), ("parquet", "parquet/*.parquet", []),
                                 ("partitions", "parquet/*.parquet", ["--workers", "2", "--partitions", "2"])]:
        capsys.readouterr()
        metadata = tool.preprocess(tool.parse_args(["--input", str(tmp_path / pattern), "--output-prefix",
                                                    str(tmp_path / name), *common, *flags]))
        assert metadata["text"]["documents"] == metadata["title"]["documents"] == len(rows)
        outputs[name] = [(tmp_path / f"{name}_{key}_document{suffix}").read_bytes()
                         for key in ("text", "title") for suffix in (".bin", ".idx")]
        if name == "parquet":  # progress as for JSON lines
            assert re.search(r"^Processed 700 documents \(", capsys.readouterr().err, re.MULTILINE)
    assert outputs["json"] == outputs["parquet"] == outputs["partitions"]
    tokenizer = build_tokenizer("HuggingFaceTokenizer", hf_tokenizer)
    assert read_documents(tmp_path / "parquet_title_document") == [
        ids + [tokenizer.eod] for ids in tokenizer.encode_batch([row["title"] for row in rows])]


@pytest.mark.slow
@pytest.mark.parametrize("columns, keys, message", [
    ({"body": ["a"]}, ["text"], r"no column 'text' \(--json-keys\); its columns are 'body'$"),
    ({"text": ["a"], "title": ["b"]}, ["title", "summary"], r"no column 'summary' .*'text', 'title'$"),
    ({"text": [1, 2]}, ["text"], r"column 'text' \(--json-keys\) holds int64, not strings$"),
], ids=["missing column", "one key of two missing", "not strings"])
def test_parquet_column_errors_name_the_file_and_column(tmp_path, byte_tokenizer, columns, keys, message):
    tool = load_tool()
    good = write_jsonl(tmp_path / "first.jsonl", [{key: "fine" for key in keys}])
    path = tmp_path / "table.parquet"
    pyarrow.parquet.write_table(pyarrow.table(columns), path)
    args = tool.parse_args(["--input", good, str(path), "--output-prefix", str(tmp_path / "out" / "data"),
                            "--json-keys", *keys, "--tokenizer-type", "TikTokenizer", "--tokenizer-model",
                            byte_tokenizer])
    with pytest.raises(tool.InputError, match=rf"^{path}: {message}"):
        tool.preprocess(args)
    assert not os.path.exists(tmp_path / "out")  # stopped before it wrote anything
    (tmp_path / "broken.parquet").write_bytes(b"not parquet")
    args.input = [str(tmp_path / "broken.parquet")]
    with pytest.raises(tool.InputError, match=rf"^{tmp_path / 'broken.parquet'}: not a readable Parquet file"):
        tool.preprocess(args)


@pytest.mark.slow
def test_parquet_null_is_a_missing_key(tmp_path, byte_tokenizer):
    tool = load_tool()
    path = tmp_path / "table.parquet"
    pyarrow.parquet.write_table(pyarrow.table({"text": ["good one", None, "good three"]}), path)
    common = ["--output-prefix", str(tmp_path / "out" / "data"), "--tokenizer-type", "TikTokenizer",
              "--tokenizer-model", byte_tokenizer]
    with pytest.raises(tool.InputError, match=rf"^{path}, row 1: missing key: 'text' is null \(--skip-bad-lines"):
        tool.preprocess(tool.parse_args(["--input", str(path), *common]))
    assert os.listdir(tmp_path / "out") == []
    # With --skip-bad-lines, what the JSON lines write when the second lacks the key.
    parquet = tool.preprocess(tool.parse_args(["--input", str(path), *common, "--skip-bad-lines"]))["text"]
    outputs = [(tmp_path / "out" / f"data_text_document{suffix}").read_bytes() for suffix in (".bin", ".idx")]
    corpus = write_jsonl(tmp_path / "corpus.jsonl", [{"text": "good one"}, {}, {"text": "good three"}])
    json_lines = tool.preprocess(tool.parse_args(["--input", corpus, *common, "--skip-bad-lines"]))["text"]
    assert outputs == [(tmp_path / "out" / f"data_text_document{suffix}").read_bytes() for suffix in (".bin", ".idx")]
    assert parquet["skipped_lines"] == json_lines["skipped_lines"] == {"missing key": 1}
    assert parquet["documents"] == json_lines["documents"] == 2


# The tool, then its peak resident memory (KB) and the peak of Arrow's memory pool (bytes), in one process.
MEASURED_RUN = ("import resource, runpy, sys; import pyarrow; sys.argv = sys.argv[1:]; "
                "runpy.run_path(sys.argv[0], run_name='__main__'); "
                "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, pyarrow.default_memory_pool().max_memory())")


@pytest.mark.slow
def test_parquet_memory_does_not_grow_with_the_file(tmp_path, byte_tokenizer):
    rng = numpy.random.default_rng(0)
    words = ["".join(rng.choice(list("abcdefghij"), size)) for size in rng.integers(2, 9, 2000)]
    row_bytes, rows = 2000, 1500
    peaks = {}
    for copies in (1, 4):
        path = tmp_path / f"x{copies}.parquet"
        with pyarrow.parquet.ParquetWriter(path, pyarrow.schema([("text", pyarrow.string())])) as writer:
            for _ in range(copies * rows // 250):  # row groups of 250 rows
                texts = [" ".join(rng.choice(words, row_bytes // 6))[:row_bytes] for _ in range(250)]
                writer.write_table(pyarrow.table({"text": texts}))
        done = subprocess.run([sys.executable, "-c", MEASURED_RUN, TOOL, "--input", path, "--output-prefix",
                               tmp_path / f"x{copies}", "--tokenizer-type", "TikTokenizer", "--tokenizer-model",
                               byte_tokenizer], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        resident_kb, arrow_bytes = map(int, done.stdout.split())
        peaks[copies] = resident_kb * 1024, arrow_bytes
    print(f"peak memory of {rows} and {4 * rows} rows of {row_bytes} bytes: resident {peaks[1][0] >> 20} and "
          f"{peaks[4][0] >> 20} MB, Arrow's pool {peaks[1][1] >> 20} and {peaks[4][1] >> 20} MB")
    added = 3 * rows * row_bytes  # the text the larger file adds: 9 MB
    # Arrow holds a batch and its row group at a time: the same peak (pyarrow's pre_buffer, which keeps the row
    # groups read, grew it from 3 to 9 MB here). The process grows by less than the text added, which reading
    # the file whole would add twice over (as Arrow's, then as Python's strings); measured: 3 MB of noise.
    assert peaks[4][1] <= 1.25 * peaks[1][1] + (1 << 20)
    assert peaks[4][0] - peaks[1][0] < added


def test_help_imports_neither_torch_nor_megatron_and_warns_nothing():
    done = subprocess.run([sys.executable, "-X", "importtime", TOOL, "--help"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0 and "--split-sentences" in done.stdout
    modules = [line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")]
    assert "numpy" in modules  # the import times are read
    assert not [module for module in modules if module.split(".")[0] in ("torch", "megatron", "pyarrow", "nltk")]
    assert [line for line in done.stderr.splitlines() if not line.startswith("import time:")] == []


def write_sharded_corpus(directory) -> list:
    """Inputs of every kind: JSON lines cut between lines (blank lines, an empty document, a long line), gzip and
    .txt files taken whole, an empty file."""
    directory.mkdir()
    write_jsonl(directory / "a.jsonl", [{"text": f"document {i} " * (i % 13)} for i in range(120)] + [""] * 3
                + [{"text": "x" * 5000}, {"text": ""}])
    with gzip.open(directory / "b.jsonl.gz", "wt", encoding="utf-8") as file:
        file.writelines(json.dumps({"text": f"gz {i}"}) + "\n" for i in range(30))
    (directory / "c.txt").write_text("a whole file\n", encoding="utf-8")
    (directory / "d.jsonl").write_bytes(b"")
    write_jsonl(directory / "e.jsonl", [{"text": f"last file {i}"} for i in range(40)])
    return [str(directory / name) for name in ("a.jsonl", "b.jsonl.gz", "c.txt", "d.jsonl", "e.jsonl")]


def megatron_lm_documents(documents, eod):
    """Megatron-LM's tools/preprocess_data.py (Encoder.encode, then add_document) on documents given as their
    sentences' ids: a sentence of no ids is dropped, and with --append-eod a document that has ids gets the EOD
    after its last sentence. Returns (the ids, each sentence's length, each document's count of sentences)."""
    tokens, lengths, counts = [], [], []
    for sentences in documents:
        doc_ids, sentence_lens = [], []
        for sentence_ids in sentences:
            if len(sentence_ids) > 0:
                doc_ids.extend(sentence_ids)
                sentence_lens.append(len(sentence_ids))
        if len(doc_ids) > 0 and eod is not None:
            doc_ids.append(eod)
            sentence_lens[-1] += 1
        tokens += doc_ids
        lengths += sentence_lens
        counts.append(len(sentence_lens))
    return tokens, lengths, counts


@pytest.mark.parametrize("eod", [None, 65535])
@pytest.mark.parametrize("documents", [
    [],  # an empty batch
    [[]],  # a document of no sentences
    [[[]]],  # a document of one empty sentence
    [[[5]]],  # one id
    [[[1, 2], [], [3]], [], [[]], [[65535, 0, 4], [6]], [[7]]],  # empty documents and sentences between others
    [[[1, 2]], [], [[]]],  # empty documents last
], ids=["no documents", "no sentences", "an empty sentence", "one id", "mixed", "empty last"])
def test_a_batch_is_assembled_as_megatron_lm_assembles_its_documents(documents, eod):
    tool = load_tool()
    sentences = [sentence for document in documents for sentence in document]
    ids = numpy.array([i for sentence in sentences for i in sentence], dtype=numpy.int64)
    lengths = numpy.array([len(sentence) for sentence in sentences], dtype=numpy.int64)
    counts = numpy.array([len(document) for document in documents], dtype=numpy.int64)
    out, out_lengths, out_counts = tool.assemble_documents(ids, lengths, counts, eod, numpy.uint16)
    tokens, expected_lengths, expected_counts = megatron_lm_documents(documents, eod)
    assert out.dtype == numpy.uint16 and out.tolist() == tokens
    assert out_lengths.tolist() == expected_lengths and out_counts.tolist() == expected_counts


def test_a_batch_of_records_is_encoded_key_by_key_with_its_bad_lines_set_apart(byte_tokenizer):
    """encode_batch with the byte tokenizer (id = byte, EOD 256) and sentences cut at "|": each key's documents
    as Megatron-LM assembles them from their sentences' bytes, a bad line reported and left out, every record's
    bytes counted."""
    tool = load_tool()
    tokenizer = build_tokenizer("TikTokenizer", byte_tokenizer)
    tool.configure_encoding(tokenizer, lambda text: text.split("|"), ["text", "title"], True, numpy.uint16, 1)
    lines = [{"text": "ab|c", "title": "d"}, {"text": "", "title": ""}, "not json", {"text": "e||fg", "title": "h|"}]
    raws = [(line if isinstance(line, str) else json.dumps(line)).encode() for line in lines]
    batch = tool.encode_batch([Record("c.jsonl", number, raw) for number, raw in enumerate(raws, 1)])
    for key in ("text", "title"):
        documents = [[list(sentence.encode()) for sentence in line[key].split("|")] for line in lines
                     if isinstance(line, dict)]
        tokens, lengths, counts = megatron_lm_documents(documents, 256)
        assert batch.tokens[key].dtype == numpy.uint16 and batch.tokens[key].tolist() == tokens, key
        assert batch.lengths[key].tolist() == lengths and batch.sequences[key].tolist() == counts, key
    assert [(bad.line, bad.reason) for bad in batch.bad_lines] == [(3, "not JSON")]
    assert batch.bytes == sum(map(len, raws))
    tool.configure_encoding(tokenizer, None, ["text"], False, numpy.int32, 1)  # no splitter, no EOD
    rows = [tool.ParquetRow("p.parquet", 0, ("xy",), 2), tool.ParquetRow("p.parquet", 1, (None,), 0)]
    batch = tool.encode_batch([Record("c.txt", None, b"a|b"), Record("d.txt", None, b""), *rows])
    assert batch.tokens["text"].dtype == numpy.int32 and batch.tokens["text"].tolist() == list(b"a|bxy")
    assert batch.lengths["text"].tolist() == [3, 2] and batch.sequences["text"].tolist() == [1, 0, 1]
    assert [(bad.line, bad.reason) for bad in batch.bad_lines] == [(1, "missing key")]
    batch = tool.encode_batch([Record("c.jsonl", 1, b"[]")])  # nothing but a bad line: no document
    assert batch.tokens["text"].tolist() == [] and batch.sequences["text"].tolist() == []


def test_shards_hold_every_document_once_in_order(tmp_path):
    tool = load_tool()
    paths = write_sharded_corpus(tmp_path / "corpus")
    whole = list(tool.iter_inputs([(path, None, None) for path in paths], ["text"]))
    for shards in range(1, 10):
        parts = [tool.shard_inputs(paths, shard, shards) for shard in range(shards)]
        assert [record for shard in parts for record in tool.iter_inputs(shard, ["text"])] == whole, shards
        assert sum(tool.count_inputs(shard, ["text"]) for shard in parts) == len(whole)


@pytest.mark.slow
def test_merged_shards_are_the_bytes_of_one_run(tmp_path, byte_tokenizer):
    tool = load_tool()
    merge_spec = importlib.util.spec_from_file_location("merge_datasets", os.path.join(ROOT, "tools",
                                                                                        "merge_datasets.py"))
    merge_tool = importlib.util.module_from_spec(merge_spec)
    merge_spec.loader.exec_module(merge_tool)
    paths = write_sharded_corpus(tmp_path / "corpus")
    flags = ["--input", *paths, "--tokenizer-type", "TikTokenizer", "--tokenizer-model", byte_tokenizer,
             "--append-eod"]
    tool.preprocess(tool.parse_args(flags + ["--output-prefix", str(tmp_path / "one" / "corpus")]))
    for shard in range(3):  # zero-padded, so that the merge's sorted order is the shards'
        tool.preprocess(tool.parse_args(flags + ["--output-prefix", str(tmp_path / "shards" / f"corpus{shard:05d}"),
                                                 "--shard", f"{shard}/3", *(["--workers", "2"] if shard else [])]))
    merge_tool.merge(str(tmp_path / "shards"), str(tmp_path / "merged"))
    one = str(tmp_path / "one" / "corpus_text_document")
    for suffix in (".bin", ".idx"):
        assert open(one + suffix, "rb").read() == (tmp_path / f"merged{suffix}").read_bytes()
    expected, merged = read_metadata(one), read_metadata(str(tmp_path / "merged"))
    for key in ("documents", "tokens", "empty_documents", "sequences", "max_token_id", "tokenizer", "eod"):
        assert merged[key] == expected[key], key
    # 122 + 30 + 1 + 40 documents; 11 empty: i % 13 == 0 below 120, and the text ""
    assert expected["empty_documents"] == 11 and check_indexed_dataset(str(tmp_path / "merged"))["documents"] == 193
    with pytest.raises(SystemExit):
        tool.parse_args(flags + ["--output-prefix", "x", "--shard", "3/3"])


def test_the_benchmark_names_how_megatron_lms_fast_path_differs(tmp_path):
    """benchmarks/preprocess.py's comparison with Megatron-LM's outputs: an empty document written as a lone end
    of document (its preprocess_data_fast.py) is told apart from other differences (datasets written here by
    megatron-core's own builder)."""
    difference = load_benchmark("preprocess").dataset_difference

    def dataset(name: str, documents: list) -> str:
        builder = IndexedDatasetBuilder(str(tmp_path / f"{name}.bin"), dtype=numpy.uint16)
        for document in documents:
            builder.add_document(numpy.array(document, dtype=numpy.int64), [len(document)] if document else [])
        builder.finalize(str(tmp_path / f"{name}.idx"))
        with open(tmp_path / f"{name}.json", "w") as file:
            json.dump({"eod": 0}, file)
        return str(tmp_path / name)

    ours = dataset("ours", [[5, 6, 0], [], [7, 0]])
    assert "but the 1 empty one(s)" in difference(ours, dataset("fast", [[5, 6, 0], [0], [7, 0]]))
    assert difference(ours, dataset("other", [[5, 6, 0], [], [8, 0]])) == \
        "1 of 3 documents differ, the first document 2"
    assert difference(ours, dataset("fewer", [[5, 6, 0], [7, 0]])) == "2 documents against our 3"


POOL_ENDED_AT_ONCE = """
import importlib.util, signal, sys, time
spec = importlib.util.spec_from_file_location("preprocess_data", sys.argv[1])
tool = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tool)
signal.signal(signal.SIGTERM, lambda *args: None)  # a handler that returns, as a trainer's records the request
tool.configure_encoding = lambda *args: None
started = tool.init_worker
def late_start(*args):
    time.sleep(1.0)  # Pool.terminate's SIGTERM comes before the worker has made it fatal
    started(*args)
tool.init_worker = late_start
pool = tool.fork_pool(2, (None, None, [], False, None, 1))
pool.terminate()
pool.join()
print("ended")
"""


@pytest.mark.slow  # a subprocess importing the tool
def test_a_pool_ended_before_its_workers_start_ends_under_a_sigterm_handler_that_returns():
    """Pool.terminate() sends each worker SIGTERM; a worker that received it before init_worker made it fatal ran
    the parent's handler instead, lived on, and join() waited forever (a test calling the tool's main() in-process
    hung in CI). The workers fork with SIGTERM blocked, so it waits until it ends them."""
    done = subprocess.run([sys.executable, "-c", POOL_ENDED_AT_ONCE, os.path.join(ROOT, "tools", "preprocess_data.py")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "ended", done.stderr
