"""Megatron-LM's timers (--timing-log-level, --timing-log-option, --log-timers-to-tensorboard) on megatron-core's
Timers: the trainer's own around its parts, and megatron-core's inside its schedules and optimizer (given the
same Timers through the model's and the optimizer's configs). Level 0 times the saves and loads, 1 adds the
forward-backward pass, the optimizer (with its parts and anGPT's bounding projection), evaluation and the
gradient reductions, 2 adds the data reads and the forward and backward computations of each micro-batch.
Every --log-interval the milliseconds per step of each timer that ran are gathered over the ranks (the max,
the min and max, or every rank's, as --timing-log-option says) into the log line and metrics.jsonl."""

from __future__ import annotations

from typing import Optional

from megatron.core.timers import DummyTimer, Timers

# The trainer's timers and their levels (Megatron-LM's where it has the timer).
LEVELS = {"save-checkpoint": 0, "save-checkpoint-non-persistent": 0, "load-checkpoint": 0, "optimizer": 1,
          "bounding": 1, "evaluate": 1, "batch-generator": 2}
# What megatron-core times itself, as Megatron-LM's training_log lists it.
MEGATRON_CORE_TIMERS = (
    "forward-backward", "forward-compute", "backward-compute", "forward-recv", "forward-send", "backward-recv",
    "backward-send",
    "forward-send-forward-recv", "forward-send-backward-recv", "backward-send-forward-recv",
    "backward-send-backward-recv", "forward-backward-send-forward-backward-recv", "layernorm-grads-all-reduce",
    "embedding-grads-all-reduce", "all-grads-sync", "params-all-gather", "optimizer-copy-to-main-grad",
    "optimizer-unscale-and-check-inf", "optimizer-clip-main-grad", "optimizer-count-zeros", "optimizer-inner-step",
    "optimizer-copy-main-to-model-params",
)
# Every rank gathers the same names in the same order (a timer a rank never started counts 0 there).
REPORTED = (*LEVELS, *MEGATRON_CORE_TIMERS)
_DUMMY = DummyTimer()


def timer(timers: Optional[Timers], name: str):
    """The trainer's timer `name` at its level, or one that does nothing (no Timers, or a higher level)."""
    return _DUMMY if timers is None else timers(name, log_level=LEVELS[name])


def per_step_ms(timers: Timers, steps: int) -> dict:
    """Collective: each timer that ran since the last call, in milliseconds per step over `steps` steps, over the
    ranks as --timing-log-option says ("max": a number, "minmax": [min, max], "all": one per rank), counting
    only the ranks where it ran (a pipeline stage's receives, say); the timers restart from 0."""
    # megatron-core's gather of every rank's elapsed seconds, [world size, timers] (its log() prints the same).
    seconds = timers._get_elapsed_time_all_ranks(list(REPORTED), reset=True, barrier=False)
    report = {}
    for index, name in enumerate(REPORTED):
        ranks = [1000 * value / steps for value in seconds[:, index].tolist()]
        ran = [value for value in ranks if value > 0]
        if not ran:
            continue
        option = timers._log_option
        report[name] = max(ran) if option == "max" else [min(ran), max(ran)] if option == "minmax" else ranks
    return report
