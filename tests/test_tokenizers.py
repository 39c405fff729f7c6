"""angpt.data.tokenizers: every --tokenizer-type, offline, and tools/train_tokenizer.py."""

import base64
import json
import os
import subprocess
import sys

import pytest

from angpt.data.tokenizers import build_tokenizer

from conftest import ROOT

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
