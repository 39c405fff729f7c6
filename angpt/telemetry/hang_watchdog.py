"""--hang-timeout-minutes: every thread's Python stack, written when an iteration runs past the timeout.

Not faulthandler's `dump_traceback_later`: its timer thread reads the other threads' frames without the GIL,
so a dump while another thread runs Python code can read a frame as it is freed. At a 0.6 s timeout, with the
TensorBoard writer busy, one rank died in the middle of a dump. This watchdog is a Python thread: it reads the
frames as Python objects, under the GIL, so a dump can never crash the run it reports on. A thread that hangs
while holding the GIL would delay the dump until it lets go; torch's collectives and synchronizations release
the GIL while they wait.
"""

from __future__ import annotations

import sys
import threading
import time
import traceback
from typing import Optional, TextIO


class HangWatchdog:
    """Writes every thread's stack to `file` once an armed iteration has run `timeout` seconds, then again every
    `timeout` seconds while it lasts. `arm(iteration)` starts each iteration's clock; `close()` stops the thread."""

    def __init__(self, timeout: float, label: str, file: Optional[TextIO] = None):
        self.timeout = timeout
        self.label = label
        self.file = file
        self._condition = threading.Condition()
        self._armed_at: Optional[float] = None
        self._next_dump = 0.0
        self._iteration = 0
        self._closed = False
        self._thread = threading.Thread(target=self._watch, name="hang-watchdog", daemon=True)
        self._thread.start()

    def arm(self, iteration: int) -> None:
        with self._condition:
            # Armed already, the thread wakes at the old deadline and waits on to the new one: no wake-up per step.
            if self._armed_at is None:
                self._condition.notify()
            self._armed_at = time.monotonic()
            self._next_dump = self._armed_at + self.timeout
            self._iteration = iteration

    def close(self) -> None:
        with self._condition:
            self._closed = True
            self._condition.notify()
        self._thread.join()

    def _watch(self) -> None:
        with self._condition:
            while not self._closed:
                if self._armed_at is None:
                    self._condition.wait()
                    continue
                remaining = self._next_dump - time.monotonic()
                if remaining > 0:
                    self._condition.wait(remaining)
                    continue
                self._dump(time.monotonic() - self._armed_at)
                self._next_dump += self.timeout

    def _dump(self, elapsed: float) -> None:
        file = self.file or sys.stderr
        names = {thread.ident: thread.name for thread in threading.enumerate()}
        lines = [f"angpt hang watchdog: {self.label}, iteration {self._iteration} has run {elapsed:.1f} s "
                 f"(--hang-timeout-minutes {self.timeout / 60:g}); every thread's stack, most recent call last:\n"]
        for ident, frame in sys._current_frames().items():
            if ident == threading.get_ident():
                continue
            lines.append(f"Thread {names.get(ident, '?')} ({ident:#x}):\n")
            lines.extend(traceback.format_stack(frame))
        file.write("".join(lines))
        file.flush()
