"""The points at which the trainer and checkpointing call out (`Hooks`: nothing happens there in production), and
the faults tests inject at them on purpose, to check the trainer's handling of them. Set only by tests, through
the environment of the training processes:

    ANGPT_TEST_NAN_AT_ITERATIONS=5,6      these steps get a NaN loss (and NaN gradients), on every rerun of them
    ANGPT_TEST_NAN_IN_MICRO_BATCH=2       only in this micro-batch (1-based) of each rank (default: in all)
    ANGPT_TEST_PAUSE_IN_SAVE_AT=4         the save of this iteration stops, forever, after writing its
                                          files and before committing the checkpoint (to be killed there);
                                          4:2.5 stops it for 2.5 s (a slow save, for a signal to arrive in)
    ANGPT_TEST_PAUSE_IN_WRITER_AT=4       the async save of this iteration: its background writer stops,
                                          forever (or 4:2.5: for 2.5 s), before writing (the training process
                                          goes on)
    ANGPT_TEST_CRASH_AT=5:1               rank 1 kills itself (SIGKILL, as the OOM killer would) before iteration 5,
                                          in the first attempt of a torchrun job only (TORCHELASTIC_RESTART_COUNT
                                          0), so that the restarted attempt gets past it
    ANGPT_TEST_STEP_SECONDS=0.05          every step lasts at least this long, so that a small job lives until a
                                          scheduler's signal (tests/slurm)
    ANGPT_TEST_STALL_BEFORE=3:2.5         before iteration 3, this process stalls for 2.5 s (a hang that ends);
                                          3:2.5:1: rank 1 only
    ANGPT_TEST_SLOW_RANK=1:0.05           rank 1's every forward pass of a micro-batch lasts 0.05 s longer (a
                                          straggler)
    ANGPT_TEST_WAIT_FOR_SIGNAL_BEFORE=3   this step starts only once an exit signal has reached the process
                                          (each rank says when it waits), so that a test signals the job
                                          at a known iteration, with saves behind it and a step before the exit
"""

from __future__ import annotations

import math
import os
import signal
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Optional

NAN_AT_ITERATIONS = "ANGPT_TEST_NAN_AT_ITERATIONS"
NAN_IN_MICRO_BATCH = "ANGPT_TEST_NAN_IN_MICRO_BATCH"
PAUSE_IN_SAVE_AT = "ANGPT_TEST_PAUSE_IN_SAVE_AT"
PAUSE_IN_WRITER_AT = "ANGPT_TEST_PAUSE_IN_WRITER_AT"
WAIT_FOR_SIGNAL_BEFORE = "ANGPT_TEST_WAIT_FOR_SIGNAL_BEFORE"
CRASH_AT = "ANGPT_TEST_CRASH_AT"
STEP_SECONDS = "ANGPT_TEST_STEP_SECONDS"
STALL_BEFORE = "ANGPT_TEST_STALL_BEFORE"
SLOW_RANK = "ANGPT_TEST_SLOW_RANK"
VARIABLES = (NAN_AT_ITERATIONS, NAN_IN_MICRO_BATCH, PAUSE_IN_SAVE_AT, PAUSE_IN_WRITER_AT, WAIT_FOR_SIGNAL_BEFORE,
             CRASH_AT, STEP_SECONDS, STALL_BEFORE, SLOW_RANK)


class Hooks:
    """The named points at which the trainer and checkpointing call out, all doing nothing: production's hooks.
    `from_environment` gives `Faults` instead when a test sets one of the variables above."""

    def model_built(self, chunks) -> None:
        """After the model is built on this rank."""

    @contextmanager
    def step(self, iteration: int, exit_received: Callable[[], bool]):
        """Around one training step (`exit_received`: whether an exit signal has reached the process)."""
        yield

    def batches(self, iteration: int, batches: list[dict]) -> list[dict]:
        """The micro-batches of a training step, before the step reads them."""
        return batches

    def before_commit(self, iteration: int) -> None:
        """In a save, on every rank, after the checkpoint's files are written and before it is committed."""

    def before_background_write(self, iteration: int) -> None:
        """In an async save's writer process, before it writes."""


NO_HOOKS = Hooks()


@dataclass(frozen=True)
class Faults(Hooks):
    nan_iterations: frozenset = field(default_factory=frozenset)
    pause_in_save_at: Optional[int] = None
    pause_in_writer_at: Optional[int] = None
    pause_in_save_seconds: float = math.inf
    pause_in_writer_seconds: float = math.inf
    wait_for_signal_before: Optional[int] = None
    crash_before: Optional[int] = None  # this rank's, in this attempt
    step_seconds: float = 0.0
    stall_before: Optional[int] = None
    stall_seconds: float = 0.0
    slow_forward_seconds: float = 0.0  # this rank's
    nan_micro_batch: Optional[int] = None  # 1-based; None: all

    def model_built(self, chunks) -> None:
        """Each forward pass of `chunks` (this rank's model) starts `slow_forward_seconds` late."""
        if self.slow_forward_seconds:
            for chunk in chunks:
                chunk.register_forward_pre_hook(lambda *_: time.sleep(self.slow_forward_seconds))

    @contextmanager
    def step(self, iteration: int, exit_received: Callable[[], bool]):
        if iteration == self.crash_before:
            say(f"rank {os.environ.get('RANK', '0')} crashes before iteration {iteration}")
            os.kill(os.getpid(), signal.SIGKILL)
        if iteration == self.stall_before:
            stall(self.stall_seconds)
        if iteration == self.wait_for_signal_before:
            wait_for_signal(exit_received, iteration)
        started = time.monotonic()
        yield
        time.sleep(max(0.0, self.step_seconds - (time.monotonic() - started)))

    def batches(self, iteration: int, batches: list[dict]) -> list[dict]:
        """A NaN loss (and NaN gradients) in this step."""
        if iteration in self.nan_iterations:
            for number, batch in enumerate(batches, 1):
                if self.nan_micro_batch in (None, number):
                    batch["loss_mask"] = batch["loss_mask"].float() * float("nan")
        return batches

    def before_commit(self, iteration: int) -> None:
        if iteration == self.pause_in_save_at:
            pause("inside the save", self.pause_in_save_seconds)

    def before_background_write(self, iteration: int) -> None:
        if iteration == self.pause_in_writer_at:
            pause("in the save's background writer", self.pause_in_writer_seconds)


def _iteration_and_seconds(value: Optional[str]) -> tuple[Optional[int], float]:
    if not value:
        return None, math.inf
    iteration, _, seconds = value.partition(":")
    return int(iteration), float(seconds) if seconds else math.inf


def from_environment() -> Hooks:
    """Faults, when a test set one of the variables; else the hooks that do nothing."""
    if not any(os.environ.get(name) for name in VARIABLES):
        return NO_HOOKS
    nan = os.environ.get(NAN_AT_ITERATIONS, "")
    pause, pause_seconds = _iteration_and_seconds(os.environ.get(PAUSE_IN_SAVE_AT))
    wait = os.environ.get(WAIT_FOR_SIGNAL_BEFORE)
    writer, writer_seconds = _iteration_and_seconds(os.environ.get(PAUSE_IN_WRITER_AT))
    rank = int(os.environ.get("RANK", "0"))
    stall_at, _, rest = os.environ.get(STALL_BEFORE, "").partition(":")
    seconds, _, stalled_rank = rest.partition(":")  # no rank: any process given the variable
    stall_before, stall_seconds = _iteration_and_seconds(f"{stall_at}:{seconds}" if stall_at else None)
    if stalled_rank and int(stalled_rank) != rank:
        stall_before = None
    slow_rank, _, slow_seconds = os.environ.get(SLOW_RANK, "").partition(":")
    crash = None
    if os.environ.get(CRASH_AT) and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        iteration, crashing_rank = os.environ[CRASH_AT].split(":")
        crash = int(iteration) if int(crashing_rank) == rank else None
    nan_micro_batch = os.environ.get(NAN_IN_MICRO_BATCH)
    return Faults(frozenset(int(i) for i in nan.split(",") if i.strip()), pause, pause_in_writer_at=writer,
                  nan_micro_batch=int(nan_micro_batch) if nan_micro_batch else None,
                  pause_in_save_seconds=pause_seconds, pause_in_writer_seconds=writer_seconds,
                  wait_for_signal_before=int(wait) if wait else None,
                  crash_before=crash, step_seconds=float(os.environ.get(STEP_SECONDS, 0)),
                  stall_before=stall_before, stall_seconds=stall_seconds,
                  slow_forward_seconds=float(slow_seconds) if slow_rank and int(slow_rank) == rank else 0.0)


def say(message: str) -> None:
    """One line on stdout in one write: torchrun's workers run unbuffered (python -u), where print writes the text
    and its newline apart, and two processes' lines (a save's writers) would interleave."""
    sys.stdout.write(f"angpt fault injection: {message}\n")
    sys.stdout.flush()


def stall(seconds: float) -> None:
    say(f"rank {os.environ.get('RANK', '0')} stalls for {seconds} s")
    time.sleep(seconds)


def pause(where: str = "inside the save", seconds: float = math.inf) -> None:
    say(f"pausing {where} (pid {os.getpid()})")
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(min(1.0, end - time.monotonic()))


def wait_for_signal(received: Callable[[], bool], iteration: int) -> None:
    say(f"waiting for an exit signal before iteration {iteration}")
    while not received():
        time.sleep(0.05)
