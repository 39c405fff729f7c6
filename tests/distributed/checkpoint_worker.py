"""Saves each family with megatron-core distributed checkpointing (torch_dist) at one layout and loads it
back at another, comparing every parameter bit for bit.

    torchrun --nproc-per-node 2 tests/distributed/checkpoint_worker.py --save-tp 2 --load-tp 1 --dir DIR
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

from common import S, V, fixed_batches, gather_full, report, small_config, unwrap

from angpt import distributed
from angpt.optimizer import build_optimizer
from angpt.training import build_model_chunks, train_step
from megatron.core import dist_checkpointing, parallel_state


def build(family, tp, pp, seed):
    distributed.initialize(tp, pp, seed=seed)
    return build_model_chunks(small_config(family, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp), V, S)


def sharded_state(chunks):
    state = {}
    for chunk in chunks:
        state.update(unwrap(chunk).sharded_state_dict())
    return state


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--save-tp", type=int, default=2)
    parser.add_argument("--save-pp", type=int, default=1)
    parser.add_argument("--load-tp", type=int, default=1)
    parser.add_argument("--load-pp", type=int, default=1)
    parser.add_argument("--families", default="angpt,gptplus,ngpt")
    args = parser.parse_args()
    distributed.initialize()
    parallel_state.destroy_model_parallel()
    for family in args.families.split(","):
        path = os.path.join(args.dir, family)
        if dist.get_rank() == 0:
            os.makedirs(path, exist_ok=True)
        dist.barrier()
        chunks = build(family, args.save_tp, args.save_pp, seed=1)
        # One training step so that the scales and weights are not at their initial values.
        optimizer, scheduler = build_optimizer(chunks, family, lr=1e-2, train_iters=1)
        train_step(iter(fixed_batches()[:1]), chunks, optimizer, scheduler, 1, 2, S)
        saved = gather_full(chunks)
        dist_checkpointing.save(sharded_state(chunks), path)
        parallel_state.destroy_model_parallel()

        results = {}
        for tp, pp in ((args.load_tp, args.load_pp), (args.save_tp, args.save_pp)):
            chunks = build(family, tp, pp, seed=2)
            fresh = gather_full(chunks)
            state = dist_checkpointing.load(sharded_state(chunks), path)
            for chunk in chunks:
                unwrap(chunk).load_state_dict(state, strict=True)
            loaded = gather_full(chunks)
            results[f"tp{tp}pp{pp}"] = dict(
                exact=all(torch.equal(loaded[k], saved[k]) for k in saved) and loaded.keys() == saved.keys(),
                differed_before_load=sum(not torch.equal(fresh[k], saved[k]) for k in saved),
                parameters=len(saved),
            )
            parallel_state.destroy_model_parallel()
        if dist.get_rank() == 0:
            report({"family": family, "save": f"tp{args.save_tp}pp{args.save_pp}", "loads": results})
    dist.barrier()


if __name__ == "__main__":
    main()
