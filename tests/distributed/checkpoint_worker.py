"""Saves each family with megatron-core distributed checkpointing (torch_dist) at one layout and loads it
back at another (and at its own), comparing every parameter bit for bit; one round trip after another in
one job. With --sixteen-bit-saves, it also saves each family in bf16 without the distributed optimizer (model and
optimizer, by angpt's checkpointing) at the layouts named, the full state saved beside each checkpoint, for
test_checkpoint.py to load in one process.

    torchrun --nproc-per-node 2 tests/distributed/checkpoint_worker.py --round-trips tp2pp1:tp1pp1 --dir DIR \
        [--sixteen-bit-saves tp2pp1,tp1pp2]
"""

from __future__ import annotations

import argparse
import os
import re

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing

from angpt.config.sections import RunConfig
from angpt.training import checkpointing, distributed
from angpt.training.optimizer import build_optimizer
from angpt.training.step import build_model_chunks, train_step

from common import S, V, _tp_gather, fixed_batches, gather_full, global_name, report, small_config, unwrap

BF16 = dict(bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16)
EXPECTED = "expected.pt"


def build(family, tp, pp, seed, **overrides):
    distributed.initialize(tp, pp, seed=seed)
    config = small_config(family, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, **overrides)
    return build_model_chunks(config, V, S)


def sixteen_bit_optimizer(chunks, family):
    """bf16 without the distributed optimizer: megatron-core's Float16OptimizerWithFloat16Params."""
    return build_optimizer(chunks, RunConfig.from_flags(dict(model_family=family, lr=1e-2, train_iters=1, bf16=True)))


def full_state(chunks, optimizer) -> dict[str, torch.Tensor]:
    """{"<what>.<global name>": full tensor} of the 16-bit optimizer, on every rank: every parameter, its fp32 main
    copy (the parameter itself where it is fp32) and Adam's moments once it has stepped."""
    (inner,) = optimizer.chained_optimizers
    mine = {}
    for chunk in chunks:
        model = unwrap(chunk)
        for name, param in model.named_parameters():
            main = getattr(param, "main_param", param)
            state = inner.optimizer.state.get(main, {})  # none before the first step
            parts = dict(param=param, main=main, **{key: state[key] for key in ("exp_avg", "exp_avg_sq")
                                                    if key in state})
            for what, tensor in parts.items():
                mine[f"{what}.{global_name(model, name)}"] = _tp_gather(param, tensor.detach())
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return {key: value for part in everyone for key, value in part.items()}


def sixteen_bit_save(family: str, path: str, tp: int, pp: int) -> None:
    """One step, then angpt's save of the model and the 16-bit optimizer (its fp32 main copies and the moments of
    every parameter, the fp32 scales' included), the full state beside it."""
    if dist.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
    dist.barrier()
    chunks = build(family, tp, pp, seed=1, **BF16)
    optimizer, scheduler = sixteen_bit_optimizer(chunks, family)
    train_step(iter(fixed_batches()[:1]), chunks, optimizer, scheduler, 1, 2, S)
    checkpointing.save_checkpoint(path, checkpointing.TrainState(iteration=1), chunks, optimizer, scheduler, {})
    expected = full_state(chunks, optimizer)
    if dist.get_rank() == 0:
        torch.save(expected, os.path.join(path, EXPECTED))
    distributed.destroy_model_parallel()


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
    parser.add_argument("--sixteen-bit-saves", default="", help="layouts, comma-separated: tp2pp1,tp1pp1")
    args = parser.parse_args()
    distributed.initialize()
    distributed.destroy_model_parallel()
    for name in filter(None, args.sixteen_bit_saves.split(",")):
        for family in args.families.split(","):
            path = os.path.join(args.dir, f"sixteen_bit_{name}", family)
            sixteen_bit_save(family, path, *layout(name))
            if dist.get_rank() == 0:
                report({"sixteen_bit_save": name, "family": family, "path": path})
    for trip in args.round_trips.split(","):
        save, load = trip.split(":")
        for family in args.families.split(","):
            results = round_trip(family, os.path.join(args.dir, f"{save}_{load}", family), layout(save), layout(load))
            if dist.get_rank() == 0:
                report({"round_trip": trip, "family": family, "save": save, "loads": results})
    dist.barrier()


if __name__ == "__main__":
    main()
