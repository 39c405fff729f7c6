"""--tokenizer-backend: gigatoken encodes every document as the tokenizer's own library does, or is not used;
and angpt.data.indexed.DatasetWriter writes what megatron-core's builder writes."""

import glob
import importlib.metadata
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import numpy
import pytest
from megatron.core.datasets import indexed_dataset as megatron_indexed
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import models, pre_tokenizers

import angpt.data.tokenizers as tokenizers
from angpt.data import indexed
from angpt.data.indexed import DatasetWriter
from angpt.data.tokenizers import (
    PROBE_TEXTS,
    GigatokenTokenizer,
    TokenizerBackendError,
    build_tokenizer,
    select_backend,
)

from conftest import ROOT, write_megatron_tiktoken

pytest.importorskip("gigatoken")


def repository_texts() -> list:
    """Every Python, Markdown and shell file of this repository, one document each (MBs of distinct text: few
    cache hits), with the probe texts and documents made of special-token text, blank lines and nothing."""
    texts = []
    for pattern in ("**/*.py", "**/*.md", "**/*.sh"):
        for path in sorted(glob.glob(os.path.join(ROOT, pattern), recursive=True)):
            if "/.venv/" not in path:
                with open(path, encoding="utf-8") as file:
                    texts.append(file.read())
    return texts + PROBE_TEXTS + ["<|endoftext|>" * 3, "\n\n\n", "", "x<|endoftext|>\n" * 100]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A byte-level BPE of 2,000 tokens trained by tools/train_tokenizer.py on this repository's text, and the
    same vocabulary and merges as GPT-2's vocab.json and merges.txt."""
    directory = tmp_path_factory.mktemp("bpe")
    with open(directory / "corpus.jsonl", "w") as file:
        file.writelines(json.dumps({"text": text}) + "\n" for text in repository_texts()[::3])
    subprocess.run([sys.executable, os.path.join(ROOT, "tools", "train_tokenizer.py"), "--input",
                    directory / "corpus.jsonl", "--vocab-size", "2000", "--output-dir", directory / "bpe"],
                   check=True, capture_output=True, timeout=300)
    with open(directory / "bpe" / "tokenizer.json") as file:
        model = json.load(file)["model"]
    (directory / "vocab.json").write_text(json.dumps(model["vocab"]))
    merges = [merge if isinstance(merge, str) else " ".join(merge) for merge in model["merges"]]
    (directory / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    return directory


@pytest.fixture(scope="module")
def byte_ranks(tmp_path_factory):
    import base64  # noqa: PLC0415 (this fixture only)

    path = tmp_path_factory.mktemp("ranks") / "bytes.tiktoken"
    path.write_text("".join(f"{base64.b64encode(bytes([value])).decode()} {value}\n" for value in range(256)))
    return str(path)


def tokenizer_flags(kind: str, trained, byte_ranks) -> dict:
    return {"HuggingFaceTokenizer": dict(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(trained / "bpe")),
            "GPT2BPETokenizer": dict(tokenizer_type="GPT2BPETokenizer", vocab_file=str(trained / "vocab.json"),
                                     merge_file=str(trained / "merges.txt")),
            "TikTokenizer": dict(tokenizer_type="TikTokenizer", tokenizer_model=byte_ranks)}[kind]


@pytest.mark.slow  # 1-4 s each: MBs of text through tokenizers
@pytest.mark.parametrize("as_text", [False, True], ids=["special tokens", "special tokens as text"])
@pytest.mark.parametrize("kind", ["HuggingFaceTokenizer", "GPT2BPETokenizer", "TikTokenizer"])
def test_gigatoken_encodes_every_document_as_the_tokenizer(trained, byte_ranks, kind, as_text):
    reference = build_tokenizer(**tokenizer_flags(kind, trained, byte_ranks), special_tokens_as_text=as_text)
    fast, backend = select_backend(reference, None)
    assert isinstance(fast, GigatokenTokenizer) and backend["name"] == "gigatoken" and backend["chosen"] == "auto"
    texts = repository_texts()
    expected = reference.encode_batch(texts)
    ids, lengths = fast.encode_flat(texts)
    assert lengths.tolist() == list(map(len, expected))
    assert ids.tolist() == [token for document in expected for token in document]
    assert fast.encode_batch(texts[:50]) == expected[:50]
    eod_in_text = reference.encode_batch(["a<|endoftext|>b"])[0]
    assert (reference.eod in eod_in_text) is not as_text  # the cases differ, so both are held


def test_backend_by_hand_and_why_gigatoken_is_not_used(trained, byte_ranks, tmp_path, monkeypatch):
    reference = build_tokenizer(**tokenizer_flags("HuggingFaceTokenizer", trained, byte_ranks))
    chosen, backend = select_backend(reference, "tokenizers")
    assert chosen is reference and backend["name"] == "tokenizers" and backend["library"] == "tokenizers"
    assert "gigatoken_not_used" not in backend and backend["chosen"] == "by hand"
    assert select_backend(reference, "gigatoken")[1] == {"name": "gigatoken", "version": "0.10.0",
                                                         "chosen": "by hand"}
    # Megatron-LM's TikTokenizer splits with patterns gigatoken does not implement: the library's own.
    megatron = build_tokenizer("TikTokenizer", write_megatron_tiktoken(tmp_path / "vocab.json", [b"th"]),
                               vocab_size=1257)
    chosen, backend = select_backend(megatron, None)
    assert chosen is megatron and backend["library"] == "tiktoken"
    assert "does not encode TikTokenizer" in backend["gigatoken_not_used"]
    with pytest.raises(TokenizerBackendError, match="^--tokenizer-backend gigatoken: gigatoken does not encode"):
        select_backend(megatron, "gigatoken")
    # A tokenizer.json of a model gigatoken lacks (BPE only): the library's own, gigatoken's reason in one line.
    word_level = RustTokenizer(models.WordLevel({"a": 0, "b": 1, "<unk>": 2, "<|endoftext|>": 3}, unk_token="<unk>"))
    word_level.pre_tokenizer = pre_tokenizers.Whitespace()
    word_level.save(str(tmp_path / "word_level.json"))
    word_level = build_tokenizer("HuggingFaceTokenizer", str(tmp_path / "word_level.json"))
    chosen, backend = select_backend(word_level, None)
    assert chosen is word_level and backend["library"] == "tokenizers"
    assert backend["gigatoken_not_used"] == ('gigatoken does not read this tokenizer.json: Unsupported model type '
                                             '"WordLevel": gigatoken supports BPE tokenizers (byte-level, or '
                                             'SentencePiece-style with byte_fallback)')
    with pytest.raises(TokenizerBackendError, match="^--tokenizer-backend gigatoken: gigatoken does not read"):
        select_backend(word_level, "gigatoken")
    monkeypatch.setitem(sys.modules, "gigatoken", None)  # not installed
    assert select_backend(reference, None)[1]["gigatoken_not_used"].startswith("gigatoken is not installed")


def test_a_difference_is_reported_and_gigatoken_not_used(trained, byte_ranks, monkeypatch):
    reference = build_tokenizer(**tokenizer_flags("HuggingFaceTokenizer", trained, byte_ranks))
    other = build_tokenizer(**tokenizer_flags("TikTokenizer", trained, byte_ranks))  # another vocabulary
    builder = tokenizers.gigatoken_builder(other)
    monkeypatch.setattr(tokenizers, "gigatoken_builder", lambda tokenizer: builder)
    chosen, backend = select_backend(reference, None)
    assert chosen is reference and backend["name"] == "tokenizers"
    assert backend["gigatoken_not_used"].startswith("gigatoken 0.10.0 encodes ' ' as [32], the tokenizer as [")
    with pytest.raises(TokenizerBackendError, match=r"^--tokenizer-backend gigatoken: gigatoken 0.10.0 encodes"):
        select_backend(reference, "gigatoken")


def test_caches_are_dropped_when_memory_grows(trained, byte_ranks, monkeypatch):
    reference = build_tokenizer(**tokenizer_flags("HuggingFaceTokenizer", trained, byte_ranks))
    fast, _ = select_backend(reference, "gigatoken")
    texts = repository_texts()[:40]
    first = fast.encoder
    monkeypatch.setattr(tokenizers, "GIGATOKEN_CACHE_BYTES", -1)  # every batch is over the bound
    assert [fast.encode_batch(texts[i:i + 10]) for i in range(0, 40, 10)] == \
        [reference.encode_batch(texts[i:i + 10]) for i in range(0, 40, 10)]
    assert fast.rebuilds == 4 and fast.encoder is not first


@pytest.mark.parametrize("documents, dtype", [(200, numpy.uint16), (200, numpy.int32), (1, numpy.uint16),
                                              (0, numpy.uint16), ("empty", numpy.uint16)])
def test_the_writer_writes_what_megatron_cores_builder_writes(tmp_path, documents, dtype):
    rng = numpy.random.default_rng(0)
    sequences = numpy.zeros(3, numpy.int64) if documents == "empty" else rng.integers(0, 3, documents)  # 0: empty
    lengths = rng.integers(1, 50, int(sequences.sum()))
    tokens = rng.integers(0, 60000, int(lengths.sum()))
    expected = IndexedDatasetBuilder(str(tmp_path / "a.bin"), dtype=dtype)
    got = DatasetWriter(str(tmp_path / "b.bin"), dtype=dtype)
    sequence, token = 0, 0
    for count in sequences:
        document_lengths = lengths[sequence:sequence + count].tolist()
        expected.add_document(tokens[token:token + sum(document_lengths)], document_lengths)
        sequence, token = sequence + count, token + sum(document_lengths)
    # In two calls, as batches come: the second's document indices continue the first's.
    half = len(sequences) // 2
    split_sequences = int(sequences[:half].sum())
    split_tokens = int(lengths[:split_sequences].sum())
    got.add_documents(tokens[:split_tokens], lengths[:split_sequences], sequences[:half])
    got.add_documents(tokens[split_tokens:], lengths[split_sequences:], sequences[half:])
    expected.finalize(str(tmp_path / "a.idx"))
    got.finalize(str(tmp_path / "b.idx"))
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"a{suffix}").read_bytes() == (tmp_path / f"b{suffix}").read_bytes()


def test_the_format_constants_are_megatron_cores():
    assert indexed._INDEX_HEADER == megatron_indexed._INDEX_HEADER
    assert {dtype.name: code for dtype, code in indexed.DTYPE_CODES.items()} == {
        member.name: member.value for member in megatron_indexed.DType}
    for vocab_size in (1, 65499, 65500, 2**31 - 1):  # either side of megatron-core's cut
        assert indexed.optimal_dtype(vocab_size) == megatron_indexed.DType.optimal_dtype(vocab_size)


@pytest.fixture
def tiny_gpt2(tmp_path):
    """GPT-2's byte-level BPE with three merges (tests/test_tokenizers.py's pair): built in milliseconds."""
    from test_tokenizers import gpt2_pair  # noqa: PLC0415 (a helper of the other tokenizer tests)

    return gpt2_pair(tmp_path, "#version: 0.2\nh e\nĠ t\nĠt he\n")


def test_each_backend_is_described_by_its_library_and_version(tiny_gpt2, byte_ranks, sentencepiece_model,
                                                               tmp_path):
    """The description in the log and the dataset's metadata: gigatoken's, or the tokenizer's own library's
    (tokenizers, tiktoken or sentencepiece) with the installed version, chosen by hand or automatically, and why
    gigatoken was not used where it was not."""
    version = importlib.metadata.version
    hugging_face = tokenizers.load_gpt2_vocab_merges(*tiny_gpt2)
    fast, backend = select_backend(hugging_face, None)
    assert isinstance(fast, GigatokenTokenizer) and backend == {"name": "gigatoken", "version": version("gigatoken"),
                                                                "chosen": "auto"}
    assert select_backend(hugging_face, "gigatoken")[1]["chosen"] == "by hand"
    ranks = build_tokenizer("TikTokenizer", byte_ranks)
    sentencepiece = build_tokenizer("Llama2Tokenizer", sentencepiece_model)
    megatron = build_tokenizer("TikTokenizer", write_megatron_tiktoken(tmp_path / "vocab.json", [b"th"]),
                               vocab_size=1257)
    for tokenizer, library in ((hugging_face, "tokenizers"), (ranks, "tiktoken"), (sentencepiece, "sentencepiece"),
                               (megatron, "tiktoken")):
        chosen, backend = select_backend(tokenizer, "tokenizers")
        assert chosen is tokenizer and backend == {"name": "tokenizers", "library": library,
                                                   "version": version(library), "chosen": "by hand"}
    chosen, backend = select_backend(sentencepiece, None)
    assert chosen is sentencepiece and backend == {
        "name": "tokenizers", "library": "sentencepiece", "version": version("sentencepiece"), "chosen": "auto",
        "gigatoken_not_used": "gigatoken does not encode Llama2Tokenizer here (Megatron-LM's tiktoken patterns v1/v2 "
                              "and SentencePiece models are not verified)"}
    with pytest.raises(ValueError) as refusal:
        select_backend(hugging_face, "fast")
    assert str(refusal.value) == "--tokenizer-backend fast: choose one of tokenizers, gigatoken"


def test_without_gigatoken_the_library_is_used_unless_gigatoken_was_asked_for(tiny_gpt2, monkeypatch):
    reference = tokenizers.load_gpt2_vocab_merges(*tiny_gpt2)
    monkeypatch.setitem(sys.modules, "gigatoken", None)  # not installed
    chosen, backend = select_backend(reference, None)
    assert chosen is reference and backend["gigatoken_not_used"] == "gigatoken is not installed (pip install gigatoken)"
    with pytest.raises(TokenizerBackendError) as refusal:
        select_backend(reference, "gigatoken")
    assert str(refusal.value) == "--tokenizer-backend gigatoken: gigatoken is not installed (pip install gigatoken)"


@pytest.mark.parametrize("as_text", [False, True], ids=["special tokens", "special tokens as text"])
def test_gigatoken_reads_special_tokens_as_the_tokenizer_and_keeps_its_other_added_tokens(tiny_gpt2, byte_ranks,
                                                                                          as_text):
    """special_tokens_as_text: <|endoftext|> in the text is text for gigatoken too, while an added token that is not
    special (<tag>) is still matched, as tokenizers' encode_special_tokens reads them. The reference's vocabulary,
    end of document, description and decoding stay; a ranks file's EOD is matched only without as_text."""
    from tokenizers import Tokenizer as RustTokenizer  # noqa: PLC0415 (this test only)

    rust = RustTokenizer.from_str(tokenizers.load_gpt2_vocab_merges(*tiny_gpt2).tokenizer.to_str())
    rust.add_tokens(["<tag>"])
    reference = tokenizers.HuggingFaceTokenizer(rust, "<|endoftext|>", {"type": "HuggingFaceTokenizer"}, as_text)
    texts = ["a<tag>b<|endoftext|>", "the <|endoftext|>", ""]
    expected = [ord("a"), 260, ord("b"), *(list(b"<|endoftext|>") if as_text else [259])]  # byte b is id b
    fast, backend = select_backend(reference, None)
    assert backend["name"] == "gigatoken"
    assert fast.encode_batch(texts) == reference.encode_batch(texts)
    assert fast.encode_batch(texts[:1]) == [expected]
    assert (fast.vocab_size, fast.eod, fast.description, fast.special_tokens_as_text) == (
        261, 259, reference.description, as_text)
    assert fast.decode(expected) == reference.decode(expected) == texts[0]
    ranks = build_tokenizer("TikTokenizer", byte_ranks, special_tokens_as_text=as_text)
    fast, backend = select_backend(ranks, None)
    assert backend["name"] == "gigatoken" and isinstance(fast, GigatokenTokenizer)
    assert fast.encode_batch(["a<|endoftext|>"]) == [[97, *(list(b"<|endoftext|>") if as_text else [256])]]
    assert fast.special_tokens_as_text is as_text


def test_gigatoken_encodes_no_texts_into_nothing_and_caps_its_threads(tiny_gpt2, monkeypatch):
    fast = select_backend(tokenizers.load_gpt2_vocab_merges(*tiny_gpt2), "gigatoken")[0]
    assert fast.encode_batch([]) == []
    ids, lengths = fast.encode_flat([])
    assert ids.shape == lengths.shape == (0,)
    monkeypatch.setenv("RAYON_NUM_THREADS", "16")
    fast.set_threads(3)
    assert os.environ["RAYON_NUM_THREADS"] == "3"


def test_the_encoder_is_rebuilt_only_past_the_memory_bound(tiny_gpt2, monkeypatch):
    """Growth since the build equal to GIGATOKEN_CACHE_BYTES keeps the encoder; one byte more rebuilds it, and the
    growth counts again from there (the resident memory scripted here)."""
    rss = [1 << 30]
    monkeypatch.setattr(tokenizers.psutil, "Process", lambda: SimpleNamespace(
        memory_info=lambda: SimpleNamespace(rss=rss[0])))
    fast = select_backend(tokenizers.load_gpt2_vocab_merges(*tiny_gpt2), "gigatoken")[0]
    first = fast.encoder
    rss[0] += tokenizers.GIGATOKEN_CACHE_BYTES
    assert fast.encode_batch(["the"]) == [[ord("t"), 256]] and (fast.rebuilds, fast.encoder) == (0, first)
    rss[0] += 1
    assert fast.encode_batch(["the"]) == [[ord("t"), 256]] and fast.rebuilds == 1 and fast.encoder is not first
    assert fast.built_at == rss[0]
    second = fast.encoder
    fast.encode_batch(["the"])
    assert (fast.rebuilds, fast.encoder) == (1, second)


def test_a_difference_is_quoted_by_the_texts_first_60_characters_and_the_first_12_ids(tiny_gpt2, byte_ranks,
                                                                                       monkeypatch):
    text = "the " * 20
    reference = tokenizers.load_gpt2_vocab_merges(*tiny_gpt2)
    other = build_tokenizer("TikTokenizer", byte_ranks)  # bytes only: another vocabulary
    builder = tokenizers.gigatoken_builder(other)
    monkeypatch.setattr(tokenizers, "gigatoken_builder", lambda tokenizer: builder)
    monkeypatch.setattr(tokenizers, "PROBE_TEXTS", [text])
    expected = reference.tokenizer.encode(text, add_special_tokens=False).ids
    with pytest.raises(TokenizerBackendError) as refusal:
        select_backend(reference, "gigatoken")
    assert str(refusal.value) == (f"--tokenizer-backend gigatoken: gigatoken 0.10.0 encodes {text[:60]!r} as "
                                  f"{list(text.encode())[:12]}, the tokenizer as {expected[:12]}")
