#!/usr/bin/env python
"""Concatenate the indexed datasets of a directory into one: Megatron-LM's tools/merge_datasets.py.

    python tools/merge_datasets.py --input data/shards --output-prefix data/corpus_text_document

As Megatron-LM's tool: every .bin/.idx pair in --input, in the sorted order of their names, appended to
{output-prefix}.bin/.idx with megatron-core's IndexedDatasetBuilder.add_index (so name shards with zero-padded
numbers: tools/preprocess_data.py --shard I/N, examples/preprocess.slurm). The shards of one corpus merge into
the bytes a single run of tools/preprocess_data.py writes. Beside Megatron-LM's tool, it merges the shards'
.json metadata too (the counts summed; the tokenizer, its EOD and the options must be the same in all), and
refuses datasets written with different tokenizers or token dtypes. A blend (--data-path 1 shard0 1 shard1 ...)
reads the shards without merging them.
"""

import argparse
import os
import sys
from collections import Counter


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", required=True, help="directory holding the .bin/.idx pairs to merge")
    parser.add_argument("--output-prefix", required=True, help="path of the merged .bin/.idx without the suffix")
    parser.add_argument("--multimodal", action="store_true", help="the datasets have sequence modes (Megatron-LM's)")
    args = parser.parse_args(argv)
    if not os.path.isdir(args.input):
        parser.error(f"--input {args.input}: not a directory")
    if not os.path.isdir(os.path.dirname(os.path.abspath(args.output_prefix))):
        parser.error(f"--output-prefix {args.output_prefix}: its directory does not exist")
    return args


def dataset_prefixes(directory: str) -> list:
    """The prefixes of the .bin/.idx pairs in directory, sorted by name as Megatron-LM's tool sorts them."""
    prefixes = set()
    for name in os.listdir(directory):
        prefix, suffix = os.path.splitext(name)
        if suffix in (".bin", ".idx") and os.path.isfile(os.path.join(directory, name)):
            other = ".idx" if suffix == ".bin" else ".bin"
            if not os.path.isfile(os.path.join(directory, prefix + other)):
                raise ValueError(f"{os.path.join(directory, name)}: no {other} beside it")
            prefixes.add(prefix)
    if not prefixes:
        raise ValueError(f"--input {directory}: no .bin/.idx pair to merge")
    return [os.path.join(directory, prefix) for prefix in sorted(prefixes)]


# What the shards of one corpus share; the merged dataset keeps them.
SHARED = ("tokenizer", "vocab_size", "eod", "pad", "append_eod", "special_tokens_as_text", "dtype", "json_key",
          "split_sentences")


def merge_metadata(prefixes: list, metadata: list) -> dict:
    """The merged dataset's metadata: the shards' counts summed, what they share kept."""
    merged = {key: metadata[0].get(key) for key in SHARED if key in metadata[0]}
    for prefix, part in zip(prefixes[1:], metadata[1:]):
        for key in SHARED:
            if part.get(key) != merged.get(key):
                raise ValueError(f"{prefix}.json: its {key} is {part.get(key)!r}, {prefixes[0]}.json's "
                                 f"{merged.get(key)!r}: not shards of one corpus")
    for key in ("documents", "tokens", "empty_documents", "sequences"):
        merged[key] = sum(part.get(key, 0) for part in metadata)
    largest = [part["max_token_id"] for part in metadata if part.get("max_token_id") is not None]
    merged["max_token_id"] = max(largest) if largest else None
    skipped = Counter()
    for part in metadata:
        skipped.update(part.get("skipped_lines", {}))
    merged["skipped_lines"] = dict(skipped)
    merged["input"] = list(dict.fromkeys(path for part in metadata for path in part.get("input", [])))
    merged["tokenizer_backend"] = [part.get("tokenizer_backend") for part in metadata]
    merged["merged_from"] = [os.path.abspath(prefix) for prefix in prefixes]
    return merged


def merge(input_directory: str, output_prefix: str, multimodal: bool = False) -> list:
    """Write the merged .bin/.idx (and .json, when every dataset has one); returns the prefixes merged."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder  # noqa: PLC0415 (after parsing: --help without torch)

    from angpt.data.indexed import (  # noqa: PLC0415 (as megatron-core)
        check_indexed_dataset,
        metadata_path,
        read_metadata,
        write_metadata,
    )

    prefixes = dataset_prefixes(input_directory)
    for prefix in prefixes:  # whole and consistent, before megatron-core reads them (and before anything is written)
        check_indexed_dataset(prefix)
    with_metadata = [os.path.isfile(metadata_path(prefix)) for prefix in prefixes]
    if any(with_metadata) and not all(with_metadata):
        missing = prefixes[with_metadata.index(False)]
        raise ValueError(f"{missing}: no .json beside its .bin/.idx, which the other datasets have")
    metadata = [read_metadata(prefix) for prefix in prefixes] if all(with_metadata) else []
    dtype = IndexedDataset(prefixes[0], multimodal=multimodal).index.dtype
    for prefix in prefixes[1:]:
        other = IndexedDataset(prefix, multimodal=multimodal).index.dtype
        if other != dtype:  # add_index would append its tokens reinterpreted
            raise ValueError(f"{prefix}: tokens of {other.__name__}, {prefixes[0]}'s of {dtype.__name__}")
    builder = IndexedDatasetBuilder(output_prefix + ".bin", dtype=dtype, multimodal=multimodal)
    for prefix in prefixes:
        builder.add_index(prefix)
    builder.finalize(output_prefix + ".idx")
    if metadata:
        write_metadata(metadata_path(output_prefix), merge_metadata(prefixes, metadata))
    return prefixes


def main() -> None:
    args = parse_args()
    try:
        prefixes = merge(args.input, args.output_prefix, args.multimodal)
    except (ValueError, OSError) as error:
        sys.exit(f"error: {error}")
    print(f"{args.output_prefix}.bin/.idx: {len(prefixes)} datasets merged", file=sys.stderr)


if __name__ == "__main__":
    main()
