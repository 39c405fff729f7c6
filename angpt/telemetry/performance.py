"""How fast and how full a run is: model FLOPs per token and the device's peak (model FLOPs utilisation),
memory, and GPU telemetry, for the trainer's records (angpt.telemetry.monitoring).

MFU = model_flops_per_token(...) * tokens_per_s_per_device / peak_flops_per_device(dtype).
"""

from __future__ import annotations

import re
from contextlib import contextmanager
from typing import Optional

import psutil
import torch
from megatron.core.energy_monitor import EnergyMonitor

from angpt.models.config import AnGPTConfig

GIB = 2**30


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
    # With --mtp-num-layers, as Megatron-LM counts them: each MTP layer a layer more, its projection of the
    # [embedding, hidden state] pair (2h x h) and its own logits.
    mtp = config.mtp_num_layers or 0
    forward = 2 * ((config.num_layers + mtp) * multiply_adds_per_layer + mtp * 2 * hidden * hidden
                   + (1 + mtp) * hidden * vocab_size)
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




def memory_report(iteration: int, rank: int, device_memory_used: bool = False) -> str:
    """Megatron-LM's report_memory line (--log-memory-interval): this rank's CUDA caching allocator in MB (the
    maxima since the previous log line, which resets them), and with `device_memory_used` the device's memory in
    use by every process (NVML's)."""
    megabytes = 1024.0 * 1024.0
    line = (f"[Rank {rank}] (after {iteration} iterations) memory (MB)"
            f" | allocated: {torch.cuda.memory_allocated() / megabytes:.2f}"
            f" | max allocated: {torch.cuda.max_memory_allocated() / megabytes:.2f}"
            f" | reserved: {torch.cuda.memory_reserved() / megabytes:.2f}"
            f" | max reserved: {torch.cuda.max_memory_reserved() / megabytes:.2f}")
    if device_memory_used:
        line += f" | total device memory used: {torch.cuda.device_memory_used() / megabytes:.2f}"
    return line


class GpuEnergy:
    """--log-energy (Megatron-LM's): the GPUs' energy from NVML, through megatron-core's EnergyMonitor (summed over
    the ranks: its lap() and get_total() are collective). Paused while the run evaluates or saves, as Megatron-LM
    pauses it. Built only with CUDA and nvidia-ml-py (angpt.config.megatron_lm.notes says so otherwise)."""

    def __init__(self, monitor=None):
        self._monitor = monitor if monitor is not None else EnergyMonitor()
        self._monitor.setup()
        self._monitor.resume()

    def figures(self, steps: int, seconds: float, world_size: int) -> dict[str, float]:
        """Megatron-LM's log-line figures of the steps since the previous call: J per iteration per GPU, and W."""
        energy = self._monitor.lap() / steps / world_size
        return {"energy_per_gpu_j": energy, "power_per_gpu_w": energy / (seconds / steps)}

    @contextmanager
    def paused(self):
        self._monitor.pause()
        try:
            yield
        finally:
            self._monitor.resume()

    def close(self) -> float:
        """The run's energy over every GPU (J), as Megatron-LM reports it at the end; NVML shut down."""
        self._monitor.lap()
        total = self._monitor.get_total()
        self._monitor.shutdown()
        return total
