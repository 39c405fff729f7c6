"""What asks a run to save and exit: the exit signals (caught from the process's first line on, so that one
arriving while the job starts is not lost: Slurm's warning before a time limit can come at any time), the
wall-clock limit, and the death of torchrun (angpt.megatron_compat.parent_watch.watch_launcher)."""

from __future__ import annotations

import signal
import time
from typing import Optional

_received: Optional[str] = None  # the last exit signal this process got


def catch(signals) -> None:
    """Record each of `signals` from now on rather than die of it (their default action)."""
    for sig in signals:
        signal.signal(sig, _record)


def _record(signum, frame) -> None:
    global _received
    _received = signal.Signals(signum).name


class ExitRequests:
    """The requests to exit, agreed on by every rank with one small all-reduce per step (a signal may reach
    only some ranks, or reach them in different steps). --exit-duration-in-mins counts from its construction."""

    def __init__(self, signals, duration_minutes: Optional[float]):
        catch(signals)
        self.launcher_died = False
        self.duration_minutes = duration_minutes
        self.start = time.monotonic()

    @property
    def received(self) -> Optional[str]:
        return _received

    def launcher_gone(self) -> None:
        self.launcher_died = True

    def check(self) -> Optional[str]:
        """The reason to exit now, the same on every rank, or None."""
        import torch  # noqa: PLC0415 (the entry point catches the signals before torch is imported)
        import torch.distributed as dist  # noqa: PLC0415

        elapsed = (time.monotonic() - self.start) / 60
        flags = torch.tensor([float(self.received is not None), elapsed, float(self.launcher_died)],
                             dtype=torch.float64,
                             device=torch.cuda.current_device() if torch.cuda.is_available() else "cpu")
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        if flags[2] > 0:
            return "torchrun, which started this process, died"
        if flags[0] > 0:
            return f"received {self.received or 'an exit signal (on another rank)'}"
        if self.duration_minutes is not None and flags[1] > self.duration_minutes:
            return f"ran {flags[1].item():.1f} min, past --exit-duration-in-mins {self.duration_minutes}"
        return None
