"""Saves each family with megatron-core distributed checkpointing (torch_dist) at one layout and loads it
back at another (and at its own), comparing every parameter bit for bit; one round trip after another in
one job.

    torchrun --nproc-per-node 2 tests/distributed/checkpoint_worker.py --round-trips tp2pp1:tp1pp1 --dir DIR
"""

from __future__ import annotations

import argparse
import os
import re

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing

from angpt.config.sections import RunConfig
from angpt.training import distributed
from angpt.training.optimizer import build_optimizer
from angpt.training.step import build_model_chunks, train_step

from common import S, V, fixed_batches, gather_full, report, small_config, unwrap


def build(family, tp, pp, seed):
    distributed.initialize(tp, pp, seed=seed)
    config = small_config(family, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    return build_model_chunks(config, V, S)


def sharded_state(chunks):
    state = {}
    for chunk in chunks:
        state.update(unwrap(chunk).sharded_state_dict())
    return state


def layout(name: str) -> tuple[int, int]:
    """"tp2pp1" -> (2, 1)"""
    match = re.fullmatch(r"tp(\d+)pp(\d+)", name)
    if not match:
        raise SystemExit(f"--round-trips: {name!r} is not a layout such as tp2pp1")
    return int(match.group(1)), int(match.group(2))


def round_trip(family: str, path: str, save: tuple[int, int], load: tuple[int, int]) -> dict:
    if dist.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
    dist.barrier()
    chunks = build(family, *save, seed=1)
    # One training step so that the scales and weights are not at their initial values.
    optimizer, scheduler = build_optimizer(chunks, RunConfig.from_flags(dict(model_family=family, lr=1e-2,
                                                                              train_iters=1)))
    train_step(iter(fixed_batches()[:1]), chunks, optimizer, scheduler, 1, 2, S)
    saved = gather_full(chunks)
    dist_checkpointing.save(sharded_state(chunks), path)
    distributed.destroy_model_parallel()

    results = {}
    for tp, pp in (load, save):
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
        distributed.destroy_model_parallel()
    return results


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--round-trips", required=True, help="SAVE:LOAD layouts, comma-separated: tp2pp1:tp1pp1")
    parser.add_argument("--families", default="angpt,gptplus,ngpt")
    args = parser.parse_args()
    distributed.initialize()
    distributed.destroy_model_parallel()
    for trip in args.round_trips.split(","):
        save, load = trip.split(":")
        for family in args.families.split(","):
            results = round_trip(family, os.path.join(args.dir, f"{save}_{load}", family), layout(save), layout(load))
            if dist.get_rank() == 0:
                report({"round_trip": trip, "family": family, "save": save, "loads": results})
    dist.barrier()


if __name__ == "__main__":
    main()
