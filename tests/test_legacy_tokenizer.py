"""--legacy-tokenizer: Megatron-LM core_v0.16.1's legacy tokenizers (megatron/training/tokenizer/tokenizer.py, not
in the megatron-core wheel) against the tokenizer angpt builds from the same flags: the types accepted give the same
vocabulary size, end of document and pad id (what a run of preprocessed data reads of its tokenizer; the pad as
megatron-core's GPTDataset takes it, NO_PAD where reading it raises). The legacy module is loaded from the local
Megatron-LM mirror where there is one; the values it gave are also recorded below, checked without it."""

import importlib
import os
import subprocess
import sys
import types

import pytest
import sentencepiece
from test_bert_tokenizers import VOCAB
from test_megatron_lm_flags import parse_error
from test_tokenizer_flags import tiny_hugging_face

from angpt.config.arguments import parse_args
from angpt.config.megatron_lm import notes
from angpt.data.gpt_datasets import flag_vocabulary
from angpt.data.tokenizers import NO_PAD

MIRROR = "/work/.mirror/NVIDIA+Megatron-LM/repo"
BASE = ["--train-iters", "10", "--mock-data", "--model-family", "gpt"]
# (vocab_size, eod, pad) of the legacy tokenizer, recorded from the mirror's module (legacy_module) on the models of
# the fixtures: a 120-piece SentencePiece model without a pad piece (EOS 2); NullTokenizer of --vocab-size 100.
RECORDED = {"GPTSentencePieceTokenizer": (120, 2, NO_PAD), "Llama2Tokenizer": (120, 2, NO_PAD),
            "NullTokenizer": (101, 100, NO_PAD)}


def legacy_module(tmp_path):
    """megatron/training/tokenizer/tokenizer.py of core_v0.16.1, unchanged, as a package of its own (its multimodal
    and SFT modules, which it only names, stubbed)."""
    if not os.path.isdir(MIRROR):
        pytest.skip(f"no Megatron-LM mirror at {MIRROR} (its legacy tokenizers are not in the megatron-core wheel)")
    package = tmp_path / "megatron_legacy"
    (package / "tokenizer").mkdir(parents=True)
    for name in ("tokenizer", "bert_tokenization", "gpt2_tokenization"):
        (package / "tokenizer" / f"{name}.py").write_text(subprocess.run(
            ["git", "-C", MIRROR, "show", f"core_v0.16.1:megatron/training/tokenizer/{name}.py"],
            check=True, capture_output=True, text=True).stdout)
    (package / "tokenizer" / "__init__.py").write_text("")
    (package / "__init__.py").write_text("print_rank_0 = print\n")
    for name, attribute in (("multimodal_tokenizer", "MultimodalTokenizer"), ("sft_tokenizer", "SFTTokenizer")):
        stub = types.ModuleType(f"megatron.training.tokenizer.{name}")
        setattr(stub, attribute, object)
        sys.modules[stub.__name__] = stub
    sys.path.insert(0, str(tmp_path))
    try:
        return importlib.import_module("megatron_legacy.tokenizer.tokenizer")
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("megatron_legacy", None)


def as_a_dataset_reads_it(tokenizer) -> tuple:
    try:  # megatron-core's MegatronDataset: a pad that raises is none
        pad = tokenizer.pad
    except Exception:  # noqa: BLE001 (as megatron-core catches it)
        pad = NO_PAD
    return tokenizer.vocab_size, tokenizer.eod, pad


def ours(argv) -> tuple:
    config = parse_args([*BASE, *argv, "--legacy-tokenizer"], world_size=1)
    vocabulary = flag_vocabulary(config.data)
    assert notes(config)[-1].startswith(f"--legacy-tokenizer: Megatron-LM's legacy {config.data.tokenizer_type} "
                                        "gives the vocabulary size, end of document and pad id of megatron-core's")
    return vocabulary.vocab_size, vocabulary.eod, vocabulary.pad


@pytest.mark.parametrize("tokenizer_type", ["GPTSentencePieceTokenizer", "Llama2Tokenizer"])
def test_accepted_sentencepiece_types_give_what_the_legacy_tokenizer_gives(tokenizer_type, sentencepiece_model):
    assert ours(["--tokenizer-type", tokenizer_type, "--tokenizer-model", sentencepiece_model]) == \
        RECORDED[tokenizer_type]


def test_null_tokenizer_gives_what_the_legacy_one_gives():
    assert ours(["--tokenizer-type", "NullTokenizer", "--vocab-size", "100"]) == RECORDED["NullTokenizer"]


def test_recorded_values_are_the_legacy_modules(sentencepiece_model, tmp_path):
    legacy = legacy_module(tmp_path)
    assert as_a_dataset_reads_it(legacy._GPTSentencePieceTokenizer(sentencepiece_model)) == \
        RECORDED["GPTSentencePieceTokenizer"]
    assert as_a_dataset_reads_it(legacy._Llama2Tokenizer(sentencepiece_model)) == RECORDED["Llama2Tokenizer"]
    assert as_a_dataset_reads_it(legacy._NullTokenizer(100)) == RECORDED["NullTokenizer"]


def test_hugging_face_gives_what_the_legacy_tokenizer_gives(tmp_path):
    directory = tiny_hugging_face(tmp_path / "hf", {"eos_token": "</s>", "pad_token": "<pad>"})
    legacy = legacy_module(tmp_path)._HuggingFaceTokenizer(directory)
    assert ours(["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", directory]) == \
        as_a_dataset_reads_it(legacy)


def test_types_whose_legacy_tokenizer_differs_are_refused_with_the_difference(sentencepiece_model, tmp_path, capsys):
    """The differences the refusals name, from the legacy module: SentencePieceTokenizer's 4 added tokens (<CLS>
    <SEP> <EOD> <MASK>, and <PAD> for a model without one) and <EOD> as the end of document; BERT's [BOS] [EOS]."""
    legacy = legacy_module(tmp_path)
    spm = legacy._SentencePieceTokenizer(sentencepiece_model)
    pieces = sentencepiece.SentencePieceProcessor(model_file=sentencepiece_model).get_piece_size()
    assert (spm.vocab_size, spm.eod) == (pieces + 5, pieces + 2)
    (tmp_path / "vocab.txt").write_text("\n".join(VOCAB) + "\n")
    bert = legacy._BertWordPieceTokenizer(str(tmp_path / "vocab.txt"), lower_case=True, vocab_extra_ids=0)
    assert (bert.vocab_size, bert.eod, bert.inv_vocab[bert.eod]) == (len(VOCAB) + 2, len(VOCAB) + 1, "[EOS]")
    for argv, message in (
            (["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", sentencepiece_model],
             "adds <CLS>, <SEP>, <EOD>, <MASK> after the model's pieces"),
            (["--tokenizer-type", "BertWordPieceCase", "--vocab-file", str(tmp_path / "vocab.txt")],
             "adds [BOS] and [EOS] after vocab.txt"),
            (["--tokenizer-type", "TikTokenizer", "--tokenizer-model", "x.json"], "has no pad id"),
            (["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", "x",
              "--tokenizer-special-tokens", "<X>"], "adds no --tokenizer-special-tokens"),
            ([], "give --tokenizer-type")):
        assert message in parse_error([*BASE, "--vocab-size", "256", *argv, "--legacy-tokenizer"], capsys)


def test_llama2_with_a_pad_piece_is_refused(tmp_path, capsys):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(f"the quick brown fox {i} jumps over the lazy dog" for i in range(200)))
    sentencepiece.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(tmp_path / "pad"), vocab_size=60,
                                             model_type="bpe", pad_id=3, minloglevel=2)
    legacy = legacy_module(tmp_path)._Llama2Tokenizer(str(tmp_path / "pad.model"))
    assert as_a_dataset_reads_it(legacy)[2] == NO_PAD  # where megatron-core's pads with id 3
    assert "has no pad id (no padding masked), where megatron-core's pads with the model's pad piece, id 3" in \
        parse_error([*BASE, "--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model", str(tmp_path / "pad.model"),
                     "--legacy-tokenizer"], capsys)
