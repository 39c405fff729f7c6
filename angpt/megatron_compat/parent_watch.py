"""Helper processes that end with their parent, whatever killed it (SIGKILL, the OOM killer included).

megatron-core's checkpoint saves start processes of their own: the results queue's Manager (spawned,
`results_queue.py`), the async save's writer (forked) and its write workers (forked from the writer). A training
process killed in the middle of a save left them running, re-parented to init: the Manager for good (it is
deaf to the exit signals on purpose), the writers until their writes ended, writing a checkpoint nobody would
commit. Each now watches its parent from a thread and exits once the parent is gone. Not PR_SET_PDEATHSIG:
that fires when the forking *thread* ends, which need not be the process's end.

A training process started by torchrun watches torchrun, its parent, from its first line on (`watch_launcher`):
SIGKILLed, torchrun forwards no signal, and nothing would stop or watch the job any more.
Standard library only: the Manager imports this module without torch.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Callable, Optional

# How often a helper looks for its parent, in seconds.
PARENT_POLL_INTERVAL = 0.5
_installed = False
_on_launcher_death: Optional[Callable[[], None]] = None


def on_parent_death(callback: Callable[[], None], parent: Optional[int] = None) -> None:
    """Call `callback` (from a thread) once `parent` (this process's parent now, by default) is no longer its
    parent: it died, whatever killed it."""
    parent = os.getppid() if parent is None else parent

    def watch():
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_INTERVAL)
        callback()

    threading.Thread(target=watch, name="watch-parent", daemon=True).start()


def exit_with_parent(parent: int) -> None:
    """In a helper process: end it once `parent` is no longer its parent."""
    on_parent_death(lambda: os._exit(0), parent)


def _watch_from_the_child() -> None:
    exit_with_parent(os.getppid())


def install() -> None:
    """Every process this one forks from now on (and those they fork) exits with its parent."""
    global _installed
    if not _installed:
        os.register_at_fork(after_in_child=_watch_from_the_child)
        _installed = True


def watch_launcher(launcher: int) -> None:
    """In a training process that torchrun started (`launcher`: its parent's pid, read first thing): once
    torchrun is gone, call what `on_launcher_death` set (the training loop: save and exit at the end of the
    step), or, before the loop runs, exit at once (nothing was trained since the checkpoint it loads)."""
    on_parent_death(_launcher_died, launcher)


def on_launcher_death(callback: Optional[Callable[[], None]]) -> None:
    global _on_launcher_death
    _on_launcher_death = callback


def _launcher_died() -> None:
    if _on_launcher_death is None:
        print("angpt.pretrain: torchrun, which started this process, died before training began: exiting",
              file=sys.stderr, flush=True)
        os._exit(1)
    _on_launcher_death()
