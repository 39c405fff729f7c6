"""Pretrain a model of one family with Megatron-style flags, under torchrun (or alone, as one process).

    torchrun --nproc-per-node 2 -m angpt.pretrain --model-family angpt --tensor-model-parallel-size 2 \\
        --num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 128 \\
        --micro-batch-size 4 --global-batch-size 8 --train-iters 1000 --lr 3e-3 \\
        --data-path data/corpus_text_document --save checkpoints/run --load checkpoints/run \\
        --save-interval 200 --eval-interval 200 --eval-iters 10 --log-interval 10

`--config run.yaml` takes the same flags as YAML keys; flags given on the command line win.
See `angpt.config.arguments` for every flag and `angpt.training.trainer` for what the loop does.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from typing import Optional

from angpt.config import megatron_lm
from angpt.config.arguments import parse_args
from angpt.megatron_compat import parent_watch, quiet_known_warnings, skip_wandb_import
from angpt.training import exits


def main(argv=None) -> None:
    if "TORCHELASTIC_RUN_ID" in os.environ:  # torchrun's agent is the parent: watched before the slow imports
        parent_watch.watch_launcher(os.getppid())
    # Before torch and megatron-core are imported: --help and flag errors are instant.
    config = parse_args(argv, recorded_flags=recorded_flags)
    exits.catch([getattr(signal, name) for name in config.exits.save_and_exit_signals])
    quiet_known_warnings()
    if not config.logging.wandb_project:
        skip_wandb_import()
    from angpt.telemetry.metrics import console_outlives_its_reader  # noqa: PLC0415 (after parsing)

    console_outlives_its_reader()
    set_logging_levels(config.logging.logging_level)
    if int(os.environ.get("RANK", "0")) == 0:
        import torch  # noqa: PLC0415 (after parsing: --help and flag errors stay instant)

        from angpt.kernels import missing_build  # noqa: PLC0415 (imports torch)

        if config.dry_run.dry_run is None and (missing := missing_build()):
            logging.getLogger("angpt.pretrain").warning("%s", missing)  # the run's first line

        # A dry run checks the configuration for the cluster it names, not for this machine.
        cuda = torch.cuda.is_available() or config.dry_run.dry_run is not None
        for note in megatron_lm.notes(config, cuda=cuda):
            logging.getLogger("angpt.pretrain").info("%s", note)
    if config.dry_run.dry_run is not None:
        sys.exit(dry_run(config))
    from angpt.training.trainer import pretrain  # noqa: PLC0415 (after parsing)

    sys.exit(pretrain(config))


def set_logging_levels(level: Optional[int]) -> None:
    """Python's root logger (megatron-core's loggers) at WARNING and angpt's at INFO; with --logging-level, else
    MEGATRON_LOGGING_LEVEL, both at that level (Megatron-LM's setup_logging sets the root logger's: the flag wins
    over the environment)."""
    if level is None and os.getenv("MEGATRON_LOGGING_LEVEL") is not None:
        level = int(os.environ["MEGATRON_LOGGING_LEVEL"])
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger().setLevel(logging.WARNING if level is None else level)
    logging.getLogger("angpt").setLevel(logging.INFO if level is None else level)
    if level is not None and int(os.environ.get("RANK", "0")) == 0:
        logging.getLogger("angpt.pretrain").info("Setting logging level to %d", level)


def recorded_flags(*args):
    """angpt.training.checkpointing.recorded_flags, imported for --use-checkpoint-args only."""
    from angpt.training.checkpointing import recorded_flags  # noqa: PLC0415 (torch: after parsing)

    return recorded_flags(*args)


def dry_run(config) -> int:
    from angpt.training.dry_run import describe  # noqa: PLC0415 (after parsing)

    try:
        print(describe(config))
    except (ValueError, OSError) as error:  # the data's checks (angpt.data), as the trainer reports them
        print(f"angpt.pretrain: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    main()
