"""Trains a small model three steps under each variant of Megatron-LM's data-parallel flags, as angpt.pretrain builds
it (the flags parsed, megatron-core's DDP config and model chunks from them), and records the losses, every gradient
of the first step (the distributed optimizer's reduced shards gathered whole), the weights after three steps and what
the flags changed in megatron-core's buffers and schedule config. For tests/test_ddp_flags.py.

    torchrun --nproc-per-node 2 tests/distributed/ddp_flags_worker.py VARIANTS.json OUT_DIR

VARIANTS.json: [{"name", "family", "flags"}]; the first variant of each family gives the initial weights of the others
(Megatron-FSDP's, whose parameters are its own sharded DTensors, start from the seed's weights, the same in each).
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import param_and_grad_buffer
from megatron.core.distributed.param_and_grad_buffer import shard_buffer
from megatron.core.utils import get_model_config

from angpt.config.arguments import parse_args
from angpt.training import distributed
from angpt.training.megatron_configs import ddp_config, transformer_config
from angpt.training.optimizer import build_optimizer
from angpt.training.step import (
    build_model_chunks,
    gather_whole_weights,
    param_gather_finished,
    set_pre_hooks,
    train_step,
)

from common import GLOBAL_BATCH, MICRO_BATCH, S, V, fixed_batches, gather_full, load_full

STEPS = 3
MODEL = ["--num-layers", "4", "--hidden-size", "48", "--num-attention-heads", "4", "--seq-length", str(S),
         "--max-position-embeddings", str(S), "--micro-batch-size", str(MICRO_BATCH), "--global-batch-size",
         str(GLOBAL_BATCH), "--mock-data", "--vocab-size", str(V), "--train-iters", str(STEPS), "--lr", "1e-2",
         "--hidden-dropout", "0", "--attention-dropout", "0"]


class Counted:
    """megatron-core's reduce_scatter_with_fp32_accumulation, counting its calls (the buffers look it up when built)."""

    def __init__(self, function):
        self.function, self.calls = function, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.function(*args, **kwargs)


def reduced_grads(chunks) -> dict[str, torch.Tensor]:
    """Every gradient as reduced over the data-parallel ranks: the distributed optimizer leaves each rank its own
    shard of each bucket reduced, gathered here from the others."""
    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    for chunk in chunks:
        if not chunk.ddp_config.use_distributed_optimizer or chunk.ddp_config.use_megatron_fsdp:
            continue
        for buffer in chunk.buffers:
            for bucket in buffer.buckets:
                shards = shard_buffer(bucket.grad_data, group.size())
                dist.all_gather(list(shards), shards[group.rank()].clone(), group=group)
    return gather_full(chunks, "grad")


def run(variant: dict, init: dict | None) -> tuple[dict, dict]:
    config = parse_args([*MODEL, "--model-family", variant["family"], *variant["flags"]],
                        world_size=dist.get_world_size())
    parallel = config.parallel
    distributed.initialize(parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size,
                           parallel.virtual_pipeline_stages, config.training.seed,
                           num_distributed_optimizer_instances=parallel.num_distributed_optimizer_instances,
                           create_all_gather_group=parallel.create_all_gather_group)
    counted = Counted(param_and_grad_buffer.reduce_scatter_with_fp32_accumulation)
    param_and_grad_buffer.reduce_scatter_with_fp32_accumulation = counted
    chunks = build_model_chunks(transformer_config(config), V, S, ddp_config(config),
                                one_bucket_group=parallel.overlap_param_gather_with_optimizer_step,
                                num_buckets=parallel.ddp_num_buckets, align_grad_reduce=parallel.align_grad_reduce)
    fsdp = parallel.use_megatron_fsdp
    if init is None:
        init = gather_full(chunks)
    if not fsdp:
        load_full(chunks, init)
    optimizer, scheduler = build_optimizer(chunks, config)
    dp = parallel_state.get_data_parallel_world_size()
    mine = fixed_batches()[parallel_state.get_data_parallel_rank()::dp]

    def iterators():
        return [iter(mine) for _ in chunks] if len(chunks) > 1 else iter(mine)

    # As angpt.training.trainer: the first step without the overlapped all-gather's pre-hooks.
    overlapped = parallel.use_distributed_optimizer and parallel.overlap_param_gather
    if overlapped:
        set_pre_hooks(chunks, False)
    losses, grads = [], None
    for step in range(STEPS):
        loss, _, updated = train_step(iterators(), chunks, optimizer, scheduler, len(mine), MICRO_BATCH, S)
        assert updated
        losses.append(loss)
        if step == 0 and not fsdp:
            grads = reduced_grads(chunks)
            if overlapped:
                set_pre_hooks(chunks, True)
    gather_whole_weights(chunks)  # Megatron-FSDP's sharded weights, whole (what the trainer's probes read)
    with param_gather_finished(chunks, overlapped):
        params = gather_full(chunks)
    model_config = get_model_config(chunks[0])
    result = dict(
        losses=losses, grads=grads, params=params,
        # Per model chunk, per buffer: its buckets' sizes (the gradient buffer's elements).
        buckets=None if fsdp else [[[bucket.grad_data.numel() for bucket in buffer.buckets] for buffer in chunk.buffers]
                                   for chunk in chunks],
        grad_sync_func=model_config.grad_sync_func is not None,
        param_sync_func=model_config.param_sync_func is not None,
        align_param_gather=chunks[0].ddp_config.align_param_gather,
        fp32_accumulation_calls=counted.calls,
        all_gather_group=parallel_state.has_separate_all_gather_group(),
    )
    if fsdp:  # which of megatron-core's data-parallel groups Megatron-FSDP's weight buffers all-gather over
        names = {id(parallel_state.get_data_parallel_group(with_context_parallel=True)): "data-parallel"}
        if result["all_gather_group"]:
            names[id(parallel_state.get_data_parallel_group(with_context_parallel=True,
                                                            independent_all_gather=True))] = "all-gather"
        result["weight_groups"] = {names.get(id(group.model_weight_buffer.data_parallel_group), "another")
                                   for group in chunks[0].module.param_and_grad_buffer.parameter_groups}
    # The next variant's buffers look the reduce-scatter up again; megatron-core sets the module's one for the process.
    param_and_grad_buffer.reduce_scatter_with_fp32_accumulation = counted.function
    param_and_grad_buffer.dist_reduce_scatter_func = dist.reduce_scatter_tensor
    distributed.destroy_model_parallel()
    return result, init


def main() -> None:
    with open(sys.argv[1]) as file:
        variants = json.load(file)
    out = sys.argv[2]
    distributed.initialize()  # joins the torchrun job
    distributed.destroy_model_parallel()
    inits = {}
    for variant in variants:
        result, inits[variant["family"]] = run(variant, inits.get(variant["family"]))
        if dist.get_rank() == 0:
            torch.save(result, os.path.join(out, f"{variant['name']}.pt"))
            print(f"{variant['name']}: losses {result['losses']}", flush=True)
    dist.barrier()


if __name__ == "__main__":
    main()
