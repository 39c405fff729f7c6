"""--log-progress (Megatron-LM's): <save>/progress.txt, a line when a job starts and one after each save, in
Megatron-LM's format (its append_to_progress_log and compute_throughputs_and_append_to_progress_log), so that
Megatron-LM's readers of the file read ours:

    2026-01-02 03:04:05<TAB>Job ID: 1234<TAB># GPUs: 8<TAB>Starting job
    2026-01-02 03:14:05<TAB>Job ID: 1234<TAB># GPUs: 8<TAB>Saved checkpoint<TAB>Iteration: 100<TAB>
        Job throughput: 312.4 TFLOP/s/GPU<TAB>Cumulative throughput: 310.9 TFLOP/s/GPU<TAB>
        Floating-point operations: 1.50e+18<TAB>Tokens (in billions): 0.41     (one line)

The job's throughput counts the floating-point operations since this job started over its time; the cumulative
one those since the first job of the same world size in an unbroken series of them (read back from the file)."""

from __future__ import annotations

import os
import time
from datetime import datetime

PROGRESS_FILE = "progress.txt"
_TIME_FORMAT = "%Y-%m-%d %H:%M:%S"


class ProgressLog:
    """Written by rank 0 (`enabled`). Its `flops_at_start` is for the trainer to set once a checkpoint is loaded:
    the floating-point operations of the steps the job resumes after (Megatron-LM's
    num_floating_point_operations_so_far of the checkpoint)."""

    def __init__(self, save_dir: str, world_size: int, enabled: bool = True):
        self.path = os.path.join(save_dir, PROGRESS_FILE)
        self.world_size, self.enabled = world_size, enabled
        self.start_time = time.time()
        self.flops_at_start = 0.0
        self._append("Starting job")

    def _append(self, text: str) -> None:
        if not self.enabled:
            return
        with open(self.path, "a", encoding="utf-8") as file:
            file.write(f"{datetime.now().strftime(_TIME_FORMAT)}\tJob ID: {os.getenv('SLURM_JOB_ID', '')}\t"
                       f"# GPUs: {self.world_size}\t{text}\n")

    def _series_start(self) -> tuple[datetime, float]:
        """When the first job of this world size in the file's last unbroken series of them started, and the
        floating-point operations of the last completed save before it (Megatron-LM's
        get_start_time_from_progress_log)."""
        start_time, start_flops, latest_flops = None, None, 0.0
        with open(self.path, encoding="utf-8") as file:
            for line in file:
                tokens = line.strip().split("\t")
                if tokens[3] == "Saved checkpoint":
                    latest_flops = float(tokens[7].split(": ")[1])
                if int(tokens[2].split(": ")[1]) != self.world_size:
                    start_time, start_flops = None, None
                elif tokens[3] == "Starting job" and start_time is None:
                    start_time, start_flops = tokens[0], latest_flops
        return datetime.strptime(start_time, _TIME_FORMAT), start_flops

    def saved(self, iteration: int, flops_so_far: float, tokens_so_far: int, async_save: bool) -> None:
        if not self.enabled:
            return
        job = (flops_so_far - self.flops_at_start) / ((time.time() - self.start_time) * 1e12 * self.world_size)
        start_time, start_flops = self._series_start()
        elapsed = (datetime.now() - start_time).total_seconds()
        cumulative = (flops_so_far - start_flops) / (elapsed * 1e12 * self.world_size)
        prefix = "Saving async checkpoint" if async_save else "Saved checkpoint"
        self._append(f"{prefix}\tIteration: {iteration}\tJob throughput: {job:.1f} TFLOP/s/GPU\t"
                     f"Cumulative throughput: {cumulative:.1f} TFLOP/s/GPU\t"
                     f"Floating-point operations: {flops_so_far:.2e}\t"
                     f"Tokens (in billions): {tokens_so_far / 10**9:.2f}")
