"""What megatron-core 0.16.1 says that is not news to an angpt user, silenced at our entry points.

Each is a warning megatron-core (or torch through it) prints in every process at import, at the first
save or at a load, for something this project already decided or cannot change: CPU and GPU runs without
Transformer Engine or apex fall back to torch on purpose (angpt.optimizer logs which back end runs), and
the deprecations are inside megatron-core's own checkpointing. Anything else still shows.
"""

from __future__ import annotations

import warnings

# (category, the start of the message), as megatron-core 0.16.1 and torch 2.11-2.13 word them.
KNOWN_WARNINGS = (
    (UserWarning, "Transformer Engine and Apex are not installed"),
    (UserWarning, "Apex is not installed"),
    (UserWarning, "full scope is deprecated"),  # TransformerConfig's cuda_graph_scope default
    (FutureWarning, "`load_state_dict` is deprecated"),  # dist_checkpointing's torch strategy
    (FutureWarning, "Please use DTensor instead and we are deprecating ShardedTensor"),
)


def quiet_known_warnings() -> None:
    """Ignore KNOWN_WARNINGS in this process; called by each entry point before it imports megatron-core."""
    for category, message in KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)
