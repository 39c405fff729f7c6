"""angpt.data.tokenizers: every --tokenizer-type, offline, and tools/train_tokenizer.py."""

import base64
import json
import os
import re
import subprocess
import sys

import pytest

from angpt.data.files import sha256_of
from angpt.data.tokenizers import SENTENCEPIECE_TYPES, build_tokenizer, recorded_tokenizer

from conftest import ROOT, megatron_tokenizer, write_megatron_tiktoken

TOOLS = os.path.join(ROOT, "tools")
TEXTS = ["Hello world, hello tokenizers!", "  spaces\tand\nnewlines  ", "ünïcødé ✓ 日本語", "<|endoftext|> in the text"]


def bytes_to_unicode() -> dict:
    """GPT-2's map from bytes to the printable characters its vocab.json spells them with."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    extra = [byte for byte in range(256) if byte not in printable]
    return {**{byte: chr(byte) for byte in printable}, **{byte: chr(256 + n) for n, byte in enumerate(extra)}}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    directory = tmp_path_factory.mktemp("train")
    with open(directory / "corpus.jsonl", "w") as file:
        for i in range(300):
            file.write(json.dumps({"text": f"The quick brown fox {i} jumps over the lazy dog ünïcødé."}) + "\n")
    (directory / "extra.txt").write_text("A plain text file is one more document.\n")
    done = subprocess.run([sys.executable, os.path.join(TOOLS, "train_tokenizer.py"), "--input",
                           directory / "corpus.jsonl", directory / "*.txt", "--vocab-size", "320",
                           "--output-dir", directory / "bpe"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    # Without a terminal, the summary alone (the progress bars of `tokenizers` left blank lines on stdout).
    assert done.stdout == f"{directory / 'bpe' / 'tokenizer.json'}: 320 tokens, <|endoftext|> = 0\n"
    return directory / "bpe"


@pytest.mark.slow
def test_trained_tokenizer_round_trips_file_and_directory(trained):
    with open(trained / "tokenizer.json") as file:
        vocab = json.load(file)["model"]["vocab"]
    assert len(vocab) == 320 and "Ġquick" in vocab  # merges were learned from the text
    by_directory = build_tokenizer("HuggingFaceTokenizer", str(trained))
    by_file = build_tokenizer("HuggingFaceTokenizer", str(trained / "tokenizer.json"))
    assert by_directory.vocab_size == 320 and by_directory.eod == vocab["<|endoftext|>"]
    encoded = by_directory.encode_batch(TEXTS)
    assert encoded == by_file.encode_batch(TEXTS)
    assert [by_directory.decode(ids) for ids in encoded] == TEXTS
    assert encoded[3][0] == by_directory.eod and by_directory.eod not in encoded[3][1:]  # as Megatron-LM
    as_text = build_tokenizer("HuggingFaceTokenizer", str(trained), special_tokens_as_text=True)
    assert by_directory.eod not in as_text.encode_batch([TEXTS[3]])[0]
    assert as_text.encode_batch(TEXTS[:3]) == encoded[:3]
    assert len(encoded[0]) < len(TEXTS[0].encode())
    json.dumps(by_directory.description)


@pytest.mark.slow
def test_trained_tokenizer_reads_in_transformers_as_megatron_reads_it(trained):
    """Megatron-LM's HuggingFaceTokenizer is transformers' AutoTokenizer on the directory: its EOD is the EOS,
    and it encodes with tokens_to_ids(tokenize(text)) (megatron-core 0.16), or tokenizer(text) (later)."""
    from transformers import AutoTokenizer  # noqa: PLC0415 (slow to import: only this test needs it)

    theirs = AutoTokenizer.from_pretrained(str(trained), use_fast=False)  # Megatron-LM's default use_fast
    ours = build_tokenizer("HuggingFaceTokenizer", str(trained))
    assert theirs.eos_token == "<|endoftext|>" and theirs.eos_token_id == ours.eod == 0
    assert [theirs.convert_tokens_to_ids(theirs.tokenize(text)) for text in TEXTS] == ours.encode_batch(TEXTS)
    assert [theirs(text).input_ids for text in TEXTS] == ours.encode_batch(TEXTS)  # and no BOS is added
    as_text = build_tokenizer("HuggingFaceTokenizer", str(trained), special_tokens_as_text=True)
    assert theirs(TEXTS[3], split_special_tokens=True).input_ids == as_text.encode_batch([TEXTS[3]])[0]


@pytest.mark.slow
def test_train_tokenizer_reports_bad_line(tmp_path):
    (tmp_path / "corpus.jsonl").write_text('{"text": "fine"}\n{"text": 3}\n')
    command = [sys.executable, os.path.join(TOOLS, "train_tokenizer.py"), "--input", str(tmp_path / "corpus.jsonl"),
               "--vocab-size", "300", "--output-dir", str(tmp_path / "bpe")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and f"{tmp_path / 'corpus.jsonl'}:2: not a string" in done.stderr
    assert not (tmp_path / "bpe").exists()
    done = subprocess.run(command + ["--skip-bad-lines"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "skipped 1 bad lines: 1 not a string" in done.stdout


@pytest.mark.slow
def test_directory_config_names_the_eos(trained, tmp_path):
    (tmp_path / "tokenizer.json").write_bytes((trained / "tokenizer.json").read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<|endoftext|>"}}))
    assert build_tokenizer("HuggingFaceTokenizer", str(tmp_path)).eod == 0
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    with pytest.raises(ValueError, match="no end-of-document token '</s>'"):
        build_tokenizer("HuggingFaceTokenizer", str(tmp_path))


def test_gpt2_vocab_and_merges(tmp_path):
    """A tiny GPT-2-format pair: the 256 byte symbols, merges 'h e', 'Ġ t', 'Ġt he', and <|endoftext|>."""
    symbols = bytes_to_unicode()
    vocab = {symbols[byte]: byte for byte in range(256)}
    for merged in ("he", "Ġt", "Ġthe"):
        vocab[merged] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    (tmp_path / "vocab.json").write_text(json.dumps(vocab))
    (tmp_path / "merges.txt").write_text("#version: 0.2\nh e\nĠ t\nĠt he\n")
    tokenizer = build_tokenizer("GPT2BPETokenizer", vocab_file=str(tmp_path / "vocab.json"),
                                merge_file=str(tmp_path / "merges.txt"))
    assert (tokenizer.vocab_size, tokenizer.eod) == (260, 259)
    assert tokenizer.encode_batch(["the the!", "é"]) == [[ord("t"), 256, 258, ord("!")], [0xC3, 0xA9]]
    assert tokenizer.decode([ord("t"), 256, 258]) == "the the"
    # As Megatron-LM's GPT2BPETokenizer (Hugging Face's GPT2Tokenizer): "<|endoftext|>" in the text is the EOD.
    assert tokenizer.encode_batch(["a<|endoftext|>"]) == [[ord("a"), 259]]
    as_text = build_tokenizer("GPT2BPETokenizer", vocab_file=str(tmp_path / "vocab.json"),
                              merge_file=str(tmp_path / "merges.txt"), special_tokens_as_text=True)
    assert as_text.encode_batch(["a<|endoftext|>"]) == [list(b"a<|endoftext|>")]
    assert (as_text.vocab_size, as_text.eod) == (260, 259)


def test_tiktoken_file(tmp_path):
    ranks = [bytes([byte]) for byte in range(256)] + [b"ab", b"abc"]
    (tmp_path / "tiny.tiktoken").write_text("".join(f"{base64.b64encode(t).decode()} {r}\n"
                                                    for r, t in enumerate(ranks)))
    tokenizer = build_tokenizer("TikTokenizer", str(tmp_path / "tiny.tiktoken"))
    assert (tokenizer.vocab_size, tokenizer.eod) == (259, 258)
    # As Megatron-LM's TikTokenizer (encode(allowed_special="all")): "<|endoftext|>" in the text is the EOD.
    assert tokenizer.encode_batch(["abc abd", "<|endoftext|>"]) == [[257, 32, 256, 100], [258]]
    as_text = build_tokenizer("TikTokenizer", str(tmp_path / "tiny.tiktoken"), special_tokens_as_text=True)
    assert as_text.encode_batch(["abc abd", "<|endoftext|>"]) == [[257, 32, 256, 100], list(b"<|endoftext|>")]
    assert tokenizer.description["model"]["path"] == str(tmp_path / "tiny.tiktoken")


def test_missing_files_and_flags_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="--tokenizer-model .*nothing.json: no such file"):
        build_tokenizer("HuggingFaceTokenizer", str(tmp_path / "nothing.json"))
    with pytest.raises(ValueError, match="--vocab-file and --merge-file"):
        build_tokenizer("GPT2BPETokenizer")
    with pytest.raises(ValueError, match="--tokenizer-type 'SentencePiece'"):
        build_tokenizer("SentencePiece")


@pytest.fixture(scope="module")
def gpt2_ranks(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt2") / "gpt2.tiktoken"
    done = subprocess.run([sys.executable, os.path.join(TOOLS, "fetch_gpt2_bpe.py"), "--output", str(path)],
                          capture_output=True, text=True, timeout=180)
    if done.returncode != 0 and "sha256" not in done.stderr:
        pytest.skip(f"cannot download openai-whisper from PyPI: {done.stderr[-500:]}")
    assert done.returncode == 0, done.stderr
    return str(path)


@pytest.mark.slow
def test_real_gpt2_ranks(gpt2_ranks):
    tokenizer = build_tokenizer("GPT2BPETokenizer", tokenizer_model=gpt2_ranks)
    assert (tokenizer.vocab_size, tokenizer.eod) == (50257, 50256)
    assert tokenizer.encode_batch(["Hello world"]) == [[15496, 995]]  # GPT-2's published ids
    assert tokenizer.encode_batch(["<|endoftext|>"]) == [[50256]]
    as_text = build_tokenizer("GPT2BPETokenizer", tokenizer_model=gpt2_ranks, special_tokens_as_text=True)
    assert as_text.encode_batch(["<|endoftext|>"]) == [[27, 91, 437, 1659, 5239, 91, 29]]  # < | end of text | >
    assert tokenizer.decode(tokenizer.encode_batch(TEXTS)[2]) == TEXTS[2]


# Merges after the 256 bytes of a Megatron-LM TikTokenizer vocabulary; "aB" is one piece of pattern v1 only (v2
# splits lower from upper case).
MERGES = [b"th", b"he", b"the", b" the", b"in", b"ing", b"ab", b"abc", b"aB"]
MEGATRON_TEXTS = TEXTS + ["the thing in the ring </s> and on", "<s>x<SPECIAL_7> <SPECIAL_999><SPECIAL_1000>",
                          "abc abd aB 123", "CamelCase HTTPServer don't", ""]


@pytest.fixture(scope="module")
def megatron_json(tmp_path_factory):
    return write_megatron_tiktoken(tmp_path_factory.mktemp("megatron") / "vocab.json", MERGES)


@pytest.mark.parametrize("pattern, special", [(None, 1000), ("v1", 7), ("v2", 1000)])
def test_megatron_tiktoken_json_encodes_as_megatron_core(megatron_json, pattern, special):
    """Megatron-LM's TikTokenizer (a .json vocabulary): the ids of megatron-core's own tokenize(), its special
    tokens first and read from the text ("</s>" is the EOD), ordinary text with special_tokens_as_text; the
    description rebuilds it."""
    size = special + 256 + len(MERGES)
    theirs = megatron_tokenizer("tiktoken", megatron_json, num_special_tokens=special, special_tokens=None,
                                vocab_size=size, **({"pattern": pattern} if pattern else {}))
    expected = [theirs.tokenize(text) for text in MEGATRON_TEXTS]
    ours = build_tokenizer("TikTokenizer", megatron_json, tiktoken_pattern=pattern,
                           tiktoken_num_special_tokens=special, vocab_size=size)
    assert (ours.vocab_size, ours.eod) == (theirs.vocab_size, theirs.eod) == (size, 2)
    assert ours.encode_batch(MEGATRON_TEXTS) == expected
    assert ours.encode_batch(["a</s>", "aB"]) == [[special + ord("a"), 2],
                                                  [size - 1] if pattern == "v1" else [special + 97, special + 66]]
    assert [ours.decode(ids) for ids in expected] == MEGATRON_TEXTS
    as_text = build_tokenizer("TikTokenizer", megatron_json, special_tokens_as_text=True, tiktoken_pattern=pattern,
                              tiktoken_num_special_tokens=special, vocab_size=size)
    special_texts = [text for text in MEGATRON_TEXTS if "</s>" in text or "<s>" in text]
    ordinary = [theirs._tokenizer.tokenizer.encode_ordinary(text) for text in special_texts]
    assert as_text.encode_batch(special_texts) == ordinary and all(2 not in ids for ids in ordinary)
    assert ours.description == {"type": "TikTokenizer", "model": {"path": megatron_json,
                                                                  "sha256": sha256_of(megatron_json)},
                                "pattern": pattern or "v2", "num_special_tokens": special, "vocab_size": size,
                                "eod_token": "</s>"}
    assert recorded_tokenizer(json.loads(json.dumps(ours.description))).encode_batch(MEGATRON_TEXTS) == expected


def test_megatron_tiktoken_flags_are_refused_in_one_line_at_their_boundaries(megatron_json, tmp_path):
    full = 1000 + 256 + len(MERGES)
    assert build_tokenizer("TikTokenizer", megatron_json, vocab_size=full).vocab_size == full
    # Fewer ids cut the vocabulary, as megatron-core reads it: the last merge is gone.
    cut = build_tokenizer("TikTokenizer", megatron_json, tiktoken_pattern="v1", vocab_size=full - 1)
    assert cut.vocab_size == full - 1 and cut.encode_batch(["aB"]) == [[1000 + 97, 1000 + 66]]
    path = re.escape(megatron_json)
    with pytest.raises(ValueError, match=rf"^--vocab-size {full + 1} exceeds --tiktoken-num-special-tokens 1000 plus "
                                         rf"the {full - 1000} tokens of --tokenizer-model {path}: give --vocab-size "
                                         rf"{full} \(or less, to cut the vocabulary\)$"):
        build_tokenizer("TikTokenizer", megatron_json, vocab_size=full + 1)
    with pytest.raises(ValueError, match=r"^Megatron-LM's default vocabulary size 131072 exceeds "):
        build_tokenizer("TikTokenizer", megatron_json)
    assert build_tokenizer("TikTokenizer", megatron_json, tiktoken_num_special_tokens=7, vocab_size=full - 993).eod == 2
    assert build_tokenizer("TikTokenizer", megatron_json, tiktoken_num_special_tokens=full - 1,
                           vocab_size=full).vocab_size == full
    for special, size in ((6, full - 994), (full, full)):
        with pytest.raises(ValueError, match=rf"^--tiktoken-num-special-tokens {special}: at least the 7 of <unk> to "
                                             rf"<sep>, and below --vocab-size {size}$"):
            build_tokenizer("TikTokenizer", megatron_json, tiktoken_num_special_tokens=special, vocab_size=size)
    with pytest.raises(ValueError, match=r"^--tiktoken-pattern v3: choose v1 or v2$"):
        build_tokenizer("TikTokenizer", megatron_json, tiktoken_pattern="v3", vocab_size=full)
    entries = json.loads(open(megatron_json).read())
    (tmp_path / "unordered.json").write_text(json.dumps(entries[1:] + entries[:1]))
    with pytest.raises(ValueError, match=r"unordered.json: not a Megatron-LM tiktoken vocabulary \(a .json list of "
                                         r"rank, token_bytes and token_str entries in rank order, the 256 single bytes "
                                         r"first\)$"):
        build_tokenizer("TikTokenizer", str(tmp_path / "unordered.json"), vocab_size=full)
    with pytest.raises(ValueError, match=r"^TikTokenizer needs --tokenizer-model \(a Megatron-LM .json vocabulary, "
                                         r"or a .tiktoken ranks file\)$"):
        build_tokenizer("TikTokenizer")


def test_megatron_tiktoken_flags_with_a_ranks_file_are_refused_unless_they_ask_for_nothing(tmp_path):
    """angpt's .tiktoken layout has GPT-2's pattern, no special tokens before the ranks and its own size."""
    path = str(tmp_path / "tiny.tiktoken")
    with open(path, "w") as file:
        file.writelines(f"{base64.b64encode(bytes([byte])).decode()} {byte}\n" for byte in range(256))
    assert build_tokenizer("TikTokenizer", path, tiktoken_num_special_tokens=1000, vocab_size=257).vocab_size == 257
    only_json = "TikTokenizer reads it only with a Megatron-LM .json vocabulary"
    for flags, message in (({"tiktoken_pattern": "v2"}, rf"--tiktoken-pattern v2: {only_json}; .*tiny.tiktoken is a "
                                                        r"ranks file, split with GPT-2's pattern"),
                           ({"tiktoken_num_special_tokens": 999}, rf"--tiktoken-num-special-tokens 999: {only_json}; "
                                                                  r".*tiny.tiktoken is a ranks file, <\|endoftext\|> "
                                                                  "after its last rank"),
                           ({"vocab_size": 258}, rf"--vocab-size 258: {only_json}; the ranks file .*tiny.tiktoken has "
                                                 "257 ids")):
        with pytest.raises(ValueError, match=f"^{message}$"):
            build_tokenizer("TikTokenizer", path, **flags)


@pytest.mark.parametrize("tokenizer_type", SENTENCEPIECE_TYPES)
def test_sentencepiece_types_encode_as_megatron_core(sentencepiece_model, tokenizer_type, tmp_path):
    """Megatron-LM 0.16's SentencePiece types (megatron-core's sentencepiece library, legacy=False): the ids of
    its tokenize(); control symbols never come from text ("</s>" is pieces), the user-defined <sep> does, so
    special_tokens_as_text changes nothing."""
    theirs = megatron_tokenizer("sentencepiece", sentencepiece_model, legacy=False, special_tokens=None)
    texts = TEXTS + ["the fox </s> <s> <unk> jumps", "a<sep>b", "", "  two  spaces  "]
    expected = [theirs.tokenize(text) for text in texts]
    ours = build_tokenizer(tokenizer_type, sentencepiece_model)
    assert (ours.vocab_size, ours.eod) == (theirs.vocab_size, theirs.eod) == (120, 2)
    assert ours.encode_batch(texts) == expected
    assert all(2 not in ids for ids in expected) and 3 in expected[-3]  # </s> is 2, <sep> 3
    assert build_tokenizer(tokenizer_type, sentencepiece_model, special_tokens_as_text=True).encode_batch(texts) == \
        expected
    assert [ours.decode(ids) for ids in expected] == [theirs.detokenize(ids) for ids in expected]
    assert ours.description == {"type": tokenizer_type, "model": {"path": sentencepiece_model,
                                                                  "sha256": sha256_of(sentencepiece_model)}}
    assert recorded_tokenizer(ours.description).encode_batch(texts) == expected
    (tmp_path / "bad.model").write_text("not a model")
    with pytest.raises(ValueError, match=r"^--tokenizer-model .*bad.model: not a SentencePiece model \([^\n]*\)$"):
        build_tokenizer(tokenizer_type, str(tmp_path / "bad.model"))


def test_a_hugging_face_vocabulary_counts_its_added_tokens_and_decodes_them(tmp_path):
    """<|endoftext|> added after a 2-token WordLevel vocabulary takes id 2: 3 ids in all, the last the end of
    document, which decoding keeps (as Megatron-LM's detokenize, which does not skip special tokens)."""
    from tokenizers import Tokenizer, models  # noqa: PLC0415 (this test's only use)

    tokenizer = Tokenizer(models.WordLevel({"a": 0, "b": 1}, unk_token="a"))
    tokenizer.add_special_tokens(["<|endoftext|>"])
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    built = build_tokenizer("HuggingFaceTokenizer", str(tmp_path / "tokenizer.json"))
    assert (built.vocab_size, built.eod) == (3, 2)
    assert built.decode([1, 2]) == "b <|endoftext|>"
