"""Megatron-LM's --log-straggler: each rank's time in the forward passes of its training steps (what Megatron-LM's
pretrain_gpt.py times with megatron-core's StragglerDetector), gathered every --log-interval and compared over the
ranks, so that a slow GPU or node is named in the log line.

The rule: a rank is a straggler when its forward milliseconds per iteration exceed the median of the ranks of its
pipeline stage (the ranks that do the same work: its tensor- and data-parallel peers) by more than
STRAGGLER_MARGIN, 10%. The log line names up to --straggler-minmax-count of them, the furthest over first, and the
fastest and slowest ranks of the world (Megatron-LM's MnRtt/MxRtt). Only the computation is timed: a rank that
waits for a straggler in a gradient reduction does not look slow itself, as it would by its step's wall time.
Tensor-parallel peers wait for each other inside the forward pass, so a straggler shows among its data-parallel
peers (as in Megatron-LM).

On CUDA megatron-core's StragglerDetector times the forward passes (CUDA events), and its controller on rank 0
listens on --straggler-ctrlr-port: a connection to it (`curl rank0-host:65535`) turns the timing off, or on when
--disable-straggler-on-startup started it off, from the next --log-interval. On CPU the computation is synchronous
and a perf_counter times it; megatron-core's controller runs on CUDA only, so the two flags that steer it are
refused there (StragglerReport).
"""

from __future__ import annotations

import statistics
import time
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core.utils import StragglerDetector

STRAGGLER_MARGIN = 0.10  # the documented rule: over its stage's median by more than this fraction
CONTROLLER_PORT = 65535  # Megatron-LM's default --straggler-ctrlr-port


class ForwardTimer:
    """The context each training forward pass runs in (angpt.training.step.forward_step); does nothing until
    `configure`d."""

    def __init__(self):
        self.detector: Optional[StragglerDetector] = None  # megatron-core's, on CUDA
        self.enabled = False
        self.elapsed_ms = 0.0
        self._started = 0.0

    def configure(self, world: int, rank: int, minmax_count: int, port: int, enabled: bool) -> None:
        if torch.cuda.is_available():
            try:  # its report reads the GPU's temperature, power, utilization and clock
                torch.cuda.temperature()
            except (ModuleNotFoundError, RuntimeError) as error:
                raise ValueError("--log-straggler on CUDA: megatron-core's StragglerDetector reads the GPU's "
                                 f"temperature through NVML, which failed ({error}); pip install nvidia-ml-py"
                                 ) from error
            # A singleton configured once per process, as Megatron-LM's training.py configures it.
            self.detector = StragglerDetector()
            self.detector.configure(world, rank, mmcnt=minmax_count, enabled=enabled, port=port)
        self.enabled = enabled

    def __enter__(self):
        if self.detector is not None:
            self.detector.start()
        elif self.enabled:
            self._started = time.perf_counter()
        return self

    def __exit__(self, *exception):
        if self.detector is not None:
            self.detector.stop()
        elif self.enabled:
            self.elapsed_ms += 1000 * (time.perf_counter() - self._started)

    def active(self) -> bool:
        return self.detector.enabled if self.detector is not None else self.enabled

    def take_ms(self) -> float:
        """This rank's forward milliseconds since the last call."""
        if self.detector is not None:
            return self.detector.elapsed()[0]
        elapsed, self.elapsed_ms = self.elapsed_ms, 0.0
        return elapsed

    def close(self) -> None:
        """Off (an in-process run after this one starts again from `configure`; megatron-core's detector keeps
        its first configuration, a singleton)."""
        self.detector, self.enabled, self.elapsed_ms = None, False, 0.0


FORWARD_TIMER = ForwardTimer()


def stragglers(forward_ms: list[float], stages: list[int], count: int) -> dict:
    """The report of one --log-interval from every rank's forward milliseconds per iteration and pipeline stage:
    the world's fastest and slowest ranks, and up to `count` stragglers as [rank, ms, their stage's median],
    the furthest over their median first."""
    by_stage: dict[int, list[float]] = {}
    for ms, stage in zip(forward_ms, stages):
        by_stage.setdefault(stage, []).append(ms)
    medians = {stage: statistics.median(times) for stage, times in by_stage.items()}
    over = [(ms / medians[stage], rank, ms, medians[stage])
            for rank, (ms, stage) in enumerate(zip(forward_ms, stages))
            if medians[stage] > 0 and ms > (1 + STRAGGLER_MARGIN) * medians[stage]]
    order = sorted(range(len(forward_ms)), key=lambda rank: (forward_ms[rank], rank))
    return {"forward_ms_fastest": [[rank, forward_ms[rank]] for rank in order[:count]],
            "forward_ms_slowest": [[rank, forward_ms[rank]] for rank in reversed(order[-count:])],
            "stragglers": [[rank, ms, median] for _, rank, ms, median in sorted(over, reverse=True)[:count]],
            "stragglers_count": len(over)}


def format_stragglers(record: dict) -> list[str]:
    """The log line's parts of a report of `stragglers`."""
    def ranks(pairs):
        return ", ".join(f"{ms:.1f} (rank {rank})" for rank, ms in pairs)

    parts = [f"forward ms fastest: {ranks(record['forward_ms_fastest'])}, slowest: "
             f"{ranks(record['forward_ms_slowest'])}"]
    if record["stragglers"]:
        named = ", ".join(f"rank {rank} {ms:.1f} ms (+{100 * (ms / median - 1):.0f}% over its stage's median "
                          f"{median:.1f})" for rank, ms, median in record["stragglers"])
        parts.append(f"stragglers ({record['stragglers_count']}): {named}")
    return parts


class StragglerReport:
    """--log-straggler on this rank: `configure`s FORWARD_TIMER, and `gather(iterations)` (collective) returns the
    report of the iterations since its last call (None while the timing is off)."""

    def __init__(self, world: int, rank: int, pipeline_rank: int, minmax_count: int, port: int, enabled: bool):
        if not torch.cuda.is_available() and (port != CONTROLLER_PORT or not enabled):
            flag = "--disable-straggler-on-startup" if not enabled else f"--straggler-ctrlr-port {port}"
            raise ValueError(f"{flag} steers megatron-core's StragglerDetector controller, which runs on CUDA only; "
                             "on CPU --log-straggler times the forward passes from the start to the end")
        self.pipeline_rank, self.count = pipeline_rank, minmax_count
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
        FORWARD_TIMER.configure(world, rank, minmax_count, port, enabled)

    def gather(self, iterations: int) -> Optional[dict]:
        report = None
        if FORWARD_TIMER.active():  # the same on every rank (the controller's toggle is broadcast)
            mine = torch.tensor([FORWARD_TIMER.take_ms() / iterations, self.pipeline_rank], dtype=torch.float64,
                                device=self.device)
            every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
            dist.all_gather(every, mine)
            forward_ms, stages = zip(*(row.tolist() for row in every))
            report = stragglers(list(forward_ms), [int(stage) for stage in stages], self.count)
        if FORWARD_TIMER.detector is not None:
            # megatron-core's report() without figures only applies a toggle asked for on the controller's port.
            FORWARD_TIMER.detector.report()
        return report

    def close(self) -> None:
        FORWARD_TIMER.close()
