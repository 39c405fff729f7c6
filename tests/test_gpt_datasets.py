"""Training data through megatron-core's BlendedMegatronDatasetBuilder and GPTDataset."""

import json
import os
import re
import struct
from types import SimpleNamespace

import numpy as np
import pytest
import sentencepiece
import torch
from megatron.core.datasets.blended_dataset import BlendedDataset
from megatron.core.datasets.gpt_dataset import MockGPTDataset
from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder
from megatron.core.datasets.utils import get_blend_from_list
from test_bad_inputs import write_hf_tokenizer

from angpt.config.arguments import parse_args
from angpt.config.blend import parse_blend
from angpt.config.sections import DataSection
from angpt.data import indexed
from angpt.data.gpt_datasets import (
    DatasetVocabulary,
    MicroBatchIndices,
    TrainingBatches,
    build_datasets,
    dataset_vocabulary,
    describe_samples,
    flag_vocabulary,
    micro_batches,
)
from angpt.data.indexed import IndexedDatasetError

from conftest import megatron_tokenizer, write_megatron_tiktoken

VOCAB, EOD = 500, 499


def write_dataset(prefix: str, documents: int, seed: int, empty: int = 0) -> None:
    """A small indexed dataset with the metadata tools/preprocess_data.py records beside it; `empty` zero-length
    documents first, as Megatron-LM's tools/preprocess_data.py writes an empty text (add_document([], []))."""
    rng = np.random.default_rng(seed)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for _ in range(empty):
        builder.add_document(torch.zeros(0, dtype=torch.int64), [])
    tokens = 0
    for _ in range(documents):
        document = np.append(rng.integers(0, EOD, size=int(rng.integers(20, 200))), EOD)
        builder.add_document(torch.from_numpy(document), [len(document)])
        tokens += len(document)
    builder.finalize(prefix + ".idx")
    with open(prefix + ".json", "w") as handle:
        json.dump({"tokenizer": {"type": "test"}, "vocab_size": VOCAB, "eod": EOD, "append_eod": True,
                   "documents": documents + empty, "tokens": tokens, "max_token_id": EOD, "empty_documents": empty},
                  handle)


def rewrite_metadata(prefix: str, **changes) -> None:
    """Change the .json of a dataset (a key given None is removed)."""
    with open(prefix + ".json") as handle:
        metadata = {**json.load(handle), **changes}
    with open(prefix + ".json", "w") as handle:
        json.dump({key: value for key, value in metadata.items() if value is not None}, handle)


@pytest.fixture
def two_prefixes(tmp_path):
    a, b = str(tmp_path / "a_text_document"), str(tmp_path / "b_text_document")
    write_dataset(a, 400, 1)
    write_dataset(b, 300, 2)
    return a, b


def test_a_blend_without_weights_is_blended_by_the_datasets_sizes(two_prefixes, tmp_path, single_process):
    """Megatron-LM's `--data-path a b`: megatron-core builds one epoch of each and draws them in proportion to their
    sizes, here counted from the .idx files (a has 400 documents, b 300, of equal lengths)."""
    a, b = two_prefixes
    data = DataSection(data_path=(a, b), split="98,2,0", data_cache_path=str(tmp_path / "cache"))
    train, _, _ = build_datasets(data, dataset_vocabulary(data), seq_length=32, seed=1234, samples=[1000, 0, 0])
    assert isinstance(train, BlendedDataset) and train.weights is not None
    sizes = [len(dataset) for dataset in train.datasets]
    assert train.weights == pytest.approx([size / sum(sizes) for size in sizes])
    assert np.bincount(train.dataset_index[:1000], minlength=2) / 1000 == pytest.approx([4 / 7, 3 / 7], abs=0.02)


@pytest.mark.parametrize("values", [
    ["a"], ["a", "b"], ["a", "b", "c"], ["0.3", "a", "0.7", "b"], ["1", "a"], [" a ", " b"], ["1", "a", "b", "c"],
    ["0.5", "a", "0.5"], ["a", "0.5", "b", "0.5"]], ids=str)
def test_data_path_values_are_read_as_megatron_core_reads_them(values):
    assert parse_blend(values) == get_blend_from_list(values)


def test_a_weight_after_a_prefix_in_a_weights_place_is_refused_where_megatron_core_asserts():
    with pytest.raises(AssertionError):
        get_blend_from_list(["a", "x", "1", "y"])
    with pytest.raises(ValueError, match="mixes weight/prefix pairs with prefixes without weights: 'a' stands"):
        parse_blend(["a", "x", "1", "y"])


def test_blend_follows_the_weights(two_prefixes, tmp_path, single_process):
    a, b = two_prefixes
    data = DataSection(data_path=("0.7", a, "0.3", b), split="98,2,0", data_cache_path=str(tmp_path / "cache"))
    vocabulary = dataset_vocabulary(data)
    assert (vocabulary.vocab_size, vocabulary.eod) == (VOCAB, EOD)
    train, _, _ = build_datasets(data, vocabulary, seq_length=32, seed=1234, samples=[2000, 0, 0])
    assert isinstance(train, BlendedDataset) and len(train) >= 2000
    shares = np.bincount(train.dataset_index[:2000], minlength=2) / 2000
    print("blend shares", shares)
    assert shares == pytest.approx([0.7, 0.3], abs=0.02)
    sample = train[0]
    assert sample["tokens"].shape == (32,) and torch.equal(sample["tokens"][1:], sample["labels"][:-1])


def test_data_parallel_ranks_split_each_global_batch_and_resume_exactly(two_prefixes, tmp_path, single_process):
    a, _ = two_prefixes
    data = DataSection(train_data_path=(a,), data_cache_path=str(tmp_path / "cache"))
    train, _, _ = build_datasets(data, dataset_vocabulary(data), 16, 1234, [64, 0, 0])
    one_rank = micro_batches(train, 16, 16, 4, 0, 1)  # the second global batch, one rank
    two_ranks = [micro_batches(train, 16, 16, 4, rank, 2) for rank in range(2)]
    assert len(one_rank) == 4 and all(len(batches) == 2 for batches in two_ranks)
    # Micro-batch m of rank r holds samples 16 + 8m + 4r ... : the ranks interleave as in Megatron-LM.
    for m in range(2):
        for r in range(2):
            expected = torch.stack([train[16 + 8 * m + 4 * r + j]["tokens"] for j in range(4)])
            assert torch.equal(two_ranks[r][m]["tokens"], expected)
    merged = torch.cat([two_ranks[r][m]["tokens"] for m in range(2) for r in range(2)])
    assert torch.equal(merged, torch.cat([batch["tokens"] for batch in one_rank]))


def test_datasets_tokenized_differently_are_refused(two_prefixes, tmp_path):
    a, b = two_prefixes
    meta = json.load(open(b + ".json"))
    meta["eod"] = 0
    json.dump(meta, open(b + ".json", "w"))
    with pytest.raises(ValueError, match="tokenized differently"):
        dataset_vocabulary(DataSection(data_path=("1", a, "1", b)))


# The drill: a .json that understates the vocabulary its .bin uses. megatron-core's embedding then fails
# with an IndexError at TP 1 but masks the ids at TP 2 and trains (tests/test_faults.py runs that).
@pytest.mark.parametrize("recorded", [True, False], ids=["max_token_id recorded", "bin scanned"])
def test_token_ids_outside_the_vocabulary_are_refused_when_the_datasets_open(two_prefixes, recorded):
    a, _ = two_prefixes
    rewrite_metadata(a, vocab_size=EOD, eod=0, max_token_id=EOD if recorded else None)
    expected = (f"{a}.json: token ids reach {EOD} (max_token_id), outside its vocab_size {EOD}" if recorded else
                f"{a}.bin holds token id {EOD}, outside the vocab_size {EOD} of {a}.json")
    with pytest.raises(IndexedDatasetError, match=f"^{re.escape(expected)}$"):
        dataset_vocabulary(DataSection(train_data_path=(a,)))


def test_vocab_size_must_be_the_datasets(two_prefixes):
    a, _ = two_prefixes
    assert dataset_vocabulary(DataSection(train_data_path=(a,), vocab_size=VOCAB)).vocab_size == VOCAB
    with pytest.raises(ValueError, match=f"^--vocab-size 600 disagrees with the vocab_size {VOCAB} of {a}.json"):
        dataset_vocabulary(DataSection(train_data_path=(a,), vocab_size=600))


@pytest.mark.parametrize("blend", [False, True], ids=["one dataset", "blend"])
def test_batches_check_their_token_ids_and_name_the_dataset(blend, two_prefixes, tmp_path, single_process):
    """A .json whose max_token_id understates its .bin passes the check at opening; the batches do not."""
    a, b = two_prefixes
    paths = dict(data_path=("1", a, "1", b), split="98,2,0") if blend else dict(train_data_path=(a,))
    data = DataSection(**paths, data_cache_path=str(tmp_path / "cache"))
    train, _, _ = build_datasets(data, dataset_vocabulary(data), 16, 1234, [64, 0, 0])
    assert len(micro_batches(train, 0, 16, 4, 0, 1, vocab_size=VOCAB)) == 4
    for prefix in (a, b):
        rewrite_metadata(prefix, vocab_size=100, eod=0, max_token_id=99)
    vocabulary = dataset_vocabulary(data)
    with pytest.raises(IndexedDatasetError, match=rf"^({a}|{b})\.bin: sample \d+ holds token id \d+, outside the "
                                                  r"vocabulary of 100 its \.json records$"):
        micro_batches(train, 0, 16, 4, 0, 1, vocab_size=vocabulary.vocab_size)


def test_a_split_left_without_documents_is_refused_by_name(tmp_path, single_process):
    """70 documents at 969,30,1: the test split gets round(0.999 * 70) = round(70) = 70, nothing. megatron-core
    would loop forever building it. It splits the sequences, which 500 empty documents more do not add to
    (over 570 documents, the test split would have one)."""
    prefix = str(tmp_path / "small_text_document")
    write_dataset(prefix, 70, 3, empty=500)
    data = DataSection(data_path=(prefix,), split="969,30,1", data_cache_path=str(tmp_path / "cache"))
    with pytest.raises(ValueError, match=f"--split 969,30,1 leaves the test split of {prefix} without documents "
                                         r"\(it has 70 non-empty documents\)"):
        build_datasets(data, dataset_vocabulary(data), 16, 1234, [64, 8, 8])
    data = DataSection(data_path=(prefix,), split="96,4,0", data_cache_path=str(tmp_path / "cache"))
    train, valid, test = build_datasets(data, dataset_vocabulary(data), 16, 1234, [64, 8, 0])
    assert len(train) >= 64 and len(valid) >= 8 and test is None


# Datasets as Megatron-LM's own tools/preprocess_data.py writes them: a .bin/.idx pair and no .json. Their
# vocabulary comes from Megatron-LM's tokenizer flags.
def without_metadata(prefix: str) -> str:
    os.remove(prefix + ".json")
    return prefix


def null_tokenizer(vocab_size: int, **data) -> DataSection:
    return DataSection(tokenizer_type="NullTokenizer", vocab_size=vocab_size, **data)


def test_a_dataset_without_metadata_is_refused_in_one_line_without_tokenizer_flags(two_prefixes):
    a = without_metadata(two_prefixes[0])
    with pytest.raises(IndexedDatasetError) as refusal:
        dataset_vocabulary(DataSection(train_data_path=(a,)))
    assert str(refusal.value).startswith(f"{a}.json: no dataset metadata: give the tokenizer the dataset was "
                                         "written with (--tokenizer-type") and "\n" not in str(refusal.value)


def test_null_tokenizer_has_megatron_lms_vocabulary_and_bounds_the_token_ids_at_its_edge(two_prefixes, tmp_path,
                                                                                         single_process):
    """Megatron-LM's NullTokenizer: --vocab-size ids, then the end-of-document id (vocab_size + 1 in all). The
    datasets' ids reach EOD = 499: --vocab-size 499 holds them exactly, 498 does not."""
    a = without_metadata(two_prefixes[0])
    data = null_tokenizer(EOD, train_data_path=(a,), data_cache_path=str(tmp_path / "cache"))
    vocabulary = dataset_vocabulary(data)
    assert (vocabulary.vocab_size, vocabulary.eod) == (EOD + 1, EOD)
    train, _, _ = build_datasets(data, vocabulary, seq_length=32, seed=1234, samples=[64, 0, 0])
    assert len(train) >= 64
    with pytest.raises(IndexedDatasetError, match=rf"^{re.escape(a)}\.bin holds token id {EOD}, outside the "
                                                  rf"vocab_size {EOD} of --tokenizer-type NullTokenizer --vocab-size "
                                                  rf"{EOD - 1}$"):
        dataset_vocabulary(null_tokenizer(EOD - 1, train_data_path=(a,)))
    with pytest.raises(ValueError, match="^--tokenizer-type NullTokenizer needs --vocab-size$"):
        dataset_vocabulary(DataSection(tokenizer_type="NullTokenizer", train_data_path=(a,)))


def test_a_blend_mixes_datasets_with_and_without_metadata_when_the_tokenizer_agrees(two_prefixes, tmp_path,
                                                                                    single_process):
    a, b = two_prefixes
    without_metadata(a)
    data = null_tokenizer(EOD, data_path=("1", a, "1", b), split="98,2,0", data_cache_path=str(tmp_path / "cache"))
    vocabulary = dataset_vocabulary(data)  # b.json records VOCAB = EOD + 1 and EOD, as NullTokenizer(EOD) has
    assert (vocabulary.vocab_size, vocabulary.eod) == (VOCAB, EOD)
    train, _, _ = build_datasets(data, vocabulary, seq_length=32, seed=1234, samples=[200, 0, 0])
    assert isinstance(train, BlendedDataset) and set(np.unique(train.dataset_index[:200])) == {0, 1}


def test_a_json_that_disagrees_with_the_tokenizer_flags_is_refused_naming_both(two_prefixes):
    a, b = two_prefixes
    without_metadata(a)
    with pytest.raises(ValueError, match=rf"^{re.escape(b)}\.json records vocab_size {VOCAB} and eod {EOD}, but "
                                         rf"--tokenizer-type NullTokenizer --vocab-size 600 has vocab_size 601 and "
                                         rf"eod 600$"):
        dataset_vocabulary(null_tokenizer(600, data_path=("1", a, "1", b)))


def test_a_hugging_face_tokenizer_gives_the_vocabulary_and_the_description_checkpoints_carry(two_prefixes,
                                                                                             tmp_path):
    """A WordLevel tokenizer of 500 entries whose last is <|endoftext|>: vocab_size 500, eod 499."""
    from tokenizers import Tokenizer, models  # noqa: PLC0415 (this test's only use)

    vocab = {f"w{i}": i for i in range(EOD)} | {"<|endoftext|>": EOD}
    Tokenizer(models.WordLevel(vocab, unk_token="w0")).save(str(tmp_path / "tokenizer.json"))
    a = without_metadata(two_prefixes[0])
    vocabulary = dataset_vocabulary(DataSection(train_data_path=(a,), tokenizer_type="HuggingFaceTokenizer",
                                                tokenizer_model=str(tmp_path / "tokenizer.json")))
    assert (vocabulary.vocab_size, vocabulary.eod) == (VOCAB, EOD)
    described = vocabulary.unique_identifiers["tokenizer"]
    assert described["type"] == "HuggingFaceTokenizer"
    assert described["model"]["path"].endswith("tokenizer.json") and len(described["model"]["sha256"]) == 64
    built = ("HuggingFaceTokenizer, TikTokenizer, GPT2BPETokenizer, SentencePieceTokenizer, "
             "GPTSentencePieceTokenizer, Llama2Tokenizer, BertWordPieceLowerCase, BertWordPieceCase, NullTokenizer")
    with pytest.raises(ValueError, match=rf"^--tokenizer-type MultimodalTokenizer: a vision-language model's "
                                         rf"tokenizer .*: angpt pretrains text-only GPTs \({built} are built\)$"):
        dataset_vocabulary(DataSection(train_data_path=(a,), tokenizer_type="MultimodalTokenizer"))
    with pytest.raises(ValueError, match=f"^--tokenizer-type SentencepieceTokenizer: choose one of {built}$"):
        dataset_vocabulary(DataSection(train_data_path=(a,), tokenizer_type="SentencepieceTokenizer"))


def test_the_scan_of_a_bin_without_metadata_is_cached_until_the_bin_changes(two_prefixes, tmp_path, monkeypatch):
    """The largest token id of a .json-less dataset is scanned once into --data-cache-path and read back while
    the .bin keeps its size and modification time; a changed .bin is scanned again; an unwritable cache only
    costs the scan."""
    a = without_metadata(two_prefixes[0])
    cache = tmp_path / "cache"
    scans = []
    real_scan = indexed.max_token_id
    monkeypatch.setattr(indexed, "max_token_id", lambda prefix: scans.append(prefix) or real_scan(prefix))
    data = null_tokenizer(EOD, train_data_path=(a,), data_cache_path=str(cache))
    for _ in range(2):
        assert dataset_vocabulary(data).vocab_size == EOD + 1
    assert scans == [a] and len(list(cache.iterdir())) == 1
    stat = os.stat(a + ".bin")
    os.utime(a + ".bin", ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))  # the same size, a newer .bin
    dataset_vocabulary(data)
    assert scans == [a, a]
    # Without --data-cache-path, megatron-core's place for a dataset's caches: <prefix>/cache.
    dataset_vocabulary(null_tokenizer(EOD, train_data_path=(a,)))
    assert scans == [a, a, a] and len(os.listdir(os.path.join(a, "cache"))) == 1
    blocked = tmp_path / "not_a_directory"
    blocked.write_text("")
    dataset_vocabulary(null_tokenizer(EOD, train_data_path=(a,), data_cache_path=str(blocked)))
    assert scans == [a, a, a, a]


@pytest.mark.parametrize("tokenizer_type", ["SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer"])
def test_a_sentencepiece_model_gives_megatron_lms_vocabulary_and_bounds_the_ids(tokenizer_type, tmp_path,
                                                                               single_process):
    """Megatron-LM 0.16 reads a SentencePiece model through megatron-core's tokenizer library: its pieces, and
    its EOS as the end-of-document id (here from sentencepiece itself). A dataset Megatron-LM's tool wrote
    with it trains; an id at the vocabulary's size is refused."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(f"the quick brown fox {i} jumps over the lazy dog {7 * i}" for i in range(300)))
    sentencepiece.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(tmp_path / "sp"), vocab_size=100,
                                             model_type="bpe", minloglevel=2)
    model = str(tmp_path / "sp.model")
    processor = sentencepiece.SentencePieceProcessor(model_file=model)
    size, eos = processor.get_piece_size(), processor.eos_id()
    prefix = str(tmp_path / "sp_text_document")
    write_ids(prefix, [processor.encode(line) + [eos] for line in corpus.read_text().splitlines()[:50]])
    data = DataSection(train_data_path=(prefix,), tokenizer_type=tokenizer_type, tokenizer_model=model,
                       data_cache_path=str(tmp_path / "cache"))
    vocabulary = dataset_vocabulary(data)
    assert (vocabulary.vocab_size, vocabulary.eod) == (size, eos) == (100, 2)
    assert vocabulary.unique_identifiers["tokenizer"]["type"] == tokenizer_type
    train, _, _ = build_datasets(data, vocabulary, seq_length=16, seed=1234, samples=[32, 0, 0])
    assert len(train) >= 32
    outside = str(tmp_path / "outside_text_document")
    write_ids(outside, [[1, 2, size]])
    with pytest.raises(IndexedDatasetError, match=f"holds token id {size}, outside the vocab_size {size}"):
        dataset_vocabulary(DataSection(train_data_path=(outside,), tokenizer_type=tokenizer_type,
                                       tokenizer_model=model))
    with pytest.raises(ValueError, match=f"^{tokenizer_type} needs --tokenizer-model"):
        dataset_vocabulary(DataSection(train_data_path=(prefix,), tokenizer_type=tokenizer_type))


def test_megatron_tiktoken_gives_vocab_size_ids_and_eod_2_as_angpt_pretrain_parses_its_flags(tmp_path):
    """A dataset Megatron-LM's tool wrote with TikTokenizer and a .json vocabulary (no .json of ours): --vocab-size
    ids, </s> (2) the EOD, with --tiktoken-pattern and --tiktoken-num-special-tokens read as Megatron-LM reads
    them. A --vocab-size beyond the vocabulary is refused; one that cuts a token the data holds bounds its ids."""
    model = write_megatron_tiktoken(tmp_path / "vocab.json", [b"ab", b"abc"])  # abc: rank 257, id 7 + 257
    theirs = megatron_tokenizer("tiktoken", model, pattern="v1", vocab_size=265, num_special_tokens=7,
                                special_tokens=None)
    prefix = str(tmp_path / "tiktoken_text_document")
    write_ids(prefix, [theirs.tokenize(text) + [theirs.eod] for text in ["abc ab", "the end</s>here"] * 20])
    config = parse_args(["--train-iters", "1", "--train-data-path", prefix, "--tokenizer-type", "TikTokenizer",
                         "--tokenizer-model", model, "--vocab-size", "265", "--tiktoken-pattern", "v1",
                         "--tiktoken-num-special-tokens", "7", "--data-cache-path", str(tmp_path / "cache")],
                        world_size=1)
    vocabulary = dataset_vocabulary(config.data)
    assert (vocabulary.vocab_size, vocabulary.eod) == (265, 2)
    described = vocabulary.unique_identifiers["tokenizer"]
    assert (described["type"], described["pattern"], described["num_special_tokens"]) == ("TikTokenizer", "v1", 7)
    flags = dict(train_data_path=(prefix,), tokenizer_type="TikTokenizer", tokenizer_model=model,
                 tiktoken_pattern="v1", tiktoken_num_special_tokens=7, data_cache_path=str(tmp_path / "cache"))
    with pytest.raises(ValueError, match=r"^--vocab-size 266 exceeds --tiktoken-num-special-tokens 7 plus the 258 "
                                         r"tokens of --tokenizer-model .*vocab.json: give --vocab-size 265 "):
        dataset_vocabulary(DataSection(**flags, vocab_size=266))
    named = f"--tokenizer-type TikTokenizer --tokenizer-model {re.escape(model)} --vocab-size 264"
    with pytest.raises(IndexedDatasetError, match=rf"holds token id 264, outside the vocab_size 264 of {named} "
                                                  r"--tiktoken-pattern v1 --tiktoken-num-special-tokens 7$"):
        dataset_vocabulary(DataSection(**flags, vocab_size=264))


def write_ids(prefix: str, documents: list[list[int]]) -> None:
    """A .bin/.idx pair of these documents and nothing else, as Megatron-LM's tools/preprocess_data.py writes."""
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    for document in documents:
        builder.add_document(torch.tensor(document), [len(document)])
    builder.finalize(prefix + ".idx")


class TokenRows:
    """A dataset of given token rows as GPTDataset gives its samples: each row is a window and the token after
    it, the tokens the window and the labels the window shifted by one (their last the token after it)."""

    def __init__(self, rows, prefix="rows"):
        self.rows = rows
        self.dataset = SimpleNamespace(path_prefix=prefix)  # the indexed dataset the samples come from

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, index):
        row = torch.tensor(self.rows[index])
        return {"tokens": row[:-1], "labels": row[1:]}


def out_of_vocabulary(sample: int, token: int, vocab_size: int = 10) -> str:
    return (f"^rows.bin: sample {sample} holds token id {token}, outside the vocabulary of {vocab_size} its .json "
            "records$")


def test_the_batch_guard_takes_ids_up_to_the_last_of_the_vocabulary_and_refuses_one_past_it():
    """The embedding has vocab_size rows, ids 0 to vocab_size - 1: those pass, vocab_size and -1 do not, wherever
    they are (a window's token, or the last label, the token after the window that no window's tokens hold)."""
    good = [[0, 9, 0, 9, 0], [9, 0, 9, 0, 9]]
    assert len(micro_batches(TokenRows(good), 0, 2, 1, 0, 1, vocab_size=10)) == 2
    for bad_row, token in (([1, 10, 2, 3, 4], 10), ([1, 2, 3, 4, 10], 10), ([1, 2, -1, 3, 4], -1),
                           ([0, 3, 4, 5, 10], 10)):  # 0 first and in range: the id named is the one outside
        with pytest.raises(IndexedDatasetError, match=out_of_vocabulary(1, token)):
            micro_batches(TokenRows([good[0], bad_row]), 0, 2, 2, 0, 1, vocab_size=10)


def test_the_batch_guard_names_the_sample_of_the_bad_id_within_the_global_batch():
    """The second global batch of 2 (samples 2 and 3, one micro-batch of 2): the id in sample 3 is named as there;
    then the same with micro-batches of 1, whose second starts at sample 3."""
    rows = [[1, 2, 3]] * 3 + [[1, 10, 3]]
    with pytest.raises(IndexedDatasetError, match=out_of_vocabulary(3, 10)):
        micro_batches(TokenRows(rows), 2, 2, 2, 0, 1, vocab_size=10)
    assert len(micro_batches(TokenRows(rows), 2, 1, 1, 0, 1, vocab_size=10)) == 1  # sample 2 alone is clean
    with pytest.raises(IndexedDatasetError, match=out_of_vocabulary(3, 10)):
        micro_batches(TokenRows(rows), 2, 2, 1, 0, 1, vocab_size=10)


@pytest.mark.parametrize("start,end,micro,rank,ranks,expected", [
    (0, 5, 2, 0, 1, [[0, 1], [2, 3]]),  # the last, partial micro-batch is left out
    (0, 8, 2, 1, 2, [[2, 3], [6, 7]]),  # exactly two global steps of 2 x 2
    (0, 7, 2, 1, 2, [[2, 3]]),  # one sample short of the second
    (4, 4, 1, 0, 1, []),  # nothing from start to end
    (6, 12, 1, 2, 3, [[8], [11]]),
])
def test_micro_batch_indices_are_megatron_lms_whole_micro_batches(start, end, micro, rank, ranks, expected):
    """Megatron-LM's MegatronPretrainingSampler: micro-batch m of rank r holds start + m * micro * ranks + r * micro
    + [0, micro), while the whole step of micro * ranks samples fits before `end`."""
    indices = MicroBatchIndices(start, end, micro, rank, ranks)
    assert list(indices) == expected and len(indices) == len(expected)


def test_the_data_loader_reads_this_ranks_micro_batches_and_guards_their_ids():
    """Rank 1 of 2 from sample 2, micro-batches of 1: samples 3, 5, 7, ...; the bad id in sample 7 is named."""
    rows = [[i, i + 1, i + 2] for i in range(7)] + [[7, 10, 9], [8, 9, 9], [9, 9, 9]]
    loader = TrainingBatches(TokenRows(rows), 2, 1, 1, 2, 0, vocab_size=10)
    first = loader.take(2)
    assert [batch["tokens"].tolist() for batch in first] == [[[3, 4]], [[5, 6]]]
    assert sorted(first[0]) == ["labels", "tokens"] and first[0]["labels"].tolist() == [[4, 5]]
    with pytest.raises(IndexedDatasetError, match=out_of_vocabulary(7, 10)):
        loader.take(1)


def test_mock_data_has_vocab_size_ids_ending_with_the_end_of_document_id_and_needs_a_vocab_size():
    """--mock-data: megatron-core's synthetic sequences over --vocab-size ids; the end-of-document id is the last
    (it must lie inside the vocabulary the embedding has). With --tokenizer-type, that tokenizer's vocabulary, as in
    Megatron-LM: NullTokenizer's --vocab-size ids and its end of document after them; a Hugging Face tokenizer's size,
    EOS and pad (megatron-core's own tokenizer object says which)."""
    assert dataset_vocabulary(DataSection(mock_data=True, vocab_size=64)) == DatasetVocabulary(64, 63,
                                                                                               {"tokenizer": "mock"})
    null = dataset_vocabulary(DataSection(mock_data=True, vocab_size=64, tokenizer_type="NullTokenizer"))
    assert (null.vocab_size, null.eod, null.pad) == (65, 64, -1)
    for vocab_size in (None, 0):
        with pytest.raises(ValueError, match="^--mock-data needs --vocab-size or --tokenizer-type$"):
            dataset_vocabulary(DataSection(mock_data=True, vocab_size=vocab_size))
    with pytest.raises(ValueError, match="^no training data: give --data-path, --train-data-path or --mock-data$"):
        dataset_vocabulary(DataSection())


def test_mock_data_builds_megatron_cores_mock_dataset_with_the_mask_only_when_asked(single_process):
    """--mock-data builds MockGPTDataset; the same seed gives the same samples, another seed others (the shuffle);
    an attention mask is built only with --reset-attention-mask (the model is causal by itself)."""
    def first_tokens(seed, **flags):
        data = DataSection(mock_data=True, vocab_size=64, **flags)
        # Long samples: megatron-core's mock corpus is fixed, and its index over 16-token samples takes seconds.
        train, _, _ = build_datasets(data, dataset_vocabulary(data), 1024, seed, [8, 0, 0])
        assert isinstance(train, MockGPTDataset)
        return train[0], torch.stack([train[i]["tokens"] for i in range(8)])

    sample, tokens = first_tokens(1234)
    assert "attention_mask" not in sample and int(tokens.max()) < 64
    data = DataSection(mock_data=True, vocab_size=64)
    train, _, _ = build_datasets(data, dataset_vocabulary(data), 1024, 1234, [8, 0, 0])
    assert re.fullmatch(r"3 \(mock data sample 3, documents [\d, ]+\)", describe_samples(train, [3]))
    assert torch.equal(first_tokens(1234)[1], tokens) and not torch.equal(first_tokens(4321)[1], tokens)
    masked, _ = first_tokens(1234, reset_attention_mask=True)
    assert masked["attention_mask"].shape == (1, 1024, 1024)


def test_the_datasets_json_names_the_vocabulary_and_the_cache_and_reads_go_where_the_flags_say(two_prefixes,
                                                                                              tmp_path):
    """The vocabulary a .json records, with its tokenizer entry as the identity checkpoints carry; a .json without
    max_token_id has its .bin scanned into --data-cache-path; --no-mmap-bin-files reaches the indexed dataset, and
    megatron-core's index caches go to --data-cache-path."""
    a, _ = two_prefixes
    rewrite_metadata(a, max_token_id=None)
    cache = tmp_path / "cache"
    data = DataSection(train_data_path=(a,), data_cache_path=str(cache))
    vocabulary = dataset_vocabulary(data)
    assert vocabulary == DatasetVocabulary(VOCAB, EOD, {"tokenizer": {"type": "test"}})
    assert [name for name in os.listdir(cache) if name.endswith(".max_token_id.json")]
    for mmap in (True, False):
        data = DataSection(train_data_path=(a,), data_cache_path=str(cache), mmap_bin_files=mmap)
        train, _, _ = build_datasets(data, vocabulary, 16, 1234, [8, 0, 0])
        assert train.dataset.mmap is mmap
    assert [name for name in os.listdir(cache) if name.endswith("document_index.npy")]


def test_a_validation_path_alone_builds_only_the_validation_split(two_prefixes, tmp_path):
    """Megatron-LM's --train/--valid/--test-data-path: a split per path given, None for the others."""
    a, _ = two_prefixes
    data = DataSection(valid_data_path=(a,), data_cache_path=str(tmp_path / "cache"))
    train, valid, test = build_datasets(data, dataset_vocabulary(data), 16, 1234, [0, 8, 0])
    assert train is None and test is None and len(valid) >= 8


@pytest.mark.parametrize("split,name", [("1,969,30", "train"), ("969,1,30", "validation")])
def test_each_split_left_without_documents_is_refused_by_its_name(split, name, tmp_path):
    """70 documents: 1 in 1000 of them rounds to none (round(0.07) = 0), as megatron-core's builder splits them;
    at 969,1,30 the validation split spans round(67.83) = 68 to round(67.9) = 68."""
    prefix = str(tmp_path / "small_text_document")
    write_dataset(prefix, 70, 3)
    data = DataSection(data_path=(prefix,), split=split, data_cache_path=str(tmp_path / "cache"))
    with pytest.raises(ValueError, match=f"^--split {split} leaves the {name} split of {prefix} without documents "):
        build_datasets(data, dataset_vocabulary(data), 16, 1234, [64, 8, 8])


def test_the_tokenizer_a_json_names_is_checked_against_the_vocabulary_it_records(two_prefixes, tmp_path):
    """A WordLevel tokenizer of 500 entries whose first is <|endoftext|>: vocab_size 500, eod 0. A .json that
    names it but records eod 499 is refused, even beside a dataset whose tokenizer cannot be rebuilt (each
    tokenizer is checked); one whose tokenizer file changed since is refused naming the file."""
    from tokenizers import Tokenizer, models  # noqa: PLC0415 (this test's only use)

    path = str(tmp_path / "tokenizer.json")
    Tokenizer(models.WordLevel({"<|endoftext|>": 0} | {f"w{i}": i for i in range(1, VOCAB)},
                               unk_token="w1")).save(path)
    a, b = two_prefixes
    description = dataset_vocabulary(DataSection(train_data_path=(without_metadata(a),),
                                                 tokenizer_type="HuggingFaceTokenizer", tokenizer_model=path)
                                     ).unique_identifiers["tokenizer"]
    write_dataset(a, 400, 1)
    rewrite_metadata(a, tokenizer=description)
    expected = (f"{a}.json: records vocab_size {VOCAB} and eod {EOD}, but its tokenizer has vocab_size {VOCAB} "
                "and eod 0")
    with pytest.raises(IndexedDatasetError, match=f"^{re.escape(expected)}$"):
        dataset_vocabulary(DataSection(data_path=("1", a, "1", b)))
    rewrite_metadata(a, eod=0)
    rewrite_metadata(b, eod=0)
    assert dataset_vocabulary(DataSection(data_path=("1", a, "1", b))).eod == 0
    with open(path, "a") as file:
        file.write("\n")
    expected = f"{a}.json: its tokenizer file {path} has changed since the dataset was written (sha256)"
    with pytest.raises(IndexedDatasetError, match=f"^{re.escape(expected)}$"):
        dataset_vocabulary(DataSection(train_data_path=(a,)))


def test_null_tokenizer_flags_describe_the_tokenizer_as_checkpoints_carry_it(two_prefixes):
    """Megatron-LM's NullTokenizer of --vocab-size V: V ids and the end-of-document id V, V + 1 in all."""
    a = without_metadata(two_prefixes[0])
    assert dataset_vocabulary(null_tokenizer(EOD, train_data_path=(a,))) == DatasetVocabulary(
        VOCAB, EOD, {"tokenizer": {"type": "NullTokenizer", "vocab_size": EOD}})


@pytest.mark.parametrize("changes, expected", [
    (dict(vocab_size=True), "invalid dataset metadata: vocab_size is True"),  # a bool is not a count
    (dict(documents=-1), "invalid dataset metadata: documents is -1"),
    (dict(eod=VOCAB), f"eod {VOCAB} is outside vocab_size {VOCAB}"),  # ids run from 0 to vocab_size - 1
    (dict(max_token_id=True), "invalid dataset metadata: max_token_id is True"),
    (dict(max_token_id=-1), "invalid dataset metadata: max_token_id is -1"),
    (dict(max_token_id=VOCAB), f"token ids reach {VOCAB} (max_token_id), outside its vocab_size {VOCAB}"),
    (dict(eod=None, tokens=None), "invalid dataset metadata: missing eod, tokens"),
])
def test_metadata_is_refused_one_past_each_bound_naming_the_field(changes, expected, tmp_path):
    prefix = str(tmp_path / "a_text_document")
    write_dataset(prefix, 3, 1)
    rewrite_metadata(prefix, **changes)
    with pytest.raises(IndexedDatasetError, match=f"^{re.escape(f'{prefix}.json: {expected}')}$"):
        indexed.read_metadata(prefix)


def test_metadata_at_each_bound_is_read_and_a_missing_or_non_object_json_is_refused(tmp_path):
    """The last id of the vocabulary as the end-of-document id, and a largest token id of 0, are valid."""
    prefix = str(tmp_path / "a_text_document")
    write_dataset(prefix, 3, 1)
    rewrite_metadata(prefix, eod=VOCAB - 1, max_token_id=0)
    assert (indexed.read_metadata(prefix)["eod"], indexed.read_metadata(prefix)["max_token_id"]) == (VOCAB - 1, 0)
    with open(prefix + ".json", "w") as file:
        file.write("[1]")
    with pytest.raises(IndexedDatasetError, match=f"^{re.escape(prefix)}.json: invalid dataset metadata: not a JSON "
                                                  "object$"):
        indexed.read_metadata(prefix)
    os.remove(prefix + ".json")
    with pytest.raises(IndexedDatasetError, match=f"^{re.escape(prefix)}.json: no dataset metadata \\(write the "
                                                  r"dataset with tools/preprocess_data.py\)$"):
        indexed.read_metadata(prefix)


def test_metadata_missing_a_key_is_never_written(tmp_path):
    complete = {"tokenizer": {"type": "test"}, "vocab_size": VOCAB, "eod": EOD, "append_eod": True, "documents": 0,
                "tokens": 0}
    indexed.write_metadata(str(tmp_path / "a.json"), complete)
    assert json.loads((tmp_path / "a.json").read_text()) == complete
    with pytest.raises(AssertionError, match=r"metadata lacks \['tokens'\]"):
        indexed.write_metadata(str(tmp_path / "b.json"), {key: value for key, value in complete.items()
                                                          if key != "tokens"})
    assert not (tmp_path / "b.json").exists()


def test_the_largest_token_id_of_a_dataset_without_tokens_is_none(tmp_path):
    """Only empty documents: a 0-byte .bin, which numpy cannot map."""
    prefix = str(tmp_path / "empty_text_document")
    write_ids(prefix, [[], []])
    assert os.path.getsize(prefix + ".bin") == 0 and indexed.max_token_id(prefix) is None
    write_ids(prefix, [[0]])
    assert indexed.max_token_id(prefix) == 0


def test_the_scan_is_cached_in_a_cache_directory_that_already_exists(tmp_path):
    """--data-cache-path usually exists (megatron-core's index caches are there): the scan's cache goes there too."""
    prefix = str(tmp_path / "a_text_document")
    write_ids(prefix, [[1, 2, 7], [3]])
    cache = tmp_path / "cache"
    cache.mkdir()
    assert indexed.cached_max_token_id(prefix, str(cache)) == 7
    assert [name for name in os.listdir(cache) if name.endswith(".max_token_id.json")]


@pytest.mark.parametrize("vocab_size, dtype", [(65499, np.uint16), (65500, np.int32), (1, np.uint16)])
def test_the_token_dtype_is_megatron_cores_choice_at_its_boundary(vocab_size, dtype):
    assert indexed.optimal_dtype(vocab_size) is dtype is DType.optimal_dtype(vocab_size)


class RowsAndReaders(TokenRows):
    """TokenRows that notes the process reading each sample."""

    readers: set = set()

    def __getitem__(self, index):
        self.readers.add(os.getpid())
        return super().__getitem__(index)


@pytest.mark.parametrize("num_workers", [None, 1])
def test_the_data_loader_reads_in_this_process_unless_given_workers(num_workers):
    """--num-workers 0 (the default) reads in the training process; 1 reads ahead in a worker process."""
    rows = RowsAndReaders([[i, i + 1, i + 2] for i in range(4)])
    rows.readers = set()
    workers = {} if num_workers is None else {"num_workers": num_workers}
    loader = TrainingBatches(rows, 0, 1, 0, 1, **workers)
    assert [batch["tokens"].tolist() for batch in loader.take(2)] == [[[0, 1]], [[1, 2]]]
    loader.close()
    assert (rows.readers == {os.getpid()}) is (num_workers is None)


def test_gpt2_bpe_flags_give_the_vocabulary_and_are_named_when_ids_exceed_it(two_prefixes, tmp_path):
    """Megatron-LM's GPT2BPETokenizer from --vocab-file and --merge-file: 256 bytes, one merge and <|endoftext|>,
    258 ids; the datasets' ids reach 499, and the refusal names the flags that gave the vocabulary."""
    write_hf_tokenizer(tmp_path / "gpt2")
    vocab, merges = str(tmp_path / "gpt2" / "vocab.json"), str(tmp_path / "gpt2" / "merges.txt")
    a = without_metadata(two_prefixes[0])
    flags = dict(train_data_path=(a,), tokenizer_type="GPT2BPETokenizer", vocab_file=vocab, merge_file=merges)
    assert (flag_vocabulary(DataSection(**flags)).vocab_size, flag_vocabulary(DataSection(**flags)).eod) == (258, 257)
    expected = (f"{a}.bin holds token id {EOD}, outside the vocab_size 258 of --tokenizer-type GPT2BPETokenizer "
                f"--vocab-file {vocab} --merge-file {merges}")
    with pytest.raises(IndexedDatasetError, match=f"^{re.escape(expected)}$"):
        dataset_vocabulary(DataSection(**flags))


def described_documents_hold_the_sample(dataset, index: int, description: str) -> bool:
    """Whether the documents a description names, read from its indexed dataset, hold the sample's tokens (the
    window and the token after it) in one run."""
    sample = dataset[index]
    window = torch.cat([sample["tokens"], sample["labels"][-1:]]).tolist()
    source = dataset.datasets[int(sample["dataset_id"])] if "dataset_id" in sample else dataset
    documents = [int(d) for d in re.search(r"documents ([\d, ]+)\)", description).group(1).split(", ")]
    text = [int(t) for d in documents for t in source.dataset[d]]
    return any(text[start:start + len(window)] == window for start in range(len(text) - len(window) + 1))


@pytest.mark.parametrize("blend", [False, True], ids=["one dataset", "blend"])
def test_described_samples_name_the_dataset_sample_and_documents_they_come_from(blend, two_prefixes, tmp_path,
                                                                               single_process):
    a, b = two_prefixes
    paths = dict(data_path=("1", a, "1", b), split="98,2,0") if blend else dict(train_data_path=(a,))
    data = DataSection(**paths, data_cache_path=str(tmp_path / "cache"))
    train, _, _ = build_datasets(data, dataset_vocabulary(data), 64, 1234, [16, 0, 0])
    described = describe_samples(train, [0, 5]).split("; ")
    assert len(described) == 2
    for index, text in zip((0, 5), described):
        match = re.fullmatch(rf"{index} \((\S+) sample (\d+), documents [\d, ]+\)", text)
        assert match and match.group(1) in (a, b), text
        component = train.datasets[int(train.dataset_index[index])] if blend else train
        assert match.group(1) == component.dataset.path_prefix
        assert torch.equal(component[int(match.group(2))]["tokens"], train[index]["tokens"])
        assert described_documents_hold_the_sample(train, index, text), text


def test_megatron_tiktokens_default_flags_are_left_out_of_the_refusal(tmp_path):
    """Megatron-LM's defaults (1000 special tokens, no pattern given) are not repeated when a refusal names the
    flags: 1000 + 256 + 1 ids with --vocab-size 1257, and an id one past them."""
    model = write_megatron_tiktoken(tmp_path / "vocab.json", [b"ab"])
    prefix = str(tmp_path / "tiktoken_text_document")
    write_ids(prefix, [[0, 2, 1257]])
    data = DataSection(train_data_path=(prefix,), tokenizer_type="TikTokenizer", tokenizer_model=model,
                       vocab_size=1257)
    expected = (f"{prefix}.bin holds token id 1257, outside the vocab_size 1257 of --tokenizer-type TikTokenizer "
                f"--tokenizer-model {model} --vocab-size 1257")
    with pytest.raises(IndexedDatasetError, match=f"^{re.escape(expected)}$"):
        dataset_vocabulary(data)


def patched_index(prefix: str, offset: int, fmt: str, value: int) -> None:
    """Overwrite one field of prefix.idx."""
    with open(prefix + ".idx", "r+b") as file:
        file.seek(offset)
        file.write(struct.pack(fmt, value))


# write_ids(prefix, [[1, 2], [3, 4, 5], [6], [7, 8]]) in int32: a 34-byte header, the lengths 2, 3, 1, 2 (int32), the
# byte pointers 0, 8, 20, 24 (int64), the document indices 0, 1, 2, 3, 4 (int64); the .bin holds 32 bytes.
LENGTHS, POINTERS, DOCUMENT_INDICES = 34, 34 + 4 * 4, 34 + 4 * 12
INDEX_DAMAGES = [
    ((POINTERS + 2 * 8, "<q", 24), "sequence 1 has 3 tokens, but its pointers are 16 bytes apart: corrupted"),
    ((POINTERS + 1 * 8, "<q", 12), "sequence 0 has 2 tokens, but its pointers are 12 bytes apart: corrupted"),
    ((POINTERS + 3 * 8, "<q", 28), "sequence 2 has 1 tokens, but its pointers are 8 bytes apart: corrupted"),
    ((POINTERS, "<q", 4), "the first sequence starts at byte 4, not 0: corrupted"),
    ((DOCUMENT_INDICES + 1 * 8, "<q", -1), "document indices out of order at document 1: corrupted"),
    ((DOCUMENT_INDICES + 3 * 8, "<q", 9), "document indices out of order at document 4: corrupted"),
    ((DOCUMENT_INDICES, "<q", 1), "document indices run from 1 to 4, expected 0 to 4: corrupted"),
    ((DOCUMENT_INDICES, "<q", -1), "document indices run from -1 to 4, expected 0 to 4: corrupted"),
    ((DOCUMENT_INDICES + 4 * 8, "<q", -1), "document indices run from 0 to -1, expected 0 to 4: corrupted"),
    ((9, "<Q", 2), "index version 2, expected 1"),
    ((17, "<B", 99), "unknown dtype code 99"),
]


@pytest.mark.parametrize("damage, expected", INDEX_DAMAGES, ids=[case[1].split(":")[0] for case in INDEX_DAMAGES])
def test_each_corrupted_index_field_is_refused_naming_the_entry(damage, expected, tmp_path):
    """Each pair of neighbouring entries is checked, the first and the last included; a signed field read as
    megatron-core reads it (int32 lengths, int64 pointers and document indices)."""
    prefix = str(tmp_path / "a_text_document")
    write_ids(prefix, [[1, 2], [3, 4, 5], [6], [7, 8]])
    assert indexed.check_indexed_dataset(prefix) == {"documents": 4, "sequences": 4, "tokens": 8, "dtype": "int32"}
    patched_index(prefix, *damage)
    with pytest.raises(IndexedDatasetError, match=f"^{re.escape(f'{prefix}.idx: {expected}')}$"):
        indexed.check_indexed_dataset(prefix)


def test_a_negative_last_length_is_read_as_megatron_core_reads_it(tmp_path):
    """The last sequence's length is checked against the .bin's size: -1 tokens at byte 24 end at byte 20."""
    prefix = str(tmp_path / "a_text_document")
    write_ids(prefix, [[1, 2], [3, 4, 5], [6], [7, 8]])
    patched_index(prefix, LENGTHS + 3 * 4, "<i", -1)
    expected = f"{prefix}.bin: 32 bytes, but {prefix}.idx indexes 20: truncated or corrupted"
    with pytest.raises(IndexedDatasetError, match=f"^{re.escape(expected)}$"):
        indexed.check_indexed_dataset(prefix)


def test_a_dataset_of_empty_documents_only_and_its_json_agree_on_the_counts(tmp_path):
    """Megatron-LM writes an empty text as a document without sequences: no sequences, a 0-byte .bin."""
    prefix = str(tmp_path / "a_text_document")
    write_dataset(prefix, 0, 1, empty=2)
    assert indexed.check_indexed_dataset(prefix) == {"documents": 2, "sequences": 0, "tokens": 0, "dtype": "uint16"}
    write_ids(prefix, [[1, 2], [3]])
    rewrite_metadata(prefix, documents=2, tokens=3)
    counts = indexed.check_indexed_dataset(prefix)
    assert counts["tokens"] == 3 and isinstance(counts["tokens"], int)  # counts, printed by --dry-run as such
    write_ids(prefix, [])  # no document at all: the index holds the leading 0 alone
    rewrite_metadata(prefix, documents=0, tokens=0)
    assert indexed.check_indexed_dataset(prefix)["documents"] == 0
    rewrite_metadata(prefix, documents=1)
    with pytest.raises(IndexedDatasetError, match=f"^{re.escape(f'{prefix}.json: records 1 documents, but {prefix}')}"
                                                  r"\.bin/\.idx hold 0$"):
        indexed.check_indexed_dataset(prefix)


def test_a_dataset_without_metadata_names_every_way_to_give_its_tokenizer(two_prefixes):
    a = without_metadata(two_prefixes[0])
    expected = (f"{a}.json: no dataset metadata: give the tokenizer the dataset was written with (--tokenizer-type "
                "and --tokenizer-model, --vocab-file/--merge-file, or NullTokenizer with --vocab-size), or write it "
                "with tools/preprocess_data.py")
    with pytest.raises(IndexedDatasetError, match=f"^{re.escape(expected)}$"):
        dataset_vocabulary(DataSection(train_data_path=(a,)))


def test_the_pointers_of_an_index_of_two_sequences_are_checked(tmp_path):
    """Two sequences, [1, 2] and [3] in int32: pointers 0 and 8; a second pointer of 12 is refused by the pair check,
    before the .bin's size (the last pointer plus its length) is compared."""
    prefix = str(tmp_path / "a_text_document")
    write_ids(prefix, [[1, 2], [3]])
    patched_index(prefix, 34 + 2 * 4 + 8, "<q", 12)
    expected = f"{prefix}.idx: sequence 0 has 2 tokens, but its pointers are 12 bytes apart: corrupted"
    with pytest.raises(IndexedDatasetError, match=f"^{re.escape(expected)}$"):
        indexed.check_indexed_dataset(prefix)


def test_the_writer_continues_the_document_indices_over_three_batches(tmp_path):
    """Documents added in three batches index as megatron-core's builder indexes them added one by one: each batch's
    document indices continue from all the sequences before it."""
    batches = [[[1, 2], [3]], [[4], [5, 6, 7]], [[8, 9]]]
    expected = IndexedDatasetBuilder(str(tmp_path / "a.bin"), dtype=np.uint16)
    got = indexed.DatasetWriter(str(tmp_path / "b.bin"), np.uint16)
    for batch in batches:
        for document in batch:
            expected.add_document(torch.tensor(document), [len(document)])
        got.add_documents(np.concatenate(batch), np.array([len(d) for d in batch]), np.ones(len(batch), np.int64))
    expected.finalize(str(tmp_path / "a.idx"))
    got.finalize(str(tmp_path / "b.idx"))
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"a{suffix}").read_bytes() == (tmp_path / f"b{suffix}").read_bytes()
