"""What users watch during training: the log line, the progress bar, metrics.jsonl, TensorBoard scalars,
throughput (model FLOPs utilisation), memory, GPU telemetry, and anGPT's health signals.

The trainer assembles one record per logged iteration (and per evaluation) from these pieces:

    record = {"kind": "train", "iteration": 10, "train_iters": 100, "consumed_tokens": 40960,
              "lm_loss": 5.12, "lr": 3e-3, "grad_norm": 0.51, "ms_per_step": 812.3,
              "tokens_per_s_per_device": 2521.0, "mfu": 0.412, "skipped": 0,
              **memory_stats(), **telemetry.read(), **probe.summary()}
    progress.write(format_log_line(record)); metrics.log(record)

MFU = model_flops_per_token(...) * tokens_per_s_per_device / peak_flops_per_device(dtype).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import sys
import time
from functools import partial
from typing import Iterator, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel.layers import param_is_not_tensor_parallel_duplicate
from megatron.core.utils import unwrap_model

from angpt.bounding import _all_reduce_in_place, _split_over_tp, constrained_parameters
from angpt.models.config import AnGPTConfig
from angpt.models.gpt import WEIGHT_CONSTRAINTS
from angpt.models.layers import NormalizedResidual, PostNorm

GIB = 2**30
# A row counts as "at the bound" when its norm is within this of 1 (spec section 6: rows are projected to
# norm <= 1, so rows the optimizer pushes outward sit at exactly 1 up to round-off).
BOUND_TOLERANCE = 1e-3


# ---------------------------------------------------------------------------------------------------------
# Throughput


def model_flops_per_token(config: AnGPTConfig, seq_length: int, vocab_size: int) -> float:
    """Training FLOPs per token of the model (forward + backward = 3 x forward), counted as Megatron-LM's
    `num_floating_point_operations` does: 2 FLOPs per multiply-add of every matmul (qkv, attention
    output, fc1, fc2, output head) plus the attention scores and values, of which the causal mask leaves
    half (seq_length / 2 keys per query). Elementwise work (norms, scales, softmax, RoPE) is not counted,
    nor is activation recomputation (model FLOPs, not hardware FLOPs). `vocab_size` is the padded one."""
    hidden = config.hidden_size
    query_size = config.kv_channels * config.num_attention_heads
    key_value_size = config.kv_channels * (config.num_query_groups or config.num_attention_heads)
    # fc1 is 2f wide with a gated linear unit (SwiGLU: u and z), fc2 is f wide.
    mlp_matrices = 3 if config.gated_linear_unit else 2
    multiply_adds_per_layer = (
        hidden * (query_size + 2 * key_value_size)  # qkv
        + query_size * seq_length / 2 * 2  # q k^T and scores x v, causal
        + query_size * hidden  # attention output projection
        + mlp_matrices * config.ffn_hidden_size * hidden
    )
    forward = 2 * (config.num_layers * multiply_adds_per_layer + hidden * vocab_size)
    return 3 * forward


# Dense (not 2:4 sparse) tensor-core peaks in TFLOP/s from NVIDIA's datasheets, by device name as CUDA
# reports it ("NVIDIA H100 80GB HBM3" is the SXM part). First match wins, so variants precede the base
# name. fp16 runs at the bf16 rate on all of these.
_PEAK_TFLOPS = (
    (r"\bGB200\b", dict(fp8=5000, bf16=2500, tf32=1250, fp32=80)),
    (r"\bB200\b", dict(fp8=4500, bf16=2250, tf32=1100, fp32=75)),
    (r"\bGH200\b", dict(fp8=1979, bf16=989.5, tf32=494.5, fp32=67)),
    (r"\bH200 NVL\b", dict(fp8=1670.5, bf16=835.5, tf32=417.5, fp32=60)),
    (r"\bH200\b", dict(fp8=1979, bf16=989.5, tf32=494.5, fp32=67)),
    (r"\bH100 NVL\b", dict(fp8=1670.5, bf16=835.5, tf32=417.5, fp32=60)),
    (r"\bH100\b.*\bPCIe\b", dict(fp8=1513, bf16=756.5, tf32=378, fp32=51)),
    (r"\bH100\b", dict(fp8=1979, bf16=989.5, tf32=494.5, fp32=67)),
    (r"\bA100\b", dict(bf16=312, tf32=156, fp32=19.5)),
    (r"\bL40S\b", dict(fp8=733, bf16=362, tf32=183, fp32=91.6)),
    (r"\bL4\b", dict(fp8=242.5, bf16=121, tf32=60, fp32=30.3)),
    (r"\bA10\b", dict(bf16=125, tf32=62.5, fp32=31.2)),
)


def _matmul_precision(dtype: torch.dtype) -> str:
    if dtype in (torch.bfloat16, torch.float16):
        return "bf16"
    if "float8" in str(dtype):
        return "fp8"
    if dtype == torch.float32:
        # fp32 matmuls run on TF32 tensor cores only where PyTorch is allowed to (not its default).
        return "fp32" if torch.get_float32_matmul_precision() == "highest" else "tf32"
    raise ValueError(f"no peak FLOP/s known for matmuls in {dtype}")


def peak_flops_per_device(dtype: torch.dtype, device_name: Optional[str] = None) -> Optional[float]:
    """Dense peak FLOP/s of the current CUDA device (or of `device_name`) for matmuls in `dtype`
    (bf16/fp16, an fp8 dtype, or fp32: the TF32 peak when TF32 matmuls are allowed, else plain fp32).
    None on CPU, on unknown devices, and for precisions a device lacks (fp8 on A100)."""
    if device_name is None:
        if not torch.cuda.is_available():
            return None
        device_name = torch.cuda.get_device_name()
    precision = _matmul_precision(dtype)
    for pattern, peaks in _PEAK_TFLOPS:
        if re.search(pattern, device_name):
            return peaks[precision] * 1e12 if precision in peaks else None
    return None


# ---------------------------------------------------------------------------------------------------------
# Memory and device telemetry


def memory_stats() -> dict[str, float]:
    """On GPU the peak allocated and reserved memory (GiB) since the previous call; on CPU the resident
    set size of this process (GiB)."""
    if torch.cuda.is_available():
        stats = {
            "memory_max_allocated_gib": torch.cuda.max_memory_allocated() / GIB,
            "memory_max_reserved_gib": torch.cuda.max_memory_reserved() / GIB,
        }
        torch.cuda.reset_peak_memory_stats()
        return stats
    import psutil

    return {"memory_rss_gib": psutil.Process().memory_info().rss / GIB}


class DeviceTelemetry:
    """Utilisation, memory, power and temperature of this rank's GPU from NVML (nvidia-ml-py, through
    torch.cuda's readers, which map CUDA_VISIBLE_DEVICES to NVML's numbering). `read()` returns {} on
    CPU, without a driver or without nvidia-ml-py, and never raises or prints: a reading that fails once
    (not supported on this board, no NVML) is not tried again."""

    def __init__(self):
        self._readers = {}
        if torch.cuda.is_available():
            self._readers = {
                "gpu_util_percent": torch.cuda.utilization,
                "gpu_memory_used_gib": lambda device: torch.cuda.device_memory_used(device) / GIB,
                "gpu_power_w": lambda device: torch.cuda.power_draw(device) / 1000,  # NVML reports mW
                "gpu_temperature_c": torch.cuda.temperature,
            }

    def read(self) -> dict[str, float]:
        figures = {}
        for name, reader in list(self._readers.items()):
            try:
                figures[name] = float(reader(torch.cuda.current_device()))
            except Exception:  # NVMLError_*, or torch's RuntimeError / ModuleNotFoundError around them
                del self._readers[name]
        return figures


# ---------------------------------------------------------------------------------------------------------
# anGPT's health signals (spec section 10)


class HealthProbe:
    """Residual-stream norms after every layer, the post-norm input norms, the mean of each alpha and the
    fraction of weight rows at the bound, for the model chunks of this rank.

    Wrap forward passes in `capture()`: hooks exist only inside it, so other passes pay nothing. Under
    activation recomputation a capture spanning the backward pass sees recomputed layers twice, which
    leaves the means unchanged. `summary()` is collective over the default group.
    """

    def __init__(self, model_chunks: list[torch.nn.Module]):
        self._models = unwrap_model(list(model_chunks))
        config = self._models[0].config
        width = max(2, len(str(config.num_layers)))
        self._alpha_abs = config.alpha_abs
        # (layer name, layer) for every layer of every chunk; layer_number counts from 1 over the model.
        self._layers = [
            (f"layer_{layer.layer_number:0{width}d}", layer)
            for model in self._models
            for layer in model.decoder.layers
        ]
        # The last stage's copy of a tied embedding (`shared`) would count the embedding twice.
        self._bounded_weights = (
            [p for p in constrained_parameters(self._models) if not getattr(p, "shared", False)]
            if WEIGHT_CONSTRAINTS[config.model_family] == "bound"
            else []
        )
        self._norm_sums: dict[str, torch.Tensor] = {}
        self._token_counts: dict[str, int] = {}

    @contextlib.contextmanager
    def capture(self) -> Iterator[None]:
        handles = []
        for layer_name, layer in self._layers:
            record_output = partial(self._record_output, f"residual_norm/{layer_name}")
            handles.append(layer.register_forward_hook(record_output))
            for child_name, child in layer.named_children():
                if isinstance(child, PostNorm):
                    sub_block = child_name.removesuffix("_post_norm")
                    name = f"post_norm_input/{sub_block}/{layer_name}"
                    handles.append(child.register_forward_pre_hook(partial(self._record_input, name)))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def _record_input(self, name, module, inputs):
        self._accumulate(name, inputs[0])

    def _record_output(self, name, module, inputs, output):
        # Transformer layers return (hidden_states, context).
        self._accumulate(name, output[0] if isinstance(output, tuple) else output)

    def _accumulate(self, name: str, hidden: torch.Tensor) -> None:
        # Sums and token counts, not means: under sequence parallelism each TP rank holds other tokens,
        # without it every TP rank holds the same ones; sum over sum of counts is the mean in both cases.
        norms = hidden.detach().float().norm(dim=-1)
        total = norms.sum(dtype=torch.float64)
        self._norm_sums[name] = self._norm_sums[name] + total if name in self._norm_sums else total
        self._token_counts[name] = self._token_counts.get(name, 0) + norms.numel()

    @torch.no_grad()
    def _alpha_means(self) -> dict[str, float]:
        means = {}
        for layer_name, layer in self._layers:
            for child_name, child in layer.named_children():
                if isinstance(child, NormalizedResidual) and child.lerp:
                    alpha = child.alpha()
                    # nGPT's LERP uses |alpha| (NormalizedResidual.forward).
                    alpha = alpha.abs() if self._alpha_abs else alpha
                    means[f"alpha_{child_name.removesuffix('_residual')}/{layer_name}"] = alpha.mean()
        return {name: value.item() for name, value in means.items()}

    @torch.no_grad()
    def _rows_at_bound(self) -> tuple[int, int]:
        """(rows at the bound, rows) that this rank counts, so that over all ranks each row counts once:
        on data-parallel rank 0, and on TP rank 0 for weights replicated over TP and rows split over it."""
        tp_group = parallel_state.get_tensor_model_parallel_group()
        squared = [p.detach().float().pow(2).sum(dim=p.unit_norm_dim) for p in self._bounded_weights]
        split = [_split_over_tp(p) for p in self._bounded_weights]
        if tp_group.size() > 1:
            # Row-parallel weights hold a part of each row on each TP rank: sum the partial squared norms.
            _all_reduce_in_place([sq for sq, is_split in zip(squared, split) if is_split], tp_group)
        if parallel_state.get_data_parallel_rank(with_context_parallel=True) != 0:
            return 0, 0
        counted = [
            sq
            for sq, param, is_split in zip(squared, self._bounded_weights, split)
            if (tp_group.rank() == 0 if is_split else param_is_not_tensor_parallel_duplicate(param))
        ]
        if not counted:
            return 0, 0
        norms = torch.cat(counted).sqrt()
        return int((norms >= 1 - BOUND_TOLERANCE).sum().item()), norms.numel()

    def summary(self) -> dict[str, float]:
        """{"health/...": value} over the whole model, on every rank (collective over the default group),
        then forgets what was captured. Norms are means over all tokens captured by any rank since the
        previous summary, so with data parallelism they cover every data-parallel rank's micro-batches."""
        sums = {name: total.item() for name, total in self._norm_sums.items()}
        local = (sums, dict(self._token_counts), self._alpha_means(), self._rows_at_bound())
        self._norm_sums.clear()
        self._token_counts.clear()
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, local)

        norm_sums, token_counts, figures = {}, {}, {}
        at_bound = rows = 0
        for rank_sums, rank_counts, rank_alphas, (rank_at_bound, rank_rows) in everyone:
            for name, total in rank_sums.items():
                norm_sums[name] = norm_sums.get(name, 0.0) + total
                token_counts[name] = token_counts.get(name, 0) + rank_counts[name]
            figures.update(rank_alphas)  # alpha is replicated over TP and DP ranks
            at_bound += rank_at_bound
            rows += rank_rows
        figures.update({name: norm_sums[name] / token_counts[name] for name in norm_sums})
        if rows:
            figures["rows_at_bound"] = at_bound / rows
        return {f"health/{name}": figures[name] for name in sorted(figures)}


# ---------------------------------------------------------------------------------------------------------
# Output: metrics.jsonl and TensorBoard, the log line, the progress bar

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
    "{kind}/{name}" at step = iteration. Records hold "kind" ("train" or "eval"), "iteration" and
    figures, or "kind": "start" and where a run starts (JSON only; `angpt.metrics` reads the file back);
    the JSON line adds "time" (Unix seconds). Non-finite figures (a NaN loss) are written as null, which
    keeps every line valid JSON (pandas reads null back as NaN); TensorBoard gets the NaN itself.
    Disabled (`enabled=False`, e.g. on ranks other than 0), it does nothing."""

    def __init__(self, path_jsonl: Optional[str], tensorboard_dir: Optional[str], enabled: bool = True):
        self._file = None
        self._writer = None
        if not enabled:
            return
        if path_jsonl:
            os.makedirs(os.path.dirname(os.path.abspath(path_jsonl)), exist_ok=True)
            self._file = open(path_jsonl, "a", encoding="utf-8")
        if tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(tensorboard_dir)

    def log(self, record: dict) -> None:
        if self._file is not None:
            line = {name: _json_value(value) for name, value in record.items()}
            line.setdefault("time", round(time.time(), 3))
            self._file.write(json.dumps(line, allow_nan=False) + "\n")
            self._file.flush()
        if self._writer is not None and record["kind"] != "start":
            for name, value in record.items():
                value = _number(value)
                if name not in _NOT_SCALARS and isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._writer.add_scalar(f"{record['kind']}/{name}", value, record["iteration"])
            self._writer.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None


# (record field, label, format) of the log line, in order; fields a record lacks (or holds as None) are
# left out. Memory is the GPU's peak allocation, or the process RSS on CPU.
_LOG_LINE_FIGURES = (
    ("consumed_tokens", "consumed tokens", lambda v: f"{int(v)}"),
    ("lm_loss", "lm loss", "{:.4E}".format),
    ("lm_loss_ppl", "lm loss PPL", "{:.4E}".format),
    ("lr", "learning rate", "{:.3E}".format),
    ("grad_norm", "grad norm", "{:.3f}".format),
    ("ms_per_step", "ms per step", "{:.1f}".format),
    ("tokens_per_s_per_device", "tokens/s/device", "{:.0f}".format),
    ("mfu", "MFU", lambda v: f"{100 * v:.1f}%"),
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
            from tqdm import tqdm

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
