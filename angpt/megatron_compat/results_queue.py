"""The queue that brings a checkpoint save's write results back to the training process (megatron-core's
`filesystem_async._get_write_results_queue`, replaced by `patches.install()`).

megatron-core serves it from a spawned multiprocessing Manager, started at the first save and kept for the
process's life. Three things go wrong with that:
- torchrun forwards SIGTERM and SIGINT to the training process's group (os.killpg), and Slurm signals every
  process of a job: the Manager died of it, and the save the signal asked for failed (BrokenPipeError,
  an `.incomplete` directory left, the steps since the last save lost). Here the Manager starts with the exit
  signals blocked (a child inherits its parent's mask and the Manager never unblocks them): the training
  process decides, and shuts it down at exit.
- Deaf to those signals, a Manager whose training process was SIGKILLed (the OOM killer, `kill -9`) would be
  left behind for good: it watches its parent and exits within a second of the parent's death.
- It unpickled every result, importing torch to do so (2 CPU-s and 300 MB per rank): here the results
  cross it as pickled bytes, so it imports nothing beyond this module and the standard library.

This module imports neither torch nor megatron-core (the spawned Manager imports it to run `_serve_while`).
"""

from __future__ import annotations

import os
import pickle
import signal
import sys
import types
from multiprocessing import get_context, resource_tracker
from multiprocessing.managers import SyncManager

from angpt.megatron_compat.parent_watch import exit_with_parent


class PickledQueue:
    """A Manager queue's proxy whose items cross the Manager as pickled bytes; megatron-core uses only `put`
    (in the save's writer process) and `get_nowait` (in the training process). Picklable, as the proxy is,
    for megatron-core's persistent async writer, which is spawned."""

    def __init__(self, proxy):
        self.proxy = proxy

    def put(self, item) -> None:
        self.proxy.put(pickle.dumps(item))

    def get_nowait(self):
        # What the save's own writer put there, read by the process that started the writer.
        return pickle.loads(self.proxy.get_nowait())


def start(exit_signals: tuple[str, ...]) -> tuple[SyncManager, PickledQueue]:
    """Start a Manager deaf to `exit_signals` that exits when this process dies, and return it with its queue
    (the queue's proxy keeps the Manager alive)."""
    manager = SyncManager(ctx=get_context("spawn"))
    # Starting multiprocessing's resource tracker unblocks SIGINT and SIGTERM: start it before they are blocked.
    resource_tracker.ensure_running()
    unblocked = signal.pthread_sigmask(signal.SIG_BLOCK, {getattr(signal, name) for name in exit_signals})
    # A spawned process imports its parent's main module first (angpt.pretrain: torch and megatron-core, 5 s of
    # CPU and 400 MB), which a queue's server does not need: it is spawned while `__main__` is a blank module.
    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        manager.start(initializer=exit_with_parent, initargs=(os.getpid(),))
    finally:
        sys.modules["__main__"] = main
        signal.pthread_sigmask(signal.SIG_SETMASK, unblocked)  # what arrived meanwhile is handled now
    return manager, PickledQueue(manager.Queue())
