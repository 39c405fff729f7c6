"""angpt.data.tokenizers: every --tokenizer-type, offline, and tools/train_tokenizer.py."""

import base64
import json
import logging
import os
import re
import subprocess
import sys

import pytest

from angpt.config.files import sha256_of
from angpt.data import tokenizers
from angpt.data.tokenizers import SENTENCEPIECE_TYPES, build_tokenizer, load_gpt2_vocab_merges, recorded_tokenizer

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


def tiny_hugging_face(directory, config=None) -> str:
    """A tokenizer.json of a 3-word WordLevel vocabulary split at whitespace, with the special tokens <|endoftext|>,
    </s> and <s> added (ids 3, 4, 5) and a post-processor that puts <s> before each text (as a Llama-style
    tokenizer.json does), in `directory` with `config` as its tokenizer_config.json (none when None)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors  # noqa: PLC0415 (these tests only)

    tokenizer = Tokenizer(models.WordLevel({"a": 0, "b": 1, "<unk>": 2}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(["<|endoftext|>", "</s>", "<s>"])
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 5)])
    os.makedirs(directory, exist_ok=True)
    tokenizer.save(os.path.join(directory, "tokenizer.json"))
    if config is not None:
        with open(os.path.join(directory, "tokenizer_config.json"), "w") as file:
            json.dump(config, file)
    return str(directory)


@pytest.mark.parametrize("config, eos, eod", [
    ({"eos_token": {"content": "</s>", "special": True}}, "</s>", 4),  # transformers' AddedToken form
    ({"eos_token": "</s>"}, "</s>", 4),
    ({"eos_token": None}, "<|endoftext|>", 3),
    ({"eos_token": {"content": None}}, "<|endoftext|>", 3),
    ({"bos_token": "<s>"}, "<|endoftext|>", 3),
    (None, "<|endoftext|>", 3),  # no tokenizer_config.json
])
def test_a_hugging_face_directory_takes_its_eos_as_the_end_of_document(tmp_path, config, eos, eod):
    """Megatron-LM's HuggingFaceTokenizer ends documents with the EOS that transformers reads from
    tokenizer_config.json (a string, or an added token's "content"); without one, <|endoftext|> (the module's
    docstring). The description names the file, its sha256 and that token, and rebuilds the same tokenizer."""
    directory = tiny_hugging_face(tmp_path / "hf", config)
    path = os.path.join(directory, "tokenizer.json")
    tokenizer = build_tokenizer("HuggingFaceTokenizer", directory)
    assert (tokenizer.eod, tokenizer.vocab_size) == (eod, 6)
    assert tokenizer.description == {"type": "HuggingFaceTokenizer", "model": {"path": path, "sha256": sha256_of(path)},
                                     "eod_token": eos}
    rebuilt = recorded_tokenizer(json.loads(json.dumps(tokenizer.description)))
    assert type(rebuilt) is type(tokenizer) and rebuilt.eod == eod
    assert rebuilt.encode_batch(["a b </s>", "<|endoftext|>"]) == [[0, 1, 4], [3]]


def test_a_hugging_face_tokenizer_adds_no_special_tokens_of_its_own_and_reads_them_from_text_by_default(tmp_path):
    """As Megatron-LM 0.16's HuggingFaceTokenizer (tokens_to_ids(tokenize(text))): the post-processor's <s> is not
    added, and a special token's text is that token; special_tokens_as_text reads it as words (here the unknown
    word, 2). load_huggingface's own default is Megatron-LM's."""
    from tokenizers import Tokenizer  # noqa: PLC0415 (this test only)

    directory = tiny_hugging_face(tmp_path / "hf", {"eos_token": "</s>"})
    assert Tokenizer.from_file(os.path.join(directory, "tokenizer.json")).encode("a b").ids == [5, 0, 1]
    for tokenizer in (build_tokenizer("HuggingFaceTokenizer", directory),
                      tokenizers.load_huggingface(directory, "HuggingFaceTokenizer")):
        assert tokenizer.encode_batch(["a b", "a </s> b", ""]) == [[0, 1], [0, 4, 1], []]
        assert not tokenizer.special_tokens_as_text
    as_text = build_tokenizer("HuggingFaceTokenizer", directory, special_tokens_as_text=True)
    assert as_text.special_tokens_as_text and as_text.encode_batch(["a </s> b"]) == [[0, 2, 1]]


def test_a_hugging_face_directory_without_its_files_or_eos_is_refused_naming_them(tmp_path):
    directory = tiny_hugging_face(tmp_path / "hf", {"eos_token": "<eos>"})
    path = os.path.join(directory, "tokenizer.json")
    description = {"type": "HuggingFaceTokenizer", "model": {"path": path, "sha256": sha256_of(path)}}
    with pytest.raises(ValueError) as refusal:
        build_tokenizer("HuggingFaceTokenizer", directory)
    assert str(refusal.value) == f"{description}: the tokenizer has no end-of-document token '<eos>'"
    os.remove(path)
    with pytest.raises(FileNotFoundError) as missing:
        build_tokenizer("HuggingFaceTokenizer", directory)
    assert str(missing.value) == f"--tokenizer-model: no tokenizer file {path}"


def test_a_recorded_tokenizer_is_rebuilt_only_from_its_own_unchanged_files(tmp_path):
    """recorded_tokenizer: None for what is not one of our descriptions or names a file that is gone (the dataset
    is then read without it); a ValueError naming the file when it has changed (its sha256). The directory's EOS is
    </s> (4)."""
    directory = tiny_hugging_face(tmp_path / "hf", {"eos_token": "</s>"})
    description = build_tokenizer("HuggingFaceTokenizer", directory).description
    for other in (None, "HuggingFaceTokenizer", ["HuggingFaceTokenizer"], {"type": "NullTokenizer"},
                  {"type": "HuggingFaceTokenizer"}, {**description, "model": {"path": str(tmp_path / "gone.json")}}):
        assert recorded_tokenizer(other) is None
    # A description written before the end-of-document token was recorded: <|endoftext|>, angpt's default then.
    older = recorded_tokenizer({name: value for name, value in description.items() if name != "eod_token"})
    assert (older.eod, recorded_tokenizer(description).eod) == (3, 4)
    path = description["model"]["path"]
    with open(path, "a") as file:
        file.write("\n")
    with pytest.raises(ValueError) as changed:
        recorded_tokenizer(description)
    assert str(changed.value) == f"its tokenizer file {path} has changed since the dataset was written (sha256)"


def test_encode_flat_is_every_id_as_int64_and_each_texts_count(tmp_path, megatron_json, sentencepiece_model):
    """(the ids of all the texts one after another, int64; the number of each text's ids), for every library,
    against the ids of encode_batch; no texts give two empty arrays."""
    import numpy  # noqa: PLC0415 (this test only)

    texts = ["a b a", "", "b </s>"]
    for tokenizer in (build_tokenizer("HuggingFaceTokenizer", tiny_hugging_face(tmp_path / "hf", {})),
                      build_tokenizer("TikTokenizer", megatron_json, tiktoken_num_special_tokens=1000,
                                      vocab_size=1000 + 256 + len(MERGES)),
                      build_tokenizer("Llama2Tokenizer", sentencepiece_model)):
        expected = tokenizer.encode_batch(texts)
        assert expected[0] and expected[1] == [] and expected[2]
        ids, lengths = tokenizer.encode_flat(texts)
        assert ids.dtype == lengths.dtype == numpy.int64
        assert ids.tolist() == expected[0] + expected[2] and lengths.tolist() == [len(part) for part in expected]
        ids, lengths = tokenizer.encode_flat([])
        assert ids.dtype == numpy.int64 and ids.shape == lengths.shape == (0,)


class ThreadsSpy:
    """A library encoder (tiktoken's Encoding, sentencepiece's processor) that records the num_threads of each
    batch it encodes."""

    def __init__(self, encoder):
        self.encoder, self.threads = encoder, []

    def __getattr__(self, name):
        method = getattr(self.encoder, name)

        def recorded(*args, **kwargs):
            self.threads.append(kwargs.get("num_threads"))
            return method(*args, **kwargs)
        return recorded if name in ("encode", "encode_batch", "encode_ordinary_batch") else method


@pytest.mark.parametrize("as_text", [False, True])
def test_set_threads_caps_the_librarys_batch_threads(tmp_path, megatron_json, sentencepiece_model, monkeypatch,
                                                     as_text):
    """--workers' threads: tiktoken's and sentencepiece's batch encoders take num_threads per call (the CPU count
    until set); the Rust libraries (tokenizers, gigatoken) read RAYON_NUM_THREADS."""
    ranks = tmp_path / "bytes.tiktoken"
    ranks.write_text("".join(f"{base64.b64encode(bytes([byte])).decode()} {byte}\n" for byte in range(256)))
    for tokenizer, attribute in ((build_tokenizer("TikTokenizer", str(ranks), special_tokens_as_text=as_text),
                                  "encoding"),
                                 (build_tokenizer("TikTokenizer", megatron_json, special_tokens_as_text=as_text,
                                                  tiktoken_num_special_tokens=1000,
                                                  vocab_size=1000 + 256 + len(MERGES)), "encoder"),
                                 (build_tokenizer("Llama2Tokenizer", sentencepiece_model,
                                                  special_tokens_as_text=as_text), "encoder")):
        spy = ThreadsSpy(getattr(tokenizer, attribute))
        setattr(tokenizer, attribute, spy)
        expected = tokenizer.encode_batch(["a b", "c"])
        tokenizer.set_threads(3)
        assert tokenizer.encode_batch(["a b", "c"]) == expected
        assert spy.threads == [os.cpu_count(), 3]
    monkeypatch.setenv("RAYON_NUM_THREADS", "16")
    build_tokenizer("HuggingFaceTokenizer", tiny_hugging_face(tmp_path / "hf", {})).set_threads(3)
    assert os.environ["RAYON_NUM_THREADS"] == "3"


def gpt2_pair(directory, merges: str, vocab=None) -> tuple:
    """vocab.json (the 256 byte symbols, "he", "Ġt", "Ġthe", <|endoftext|>, or `vocab`) and merges.txt (`merges`)."""
    if vocab is None:
        symbols = bytes_to_unicode()
        vocab = {symbols[byte]: byte for byte in range(256)}
        for merged in ("he", "Ġt", "Ġthe", "<|endoftext|>"):
            vocab[merged] = len(vocab)
    (directory / "vocab.json").write_text(json.dumps(vocab))
    (directory / "merges.txt").write_bytes(merges.encode())
    return str(directory / "vocab.json"), str(directory / "merges.txt")


def test_gpt2_merges_are_read_as_the_tokenizers_library_reads_them(tmp_path):
    """BPE.from_file's reading: Windows line ends are fine; a merge is two tokens split at one space (two spaces or
    a tab are refused, as BPE.from_file refuses them); the message quotes the line's first 40 characters."""
    from tokenizers import models  # noqa: PLC0415 (this test only)

    vocab_file, merge_file = gpt2_pair(tmp_path, "#version: 0.2\r\nh e\r\nĠ t\r\nĠt he\r\n")
    crlf = load_gpt2_vocab_merges(vocab_file, merge_file)
    assert crlf.encode_batch(["the the!"]) == [[ord("t"), 256, 258, ord("!")]]
    for line in ("h  e", "h\te"):
        gpt2_pair(tmp_path, f"h e\n{line}\n")
        with pytest.raises(Exception, match="Merges text file invalid at line 2"):
            models.BPE.from_file(vocab_file, merge_file)
        with pytest.raises(ValueError) as refusal:
            load_gpt2_vocab_merges(vocab_file, merge_file)
        assert str(refusal.value) == f"{merge_file}:2: not a merge of two tokens of {vocab_file}: {line!r}"
    long = "h e " + "x" * 60
    gpt2_pair(tmp_path, long + "\n")
    with pytest.raises(ValueError) as refusal:
        load_gpt2_vocab_merges(vocab_file, merge_file)
    assert str(refusal.value) == f"{merge_file}:1: not a merge of two tokens of {vocab_file}: {long[:40]!r}"


@pytest.mark.parametrize("vocab", [["a", "b"], {"a": -1}, {"a": "1"}, {"a": 1.0}, {"a": True}])
def test_a_gpt2_vocab_that_is_not_tokens_to_ids_is_refused(tmp_path, vocab):
    """An object of tokens to ids (whole numbers from 0; id 0 is one): anything else is refused in one line."""
    vocab_file, merge_file = gpt2_pair(tmp_path, "#version: 0.2\n", vocab=vocab)
    with pytest.raises(ValueError) as refusal:
        load_gpt2_vocab_merges(vocab_file, merge_file)
    assert str(refusal.value) == f"{vocab_file}: not a BPE vocab.json (an object of tokens to ids)"
    gpt2_pair(tmp_path, "#version: 0.2\n", vocab={"a": 0, "<|endoftext|>": 1})
    assert load_gpt2_vocab_merges(vocab_file, merge_file).eod == 1


def test_a_gpt2_pair_is_described_by_both_files_and_reads_special_tokens_as_megatron_lm(tmp_path):
    """load_gpt2_vocab_merges' own default reads <|endoftext|> in the text as the EOD, as Megatron-LM's
    GPT2BPETokenizer (the Hugging Face export builds from it with that default)."""
    vocab_file, merge_file = gpt2_pair(tmp_path, "#version: 0.2\nh e\nĠ t\nĠt he\n")
    tokenizer = load_gpt2_vocab_merges(vocab_file, merge_file)
    assert tokenizer.encode_batch(["a<|endoftext|>"]) == [[ord("a"), 259]] and not tokenizer.special_tokens_as_text
    assert tokenizer.description == {"type": "GPT2BPETokenizer",
                                     "vocab_file": {"path": vocab_file, "sha256": sha256_of(vocab_file)},
                                     "merge_file": {"path": merge_file, "sha256": sha256_of(merge_file)},
                                     "eod_token": "<|endoftext|>"}
    rebuilt = recorded_tokenizer(tokenizer.description)
    assert rebuilt.encode_batch(["the a<|endoftext|>"]) == tokenizer.encode_batch(["the a<|endoftext|>"])


def test_every_description_rebuilds_its_tokenizer_with_the_same_description(tmp_path, sentencepiece_model):
    """A dataset's metadata holds the description; recorded_tokenizer rebuilds the tokenizer it names, which
    describes itself the same way: a ranks file for TikTokenizer and GPT2BPETokenizer (--tokenizer-model), a
    vocab/merges pair, and each SentencePiece type."""
    ranks = tmp_path / "bytes.tiktoken"
    ranks.write_text("".join(f"{base64.b64encode(bytes([byte])).decode()} {byte}\n" for byte in range(256)))
    vocab_file, merge_file = gpt2_pair(tmp_path, "#version: 0.2\nh e\n")
    built = [build_tokenizer("TikTokenizer", str(ranks)),
             build_tokenizer("GPT2BPETokenizer", tokenizer_model=str(ranks)),
             build_tokenizer("GPT2BPETokenizer", vocab_file=vocab_file, merge_file=merge_file),
             *(build_tokenizer(kind, sentencepiece_model) for kind in SENTENCEPIECE_TYPES)]
    for tokenizer in built:
        rebuilt = recorded_tokenizer(json.loads(json.dumps(tokenizer.description)))
        assert type(rebuilt) is type(tokenizer) and rebuilt.description == tokenizer.description
        assert rebuilt.encode_batch(["the ab<|endoftext|>"]) == tokenizer.encode_batch(["the ab<|endoftext|>"])


def ranks_file(path, lines: list) -> str:
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


def byte_lines(count: int = 256) -> list:
    return [f"{base64.b64encode(bytes([byte])).decode()} {byte}" for byte in range(count)]


def test_a_ranks_file_skips_blank_lines_and_describes_its_end_of_document(tmp_path):
    """Blank lines are skipped wherever they are, as tiktoken's load_tiktoken_bpe skips them; <|endoftext|> takes the
    id after the last rank and decodes back to its text."""
    lines = byte_lines()
    path = ranks_file(tmp_path / "gaps.tiktoken", lines[:100] + [""] + lines[100:] + ["", ""])
    tokenizer = build_tokenizer("TikTokenizer", path)
    assert (tokenizer.vocab_size, tokenizer.eod) == (257, 256)
    assert tokenizer.encode_batch(["\xff"]) == [[0xC3, 0xBF]]  # ranks past the blank line are read
    assert tokenizer.decode([0xC3, 0xBF, 256]) == "\xff<|endoftext|>"
    assert tokenizer.description == {"type": "TikTokenizer", "model": {"path": path, "sha256": sha256_of(path)},
                                     "eod_token": "<|endoftext|>"}


@pytest.mark.parametrize("bad, message", [
    ("Y*Q= 256", "{path}:257: not a base64 token and its rank: b'Y*Q= 256'"),  # not base64 (only its alphabet)
    ("YWI= x", "{path}:257: not a base64 token and its rank: b'YWI= x'"),
    ("YWI= 256 7", "{path}:257: not a base64 token and its rank: b'YWI= 256 7'"),
    ("*" * 50 + " 256", "{path}:257: not a base64 token and its rank: b'" + "*" * 40 + "'"),  # its first 40 shown
    ("YQ== 256", "{path}:257: token b'a' or rank 256 given twice"),  # "a" again, at a new rank
    ("YWI= 97", "{path}:257: token b'ab' or rank 97 given twice"),  # a new token at the rank of "a"
])
def test_a_ranks_file_line_that_is_not_a_new_token_and_rank_is_refused_naming_it(tmp_path, bad, message):
    path = ranks_file(tmp_path / "bad.tiktoken", byte_lines() + [bad])
    with pytest.raises(ValueError) as refusal:
        build_tokenizer("TikTokenizer", path)
    assert str(refusal.value) == message.format(path=path)


@pytest.mark.parametrize("tokenizer_type, kind", [("Llama2Tokenizer", "a SentencePiece .model file"),
                                                  ("TikTokenizer", "a Megatron-LM .json vocabulary")])
def test_megatron_cores_libraries_need_a_model_file_and_say_which(tmp_path, tokenizer_type, kind):
    """Without --tokenizer-model, or with one that is not a file (a directory), the refusal names the kind of file
    each library reads."""
    directory = tmp_path / "vocab.json"  # a directory, with the suffix TikTokenizer reads with megatron-core
    directory.mkdir()
    with pytest.raises(ValueError) as refusal:
        build_tokenizer(tokenizer_type, str(directory))
    assert str(refusal.value) == f"{tokenizer_type} needs --tokenizer-model ({kind}); there is no {directory}"
    with pytest.raises(ValueError) as refusal:
        tokenizers.MegatronCoreTokenizer(tokenizer_type, None)
    assert str(refusal.value) == f"{tokenizer_type} needs --tokenizer-model ({kind})"


def test_megatron_cores_tiktoken_info_lines_are_silenced_and_no_other_logger(megatron_json, caplog):
    """megatron-core's tiktoken library logs an INFO line ("Adding special tokens ...") with every build: its own
    logger is raised to WARNING, and the process's other loggers keep their levels."""
    caplog.set_level(logging.INFO)
    build_tokenizer("TikTokenizer", megatron_json, tiktoken_num_special_tokens=1000,
                    vocab_size=1000 + 256 + len(MERGES))
    assert logging.getLogger().level == logging.INFO
    assert not [record for record in caplog.records if record.name.startswith("megatron")]


def test_build_tokenizer_names_the_flag_a_missing_file_or_type_was_given_by(tmp_path, sentencepiece_model):
    ranks = ranks_file(tmp_path / "bytes.tiktoken", byte_lines())
    vocab_file, merge_file = gpt2_pair(tmp_path, "#version: 0.2\nh e\n")
    for flags, flag, path in (({"vocab_file": str(tmp_path / "no.json"), "merge_file": merge_file}, "--vocab-file",
                               tmp_path / "no.json"),
                              ({"vocab_file": vocab_file, "merge_file": str(tmp_path / "no.txt")}, "--merge-file",
                               tmp_path / "no.txt")):
        with pytest.raises(FileNotFoundError) as missing:
            build_tokenizer("GPT2BPETokenizer", **flags)
        assert str(missing.value) == f"{flag} {path}: no such file"
    for tokenizer_type, flags, message in (
            ("HuggingFaceTokenizer", {},
             "HuggingFaceTokenizer needs --tokenizer-model (tokenizer.json or its directory)"),
            ("GPT2BPETokenizer", {"vocab_file": vocab_file}, "GPT2BPETokenizer needs --vocab-file and --merge-file, or "
                                                             "--tokenizer-model gpt2.tiktoken"),
            ("GPT2BPETokenizer", {"merge_file": merge_file}, "GPT2BPETokenizer needs --vocab-file and --merge-file, or "
                                                             "--tokenizer-model gpt2.tiktoken"),
            ("BertWordPieceCase", {}, "BertWordPieceCase needs --vocab-file (BERT's vocab.txt)"),
            ("SFTTokenizer", {}, "--tokenizer-type 'SFTTokenizer': choose one of HuggingFaceTokenizer, TikTokenizer, "
                                 "GPT2BPETokenizer, SentencePieceTokenizer, GPTSentencePieceTokenizer, "
                                 "Llama2Tokenizer, BertWordPieceLowerCase, BertWordPieceCase")):
        with pytest.raises(ValueError) as refusal:
            build_tokenizer(tokenizer_type, **flags)
        assert str(refusal.value) == message
    # The pair wins over a ranks file given beside it; either alone is enough.
    pair = build_tokenizer("GPT2BPETokenizer", ranks, vocab_file, merge_file)
    assert isinstance(pair, tokenizers.HuggingFaceTokenizer) and pair.vocab_size == 260
    alone = build_tokenizer("GPT2BPETokenizer", ranks, vocab_file=vocab_file)
    assert isinstance(alone, tokenizers.TikTokenizer) and alone.vocab_size == 257
    as_text = build_tokenizer("GPT2BPETokenizer", ranks, special_tokens_as_text=True)
    assert as_text.special_tokens_as_text and as_text.encode_batch(["<|endoftext|>"]) == [list(b"<|endoftext|>")]
    for tokenizer_type in SENTENCEPIECE_TYPES:  # SentencePiece ignores the flag, but the tokenizer reports it
        assert build_tokenizer(tokenizer_type, sentencepiece_model, special_tokens_as_text=True).special_tokens_as_text
