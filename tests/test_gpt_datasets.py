"""Training data through megatron-core's BlendedMegatronDatasetBuilder and GPTDataset."""

import json
import os
import re

import numpy as np
import pytest
import sentencepiece
import torch
from megatron.core.datasets.blended_dataset import BlendedDataset
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

from angpt.config.arguments import parse_args
from angpt.config.sections import DataSection
from angpt.data import indexed
from angpt.data.gpt_datasets import build_datasets, dataset_vocabulary, micro_batches
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
             "GPTSentencePieceTokenizer, Llama2Tokenizer, NullTokenizer")
    with pytest.raises(ValueError, match=rf"^--tokenizer-type BertWordPieceCase: Megatron-LM's, not built here yet "
                                         rf"\({built} are\)$"):
        dataset_vocabulary(DataSection(train_data_path=(a,), tokenizer_type="BertWordPieceCase"))
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
