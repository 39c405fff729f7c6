"""Faults injected on purpose, so that tests can check the trainer's handling of them. Set only by
tests, through the environment of the training processes:

    ANGPT_TEST_NAN_AT_ITERATIONS=5,6      these steps get a NaN loss (and NaN gradients)
    ANGPT_TEST_PAUSE_IN_SAVE_AT=4         the save of this iteration stops, forever, after writing its
                                          files and before committing the checkpoint (to be killed there)
    ANGPT_TEST_WAIT_FOR_SIGNAL_BEFORE=3   this step starts only once an exit signal has reached the process
                                          (each rank says when it waits), so that a test signals the job
                                          at a known iteration, with saves behind it and a step before the exit
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

NAN_AT_ITERATIONS = "ANGPT_TEST_NAN_AT_ITERATIONS"
PAUSE_IN_SAVE_AT = "ANGPT_TEST_PAUSE_IN_SAVE_AT"
WAIT_FOR_SIGNAL_BEFORE = "ANGPT_TEST_WAIT_FOR_SIGNAL_BEFORE"


@dataclass(frozen=True)
class Faults:
    nan_iterations: frozenset = field(default_factory=frozenset)
    pause_in_save_at: Optional[int] = None
    wait_for_signal_before: Optional[int] = None


def from_environment() -> Faults:
    nan = os.environ.get(NAN_AT_ITERATIONS, "")
    pause = os.environ.get(PAUSE_IN_SAVE_AT)
    wait = os.environ.get(WAIT_FOR_SIGNAL_BEFORE)
    return Faults(frozenset(int(i) for i in nan.split(",") if i.strip()), int(pause) if pause else None,
                  int(wait) if wait else None)


def pause_forever() -> None:
    print("angpt fault injection: pausing inside the save", flush=True)
    while True:
        time.sleep(1)


def wait_for_signal(received: Callable[[], bool], iteration: int) -> None:
    print(f"angpt fault injection: waiting for an exit signal before iteration {iteration}", flush=True)
    while not received():
        time.sleep(0.05)
