"""Megatron-LM's --check-weight-hash-across-dp-replicas-interval: every data-parallel replica must hold the same
weights after a step; a silent hardware or communication fault shows as a replica that differs. megatron-core's
check_param_hashes_across_dp_replicas compares SHA-1 hashes of each weight within the data-parallel group (and
logs the weights that differ); every rank then learns whether any group differed, so that all stop together."""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core.utils import check_param_hashes_across_dp_replicas

from angpt.training.step import param_gather_finished


class ReplicasDifferError(RuntimeError):
    """Some data-parallel replica's weights differ from the others'."""


def check_weight_hashes(chunks: list, iteration: int, param_gather_overlapped: bool) -> None:
    """Raise ReplicasDifferError on every rank if any data-parallel group's replicas hold different weights.
    With the distributed optimizer's overlapped param gather, the gather of the last step's weights is finished
    first."""
    with param_gather_finished(chunks, param_gather_overlapped):
        same = check_param_hashes_across_dp_replicas(chunks, cross_check=True)
    everywhere = torch.tensor([int(same)])
    dist.all_reduce(everywhere, op=dist.ReduceOp.MIN)
    if not everywhere.item():
        raise ReplicasDifferError(
            f"iteration {iteration}: the weights differ across data-parallel replicas "
            "(--check-weight-hash-across-dp-replicas-interval; each rank whose weights differ from its group's "
            "first logs their names): a hardware or communication fault; resume from the last checkpoint, "
            "leaving the suspect node out")
