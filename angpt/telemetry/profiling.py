"""Megatron-LM's --profile: a range of steps profiled on --profile-ranks, by the PyTorch profiler into the
TensorBoard directory (--use-pytorch-profiler: open the traces with TensorBoard's profiler plugin or Perfetto),
or as an Nsight Systems capture range (`nsys profile --capture-range=cudaProfilerApi`, with NVTX ranges for
each op), as megatron/training/training.py does it."""

from __future__ import annotations

from typing import Optional

import torch


class StepProfiler:
    """Steps are numbered as Megatron-LM numbers them: `before_step(i)` is called with the steps completed so
    far, `after_step(i)` with those completed after it; steps i with start <= i < end are profiled."""

    def __init__(self, start: int, end: int, pytorch_profiler: bool, trace_dir: Optional[str]):
        if end <= start:
            raise ValueError(f"--profile-step-end {end} must be above --profile-step-start {start}")
        if not pytorch_profiler and not torch.cuda.is_available():
            raise ValueError("--profile without --use-pytorch-profiler opens an Nsight Systems capture range "
                             "(cudaProfilerStart), which needs CUDA: add --use-pytorch-profiler")
        if pytorch_profiler and trace_dir is None:
            raise ValueError("--use-pytorch-profiler writes its traces to --tensorboard-dir: give it (or --save)")
        self.start, self.end, self.nvtx = start, end, None
        self.profiler = None
        if pytorch_profiler:
            self.profiler = torch.profiler.profile(
                schedule=torch.profiler.schedule(wait=max(start - 1, 0), warmup=1 if start > 0 else 0,
                                                 active=end - start, repeat=1),
                on_trace_ready=torch.profiler.tensorboard_trace_handler(trace_dir),
                record_shapes=True, with_stack=True)
            self.profiler.start()

    def before_step(self, completed: int) -> None:
        if self.profiler is not None:
            self.profiler.step()
        elif completed == self.start:
            torch.cuda.check_error(torch.cuda.cudart().cudaProfilerStart())
            self.nvtx = torch.autograd.profiler.emit_nvtx(record_shapes=True)
            self.nvtx.__enter__()

    def after_step(self, completed: int) -> None:
        if completed == self.end:
            self.close()

    def close(self) -> None:
        """Ends the range (at --profile-step-end, or when the run ends before it)."""
        if self.profiler is not None:
            self.profiler.stop()
            self.profiler = None
        elif self.nvtx is not None:
            torch.cuda.check_error(torch.cuda.cudart().cudaProfilerStop())
            self.nvtx.__exit__(None, None, None)
            self.nvtx = None
