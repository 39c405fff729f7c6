"""The global batch of each step, constant or ramped up (`--rampup-batch-size`), by megatron-core's calculator
of micro-batches, and the length of training it gives: Megatron-LM's arithmetic, so that a Megatron-LM script
takes the same steps here."""

from __future__ import annotations

from typing import Optional, Sequence

from megatron.core.num_microbatches_calculator import (
    ConstantNumMicroBatchesCalculator,
    RampupBatchsizeNumMicroBatchesCalculator,
)

from angpt.config.sections import TrainingSection


class BatchSchedule:
    """The global batch after `consumed_samples` samples: --global-batch-size, or during a ramp-up START plus
    INCREMENT for each whole share of SAMPLES / ((global - START) / INCREMENT) consumed. A function of the
    consumed samples alone, so a resumed run continues the ramp-up exactly. With `decrease_if_needed`
    (--decrease-batch-size-if-needed), the batch a step runs is that one rounded down to a multiple of
    micro-batch x data-parallel size (megatron-core's running global batch size)."""

    def __init__(self, global_batch_size: int, micro_batch_size: int, data_parallel_size: int,
                 rampup: Optional[Sequence[int]] = None, rank: int = 0, decrease_if_needed: bool = False):
        if rampup is None:
            self.calculator = ConstantNumMicroBatchesCalculator(global_batch_size, micro_batch_size,
                                                                data_parallel_size, decrease_if_needed, rank)
        else:
            self.calculator = RampupBatchsizeNumMicroBatchesCalculator(global_batch_size, micro_batch_size,
                                                                       data_parallel_size, decrease_if_needed, rank,
                                                                       *rampup)

    def global_batch_size(self, consumed_samples: int) -> int:
        self.calculator.update(consumed_samples, consistency_check=True)
        return self.calculator.get_current_global_batch_size()

    def running_batch_size(self, consumed_samples: int) -> int:
        """The samples the step after `consumed_samples` reads: the global batch, or with `decrease_if_needed` the
        multiple of micro-batch x data-parallel size below it."""
        self.calculator.update(consumed_samples, consistency_check=True)
        return self.calculator.get_current_running_global_batch_size()


def ramp(training: TrainingSection) -> list[tuple[int, int]]:
    """[(global batch, steps at it)] of the whole run, in order."""
    schedule = BatchSchedule(training.global_batch_size, 1, 1, training.rampup_batch_size, rank=1)
    steps, consumed, done = [], 0, 0
    while done < training.train_iters:
        size = schedule.global_batch_size(consumed)
        # Once at --global-batch-size, the batch stays there: the remaining steps at once.
        count = training.train_iters - done if size == training.global_batch_size else 1
        consumed, done = consumed + size * count, done + count
        if steps and steps[-1][0] == size:
            steps[-1] = (size, steps[-1][1] + count)
        else:
            steps.append((size, count))
    return steps


def rampup_train_iters(global_batch_size: int, rampup: Sequence[int], train_samples: int) -> int:
    """The steps of a run given --train-samples with a ramp-up (Megatron-LM's `update_train_iters`): the ramp-up's
    steps while at most SAMPLES (and --train-samples) are consumed, then whole global batches; the samples of a
    last, partial batch are left out."""
    # Counted with one micro-batch on one rank: the batches do not depend on the layout.
    schedule = BatchSchedule(global_batch_size, 1, 1, rampup, rank=1)
    iterations = consumed = 0
    while consumed <= rampup[2] and consumed <= train_samples:
        consumed += schedule.global_batch_size(consumed)
        iterations += 1
    if train_samples > consumed:
        iterations += (train_samples - consumed) // global_batch_size
    return iterations
