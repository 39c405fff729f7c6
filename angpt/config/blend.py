"""Megatron-LM's --data-path: dataset prefixes, or weight/prefix pairs of a blend. Read here, apart from the
datasets (angpt.data.gpt_datasets), so that the command line checks it before torch and megatron-core are loaded."""

from __future__ import annotations

import math
from typing import Optional, Sequence


def parse_blend(values: Sequence[str]) -> tuple[list[str], Optional[list[float]]]:
    """`prefix1 prefix2 ...` or `w1 prefix1 w2 prefix2 ...`, read as megatron-core's get_blend_from_list reads
    --data-path: an odd count, or an even count whose weights' places hold no number, is a list of prefixes without
    weights (megatron-core then blends them by their sizes)."""
    values = [value.strip() for value in values]
    if len(values) % 2:
        return values, None
    weights = [as_number(value) for value in values[0::2]]
    if None in weights:
        # megatron-core's `any(is_none)` then `all(is_none)` over one iterator: a number after a non-number fails its
        # assert, numbers before the first non-number do not.
        first = weights.index(None)
        if any(weight is not None for weight in weights[first:]):
            raise ValueError(f"--data-path mixes weight/prefix pairs with prefixes without weights: "
                             f"{values[2 * first]!r} stands where a weight goes, and a weight follows it, got {values}")
        return values, None
    for weight, prefix in zip(weights, values[1::2]):
        if not math.isfinite(weight) or weight < 0:  # megatron-core would normalize them as they are
            raise ValueError(f"--data-path: the weight {weight} of {prefix} is not a finite number >= 0")
    if not sum(weights):
        raise ValueError(f"--data-path: the weights sum to 0, got {values}")
    return values[1::2], weights


def as_number(value: str) -> Optional[float]:
    """The value as megatron-core reads a blend's weight (float), or None where it is none."""
    try:
        return float(value)
    except ValueError:
        return None
