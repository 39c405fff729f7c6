"""The pad token as Megatron-LM's datasets see it: megatron-core's MegatronDataset takes its tokenizer's `pad` (else
-1), resets it to -1 where it is the EOS or the end of document unless --allow-ambiguous-pad-tokens, and GPTDataset
leaves the labels equal to it out of the loss and maps those tokens and labels to 0. The expected samples come from
megatron-core's GPTDataset given megatron-core's own tokenizer object (Megatron-LM 0.16's build_tokenizer), not
from our vocabulary."""

import dataclasses
import json
import logging
import os

import numpy as np
import pytest
import sentencepiece
import torch
from megatron.core.datasets import megatron_dataset
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from test_gpt_datasets import rewrite_metadata, write_ids
from test_tokenizers import tiny_hugging_face

from angpt.config.arguments import parse_args
from angpt.config.sections import DataSection
from angpt.data import indexed
from angpt.data.gpt_datasets import build_datasets, dataset_vocabulary, flag_vocabulary
from angpt.data.indexed import IndexedDatasetError, read_metadata
from angpt.data.tokenizers import NO_PAD, build_tokenizer

from conftest import megatron_tokenizer, write_megatron_tiktoken

SEQ, SAMPLES = 16, 24
HF_LIBRARY = {"vocab_file": None, "merges_file": None, "additional_special_tokens": [], "use_fast": False,
              "trust_remote_code": False, "include_special_tokens": False}
TIKTOKEN_SPECIAL = 9  # <unk> <s> </s> <mask> <pad> <cls> <sep> <SPECIAL_7> <SPECIAL_8>


def theirs_pad(tokenizer) -> int:
    """The pad id megatron-core's MegatronDataset takes from Megatron-LM's tokenizer object, before its check of
    collisions: `tokenizer.pad`, -1 where that raises; transformers' None (no pad token) matches no token either."""
    try:
        pad = tokenizer.pad
    except Exception:  # noqa: BLE001 (as MegatronDataset catches it)
        return megatron_dataset._PAD_TOKEN_ID
    return megatron_dataset._PAD_TOKEN_ID if pad is None else pad


@pytest.fixture(scope="module")
def sentencepiece_with_pad(tmp_path_factory) -> str:
    """A SentencePiece BPE of 60 pieces whose pad is a piece of its own (id 3; <unk> <s> </s> at 0, 1, 2)."""
    directory = tmp_path_factory.mktemp("sentencepiece_pad")
    corpus = directory / "corpus.txt"
    corpus.write_text("\n".join(f"the quick brown fox {i} jumps over the lazy dog" for i in range(200)))
    sentencepiece.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(directory / "sp"), vocab_size=60,
                                             model_type="bpe", pad_id=3, minloglevel=2)
    return str(directory / "sp.model")


def tokenizers(kind: str, tmp_path, sentencepiece_model: str = None) -> tuple:
    """(our tokenizer flags, megatron-core's tokenizer object as Megatron-LM's build_tokenizer builds it for them)."""
    if kind.startswith("HuggingFaceTokenizer"):
        pad = {"HuggingFaceTokenizer": "<s>", "HuggingFaceTokenizer pad=eos": "</s>"}[kind]
        directory = tiny_hugging_face(tmp_path / "hf", {"eos_token": "</s>", "pad_token": pad})
        return ({"tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": directory},
                megatron_tokenizer("huggingface", directory, **HF_LIBRARY))
    if kind == "TikTokenizer":
        vocabulary = write_megatron_tiktoken(tmp_path / "vocab.json", [b"ab", b"abc"])
        size = TIKTOKEN_SPECIAL + 258
        return ({"tokenizer_type": "TikTokenizer", "tokenizer_model": vocabulary, "vocab_size": size,
                 "tiktoken_num_special_tokens": TIKTOKEN_SPECIAL},
                megatron_tokenizer("tiktoken", vocabulary, vocab_size=size, num_special_tokens=TIKTOKEN_SPECIAL,
                                   special_tokens=None))
    return ({"tokenizer_type": "SentencePieceTokenizer", "tokenizer_model": sentencepiece_model},
            megatron_tokenizer("sentencepiece", sentencepiece_model, legacy=False, special_tokens=None))


def documents_with(vocab_size: int, pad: int, eod: int) -> list:
    """40 documents of random ids below vocab_size, the pad id among them one in four, each ended by eod."""
    rng = np.random.default_rng(7)
    documents = []
    for _ in range(40):
        ids = rng.integers(0, vocab_size, size=int(rng.integers(5, 30)))
        ids[rng.random(len(ids)) < 0.25] = pad
        documents.append([*ids.tolist(), eod])
    return documents


def theirs_samples(prefix: str, tokenizer, cache, allow_ambiguous: bool = False, eod_mask_loss: bool = False):
    """megatron-core's training samples of `prefix` with Megatron-LM's tokenizer object (pretrain_gpt.py's config)."""
    config = GPTDatasetConfig(random_seed=1234, sequence_length=SEQ, blend_per_split=[([prefix], None), None, None],
                              path_to_cache=str(cache), tokenizer=tokenizer, reset_position_ids=False,
                              reset_attention_mask=False, eod_mask_loss=eod_mask_loss,
                              allow_ambiguous_pad_tokens=allow_ambiguous)
    train, _, _ = BlendedMegatronDatasetBuilder(GPTDataset, [SAMPLES, 0, 0], lambda: True, config).build()
    return [train[index] for index in range(SAMPLES)]


def ours_samples(data: DataSection, vocabulary=None):
    train, _, _ = build_datasets(data, vocabulary or dataset_vocabulary(data), SEQ, 1234, [SAMPLES, 0, 0])
    return [train[index] for index in range(SAMPLES)]


def assert_same(ours: list, theirs: list) -> None:
    for mine, expected in zip(ours, theirs, strict=True):
        for key in ("tokens", "labels", "loss_mask", "position_ids"):
            assert torch.equal(mine[key], expected[key]), key


@pytest.mark.parametrize("kind", ["HuggingFaceTokenizer", "TikTokenizer", "SentencePieceTokenizer"])
def test_a_unique_pad_id_is_masked_and_mapped_to_0_as_megatron_lm_masks_it(kind, tmp_path, sentencepiece_with_pad,
                                                                           single_process):
    """A tokenizer with a pad token of its own (tokenizer_config.json's <s>, 5; megatron-core tiktoken's <pad>, 4; the
    SentencePiece model's pad piece, 3) and data that holds it: the labels equal to it leave the loss and become 0,
    the tokens too, as megatron-core's GPTDataset does with Megatron-LM's tokenizer; with no pad (as before), none
    would. Each sample's own pad labels alone: megatron-core 0.16.1 (and Megatron-LM's main) also left the first
    sample's pad positions out of every later sample's loss, masking in place the loss mask it caches
    (angpt.megatron_compat's `_loss_mask_cached_unmasked`)."""
    flags, theirs = tokenizers(kind, tmp_path, sentencepiece_with_pad)
    pad, eod = {"HuggingFaceTokenizer": (5, 4), "TikTokenizer": (4, 2), "SentencePieceTokenizer": (3, 2)}[kind]
    assert (theirs_pad(theirs), theirs.eod) == (pad, eod)
    prefix = str(tmp_path / "data_text_document")
    write_ids(prefix, documents_with(theirs.vocab_size, pad, eod))
    data = DataSection(train_data_path=(prefix,), data_cache_path=str(tmp_path / "ours"), **flags)
    vocabulary = dataset_vocabulary(data)
    assert (vocabulary.pad, vocabulary.eod, vocabulary.vocab_size) == (pad, eod, theirs.vocab_size)
    ours = ours_samples(data, vocabulary)
    assert_same(ours, theirs_samples(prefix, theirs, tmp_path / "theirs"))
    masked = torch.cat([sample["loss_mask"] == 0 for sample in ours])
    unpadded = ours_samples(data, dataclasses.replace(vocabulary, pad=NO_PAD))  # what training read before
    raw_labels = torch.cat([sample["labels"] for sample in unpadded])
    assert torch.equal(masked, raw_labels == pad) and (unpadded[0]["labels"] == pad).any()
    assert (raw_labels == pad).sum() > 20
    assert all(torch.all(sample["loss_mask"] == 1) for sample in unpadded)
    assert not any((sample["tokens"] == pad).any() or (sample["labels"] == pad).any() for sample in ours)
    assert torch.equal(torch.cat([sample["labels"] for sample in ours]), torch.where(raw_labels == pad, 0, raw_labels))


@pytest.mark.filterwarnings("ignore:The pad token id in the tokenizer collides")  # megatron-core's own build's
@pytest.mark.parametrize("allow", [False, True])
def test_a_pad_id_that_is_the_end_of_document_is_masked_only_with_allow_ambiguous_pad_tokens(allow, tmp_path, caplog,
                                                                                          single_process):
    """tokenizer_config.json's pad token </s> is also its EOS (the end of document, 4): megatron-core resets the pad id
    (nothing is masked beyond --eod-mask-loss's tokens) unless --allow-ambiguous-pad-tokens, which masks the labels
    that are 4 too. Its warning, given once per dataset, is one log line."""
    flags, theirs = tokenizers("HuggingFaceTokenizer pad=eos", tmp_path)
    assert theirs_pad(theirs) == theirs.eod == 4
    prefix = str(tmp_path / "data_text_document")
    write_ids(prefix, documents_with(theirs.vocab_size, 0, theirs.eod))
    data = DataSection(train_data_path=(prefix,), valid_data_path=(prefix,), data_cache_path=str(tmp_path / "ours"),
                       eod_mask_loss=True, allow_ambiguous_pad_tokens=allow, **flags)
    with caplog.at_level(logging.WARNING, logger="angpt.data"):
        train, valid, _ = build_datasets(data, dataset_vocabulary(data), SEQ, 1234, [SAMPLES, 4, 0])
    assert train.config.allow_ambiguous_pad_tokens is valid.config.allow_ambiguous_pad_tokens is allow
    lines = [record.getMessage() for record in caplog.records if record.name == "angpt.data"]
    said = "its tokens are masked as padding" if allow else "no token is masked as padding, as in Megatron-LM"
    assert lines == [f"the pad id 4 is also the end of document's: {said}" + (
        " (--allow-ambiguous-pad-tokens)" if allow else " (--allow-ambiguous-pad-tokens masks them)")]
    ours = [train[index] for index in range(SAMPLES)]
    assert_same(ours, theirs_samples(prefix, theirs, tmp_path / "theirs", allow, eod_mask_loss=True))
    raw = ours_samples(dataclasses.replace(data, eod_mask_loss=False, allow_ambiguous_pad_tokens=False))
    tokens, labels = (torch.cat([sample[key] for sample in raw]) for key in ("tokens", "labels"))
    masked = torch.cat([sample["loss_mask"] == 0 for sample in ours])
    assert torch.equal(masked, (tokens == 4) | (labels == 4) if allow else tokens == 4)
    assert (labels == 4).sum() > 10


def test_without_a_pad_token_nothing_changes(tmp_path, caplog, single_process):
    """GPT-2's BPE has no pad token (transformers' GPT2Tokenizer, which megatron-core's "megatron" library loads, has
    none; Megatron-LM's legacy one raises NotImplementedError): pad -1, the samples megatron-core gives with
    transformers' GPT-2 tokenizer (saved, read by megatron-core's Hugging Face library) with no token masked, the
    tokenizer's identity (the index caches' key) as before, no line said."""
    from transformers import GPT2Tokenizer  # noqa: PLC0415 (slow to import: only this test needs it)

    vocab = {**{chr(c): i for i, c in enumerate(range(ord("a"), ord("e")))}, "ab": 4, "<|endoftext|>": 5}
    (tmp_path / "vocab.json").write_text(json.dumps(vocab))
    (tmp_path / "merges.txt").write_text("#version: 0.2\na b\n")
    gpt2 = GPT2Tokenizer(str(tmp_path / "vocab.json"), str(tmp_path / "merges.txt"))
    assert gpt2.pad_token_id is None
    gpt2.save_pretrained(tmp_path / "gpt2")
    theirs = megatron_tokenizer("huggingface", tmp_path / "gpt2", **HF_LIBRARY)
    assert (theirs_pad(theirs), theirs.eod) == (NO_PAD, 5)
    prefix = str(tmp_path / "data_text_document")
    write_ids(prefix, documents_with(6, 0, 5))
    data = DataSection(train_data_path=(prefix,), tokenizer_type="GPT2BPETokenizer",
                       vocab_file=str(tmp_path / "vocab.json"), merge_file=str(tmp_path / "merges.txt"),
                       data_cache_path=str(tmp_path / "cache"))
    vocabulary = dataset_vocabulary(data)
    assert vocabulary.pad == NO_PAD == megatron_dataset._PAD_TOKEN_ID
    assert set(vocabulary.unique_identifiers["tokenizer"]) == {"type", "vocab_file", "merge_file", "eod_token"}
    with caplog.at_level(logging.WARNING, logger="angpt.data"):
        samples = ours_samples(data, vocabulary)
    assert_same(samples, theirs_samples(prefix, theirs, tmp_path / "theirs"))
    assert all(torch.all(sample["loss_mask"] == 1) for sample in samples)
    assert not [record for record in caplog.records if record.name == "angpt.data"]


def test_each_tokenizer_types_pad_id_is_megatron_cores(tmp_path, sentencepiece_model, sentencepiece_with_pad):
    """Our pad id against the one MegatronDataset takes from megatron-core's tokenizer object, for every type we
    build: a Hugging Face directory's pad token from tokenizer_config.json or special_tokens_map.json (which wins, as
    in transformers), added where the vocabulary lacks it; tiktoken's <pad> where --tokenizer-special-tokens put it;
    a SentencePiece model's pad piece, or none; NullTokenizer's none."""
    cases = []
    for name, config, special_map in [("none", {"eos_token": "</s>"}, None),
                                      ("config", {"eos_token": "</s>", "pad_token": "<s>"}, None),
                                      ("added", {"eos_token": "</s>", "pad_token": "<pad>"}, None),
                                      ("map", {"eos_token": "</s>", "pad_token": "a"}, {"pad_token": "<s>"})]:
        directory = tiny_hugging_face(tmp_path / name, config)
        if special_map:
            (tmp_path / name / "special_tokens_map.json").write_text(json.dumps(special_map))
        cases.append((build_tokenizer("HuggingFaceTokenizer", directory),
                      megatron_tokenizer("huggingface", directory, **HF_LIBRARY), {"none": -1, "config": 5,
                                                                                  "added": 6, "map": 5}[name]))
    vocabulary = write_megatron_tiktoken(tmp_path / "vocab.json", [b"ab"])
    special = ["<s>", "</s>", "<unk>", "<cls>", "<sep>", "<mask>", "<pad>"]
    for tokens, expected in ((None, 4), (special, 6)):
        cases.append((build_tokenizer("TikTokenizer", vocabulary, vocab_size=266, tiktoken_num_special_tokens=9,
                                      special_tokens=tokens),
                      megatron_tokenizer("tiktoken", vocabulary, vocab_size=266, num_special_tokens=9,
                                         special_tokens=tokens), expected))
    for model, expected in ((sentencepiece_model, -1), (sentencepiece_with_pad, 3)):
        cases.append((build_tokenizer("SentencePieceTokenizer", model),
                      megatron_tokenizer("sentencepiece", model, legacy=False, special_tokens=None), expected))
    null = megatron_tokenizer("null", "", vocab_size=100)
    cases.append((flag_vocabulary(DataSection(tokenizer_type="NullTokenizer", vocab_size=100)), null, -1))
    for ours, theirs, expected in cases:
        assert (ours.pad, ours.vocab_size) == (theirs_pad(theirs), theirs.vocab_size)
        assert ours.pad == expected


def test_the_pad_id_a_dataset_records_is_used_and_checked_against_its_tokenizer(tmp_path, caplog):
    """tools/preprocess_data.py records the tokenizer's pad id: it is used where the tokenizer's files are no longer
    at hand, checked against them where they are, and its bounds (-1, below vocab_size) kept; a .json written
    before records none, which its rebuilt tokenizer gives, or, without its files, no pad, said in one line."""
    directory = tiny_hugging_face(tmp_path / "hf", {"eos_token": "</s>", "pad_token": "<s>"})
    tokenizer = build_tokenizer("HuggingFaceTokenizer", directory)
    prefix = str(tmp_path / "data_text_document")
    write_ids(prefix, [[0, 1, 5, 4], [1, 1, 4]])
    indexed.write_metadata(prefix + ".json", {"tokenizer": tokenizer.description, "vocab_size": 6, "eod": 4,
                                              "pad": 5, "append_eod": True, "documents": 2, "tokens": 7})
    data = DataSection(train_data_path=(prefix,))
    assert dataset_vocabulary(data).pad == 5
    rewrite_metadata(prefix, pad=2)
    with pytest.raises(IndexedDatasetError, match=r"^\S+\.json: records pad 2, but its tokenizer's pad id is 5$"):
        dataset_vocabulary(data)
    rewrite_metadata(prefix, pad=None)  # written before pads were recorded: the rebuilt tokenizer's
    assert dataset_vocabulary(data).pad == 5
    os.remove(os.path.join(directory, "tokenizer.json"))
    with caplog.at_level(logging.WARNING, logger="angpt.data"):
        assert dataset_vocabulary(data).pad == NO_PAD
    assert [record.getMessage() for record in caplog.records if record.name == "angpt.data"] == [
        f"{prefix}.json records no pad id and its tokenizer's files are not at hand: no token is masked as padding "
        "(Megatron-LM masks its tokenizer's pad id; tools/preprocess_data.py records it)"]
    rewrite_metadata(prefix, pad=5)
    assert dataset_vocabulary(data).pad == 5
    for pad in (-1, 5):  # none, and the largest id
        rewrite_metadata(prefix, pad=pad)
        assert read_metadata(prefix)["pad"] == pad
    for pad in (-2, 6, True, "5"):
        rewrite_metadata(prefix, pad=pad)
        with pytest.raises(IndexedDatasetError, match=rf"invalid dataset metadata: pad is {pad!r} \(a token id, or "
                                                      r"-1 for none\)$"):
            read_metadata(prefix)


def test_the_flag_reaches_the_dataset_from_the_command_line():
    """--allow-ambiguous-pad-tokens is the data section's field, which build_datasets gives GPTDatasetConfig by its
    name (the tests above read it back from the built datasets)."""
    base = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "16",
            "--micro-batch-size", "1", "--train-iters", "1", "--mock-data", "--vocab-size", "64"]
    assert parse_args(base).data.allow_ambiguous_pad_tokens is False
    assert parse_args([*base, "--allow-ambiguous-pad-tokens"]).data.allow_ambiguous_pad_tokens is True
    assert "allow_ambiguous_pad_tokens" in {field.name for field in dataclasses.fields(GPTDatasetConfig)}



def test_datasets_and_flags_that_disagree_on_the_pad_id_are_refused(tmp_path):
    """Every dataset of a run, and the tokenizer flags when given, must have one pad id, as they have one vocabulary:
    a .json recording none (-1) beside one recording 5, or the flags' 5 beside a .json's -1, is refused naming them."""
    directory = tiny_hugging_face(tmp_path / "hf", {"eos_token": "</s>", "pad_token": "<s>"})
    prefixes = [str(tmp_path / f"{name}_text_document") for name in ("a", "b")]
    for prefix, pad in zip(prefixes, (5, -1)):
        write_ids(prefix, [[0, 1, 4]])
        indexed.write_metadata(prefix + ".json", {"tokenizer": {"type": "test"}, "vocab_size": 6, "eod": 4,
                                                  "pad": pad, "append_eod": True, "documents": 1, "tokens": 3})
    with pytest.raises(ValueError, match=rf"^the datasets' tokenizers have different pad ids: \{{'{prefixes[0]}': 5, "
                                         rf"'{prefixes[1]}': -1\}}$"):
        dataset_vocabulary(DataSection(train_data_path=("1", prefixes[0], "1", prefixes[1])))
    flags = {"tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": directory}
    described = f"--tokenizer-type HuggingFaceTokenizer --tokenizer-model {directory}"
    with pytest.raises(ValueError, match=rf"^the datasets' tokenizers have different pad ids: \{{'{prefixes[1]}': -1, "
                                         rf"'{described}': 5\}}$"):
        dataset_vocabulary(DataSection(train_data_path=(prefixes[1],), **flags))
    assert dataset_vocabulary(DataSection(train_data_path=(prefixes[0],), **flags)).pad == 5


def test_a_json_whose_tokenizer_is_not_ours_has_no_pad(tmp_path, caplog):
    """A .json whose "tokenizer" is not an object (not written by tools/preprocess_data.py): no pad id, no line."""
    prefix = str(tmp_path / "data_text_document")
    write_ids(prefix, [[0, 1, 4]])
    indexed.write_metadata(prefix + ".json", {"tokenizer": "another tool's", "vocab_size": 6, "eod": 4,
                                              "append_eod": True, "documents": 1, "tokens": 3})
    with caplog.at_level(logging.WARNING, logger="angpt.data"):
        assert dataset_vocabulary(DataSection(train_data_path=(prefix,))).pad == NO_PAD
    assert not [record for record in caplog.records if record.name == "angpt.data"]


def test_mock_data_takes_the_tokenizer_flags_vocabulary_and_pad(tmp_path, single_process):
    """--mock-data with --tokenizer-type: Megatron-LM's MockGPTDataset is given that tokenizer, so its samples mask and
    map its pad id (5 here) as real data's do."""
    flags, theirs = tokenizers("HuggingFaceTokenizer", tmp_path)
    data = DataSection(mock_data=True, **flags)
    vocabulary = dataset_vocabulary(data)
    assert (vocabulary.vocab_size, vocabulary.eod, vocabulary.pad) == (theirs.vocab_size, theirs.eod, 5)
    train, _, _ = build_datasets(data, vocabulary, SEQ, 1234, [SAMPLES, 0, 0])
    assert train.config.tokenizer.pad == 5
