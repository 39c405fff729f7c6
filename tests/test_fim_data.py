"""Fill-in-the-middle data (--fim-data and the other --fim-* flags): Megatron-LM's GPTFIMDataset, vendored in
angpt/data/fim_dataset.py, given the run's tokenizer as Megatron-LM's MegatronTokenizer gives it. Its samples are
checked against Megatron-LM's own file (from the local mirror) and against what its code does, computed here."""

import importlib.util
import json
import os
import subprocess

import numpy as np
import pytest
import torch
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from test_gpt_datasets import write_ids
from test_megatron_loop_flags import TINY, recording_train_step, refusal
from test_pad_tokens import HF_LIBRARY
from test_trainer import losses
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from angpt.config import megatron_lm
from angpt.config.arguments import parse_args
from angpt.config.sections import DataSection
from angpt.data.fim_dataset import GPTFIMDataset
from angpt.data.gpt_datasets import build_datasets, dataset_vocabulary
from angpt.data.tokenizers import build_tokenizer

from conftest import in_process_trainer, megatron_tokenizer

MIRROR = "/work/.mirror/NVIDIA+Megatron-LM/repo"
FIM_TOKENS = ["<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>"]
SEQ, SAMPLES = 48, 40
TEXTS = ["def add(x, y):\n    return x + y\n", "the quick brown fox jumps over the lazy dog", "héllo wörld ✓ naïve",
         "for i in range(10):\n    print(i * i)\n", "class A:\n    pass\n"]


@pytest.fixture(scope="module")
def hf_directory(tmp_path_factory) -> str:
    """A byte-level BPE of 320 ids whose special tokens are <|endoftext|> (its EOS, in tokenizer_config.json), the
    four FIM tokens of Megatron-LM's defaults and <file_sep> (ids 0 to 5)."""
    directory = tmp_path_factory.mktemp("fim_tokenizer")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(TEXTS * 20, trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<|endoftext|>", *FIM_TOKENS, "<file_sep>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return str(directory)


def documents(tokenizer, count: int = 60, seed: int = 3) -> list[list[int]]:
    """`count` documents of 1 to 4 of TEXTS each, encoded, each ended by the end of document."""
    rng = np.random.default_rng(seed)
    chosen = ["".join(rng.choice(TEXTS, size=int(rng.integers(1, 5)))) for _ in range(count)]
    return [[*ids, tokenizer.eod] for ids in tokenizer.encode_batch(chosen)]


@pytest.fixture
def fim_data(hf_directory, tmp_path) -> DataSection:
    """A training split of `documents`, with the tokenizer flags of hf_directory."""
    prefix = str(tmp_path / "code_text_document")
    write_ids(prefix, documents(build_tokenizer("HuggingFaceTokenizer", hf_directory)))
    return DataSection(train_data_path=(prefix,), data_cache_path=str(tmp_path / "cache"),
                       tokenizer_type="HuggingFaceTokenizer", tokenizer_model=hf_directory, fim_data=True)


def built(data: DataSection, **fim):
    """The training split of `data` with these FIM fields replaced (a GPTFIMDataset with --fim-data)."""
    data = DataSection(**{**vars(data), **fim})
    train, _, _ = build_datasets(data, dataset_vocabulary(data), SEQ, 1234, [SAMPLES, 0, 0])
    return train


def texts(dataset, count: int = SAMPLES) -> list[np.ndarray]:
    """The token ids (seq_length + 1) of the first `count` samples, read in order (the FIM draws follow it)."""
    return [dataset._query_document_sample_shuffle_indices(index)[0] for index in range(count)]


# -- (a) Megatron-LM's own file


def megatron_lm_fim_module(tmp_path):
    """Megatron-LM core_v0.16.1's megatron/training/datasets/fim_dataset.py, from the mirror, imported."""
    if not os.path.isdir(MIRROR):
        pytest.skip(f"no Megatron-LM mirror at {MIRROR} (the peer comparison needs Megatron-LM's own file)")
    source = subprocess.run(["git", "-C", MIRROR, "show", "core_v0.16.1:megatron/training/datasets/fim_dataset.py"],
                            capture_output=True, text=True, check=True).stdout
    path = tmp_path / "megatron_lm_fim_dataset.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("megatron_lm_fim_dataset", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("fim", [{}, dict(fim_rate=0.9, fim_spm_rate=0.3, fim_no_prefix="class"),
                                 dict(fim_split_sample="<file_sep>", fim_fragment_rate=0.7)], ids=str)
def test_samples_are_megatron_lms_bit_for_bit(fim, fim_data, hf_directory, tmp_path, single_process):
    """The same data, seed and flags through Megatron-LM's own GPTFIMDataset, built as its pretrain_gpt.py builds it,
    with megatron-core's tokenizer object as Megatron-LM's build_tokenizer builds it: every key of every sample equal,
    and the samples are FIM samples (they differ from GPTDataset's)."""
    theirs_module = megatron_lm_fim_module(tmp_path)
    if "fim_split_sample" in fim:  # documents of fragments: <file_sep> between the texts
        tokenizer = build_tokenizer("HuggingFaceTokenizer", hf_directory)
        separated = [[*ids[:-1], tokenizer.library().tokens_to_ids("<file_sep>"), *ids[:-1], tokenizer.eod]
                     for ids in documents(tokenizer, 30)]
        write_ids(fim_data.train_data_path[0], separated)
    ours = built(fim_data, **fim)
    assert isinstance(ours, GPTFIMDataset)
    config = theirs_module.GPTFIMDatasetConfig(
        random_seed=1234, sequence_length=SEQ, blend_per_split=[([fim_data.train_data_path[0]], None), None, None],
        path_to_cache=str(tmp_path / "theirs"), reset_position_ids=False, reset_attention_mask=False,
        eod_mask_loss=False, tokenizer=megatron_tokenizer("huggingface", hf_directory, **HF_LIBRARY),
        fim_rate=fim.get("fim_rate", 0.5), fim_spm_rate=fim.get("fim_spm_rate", 0.5),
        fim_extra_tokens=dict(zip(("prefix", "middle", "suffix", "pad"), FIM_TOKENS), eod="<|endoftext|>"),
        fim_split_sample=fim.get("fim_split_sample"), fim_fragment_rate=fim.get("fim_fragment_rate"),
        fim_no_prefix=fim.get("fim_no_prefix"))
    theirs, _, _ = BlendedMegatronDatasetBuilder(theirs_module.GPTFIMDataset, [SAMPLES, 0, 0], lambda: True,
                                                 config).build()
    assert type(theirs).__name__ == "GPTFIMDataset" and type(theirs) is not GPTFIMDataset
    plain = built(fim_data, fim_data=False)
    differ = 0
    for index in range(SAMPLES):
        mine, expected = ours[index], theirs[index]
        for key in ("tokens", "labels", "loss_mask", "position_ids"):
            assert torch.equal(mine[key], expected[key]), (index, key)
        differ += not torch.equal(mine["tokens"], plain[index]["tokens"])
    assert differ > SAMPLES // 4


# -- (b) what Megatron-LM's code does


def sentinels(hf_directory) -> dict:
    library = build_tokenizer("HuggingFaceTokenizer", hf_directory).library()
    return dict(zip(("prefix", "middle", "suffix", "pad", "eod", "sep"),
                    library.tokens_to_ids([*FIM_TOKENS, "<|endoftext|>", "<file_sep>"]))), library


def test_fim_rate_0_gives_gptdatasets_samples_less_the_eods_of_empty_documents(fim_data, hf_directory,
                                                                              single_process):
    """No document is reordered; as Megatron-LM's code does, an end of document that starts the sample or follows
    another (an empty segment) is dropped, and the sample is filled up with the FIM pad token."""
    ids, _ = sentinels(hf_directory)
    plain = texts(built(fim_data, fim_data=False))
    fim = texts(built(fim_data, fim_rate=0.0))
    dropped = 0
    for sample, got in zip(plain, fim, strict=True):
        keep = [i for i, token in enumerate(sample) if token != ids["eod"] or (i > 0 and sample[i - 1] != ids["eod"])]
        dropped += len(sample) - len(keep)
        assert got.tolist() == [int(sample[i]) for i in keep] + [ids["pad"]] * (len(sample) - len(keep))
    assert dropped > 0


def pieces(segment: list, ids: dict, spm: bool):
    """(prefix, middle, suffix) token lists of one reordered segment, read in PSM or SPM order."""
    if spm:
        assert segment[:2] == [ids["prefix"], ids["suffix"]]
        m = segment.index(ids["middle"])
        suffix, rest = segment[2:m], segment[m + 1:]
        return rest, [], suffix  # prefix + middle are re-encoded apart: their texts are joined by the caller
    assert segment[0] == ids["prefix"]
    s, m = segment.index(ids["suffix"]), segment.index(ids["middle"])
    assert s < m
    return segment[1:s], segment[m + 1:], segment[s + 1:m]


@pytest.mark.parametrize("spm", [False, True], ids=["PSM", "SPM"])
def test_fim_rate_1_reorders_every_document_so_that_its_pieces_reassemble_it(spm, fim_data, hf_directory,
                                                                             single_process):
    """--fim-rate 1: every document of every sample starts with the prefix token; --fim-spm-rate 0 puts the pieces in
    PSM order (<prefix> prefix <suffix> suffix <middle> middle), 1 in SPM order (<prefix> <suffix> suffix <middle>
    prefix middle); the pieces' texts, put back in order, are the document's text. The last document of a sample that
    the reordering lengthened is cut with the sample: it is left out."""
    ids, library = sentinels(hf_directory)
    plain = texts(built(fim_data, fim_data=False))
    fim = texts(built(fim_data, fim_rate=1.0, fim_spm_rate=float(spm)))
    checked = 0
    for sample, got in zip(plain, fim, strict=True):
        originals = [list(part) for part in np.split(sample, np.flatnonzero(sample == ids["eod"]) + 1)]
        originals = [part[:-1] if part[-1:] == [ids["eod"]] else part for part in originals]
        originals = [part for part in originals if part]
        got = got.tolist()
        segments = [part for part in _split(got, ids["eod"]) if part]
        assert all(segment[0] == ids["prefix"] for segment in segments)
        whole = got[-1] == ids["pad"]  # filled up: nothing was cut
        for original, segment in zip(originals, segments if whole else segments[:-1]):
            segment = [token for token in segment if token != ids["pad"]]
            prefix, middle, suffix = pieces(segment, ids, spm)
            text = library.ids_to_text(prefix) + library.ids_to_text(middle) + library.ids_to_text(suffix)
            assert text == library.ids_to_text(original)
            checked += 1
    assert checked > SAMPLES // 2


def _split(tokens: list, separator: int) -> list:
    parts, current = [], []
    for token in tokens:
        if token == separator:
            parts.append(current)
            current = []
        else:
            current.append(token)
    return [*parts, current]


def crafted(fim_data, hf_directory, **fim):
    """A GPTFIMDataset with these flags, and the ids of "alpha <file_sep> beta gamma <file_sep> delta"."""
    dataset = built(fim_data, **fim)
    ids, library = sentinels(hf_directory)
    text = [*library.text_to_ids("alpha "), ids["sep"], *library.text_to_ids("beta gamma"), ids["sep"],
            *library.text_to_ids("delta")]
    return dataset, np.array(text, dtype=np.int64), ids, library


def test_split_sample_reorders_each_fragment_at_the_fragment_rate(fim_data, hf_directory, single_process):
    """--fim-split-sample: a document that holds the token is reordered fragment by fragment (each at
    --fim-fragment-rate), the split tokens staying between them; --fim-rate decides whether it is, once per
    document; a document without the token is reordered whole at --fim-rate."""
    dataset, text, ids, library = crafted(fim_data, hf_directory, fim_rate=1.0, fim_spm_rate=1.0,
                                          fim_split_sample="<file_sep>", fim_fragment_rate=1.0)
    fragments = _split(dataset._fim_split_and_permute_sequence(text).tolist(), ids["sep"])
    assert len(fragments) == 3
    for fragment, expected in zip(fragments, ["alpha ", "beta gamma", "delta"]):
        prefix, middle, suffix = pieces(fragment, ids, spm=True)
        assert library.ids_to_text(prefix) + library.ids_to_text(suffix) == expected
    unsplit = dataset._fim_split_and_permute_sequence(text[text != ids["sep"]]).tolist()
    assert unsplit[:2] == [ids["prefix"], ids["suffix"]] and ids["sep"] not in unsplit
    kept, text, _, _ = crafted(fim_data, hf_directory, fim_rate=1.0, fim_split_sample="<file_sep>",
                               fim_fragment_rate=0.0)
    assert kept._fim_split_and_permute_sequence(text).tolist() == text.tolist()
    kept, text, _, _ = crafted(fim_data, hf_directory, fim_rate=0.0, fim_split_sample="<file_sep>",
                               fim_fragment_rate=1.0)
    assert kept._fim_split_and_permute_sequence(text).tolist() == text.tolist()


def test_no_prefix_keeps_the_fragments_and_documents_that_start_with_it(fim_data, hf_directory, single_process):
    dataset, text, ids, _ = crafted(fim_data, hf_directory, fim_rate=1.0, fim_split_sample="<file_sep>",
                                    fim_fragment_rate=1.0, fim_no_prefix="beta")
    fragments = _split(dataset._fim_split_and_permute_sequence(text).tolist(), ids["sep"])
    assert fragments[1] == _split(text.tolist(), ids["sep"])[1]  # "beta gamma", as it was
    assert fragments[0][0] == fragments[2][0] == ids["prefix"]
    whole, text, _, _ = crafted(fim_data, hf_directory, fim_rate=1.0, fim_no_prefix="alpha")
    assert whole._fim_split_and_permute_sequence(text).tolist() == text.tolist()
    assert whole._fim_split_and_permute_sequence(text[3:]).tolist()[0] == ids["prefix"]


def test_the_tokenizer_a_datasets_json_records_is_asked_and_one_not_at_hand_is_refused(fim_data, hf_directory,
                                                                                       tmp_path):
    tokenizer = build_tokenizer("HuggingFaceTokenizer", hf_directory)
    prefix = fim_data.train_data_path[0]
    written = documents(tokenizer)  # the fixture's
    metadata = {"tokenizer": tokenizer.description, "vocab_size": tokenizer.vocab_size, "eod": tokenizer.eod,
                "pad": tokenizer.pad, "append_eod": True, "documents": len(written),
                "tokens": sum(map(len, written))}
    with open(prefix + ".json", "w") as file:
        json.dump(metadata, file)
    recorded = DataSection(train_data_path=(prefix,), fim_data=True)
    assert dataset_vocabulary(recorded)._tokenizer.tokens_to_ids(FIM_TOKENS) == [1, 2, 3, 4]
    with open(prefix + ".json", "w") as file:
        json.dump({**metadata, "tokenizer": {**tokenizer.description, "model": {"path": str(tmp_path / "gone.json"),
                                                                                "sha256": "0"}}}, file)
    with pytest.raises(ValueError, match=f"^--fim-data: the tokenizer {prefix}.json records is not at hand"):
        dataset_vocabulary(recorded)


# -- (c) a training run


@pytest.mark.slow  # three in-process trainer runs
def test_a_run_on_fim_data_trains_and_resumes_drawing_afresh_as_megatron_lm(fim_data, tmp_path, monkeypatch,
                                                                          single_process):
    """A run reads exactly the FIM dataset's samples in order; resumed at iteration 2, it continues from the
    checkpoint (its iterations 1 and 2 are the uninterrupted run's) and reads the samples from its consumed count on,
    their FIM choices drawn afresh from the seed, as Megatron-LM's GPTFIMDataset draws them (one line says so)."""
    flags = ["--model-family", "gpt", *TINY, "--train-data-path", fim_data.train_data_path[0], "--data-cache-path",
             fim_data.data_cache_path, "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
             fim_data.tokenizer_model, "--fim-data", "--fim-rate", "0.9", "--eval-iters", "0", "--train-iters", "4",
             "--seed", "1234"]
    seen = recording_train_step(monkeypatch)
    uninterrupted, resumed = tmp_path / "uninterrupted", tmp_path / "resumed"
    assert in_process_trainer([*flags, "--save", str(uninterrupted), "--save-interval", "2"]).run() == 0
    assert [line for line in megatron_lm.notes(parse_args(flags, world_size=1)) if "--fim" in line] == [
        "--fim-data: as in Megatron-LM, GPTFIMDataset draws its choices from one random generator per dataset (and "
        "DataLoader worker, --num-workers), seeded with --seed when the datasets are built, in the order the samples "
        "are read: a resumed run draws afresh from the seed, so its samples after the resume differ from an "
        "uninterrupted run's"]
    assert in_process_trainer([*flags, "--save", str(resumed), "--exit-interval", "2"]).run() == 0
    assert in_process_trainer([*flags, "--save", str(resumed), "--load", str(resumed)]).run() == 0
    assert sorted(losses(uninterrupted)) == sorted(losses(resumed)) == [1, 2, 3, 4]
    assert [losses(resumed)[i] for i in (1, 2)] == [losses(uninterrupted)[i] for i in (1, 2)]
    data = DataSection(**{**vars(fim_data), "fim_rate": 0.9})
    fresh = lambda: build_datasets(data, dataset_vocabulary(data), 16, 1234, [16, 0, 0])[0]  # noqa: E731
    # Each step reads its two micro-batches, samples 4 * step + [0, 4), in order; the first is recorded.
    in_order = [sample["tokens"] for sample in map(fresh().__getitem__, range(16))]
    expected = [torch.stack(in_order[4 * step:4 * step + 2]) for step in range(4)]
    after_resume = [sample["tokens"] for sample in map(fresh().__getitem__, range(8, 16))]
    expected_resumed = [torch.stack(after_resume[4 * step:4 * step + 2]) for step in range(2)]
    assert not torch.equal(expected[2], expected_resumed[0])  # the draws differ
    assert all(torch.equal(a, b) for a, b in zip(seen[:4], expected, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(seen[4:6], expected[:2], strict=True))
    assert all(torch.equal(a, b) for a, b in zip(seen[6:], expected_resumed, strict=True))


# -- (d) refusals and lines


def test_rates_outside_0_1_are_refused_at_their_boundaries(capsys):
    base = ["--mock-data", "--vocab-size", "64", "--train-iters", "1"]
    for flag in ("--fim-rate", "--fim-spm-rate", "--fim-fragment-rate"):
        for value in ("0", "1"):
            parse_args([*base, flag, value], world_size=1)
        for value in ("-0.01", "1.01"):
            assert f"{flag} {float(value)} must be in [0, 1]" in refusal([*base, flag, value], capsys)


@pytest.mark.parametrize("argv, message", [
    (["--fim-rate", "0"], "--fim-rate 0 with --fim-data: Megatron-LM's check"),
    (["--fim-spm-rate", "0"], "--fim-spm-rate 0 with --fim-data: Megatron-LM's check"),
    (["--fim-split-sample", "<file_sep>"], "--fim-split-sample needs --fim-fragment-rate"),
    (["--legacy-tokenizer"], "--fim-data with --legacy-tokenizer: Megatron-LM's check"),
], ids=lambda value: value[0] if isinstance(value, list) else "")
def test_megatron_lms_checks_are_one_line_refusals(argv, message, fim_data, capsys):
    flags = ["--train-data-path", fim_data.train_data_path[0], "--tokenizer-type", "HuggingFaceTokenizer",
             "--tokenizer-model", fim_data.tokenizer_model, "--fim-data", "--train-iters", "1"]
    assert message in refusal([*flags, *argv], capsys)
    parse_args([*flags, "--fim-rate", "0.01", "--fim-spm-rate", "0.01", "--fim-split-sample", "<file_sep>",
                "--fim-fragment-rate", "0"], world_size=1)


def test_fim_data_with_mock_data_is_refused(capsys):
    assert "--fim-data with --mock-data: Megatron-LM's check" in refusal(
        ["--mock-data", "--vocab-size", "64", "--train-iters", "1", "--fim-data"], capsys)


@pytest.mark.parametrize("field, token", [("fim_prefix_token", "<fim_start>"), ("fim_eod_token", "</s>"),
                                          ("fim_pad_token", ""), ("fim_split_sample", "alpha")])
def test_a_fim_token_that_is_not_one_token_of_the_tokenizer_is_refused_naming_its_flag(field, token, fim_data):
    flag = "--" + field.replace("_", "-")
    data = DataSection(**{**vars(fim_data), field: token, "fim_fragment_rate": 0.5})
    with pytest.raises(ValueError, match=f"^{flag} {token!r}: not one token of --tokenizer-type HuggingFaceTokenizer"):
        dataset_vocabulary(data)
    assert dataset_vocabulary(DataSection(**{**vars(fim_data), "fim_split_sample": "<file_sep>"}))


def test_a_tokenizer_without_text_or_fim_tokens_is_refused(fim_data, tmp_path):
    with pytest.raises(ValueError, match="^--fim-data: NullTokenizer has no text to split"):
        dataset_vocabulary(DataSection(**{**vars(fim_data), "tokenizer_type": "NullTokenizer", "vocab_size": 400,
                                          "tokenizer_model": None}))


def test_the_fim_flags_without_fim_data_are_said_to_change_nothing():
    mock = ["--mock-data", "--vocab-size", "64", "--train-iters", "1"]
    lines = megatron_lm.notes(parse_args([*mock, "--fim-rate", "0.2", "--fim-eod-token", "</s>"], world_size=1),
                              cuda=False)
    assert "--fim-rate, --fim-eod-token: without --fim-data there is no FIM data (as in Megatron-LM, nothing " \
           "changes)" in lines
    assert not [line for line in megatron_lm.notes(parse_args(mock, world_size=1), cuda=False) if "fim" in line]


def test_a_fragment_rate_without_split_sample_is_said_to_change_nothing(fim_data):
    flags = ["--train-data-path", fim_data.train_data_path[0], "--tokenizer-type", "HuggingFaceTokenizer",
             "--tokenizer-model", fim_data.tokenizer_model, "--fim-data", "--train-iters", "1"]
    lines = megatron_lm.notes(parse_args([*flags, "--fim-fragment-rate", "0.5"], world_size=1), cuda=False)
    assert "--fim-fragment-rate: without --fim-split-sample no document is split into fragments (as in Megatron-LM, " \
           "nothing changes)" in lines
