"""Runs `angpt.pretrain` command lines one after another in one torchrun job, each as the trainer in this process
(as `angpt.pretrain` builds it), the process groups built again for each; a run may first take a checkpoint of
an earlier one. For tests/test_megatron_configs_train.py.

    torchrun --nproc-per-node 4 tests/distributed/megatron_config_worker.py RUNS.json

RUNS.json: a list of {"name", "argv", "resume_from": null or [run directory, iteration]}; with resume_from, the
run's --save directory first gets that checkpoint of the run directory as its latest. Prints a RESULT line per
run (its name and exit code; a run whose checkpoint is refused, as angpt.pretrain's exit code 2, with the refusal
as "error"). Also for tests/test_torch_checkpoint_format.py.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys

import torch.distributed as dist

from angpt.config.arguments import parse_args
from angpt.models.attention import clear_attention_backend_environment
from angpt.training import checkpointing, distributed
from angpt.training.trainer import Trainer

from common import report


def take_checkpoint(run_dir: str, iteration: int, save_dir: str) -> None:
    """`iteration`'s checkpoint of run_dir as the latest (and only) one of save_dir."""
    name = f"iter_{iteration:07d}"
    shutil.copytree(os.path.join(run_dir, name), os.path.join(save_dir, name))
    with open(os.path.join(save_dir, "latest_checkpointed_iteration.txt"), "w") as file:
        file.write(f"{iteration}\n")


def main() -> None:
    with open(sys.argv[1]) as file:
        runs = json.load(file)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("angpt").setLevel(logging.INFO)
    distributed.initialize()  # the job's process group, which every run's groups are built in
    for run in runs:
        config = parse_args(run["argv"])
        if run["resume_from"] and dist.get_rank() == 0:
            take_checkpoint(*run["resume_from"], config.checkpoint.save)
        distributed.destroy_model_parallel()
        clear_attention_backend_environment()  # the last run's backend, which the next model's must not meet
        dist.barrier()
        try:
            trainer = Trainer(config)
        except checkpointing.CheckpointError as error:  # refused on every rank alike, as angpt.pretrain says it
            distributed.destroy_model_parallel()
            if dist.get_rank() == 0:
                report({"name": run["name"], "code": 2, "error": str(error)})
            continue
        code = trainer.run()
        del trainer  # its model and optimizer hold the groups that destroy_model_parallel frees
        distributed.destroy_model_parallel()
        if dist.get_rank() == 0:
            report({"name": run["name"], "code": code})
    dist.barrier()


if __name__ == "__main__":
    main()
