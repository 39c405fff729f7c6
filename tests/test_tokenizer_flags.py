"""Megatron-LM's tokenizer flags --tokenizer-special-tokens (and --tiktoken-special-tokens),
--tokenizer-hf-include-special-tokens, --tokenizer-metadata and --tokenizer-sentencepiece-legacy: the ids and
vocabulary they give, against megatron-core's own tokenizer library (Megatron-LM 0.16's build_tokenizer)."""

import json
import os
import re
import subprocess
import sys

import numpy
import pytest
from megatron.core.tokenizers import MegatronTokenizer
from megatron.core.tokenizers.text.libraries.tiktoken_tokenizer import SPECIAL_TOKENS
from test_tokenizers import MEGATRON_TEXTS, MERGES, tiny_hugging_face

from angpt.config import megatron_lm
from angpt.config.arguments import parse_args
from angpt.data.indexed import read_metadata
from angpt.data.tokenizers import SENTENCEPIECE_TYPES, build_tokenizer, recorded_tokenizer

from conftest import ROOT, megatron_tokenizer, write_megatron_tiktoken

# Added special tokens in and between words, one the vocabulary has ("a") and ones it lacks.
HF_TEXTS = ["a b", "", "a<X>b <X> a", "a b</s> a", "<Y>a", "b ab"]


def hugging_face(library_kwargs: dict, directory):
    """megatron-core's HuggingFaceTokenizer as Megatron-LM 0.16's build_tokenizer builds it."""
    return megatron_tokenizer("huggingface", directory, **{
        "vocab_file": None, "merges_file": None, "additional_special_tokens": [], "use_fast": False,
        "trust_remote_code": False, "include_special_tokens": False, **library_kwargs})


@pytest.mark.parametrize("special, include", [((), True), (("<X>", "a", "<Y>"), False), (("<X>",), True)])
def test_hugging_face_special_tokens_and_include_special_tokens_encode_as_megatron_core(tmp_path, special, include):
    """--tokenizer-special-tokens are megatron-core's additional_special_tokens (transformers adds the ones the
    vocabulary lacks, ids 6 and 7 here, and matches each whole in the text); --tokenizer-hf-include-special-tokens
    encodes with the post-processor's <s> (transformers' tokenizer(text)). The description rebuilds them."""
    directory = tiny_hugging_face(tmp_path / "hf", {"eos_token": "</s>"})
    theirs = hugging_face({"additional_special_tokens": list(special), "include_special_tokens": include}, directory)
    ours = build_tokenizer("HuggingFaceTokenizer", directory, special_tokens=special, include_special_tokens=include)
    expected = [theirs.tokenize(text) for text in HF_TEXTS]
    assert ours.encode_batch(HF_TEXTS) == expected
    assert (ours.vocab_size, ours.eod) == (theirs.vocab_size, theirs.eod) == (6 + len(set(special) - {"a"}), 4)
    plain = build_tokenizer("HuggingFaceTokenizer", directory).encode_batch(HF_TEXTS)
    assert expected != plain  # the flags change the ids of these texts
    rebuilt = recorded_tokenizer(json.loads(json.dumps(ours.description)))
    assert rebuilt.encode_batch(HF_TEXTS) == expected and rebuilt.vocab_size == ours.vocab_size


def test_gpt2_vocab_merges_take_special_tokens_as_transformers_gpt2_tokenizer(tmp_path):
    """GPT2BPETokenizer (vocab/merges): --tokenizer-special-tokens as transformers' GPT2Tokenizer adds them
    (megatron-core's "megatron" library is that tokenizer); GPT-2 puts no token around a text, so
    --tokenizer-hf-include-special-tokens changes no id."""
    from transformers import GPT2Tokenizer  # noqa: PLC0415 (slow to import: only this test needs it)

    vocab = {**{chr(c): i for i, c in enumerate(range(ord("a"), ord("e")))}, "ab": 4, "<|endoftext|>": 5, "Ġ": 6}
    (tmp_path / "vocab.json").write_text(json.dumps(vocab))
    (tmp_path / "merges.txt").write_text("#version: 0.2\na b\n")
    special = ("<tool>", "ab")
    theirs = GPT2Tokenizer(str(tmp_path / "vocab.json"), str(tmp_path / "merges.txt"))
    theirs.add_special_tokens({"additional_special_tokens": list(special)})
    texts = ["ab c", "a<tool>b", "cab<tool>", "<|endoftext|>d"]
    ours = build_tokenizer("GPT2BPETokenizer", vocab_file=str(tmp_path / "vocab.json"),
                           merge_file=str(tmp_path / "merges.txt"), special_tokens=special, include_special_tokens=True)
    assert ours.encode_batch(texts) == [theirs.convert_tokens_to_ids(theirs.tokenize(text)) for text in texts] \
        == [[4, 6, 2], [0, 7, 1], [2, 4, 7], [5, 3]]
    assert ours.vocab_size == len(theirs) == 8
    with pytest.raises(ValueError, match="^--tokenizer-special-tokens: GPT2BPETokenizer reads them with --vocab-file"):
        build_tokenizer("GPT2BPETokenizer", tokenizer_model=str(tmp_path / "vocab.json"), special_tokens=special)


@pytest.fixture(scope="module")
def megatron_json(tmp_path_factory):
    return write_megatron_tiktoken(tmp_path_factory.mktemp("megatron") / "vocab.json", MERGES)


def test_tiktoken_special_tokens_encode_as_megatron_core_at_their_boundaries(megatron_json):
    """TikTokenizer (a .json vocabulary): --tokenizer-special-tokens replace megatron-core's list of its first ids,
    so the EOD is </s>'s place in them; megatron-core's asserts (its seven tokens, each once, no more than
    --tiktoken-num-special-tokens, none named as its fillers <SPECIAL_N>) are one line naming the flag."""
    special = ("<tool>", *reversed(SPECIAL_TOKENS))  # </s> at 5
    size = 9 + 256 + len(MERGES)
    theirs = megatron_tokenizer("tiktoken", megatron_json, num_special_tokens=9, special_tokens=list(special),
                                vocab_size=size)
    ours = build_tokenizer("TikTokenizer", megatron_json, tiktoken_num_special_tokens=9, vocab_size=size,
                           special_tokens=special)
    texts = [*MEGATRON_TEXTS, "a<tool>b</s>"]
    assert ours.encode_batch(texts) == [theirs.tokenize(text) for text in texts]
    assert ours.encode_batch(["a<tool>b</s>"]) == [[9 + 97, 0, 9 + 98, 5]]
    assert (ours.vocab_size, ours.eod) == (theirs.vocab_size, theirs.eod) == (size, 5)
    assert recorded_tokenizer(json.loads(json.dumps(ours.description))).encode_batch(texts) == ours.encode_batch(texts)
    # Exactly --tiktoken-num-special-tokens of them is accepted (9 of 9), as megatron-core accepts it.
    both = {"tiktoken_num_special_tokens": 9, "vocab_size": size}
    for tokens, message in [
            (SPECIAL_TOKENS[1:], "must hold <unk> <s> </s> <mask> <pad> <cls> <sep> (megatron-core's check); "
                                 "<unk> missing"),
            ((*SPECIAL_TOKENS, "<unk>"), "a token given twice"),
            ((*SPECIAL_TOKENS, "<a>", "<b>", "<c>"), "more than --tiktoken-num-special-tokens 9"),
            ((*SPECIAL_TOKENS, "<SPECIAL_8>"), "named as megatron-core names")]:
        with pytest.raises(ValueError, match=f"^--tokenizer-special-tokens {' '.join(tokens)}: .*{re.escape(message)}"):
            build_tokenizer("TikTokenizer", megatron_json, special_tokens=tokens, **both)
        with pytest.raises(AssertionError):  # megatron-core refuses each as well
            megatron_tokenizer("tiktoken", megatron_json, num_special_tokens=9, special_tokens=list(tokens),
                               vocab_size=size)
    nine = (*SPECIAL_TOKENS, "<a>", "<b>")
    assert build_tokenizer("TikTokenizer", megatron_json, special_tokens=nine, **both).encode_batch(["<b>"]) == [[8]]


def test_sentencepiece_takes_no_special_tokens_and_its_legacy_wrapper_no_end_of_document(sentencepiece_model):
    """megatron-core's SentencePiece library with legacy=False (Megatron-LM's default) raises on special tokens, and
    with legacy=True (--tokenizer-sentencepiece-legacy) has no .eod, which GPTDataset reads for every sample:
    both refused, naming why."""
    with pytest.raises(ValueError, match="Special tokens must be None when legacy is set to False"):
        megatron_tokenizer("sentencepiece", sentencepiece_model, legacy=False, special_tokens=["<X>"])
    for special in (None, ["<X>"]):
        legacy = megatron_tokenizer("sentencepiece", sentencepiece_model, legacy=True, special_tokens=special)
        with pytest.raises(AttributeError, match="has no attribute 'eod'"):
            legacy.eod
    for kind in SENTENCEPIECE_TYPES:
        with pytest.raises(ValueError, match=f"^--tokenizer-special-tokens with {kind}: megatron-core's SentencePiece "
                                             "library takes special tokens only with legacy=True"):
            build_tokenizer(kind, sentencepiece_model, special_tokens=("<X>",))


@pytest.mark.parametrize("metadata, message", [
    ({"library": "sentencepiece", "model_type": "gpt", "chat_template": "{{ x }}"}, None),
    ({"library": "sentencepiece"}, None),
    ({"library": "huggingface"}, "library 'huggingface', where --tokenizer-type Llama2Tokenizer is megatron-core's "
                                 "'sentencepiece' library"),
    ({}, "library None"),
    ({"library": "sentencepiece", "model_type": "llama"}, "model_type 'llama': megatron-core has default, gpt, mamba"),
    ({"library": "sentencepiece", "tokenizer_class": "X"}, "tokenizer_class: megatron-core 0.16.1 looks it up"),
])
def test_tokenizer_metadata_names_the_types_library_and_changes_no_id(sentencepiece_model, tmp_path, metadata,
                                                                      message):
    """--tokenizer-metadata: megatron-core reads the file in place of {"library": ...}: naming the type's library,
    its ids are megatron-core's with the file (model_type and chat_template change none); another library, none,
    or what megatron-core 0.16.1 cannot read is refused in one line."""
    path = tmp_path / "tokenizer_metadata.json"
    path.write_text(json.dumps(metadata))
    texts = ["the quick brown fox </s> jumps", ""]
    if message is None:
        theirs = megatron_tokenizer("sentencepiece", sentencepiece_model, legacy=False, special_tokens=None)
        read = MegatronTokenizer.from_pretrained(tokenizer_path=sentencepiece_model, metadata_path=str(path),
                                                 legacy=False, special_tokens=None)
        ours = build_tokenizer("Llama2Tokenizer", sentencepiece_model, metadata=str(path))
        assert ours.encode_batch(texts) == [read.tokenize(text) for text in texts] \
            == [theirs.tokenize(text) for text in texts]
        assert (ours.vocab_size, ours.eod) == (read.vocab_size, read.eod)
        return
    with pytest.raises(ValueError, match=f"^--tokenizer-metadata {path}: {message}"):
        build_tokenizer("Llama2Tokenizer", sentencepiece_model, metadata=str(path))


def test_a_missing_or_bad_metadata_file_is_named(sentencepiece_model, tmp_path):
    with pytest.raises(FileNotFoundError, match=f"^--tokenizer-metadata {tmp_path}/none.json: no such file"):
        build_tokenizer("Llama2Tokenizer", sentencepiece_model, metadata=str(tmp_path / "none.json"))
    (tmp_path / "list.json").write_text("[]")
    with pytest.raises(ValueError, match=f"^--tokenizer-metadata {tmp_path}/list.json: "):
        build_tokenizer("Llama2Tokenizer", sentencepiece_model, metadata=str(tmp_path / "list.json"))


MOCK = ["--mock-data", "--vocab-size", "64", "--train-iters", "4"]


def test_the_deprecated_tiktoken_spelling_is_copied_as_megatron_lms_validate_args_copies_it():
    """Megatron-LM's validate_args: --tiktoken-special-tokens becomes --tokenizer-special-tokens when that is not
    given; each case said in one line."""
    hf = [*MOCK, "--tokenizer-type", "HuggingFaceTokenizer"]
    config = parse_args([*hf, "--tiktoken-special-tokens", "<a>", "<b>"], world_size=1)
    assert config.data.tokenizer_special_tokens == ("<a>", "<b>")
    assert [line for line in megatron_lm.notes(config, cuda=False) if "tiktoken" in line] == [
        "--tiktoken-special-tokens: deprecated in Megatron-LM, which takes it as --tokenizer-special-tokens (so here)"]
    config = parse_args([*hf, "--tiktoken-special-tokens", "<a>", "--tokenizer-special-tokens", "<c>"], world_size=1)
    assert config.data.tokenizer_special_tokens == ("<c>",)
    assert [line for line in megatron_lm.notes(config, cuda=False) if "tiktoken" in line] == [
        "--tiktoken-special-tokens: ignored, as in Megatron-LM, where --tokenizer-special-tokens is given"]
    assert parse_args(hf, world_size=1).data.tokenizer_special_tokens is None


@pytest.mark.parametrize("argv, note", [
    (["--tokenizer-type", "TikTokenizer", "--tokenizer-hf-include-special-tokens"],
     "--tokenizer-hf-include-special-tokens: read by the Hugging Face, GPT-2 and BERT tokenizers only, not "
     "TikTokenizer"),
    (["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-sentencepiece-legacy"],
     "--tokenizer-sentencepiece-legacy: HuggingFaceTokenizer is not a SentencePiece tokenizer"),
    (["--tokenizer-type", "NullTokenizer", "--tokenizer-special-tokens", "<a>"],
     "--tokenizer-special-tokens: NullTokenizer does not read it"),
    (["--tokenizer-type", "NullTokenizer", "--tokenizer-special-tokens", "<a>", "--tokenizer-metadata", "m.json"],
     "--tokenizer-special-tokens and --tokenizer-metadata: NullTokenizer does not read them"),
    (["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-hf-include-special-tokens"], None),
])
def test_what_megatron_lm_does_not_pass_to_the_tokenizer_is_said_in_one_line(argv, note):
    lines = [line for line in megatron_lm.notes(parse_args([*MOCK, *argv], world_size=1), cuda=False)
             if "tokenizer" in line]
    assert lines == ([] if note is None else [line for line in lines if line.startswith(note)]) and \
        len(lines) == (note is not None)


@pytest.mark.parametrize("argv, message", [
    (["--tokenizer-special-tokens", "<a>"], "--tokenizer-special-tokens goes with --tokenizer-type"),
    (["--tokenizer-hf-include-special-tokens"], "--tokenizer-hf-include-special-tokens goes with --tokenizer-type"),
    (["--tokenizer-metadata", "m.json"], "--tokenizer-metadata goes with --tokenizer-type"),
    (["--tokenizer-sentencepiece-legacy"], "give --tokenizer-type"),
    *[(["--tokenizer-type", kind, "--tokenizer-sentencepiece-legacy"], "Megatron-LM 0.16.1 fails with it")
      for kind in SENTENCEPIECE_TYPES],
])
def test_these_are_refused_in_one_line(argv, message, capsys):
    with pytest.raises(SystemExit):
        parse_args([*MOCK, *argv], world_size=1)
    assert message in capsys.readouterr().err


def test_preprocessing_writes_the_ids_and_vocabulary_of_the_flags(tmp_path):
    """tools/preprocess_data.py with --tokenizer-special-tokens and --tokenizer-hf-include-special-tokens writes
    megatron-core's ids (the <s> of the post-processor, the added <X> at id 6) and that vocabulary, which the
    trainer's flags must then name, and megatron-core's pad id (tokenizer_config.json's <s>)."""
    directory = tiny_hugging_face(tmp_path / "hf", {"eos_token": "</s>", "pad_token": "<s>"})
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"text": text}) + "\n" for text in ["a<X>b", "b a"]))
    flags = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", directory,
             "--tokenizer-special-tokens", "<X>", "--tokenizer-hf-include-special-tokens"]
    subprocess.run([sys.executable, os.path.join(ROOT, "tools", "preprocess_data.py"), "--input",
                    str(tmp_path / "in.jsonl"), "--output-prefix", str(tmp_path / "out"), "--append-eod", *flags,
                    "--tokenizer-backend", "tokenizers"],  # gigatoken builds BPEs only, not this WordLevel
                   check=True, capture_output=True, cwd=ROOT, timeout=300)
    theirs = hugging_face({"additional_special_tokens": ["<X>"], "include_special_tokens": True}, directory)
    expected = [*theirs.tokenize("a<X>b"), theirs.eod, *theirs.tokenize("b a"), theirs.eod]
    assert expected == [5, 0, 6, 1, 4, 5, 1, 0, 4]
    metadata = read_metadata(str(tmp_path / "out_text_document"))
    assert (metadata["vocab_size"], metadata["eod"], metadata["pad"]) == (7, 4, theirs.pad) == (7, 4, 5)
    assert numpy.fromfile(str(tmp_path / "out_text_document.bin"), dtype=numpy.uint16).tolist() == expected


def test_the_trainers_flags_give_the_model_the_vocabulary_with_the_added_tokens(tmp_path):
    """The vocabulary the model is padded from: the flags' tokenizer with --tokenizer-special-tokens (megatron-core's
    vocab_size, 6 + the one token it lacks)."""
    from angpt.config.sections import DataSection  # noqa: PLC0415 (this test only)
    from angpt.data.gpt_datasets import flag_vocabulary  # noqa: PLC0415

    directory = tiny_hugging_face(tmp_path / "hf", {"eos_token": "</s>"})
    data = DataSection(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=directory,
                       tokenizer_special_tokens=("<X>", "a"))
    theirs = hugging_face({"additional_special_tokens": ["<X>", "a"]}, directory)
    assert (flag_vocabulary(data).vocab_size, flag_vocabulary(data).eod) == (theirs.vocab_size, theirs.eod) == (7, 4)
