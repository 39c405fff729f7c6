"""Training data from Megatron indexed datasets, through megatron-core's BlendedMegatronDatasetBuilder
and GPTDataset, with Megatron-LM's flags and its order of samples across data-parallel ranks."""

from __future__ import annotations

import json
import logging
import warnings
from dataclasses import asdict, dataclass, field, fields
from typing import Optional, Sequence

import numpy
import torch
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from torch.utils.data import DataLoader

from angpt.config.blend import parse_blend
from angpt.config.files import read_json_object
from angpt.config.object_storage import is_object_storage_path
from angpt.config.sections import DataSection
from angpt.data.fim_dataset import GPTFIMDataset, GPTFIMDatasetConfig
from angpt.data.indexed import (
    DTYPES,
    IndexedDatasetError,
    check_indexed_dataset,
    check_token_ids,
    has_metadata,
    index_header,
    metadata_path,
    read_metadata,
)
from angpt.data.tokenizers import (
    MEGATRON_ONLY_TOKENIZER_TYPES,
    NO_PAD,
    NULL_TOKENIZER,
    TIKTOKEN_NUM_SPECIAL_TOKENS,
    TOKENIZER_TYPES,
    TikTokenizer,
    build_tokenizer,
    recorded_tokenizer,
)

logger = logging.getLogger("angpt.data")
# The start of the warning megatron-core's MegatronDataset gives, once per dataset, where the pad id is also the id of
# another special token (the EOS or end of document).
AMBIGUOUS_PAD = "The pad token id in the tokenizer collides with another special token id."


@dataclass(frozen=True)
class DatasetVocabulary:
    """What GPTDataset needs of a tokenizer for data that tools/preprocess_data.py already tokenized:
    the vocabulary size, the end-of-document id, an identity for its index cache key, and the pad id (NO_PAD
    without one) that megatron-core's MegatronDataset reads as Megatron-LM's tokenizer gives it: the labels
    equal to it are left out of the loss and mapped to 0, with the tokens."""

    vocab_size: int
    eod: int
    unique_identifiers: dict  # the tokenizer's description, which determines the pad id: no field of its own
    pad: int = NO_PAD

    @property
    def eos(self) -> int:
        """MegatronDataset compares the pad id with the EOS and the end of document: they are one token in every
        tokenizer of Megatron-LM's that we build (NullTokenizer has no EOS, which MegatronDataset skips)."""
        return self.eod


@dataclass(frozen=True)
class FIMVocabulary(DatasetVocabulary):
    """A DatasetVocabulary with the tokenizer Megatron-LM's GPTFIMDataset asks (--fim-data): megatron-core's library
    object of the run's tokenizer, which Megatron-LM's MegatronTokenizer keeps as `_tokenizer`."""

    _tokenizer: object = field(default=None, compare=False, repr=False)


# (GPTFIMDatasetConfig.fim_extra_tokens' key, the flag's field), in the order GPTFIMDataset looks them up.
FIM_TOKENS = (("prefix", "fim_prefix_token"), ("middle", "fim_middle_token"), ("suffix", "fim_suffix_token"),
              ("pad", "fim_pad_token"), ("eod", "fim_eod_token"))


def dataset_vocabulary(data: DataSection) -> DatasetVocabulary:
    """_dataset_vocabulary's; with --fim-data, a FIMVocabulary whose tokenizer has each FIM token (fim_vocabulary)."""
    vocabulary = _dataset_vocabulary(data)
    return fim_vocabulary(data, vocabulary) if data.fim_data else vocabulary


def fim_vocabulary(data: DataSection, vocabulary: DatasetVocabulary) -> FIMVocabulary:
    """`vocabulary` with the library of the run's tokenizer (the tokenizer flags', else the one the datasets' .json
    records, rebuilt), checked to have each FIM token, and --fim-split-sample, as one token: GPTFIMDataset looks
    them up with tokens_to_ids, and Megatron-LM asserts only that the split token is one id (a missing token is
    the unknown token's id there, or None)."""
    if data.tokenizer_type == NULL_TOKENIZER:
        raise ValueError("--fim-data: NullTokenizer has no text to split and no FIM tokens (Megatron-LM's "
                         "GPTFIMDataset decodes each document to text): give the datasets' tokenizer")
    if data.tokenizer_type is not None:
        tokenizer, source = flag_tokenizer(data), _describe_flags(data)
    else:
        prefix = next((prefix for prefix in data.prefixes() if has_metadata(prefix)), None)
        source = f"the tokenizer {metadata_path(prefix)} records" if prefix else "the datasets' tokenizer (no .json)"
        tokenizer = recorded_tokenizer(read_metadata(prefix)["tokenizer"]) if prefix else None
        if tokenizer is None:
            raise ValueError(f"--fim-data: {source} is not at hand (its files are not where it says, or it is not one "
                             "of angpt's): give --tokenizer-type and its files")
    if isinstance(tokenizer, TikTokenizer):
        raise ValueError(f"--fim-data: {source} is a .tiktoken ranks file (angpt's layout, which Megatron-LM does not "
                         "read), whose one special token is <|endoftext|>: it has no FIM tokens")
    library = tokenizer.library()
    for flag, token in [*((f"--{name.replace('_', '-')}", getattr(data, name)) for _, name in FIM_TOKENS),
                        *((("--fim-split-sample", data.fim_split_sample),) if data.fim_split_sample else ())]:
        try:
            # As GPTFIMDataset asks: the split token alone (a str), the others in a list.
            ids = library.tokens_to_ids(token if flag == "--fim-split-sample" else [token])
        except (KeyError, ValueError):  # tiktoken's library: no such token
            ids = None
        ids = [ids] if isinstance(ids, int) or ids is None else ids
        if len(ids) != 1 or not isinstance(ids[0], int) or library.ids_to_tokens([ids[0]]) != [token]:
            raise ValueError(f"{flag} {token!r}: not one token of {source} (Megatron-LM's GPTFIMDataset takes its id "
                             "from the tokenizer): give a token it has, or add it to the tokenizer")
    return FIMVocabulary(**asdict(vocabulary), _tokenizer=library)


def _dataset_vocabulary(data: DataSection) -> DatasetVocabulary:
    """The vocabulary of the datasets: the one their .json records, or, for a dataset without one (written by
    Megatron-LM's own tool), the one of the tokenizer flags (--tokenizer-type and its files, or NullTokenizer
    with --vocab-size), as Megatron-LM reads it. Every prefix must agree on it, a .json with the tokenizer
    flags when both are given, and with --vocab-size when given. Checks that each .bin/.idx pair is whole,
    that its token ids lie within that vocabulary, and that the tokenizer a .json names (when its files are
    at hand) has that vocabulary, before anything reads the data."""
    if data.mock_data:  # the tokenizer flags' vocabulary, as Megatron-LM's; else --vocab-size ids, the last the EOD
        if data.tokenizer_type is not None:
            return flag_vocabulary(data)
        if not data.vocab_size:
            raise ValueError("--mock-data needs --vocab-size or --tokenizer-type")
        return DatasetVocabulary(data.vocab_size, data.vocab_size - 1, {"tokenizer": "mock"})
    prefixes = data.prefixes()
    if not prefixes:
        raise ValueError("no training data: give --data-path, --train-data-path or --mock-data")
    flags = flag_vocabulary(data)
    metadata = {}
    for prefix in prefixes:
        check_indexed_dataset(prefix, data.object_storage_cache_path)
        if has_metadata(prefix):
            metadata[prefix] = read_metadata(prefix)
            check_token_ids(prefix, metadata[prefix], cache_dir=data.data_cache_path)
        elif flags is None:
            raise IndexedDatasetError(
                f"{metadata_path(prefix)}: no dataset metadata: give the tokenizer the dataset was written with "
                "(--tokenizer-type and --tokenizer-model, --vocab-file/--merge-file, or NullTokenizer with "
                "--vocab-size), or write it with tools/preprocess_data.py")
        else:
            check_token_ids(prefix, {"vocab_size": flags.vocab_size}, source=_describe_flags(data),
                            cache_dir=data.data_cache_path)
    recorded = {prefix: (meta["vocab_size"], meta["eod"]) for prefix, meta in metadata.items()}
    if len(set(recorded.values())) > 1:
        raise ValueError(f"the datasets were tokenized differently (vocab_size, eod): {recorded}")
    if flags is not None:
        for prefix, (vocab_size, eod) in recorded.items():
            if (vocab_size, eod) != (flags.vocab_size, flags.eod):
                raise ValueError(f"{metadata_path(prefix)} records vocab_size {vocab_size} and eod {eod}, but "
                                 f"{_describe_flags(data)} has vocab_size {flags.vocab_size} and eod {flags.eod}")
    # The pad id of each dataset: its .json's, else its tokenizer's, rebuilt (a .json written before records none).
    pads = {prefix: meta["pad"] for prefix, meta in metadata.items() if "pad" in meta}
    if metadata:
        first_prefix = next(iter(metadata))
        first = metadata[first_prefix]
        if data.vocab_size is not None and data.tokenizer_type != NULL_TOKENIZER \
                and data.vocab_size != first["vocab_size"]:
            raise ValueError(f"--vocab-size {data.vocab_size} disagrees with the vocab_size {first['vocab_size']} of "
                             f"{metadata_path(first_prefix)} (leave --vocab-size out: the datasets' is used)")
        described = {json.dumps(meta["tokenizer"], sort_keys=True): prefix for prefix, meta in metadata.items()}
        for prefix in described.values():  # each tokenizer once: a split's datasets usually share one
            tokenizer = _check_tokenizer(prefix, metadata[prefix])
            if tokenizer is not None:
                pads.setdefault(prefix, tokenizer.pad)
        if flags is not None:
            pads[_describe_flags(data)] = flags.pad
        if len(set(pads.values())) > 1:
            raise ValueError(f"the datasets' tokenizers have different pad ids: {pads}")
        if flags is None:
            if not pads and isinstance(first["tokenizer"], dict) and first["tokenizer"].get("type") in TOKENIZER_TYPES:
                logger.warning("%s records no pad id and its tokenizer's files are not at hand: no token is masked as "
                               "padding (Megatron-LM masks its tokenizer's pad id; tools/preprocess_data.py records "
                               "it)", metadata_path(first_prefix))
            return DatasetVocabulary(first["vocab_size"], first["eod"], {"tokenizer": first["tokenizer"]},
                                     next(iter(pads.values()), NO_PAD))
    return flags


def flag_vocabulary(data: DataSection) -> Optional[DatasetVocabulary]:
    """The vocabulary of the tokenizer flags, as Megatron-LM builds it (None without --tokenizer-type):
    NullTokenizer's is --vocab-size ids and the end-of-document id after them (vocab_size + 1 in all)."""
    if data.tokenizer_type is None:
        return None
    if data.tokenizer_type == NULL_TOKENIZER:
        if not data.vocab_size:
            raise ValueError("--tokenizer-type NullTokenizer needs --vocab-size")
        return DatasetVocabulary(data.vocab_size + 1, data.vocab_size,
                                 {"tokenizer": {"type": NULL_TOKENIZER, "vocab_size": data.vocab_size}})
    if data.tokenizer_type not in TOKENIZER_TYPES:
        built = ", ".join([*TOKENIZER_TYPES, NULL_TOKENIZER])
        if data.tokenizer_type in MEGATRON_ONLY_TOKENIZER_TYPES:
            raise ValueError(f"--tokenizer-type {data.tokenizer_type}: "
                             f"{MEGATRON_ONLY_TOKENIZER_TYPES[data.tokenizer_type]} ({built} are built)")
        raise ValueError(f"--tokenizer-type {data.tokenizer_type}: choose one of {built}")
    tokenizer = flag_tokenizer(data)
    # Described as a .json describes its tokenizer: checkpoints and the export carry it.
    return DatasetVocabulary(tokenizer.vocab_size, tokenizer.eod, {"tokenizer": tokenizer.description}, tokenizer.pad)


def flag_tokenizer(data: DataSection):
    """The tokenizer of --tokenizer-type (one of TOKENIZER_TYPES) and its flags."""
    return build_tokenizer(data.tokenizer_type, data.tokenizer_model, data.vocab_file, data.merge_file,
                           tiktoken_pattern=data.tiktoken_pattern, vocab_size=data.vocab_size,
                           tiktoken_num_special_tokens=data.tiktoken_num_special_tokens,
                           special_tokens=data.tokenizer_special_tokens,
                           include_special_tokens=data.tokenizer_hf_include_special_tokens,
                           metadata=data.tokenizer_metadata)


def _describe_flags(data: DataSection) -> str:
    files = [f"{flag} {path}" for flag, path in (("--tokenizer-model", data.tokenizer_model),
                                                  ("--vocab-file", data.vocab_file),
                                                  ("--merge-file", data.merge_file)) if path]
    if data.tokenizer_type == NULL_TOKENIZER:
        files = [f"--vocab-size {data.vocab_size}"]
    if data.tokenizer_type == "TikTokenizer":  # the flags of Megatron-LM's .json vocabulary, where given
        special = data.tiktoken_num_special_tokens
        files += [f"{flag} {value}" for flag, value in (
            ("--vocab-size", data.vocab_size), ("--tiktoken-pattern", data.tiktoken_pattern),
            ("--tiktoken-num-special-tokens", special if special != TIKTOKEN_NUM_SPECIAL_TOKENS else None)) if value]
    return " ".join([f"--tokenizer-type {data.tokenizer_type}", *files])


def _check_tokenizer(prefix: str, metadata: dict):
    """The tokenizer the metadata names, rebuilt from its files (None when they are not at hand, e.g. on another
    machine), checked to have the metadata's vocab_size, eod and pad (where recorded). A .json that understates the
    vocabulary would otherwise give a model too small for the tokenizer its checkpoints carry."""
    try:
        tokenizer = recorded_tokenizer(metadata["tokenizer"])
    except ValueError as error:
        raise IndexedDatasetError(f"{metadata_path(prefix)}: {error}") from error
    if tokenizer is None:
        return None
    if (tokenizer.vocab_size, tokenizer.eod) != (metadata["vocab_size"], metadata["eod"]):
        raise IndexedDatasetError(
            f"{metadata_path(prefix)}: records vocab_size {metadata['vocab_size']} and eod {metadata['eod']}, but "
            f"its tokenizer has vocab_size {tokenizer.vocab_size} and eod {tokenizer.eod}")
    if metadata.get("pad", tokenizer.pad) != tokenizer.pad:
        raise IndexedDatasetError(f"{metadata_path(prefix)}: records pad {metadata['pad']}, but its tokenizer's pad id "
                                  f"is {tokenizer.pad}")
    return tokenizer


def build_datasets(data: DataSection, vocabulary, seq_length: int, seed: int, samples: Sequence[Optional[int]],
                   full_validation: bool = False, multiple_validation_sets: bool = False):
    """(train, valid, test) datasets with the requested numbers of samples (None where not requested; a sample count
    of None builds one epoch). With `multiple_validation_sets`, megatron-core's builder gives a list of validation
    datasets, one per prefix of a --valid-data-path blend."""
    blend_per_split = None
    blend = None
    if data.train_data_path or data.valid_data_path or data.test_data_path:
        blend_per_split = [parse_blend(p) if p else None for p in
                           (data.train_data_path, data.valid_data_path, data.test_data_path)]
    elif data.data_path:
        blend = parse_blend(data.data_path)
    fim = {}
    if data.fim_data:  # as Megatron-LM's pretrain_gpt.py fills GPTFIMDatasetConfig
        fim = {item.name: getattr(data, item.name) for item in fields(GPTFIMDatasetConfig)
               if item.name.startswith("fim_") and hasattr(data, item.name)}
        fim["fim_extra_tokens"] = {key: getattr(data, name) for key, name in FIM_TOKENS}
    config = (GPTFIMDatasetConfig if data.fim_data else GPTDatasetConfig)(
        **fim,
        random_seed=seed,
        sequence_length=seq_length,
        blend=blend,
        blend_per_split=blend_per_split,
        split=data.split if blend is not None or data.mock_data else None,
        path_to_cache=data.data_cache_path,
        mmap_bin_files=data.mmap_bin_files,
        tokenizer=vocabulary,
        reset_position_ids=data.reset_position_ids,
        reset_attention_mask=data.reset_attention_mask,
        eod_mask_loss=data.eod_mask_loss,
        allow_ambiguous_pad_tokens=data.allow_ambiguous_pad_tokens,
        # The model is causal by itself: a mask is read only where it adds the documents' boundaries.
        create_attention_mask=data.reset_attention_mask,
        full_validation=full_validation,
        multiple_validation_sets=multiple_validation_sets,
        num_dataset_builder_threads=data.num_dataset_builder_threads,
        mid_level_dataset_surplus=data.mid_level_dataset_surplus,
        fast_cache_load=data.dataloader_fast_cache_load,
        defer_npy_index_mmap=data.dataloader_defer_npy_index_mmap,
        sequences_per_dataset=sequences_per_dataset(data, vocabulary),
        object_storage_cache_path=data.object_storage_cache_path,
    )
    if blend is not None:
        _check_every_split_has_documents(data.split, config.split_matrix, blend[0], data.object_storage_cache_path)
    dataset_type = MockGPTDataset if data.mock_data else GPTFIMDataset if data.fim_data else GPTDataset
    with warnings.catch_warnings(record=True) as caught:
        warnings.filterwarnings("always", message=AMBIGUOUS_PAD)  # recorded, whatever the filters say of the rest
        # Every rank builds: rank 0 first writes the index caches, the others then read them.
        datasets = BlendedMegatronDatasetBuilder(dataset_type, list(samples), lambda: True, config).build()
    for warning in caught:  # megatron-core's other warnings, as they were
        if not str(warning.message).startswith(AMBIGUOUS_PAD):
            warnings.showwarning(warning.message, warning.category, warning.filename, warning.lineno)
    if any(str(warning.message).startswith(AMBIGUOUS_PAD) for warning in caught):  # given once per dataset
        logger.warning("the pad id %d is also the end of document's: %s", vocabulary.pad,
                       "its tokens are masked as padding (--allow-ambiguous-pad-tokens)" if
                       data.allow_ambiguous_pad_tokens else "no token is masked as padding, as in Megatron-LM "
                       "(--allow-ambiguous-pad-tokens masks them)")
    return datasets


def sequences_per_dataset(data: DataSection, vocabulary) -> Optional[dict]:
    """--per-dataset-sequences-path's {prefix: [sequences, documents]}, checked against each .idx header: megatron-core
    then reads the index at those counts, in the dtype it takes from the vocabulary's size, without its header."""
    path = data.per_dataset_sequences_path
    if path is None:
        return None
    counts = read_json_object(path)
    dtype_code = 4 if vocabulary.vocab_size > numpy.iinfo(numpy.uint16).max + 1 else 8  # GPTDatasetConfig's
    for prefix in data.prefixes():
        if is_object_storage_path(prefix):  # megatron-core reads their .idx whole (angpt.config.megatron_lm.notes)
            continue
        if prefix not in counts:
            raise ValueError(f"--per-dataset-sequences-path {path}: no entry for {prefix}")
        code, sequences, documents = index_header(prefix)
        if counts[prefix] != [sequences, documents]:
            raise ValueError(f"--per-dataset-sequences-path {path}: {prefix} has {json.dumps(counts[prefix])}, but "
                             f"{prefix}.idx counts [{sequences}, {documents}] (sequences, documents)")
        if code != dtype_code:
            raise ValueError(f"--per-dataset-sequences-path: {prefix}.idx holds {DTYPES[code].name} tokens, and "
                             f"megatron-core would read them as {DTYPES[dtype_code].name} (the dtype of a vocabulary "
                             f"of {vocabulary.vocab_size}): leave the flag out")
    return counts


def _check_every_split_has_documents(split: str, split_matrix, prefixes, object_storage_cache_path=None) -> None:
    """megatron-core's GPTDataset loops forever on a split without documents; refuse it by name. The
    bounds are computed as megatron-core's dataset builder computes them: over the .idx's sequences, which
    are its non-empty documents (a zero-length document, as Megatron-LM writes an empty text, has none)."""
    for prefix in prefixes:
        documents = check_indexed_dataset(prefix, object_storage_cache_path)["sequences"]
        for name, bounds in zip(("train", "validation", "test"), split_matrix):
            if bounds is not None and round(bounds[0] * documents) == round(bounds[1] * documents):
                raise ValueError(f"--split {split} leaves the {name} split of {prefix} without documents "
                                 f"(it has {documents} non-empty documents): give that split more weight, "
                                 f"or 0 to have none")


# attention_mask: only with reset_attention_mask.
BATCH_KEYS = ("tokens", "labels", "loss_mask", "position_ids", "attention_mask")


def micro_batches(dataset, consumed_samples: int, global_batch_size: int, micro_batch_size: int,
                  dp_rank: int, dp_size: int, vocab_size: Optional[int] = None) -> list[dict]:
    """This rank's micro-batches of the global batch that starts at sample `consumed_samples`, in
    Megatron-LM's order: micro-batch m of data-parallel rank r holds samples
    consumed + m * micro * dp + r * micro + [0, micro). Resuming at `consumed_samples` continues exactly.
    With `vocab_size`, a token id outside [0, vocab_size) is refused, naming the dataset it came from."""
    batches = []
    for indices in MicroBatchIndices(consumed_samples, consumed_samples + global_batch_size, micro_batch_size,
                                     dp_rank, dp_size):
        samples = [dataset[i] for i in indices]
        batch = {key: torch.stack([sample[key] for sample in samples]) for key in BATCH_KEYS if key in samples[0]}
        if vocab_size is not None:
            check_batch_token_ids(batch, indices[0], dataset, vocab_size)
        batches.append(batch)
    return batches


class MicroBatchIndices:
    """The sample indices of this rank's micro-batches from `start` to `end`, in micro_batches' order (Megatron-LM's
    MegatronPretrainingSampler): a batch sampler for a DataLoader."""

    def __init__(self, start: int, end: int, micro_batch_size: int, dp_rank: int, dp_size: int):
        self.start, self.end, self.micro, self.dp_rank, self.dp_size = start, end, micro_batch_size, dp_rank, dp_size

    def __iter__(self):
        step = self.micro * self.dp_size
        for start in range(self.start, self.end - step + 1, step):
            first = start + self.dp_rank * self.micro
            yield list(range(first, first + self.micro))

    def __len__(self) -> int:
        return max(0, (self.end - self.start) // (self.micro * self.dp_size))


class TrainingBatches:
    """This rank's micro-batches of the training split from `consumed_samples` on, in micro_batches' order, read
    by a torch DataLoader: in `num_workers` worker processes that read ahead of the step (Megatron-LM's
    --num-workers; pinned memory with CUDA), or in this process (0). The order does not depend on the workers,
    so a resumed run continues exactly with any number of them."""

    def __init__(self, dataset, consumed_samples: int, micro_batch_size: int, dp_rank: int, dp_size: int,
                 num_workers: int = 0, vocab_size: Optional[int] = None):
        self.dataset, self.vocab_size = dataset, vocab_size
        self.first, self.step = consumed_samples + dp_rank * micro_batch_size, micro_batch_size * dp_size
        loader = DataLoader(dataset, batch_sampler=MicroBatchIndices(consumed_samples, len(dataset),
                                                                     micro_batch_size, dp_rank, dp_size),
                            num_workers=num_workers, pin_memory=torch.cuda.is_available())
        self.batches = iter(loader)

    def take(self, count: int) -> list[dict]:
        """The next `count` micro-batches (one global batch's share of this rank)."""
        taken = []
        for _ in range(count):
            batch = {key: value for key, value in next(self.batches).items() if key in BATCH_KEYS}
            if self.vocab_size is not None:
                check_batch_token_ids(batch, self.first, self.dataset, self.vocab_size)
            self.first += self.step  # the next micro-batch's first sample (MicroBatchIndices' order)
            taken.append(batch)
        return taken

    def close(self) -> None:
        """Ends the worker processes (also at interpreter exit, and by themselves when this process dies)."""
        self.batches = None


def describe_samples(dataset, indices: Sequence[int]) -> str:
    """Where the samples at `indices` of a training split come from: for each, the indexed dataset (its path
    prefix: a blend's component, megatron-core's BlendedDataset) and the sample and documents within it."""
    described = []
    for index in indices:
        source, sample = dataset, index
        if hasattr(dataset, "datasets"):  # a blend: its index arrays load with its first sample read
            dataset[index]
            source = dataset.datasets[int(dataset.dataset_index[index])]
            sample = int(dataset.dataset_sample_index[index])
        _, documents = source._query_document_sample_shuffle_indices(sample)
        prefix = getattr(source.dataset, "path_prefix", "mock data")
        described.append(f"{index} ({prefix} sample {sample}, documents {', '.join(str(d) for d in documents)})")
    return "; ".join(described)


def check_batch_token_ids(batch: dict, first: int, dataset, vocab_size: int) -> None:
    """The last guard before the embedding (tens of microseconds per micro-batch, on the host, in numpy,
    which beats torch's reductions on such small tensors): catches a max_token_id in a .json that does not
    match its .bin, which the check at opening trusts. `first`: the micro-batch's first sample."""
    # The labels are the tokens shifted by one: their last column is all they add.
    tokens, last_labels = batch["tokens"].numpy(), batch["labels"][:, -1].numpy()
    if min(tokens.min(), last_labels.min()) >= 0 and max(tokens.max(), last_labels.max()) < vocab_size:
        return
    samples = [dataset[i] for i in range(first, first + len(tokens))]
    for offset, sample in enumerate(samples):
        bad = [int(i) for key in ("tokens", "labels") for i in sample[key] if not 0 <= i < vocab_size]
        if bad:
            # A blend's sample names the dataset it came from; a GPTDataset reads one indexed dataset.
            source = dataset.datasets[int(sample["dataset_id"])] if "dataset_id" in sample else dataset
            raise IndexedDatasetError(f"{source.dataset.path_prefix}.bin: sample {first + offset} holds token id "
                                      f"{bad[0]}, outside the vocabulary of {vocab_size} its .json records")
