"""What a run logs and writes: metrics.jsonl, TensorBoard scalars and optionally a Weights & Biases run, the log
line and the progress bar on the console (angpt.telemetry.metrics_reader reads metrics.jsonl back).

The trainer assembles one record per logged iteration (and per evaluation):

    record = {"kind": "train", "iteration": 10, "train_iters": 100, "consumed_tokens": 40960, "global_batch_size": 32,
              "lm_loss": 5.12, "lr": 3e-3, "grad_norm": 0.51, "ms_per_step": 812.3,
              "tokens_per_s_per_device": 2521.0, "mfu": 0.412, "skipped": 0,
              **memory_stats(), **telemetry.read(), **probe.summary()}
    progress.write(format_log_line(record)); metrics.log(record)
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import time
from typing import Optional

from torch.utils.tensorboard import SummaryWriter
from tqdm import tqdm

from angpt.telemetry.stragglers import format_stragglers

# ---------------------------------------------------------------------------------------------------------
# Output: metrics.jsonl, TensorBoard and W&B, the log line, the progress bar

# Fields of a record that are not figures to plot.
_NOT_SCALARS = ("kind", "iteration", "time")


def _number(value):
    """Tensors and numpy scalars as Python numbers; anything else as it is."""
    return value.item() if hasattr(value, "item") else value


def _json_value(value):
    """Non-finite floats as null: Python's json would write NaN, which is not JSON."""
    value = _number(value)
    return None if isinstance(value, float) and not math.isfinite(value) else value


class MetricsLogger:
    """One JSON object per line in `path_jsonl` (appended, so resumed runs continue the file; flushed per
    line, so a crash loses nothing written before it) and each numeric figure as the TensorBoard scalar
    "train/{name}" (an evaluation's: "{split}/{name}") at step = iteration. Records hold "kind" ("train" or
    "eval"), "iteration" and figures, or "kind": "start" and where a run starts (JSON only;
    `angpt.telemetry.metrics_reader` reads the file back);
    the JSON line adds "time" (Unix seconds). Non-finite figures (a NaN loss) are written as null, which
    keeps every line valid JSON (pandas reads null back as NaN); TensorBoard gets the NaN itself.
    With `wandb_init` (wandb.init's keyword arguments: project, name, entity, dir, config), the same scalars
    go to a W&B run under the same names at step = iteration, and close() finishes the run. `log(record, scalars)`
    sends those scalars instead of the record's; `add_scalars` sends scalars of an iteration without a record.
    `queue_size`: the TensorBoard events held before the writer waits for its file (SummaryWriter's max_queue).
    Disabled (`enabled=False`, e.g. on ranks other than 0), it does nothing."""

    def __init__(self, path_jsonl: Optional[str], tensorboard_dir: Optional[str], enabled: bool = True,
                 wandb_init: Optional[dict] = None, timers_to_tensorboard: bool = False, queue_size: int = 1000):
        self.timers_to_tensorboard = timers_to_tensorboard
        self._file = None
        self._writer = None
        self._wandb_run = None
        if not enabled:
            return
        if path_jsonl:
            os.makedirs(os.path.dirname(os.path.abspath(path_jsonl)), exist_ok=True)
            self._file = open(path_jsonl, "a", encoding="utf-8")
        if tensorboard_dir:
            self._writer = SummaryWriter(tensorboard_dir, max_queue=queue_size)
        if wandb_init is not None:
            import wandb  # noqa: PLC0415 (optional dependency)

            os.makedirs(wandb_init["dir"], exist_ok=True)
            # Silent and without console capture: W&B's banners stay out of the log, and our log lines out of
            # W&B. A run of its own (create_new), never a run another logger of this process left open.
            settings = wandb.Settings(silent=True, console="off", reinit="create_new")
            self._wandb_run = wandb.init(**wandb_init, settings=settings)

    def log(self, record: dict, scalars: Optional[dict] = None) -> None:
        if self._file is not None:
            line = {name: _json_value(value) for name, value in record.items()}
            line.setdefault("time", round(time.time(), 3))
            self._file.write(json.dumps(line, allow_nan=False) + "\n")
            self._file.flush()
        if record["kind"] != "start":
            self.add_scalars(self.scalars(record) if scalars is None else scalars, record["iteration"], flush=True)

    def scalars(self, record: dict) -> dict:
        """{tag: value} of the record's numeric figures, as TensorBoard and W&B get them."""
        # An evaluation's scalars are named by its split: validation and test both evaluate at the last step.
        group = record.get("split") or record["kind"]
        scalars = {}
        for name, value in record.items():
            value = _number(value)
            if name not in _NOT_SCALARS and isinstance(value, (int, float)) and not isinstance(value, bool):
                scalars[f"{group}/{name}"] = value
        if self.timers_to_tensorboard:  # Megatron-LM's tags: the slowest rank's time
            for name, value in record.get("timers_ms", {}).items():
                scalars[f"timers/{name}-time"] = max(value) if isinstance(value, list) else value
        return scalars

    def add_scalars(self, scalars: dict, iteration: int, flush: bool = False) -> None:
        """TensorBoard's and W&B's scalars at step = iteration; written to the event file at once with `flush`
        (else by the writer's thread, as its queue fills or every two minutes)."""
        if self._writer is not None:
            for tag, value in scalars.items():
                self._writer.add_scalar(tag, value, iteration)
            if flush:
                self._writer.flush()
        if self._wandb_run is not None and scalars:
            self._wandb_run.log(scalars, step=iteration)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._wandb_run is not None:
            self._wandb_run.finish()
            self._wandb_run = None


# (record field, label, format) of the log line, in order; fields a record lacks (or holds as None) are
# left out. Memory is the GPU's peak allocation, or the process RSS on CPU.
# Each MTP layer's loss (--mtp-num-layers): "mtp_1_loss", ..., in the log line as Megatron-LM's "mtp_1 loss".
MTP_LOSS = re.compile(r"mtp_(\d+)_loss")
_LOG_LINE_FIGURES = (
    ("consumed_tokens", "consumed tokens", lambda v: f"{int(v)}"),
    ("global_batch_size", "global batch size", lambda v: f"{int(v)}"),
    ("lm_loss", "lm loss", "{:.4E}".format),
    ("lm_loss_ppl", "lm loss PPL", "{:.4E}".format),
    ("lr", "learning rate", "{:.3E}".format),
    ("loss_scale", "loss scale", "{:.1f}".format),
    ("grad_norm", "grad norm", "{:.3f}".format),
    ("num_zeros", "num zeros", lambda v: f"{int(v)}"),
    ("params_norm", "params norm", "{:.3f}".format),
    ("ms_per_step", "ms per step", "{:.1f}".format),
    ("tokens_per_s_per_device", "tokens/s/device", "{:.0f}".format),
    ("mfu", "MFU", lambda v: f"{100 * v:.1f}%"),
    ("energy_per_gpu_j", "energy per GPU (J/iter/GPU)", "{:.1f}".format),
    ("power_per_gpu_w", "power per GPU (W/GPU)", "{:.1f}".format),
    ("memory_max_allocated_gib", "mem", "{:.2f} GiB".format),
    ("memory_rss_gib", "mem", "{:.2f} GiB".format),
    ("skipped", "skipped", lambda v: f"{int(v)}"),
)


def format_log_line(record: dict) -> str:
    """Megatron-style one-line summary of a train or eval record, e.g.
    ` iteration      10/     100 | consumed tokens: 40960 | lm loss: 5.1234E+00 | ... | skipped: 0`."""
    iteration = int(record["iteration"])
    if record["kind"] == "eval":
        head = f" {record.get('split', 'validation')} at iteration {iteration:8d}"
    elif "train_iters" in record:
        head = f" iteration {iteration:8d}/{int(record['train_iters']):8d}"
    else:
        head = f" iteration {iteration:8d}"
    parts = [head]
    for field, label, fmt in _LOG_LINE_FIGURES:
        value = record.get(field)
        if value is not None:
            parts.append(f"{label}: {fmt(_number(value))}")
        if field == "lm_loss":
            parts.extend(f"mtp_{MTP_LOSS.fullmatch(name)[1]} loss: {_number(record[name]):.4E}"
                         for name in filter(MTP_LOSS.fullmatch, record))
    if record.get("timers_ms"):  # per step: the max over the ranks, min/max, or every rank's a/b/...
        shown = ", ".join(f"{name} {'/'.join(f'{v:.1f}' for v in value) if isinstance(value, list) else f'{value:.1f}'}"
                          for name, value in record["timers_ms"].items())
        parts.append(f"timers (ms): {shown}")
    if "stragglers" in record:
        parts.extend(format_stragglers(record))
    return " | ".join(parts)


class _StreamOutlivingItsReader:
    """sys.stdout or sys.stderr, made to outlive the reader of the pipe behind it (`torchrun ... | tee
    log` where the Ctrl-C that stops training kills tee too, or a log collector that died): at the first
    BrokenPipeError the stream's descriptor is pointed at /dev/null and the write retried, so that a
    print, a log record or the flush at exit (which would turn exit status 0 into 120) never fails a
    save in progress. Output written after that is lost; metrics.jsonl still has every record."""

    def __init__(self, stream):
        self._stream = stream

    def _retried(self, method, *args):
        try:
            return method(*args)
        except BrokenPipeError:
            devnull = os.open(os.devnull, os.O_WRONLY)
            try:
                os.dup2(devnull, self._stream.fileno())
            finally:
                os.close(devnull)
            return method(*args)

    def write(self, text):
        return self._retried(self._stream.write, text)

    def writelines(self, lines):
        return self._retried(self._stream.writelines, lines)

    def flush(self):
        return self._retried(self._stream.flush)

    def __getattr__(self, name):
        return getattr(self._stream, name)


def console_outlives_its_reader() -> None:
    """Wrap sys.stdout and sys.stderr in `_StreamOutlivingItsReader` (before logging takes sys.stderr)."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, _StreamOutlivingItsReader):
            setattr(sys, name, _StreamOutlivingItsReader(stream))


class ProgressBar:
    """A tqdm bar on stderr when `enabled` (rank 0) and stderr is a terminal. `write` prints log lines
    above the bar, or plainly to stdout when there is no bar; with `enabled=False` everything is a no-op."""

    def __init__(self, total: int, initial: int = 0, enabled: bool = True):
        self._enabled = enabled
        self._bar = None
        if enabled and sys.stderr.isatty():
            self._bar = tqdm(total=total, initial=initial, unit="it", dynamic_ncols=True, file=sys.stderr)

    def update(self, n: int = 1, postfix: Optional[dict] = None) -> None:
        if self._bar is None:
            return
        if postfix:
            self._bar.set_postfix(
                {k: f"{v:.4g}" if isinstance(v, float) else v for k, v in postfix.items()}, refresh=False
            )
        self._bar.update(n)

    def write(self, line: str) -> None:
        if self._bar is not None:
            self._bar.write(line)
        elif self._enabled:
            print(line, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
