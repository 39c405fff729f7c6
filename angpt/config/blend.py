"""Megatron-LM's --data-path: one dataset prefix, or weight/prefix pairs of a blend. Read here, apart
from the datasets (angpt.data.gpt_datasets), so that the command line checks it before torch and megatron-core
are loaded."""

from __future__ import annotations

import math
from typing import Optional, Sequence


def parse_blend(values: Sequence[str]) -> tuple[list[str], Optional[list[float]]]:
    """`prefix` or `w1 prefix1 w2 prefix2 ...`, as Megatron's --data-path."""
    values = list(values)
    if len(values) == 1:
        return values, None
    if len(values) % 2:
        raise ValueError(f"--data-path takes one prefix or weight/prefix pairs, got {values}")
    try:
        weights = [float(w) for w in values[0::2]]
    except ValueError:
        raise ValueError(f"--data-path takes one prefix or weight/prefix pairs, got {values}") from None
    for weight, prefix in zip(weights, values[1::2]):
        if not math.isfinite(weight) or weight < 0:  # megatron-core would normalize them as they are
            raise ValueError(f"--data-path: the weight {weight} of {prefix} is not a finite number >= 0")
    if not sum(weights):
        raise ValueError(f"--data-path: the weights sum to 0, got {values}")
    return values[1::2], weights
