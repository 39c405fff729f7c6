"""Helper processes that end with their parent, whatever killed it (SIGKILL, the OOM killer included).

megatron-core's checkpoint saves start processes of their own: the results queue's Manager (spawned,
`results_queue.py`), the async save's writer (forked) and its write workers (forked from the writer). A training
process killed in the middle of a save left them running, re-parented to init: the Manager for good (it is
deaf to the exit signals on purpose), the writers until their writes ended, writing a checkpoint nobody would
commit. Each now watches its parent from a thread and exits once the parent is gone. Not PR_SET_PDEATHSIG:
that fires when the forking *thread* ends, which need not be the process's end.

Standard library only: the Manager imports this module without torch.
"""

from __future__ import annotations

import os
import threading
import time

# How often a helper looks for its parent, in seconds.
PARENT_POLL_INTERVAL = 0.5
_installed = False


def exit_with_parent(parent: int) -> None:
    """In a helper process: end it once `parent` is no longer its parent (it died, whatever killed it)."""

    def watch():
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_INTERVAL)
        os._exit(0)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def _watch_from_the_child() -> None:
    exit_with_parent(os.getppid())


def install() -> None:
    """Every process this one forks from now on (and those they fork) exits with its parent."""
    global _installed
    if not _installed:
        os.register_at_fork(after_in_child=_watch_from_the_child)
        _installed = True
