"""Run megatron-core (written for 0.16.1) on a machine without CUDA, with the gloo backend.

megatron-core assumes a CUDA device in a few dozen places. `enable()` patches those places once per
process, and only when `torch.cuda.is_available()` is false, so GPU runs are untouched. Every patch
says what breaks without it.

`angpt.megatron_compat.patches.install()` calls it (through `angpt.training.distributed.initialize`, which every
entry point calls before it builds a model).
"""

from __future__ import annotations

import contextlib
import os
import types

import megatron.core.distributed.distributed_data_parallel as ddp
import megatron.core.fusions.fused_softmax as fused_softmax
import megatron.core.pipeline_parallel.schedules as schedules
import megatron.core.tensor_parallel.random as mp_random
import torch
from megatron.core.dist_checkpointing.strategies.async_utils import PersistentAsyncCaller
from torch.overrides import TorchFunctionMode

from angpt.megatron_compat import parent_watch

_enabled = False
# Captured on import, before `enable()` replaces it (also in the persistent writer's own interpreter).
_persistent_async_loop = PersistentAsyncCaller.async_loop


def _is_cuda(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    # A bare int means "cuda:N" to torch.
    return isinstance(device, int) and not isinstance(device, bool)


class _CudaToCpu(TorchFunctionMode):
    """Sends hard-coded `device="cuda"` (optimizer, grad clipping, grad buffers, schedules) to the CPU,
    makes `Tensor.cuda()` the identity, drops `pin_memory=True` (pinned memory needs an accelerator), and
    reports CPU tensors' `type()` as the CUDA type, because
    megatron's optimizers dispatch on `param.type() == "torch.cuda.FloatTensor"` and raise otherwise."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if _is_cuda(kwargs.get("device")):
            kwargs = {**kwargs, "device": "cpu"}
        if kwargs.get("pin_memory"):  # CP-aware RoPE's chunk index (get_pos_emb_on_this_cp_rank): no CPU allocator
            kwargs = {**kwargs, "pin_memory": False}
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], "cpu", *args[2:])
        out = func(*args, **kwargs)
        if func is torch.Tensor.type and len(args) == 1 and not kwargs and isinstance(out, str):
            if out.startswith("torch.") and not out.startswith("torch.cuda."):
                out = "torch.cuda." + out[len("torch."):]
        return out


class _Stream:
    """A CUDA stream where there is none: every CPU op runs on the calling thread in program order, so there is
    nothing to order."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, stream) -> None:
        pass


def enable() -> bool:
    """Apply the CPU patches if this process has no CUDA device. Returns whether they are active."""
    global _enabled
    if _enabled:
        return True
    if torch.cuda.is_available():
        return False
    _enabled = True

    # `torch.empty(..., device=torch.cuda.current_device())` in RoPE, TP gather/scatter buffers, DDP
    # grad buffers, p2p receive buffers and loss reductions: "Torch not compiled with CUDA enabled".
    torch.cuda.current_device = lambda: torch.device("cpu")
    # `torch.cuda.synchronize()` in parallel_state, optimizer and checkpoint code.
    torch.cuda.synchronize = lambda *args, **kwargs: None

    # The model-parallel RNG tracker (dropout forks, recomputation, `model_parallel_cuda_manual_seed`)
    # stores CUDA generator states; on the CPU the device generator is the CPU generator. Without this,
    # `torch.cuda.manual_seed` is a silent no-op and "TP-parallel" randomness is not seeded at all.
    torch.cuda.get_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    torch.cuda.set_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)
    torch.cuda.manual_seed = lambda seed: torch.manual_seed(seed)
    mp_random._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    mp_random._set_cuda_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)

    # Without an attention mask, the local attention builds its causal mask with device="cuda",
    # which the mode below cannot see (it is cached in a compiled helper).
    fused_softmax.get_default_causal_mask = lambda sq: torch.triu(
        torch.ones(sq, sq, dtype=torch.bool), diagonal=1
    )

    # All three pipeline schedules count tokens in `torch.zeros([], device="cuda")`.
    cpu_torch = types.ModuleType("torch_on_cpu")
    cpu_torch.__dict__.update(torch.__dict__)
    cpu_torch.zeros = lambda *args, device=None, **kwargs: torch.zeros(*args, **kwargs)
    schedules.torch = cpu_torch

    # --num-distributed-optimizer-instances: DDP gives the reduction between the instances a stream of its own
    # (torch.cuda.Stream, "Torch not compiled with CUDA enabled"), entered and waited on around synchronous
    # collectives (megatron-core passes async_op=False with several instances): exact without one.
    torch.cuda.Stream = _Stream
    torch.cuda.default_stream = lambda device=None: _Stream()
    torch.cuda.stream = lambda stream: contextlib.nullcontext()

    # A bucket group's weight all-gathers are coalesced into one collective, and gloo's (torch 2.13) writes the
    # tensors of a second dtype with the first's element size: a group of the bf16 weights' buckets and then the
    # fp32 learnable scales' (the first model chunk's one group under --overlap-param-gather-with-optimizer-step)
    # gathered the scales as garbage, and the loss went off from the second step. One group per dtype then.
    ddp.partition_buckets = _bucket_groups_of_one_dtype

    _CudaToCpu().__enter__()
    return True


_partition_buckets = ddp.partition_buckets


def _bucket_groups_of_one_dtype(buffers, force_single_bucket_group: bool = False):
    """megatron-core's bucket groups, a forced single group split into one per buffer (each of one dtype)."""
    if not force_single_bucket_group:
        return _partition_buckets(buffers)
    return [group for buffer in buffers for group in _partition_buckets([buffer], force_single_bucket_group=True)]


def persistent_writer_loop(*args, **kwargs):
    """megatron-core's persistent checkpoint writer (--use-persistent-ckpt-worker), a spawned interpreter (no fork:
    parent_watch's fork hook never runs there), exiting once its training process is gone, whatever killed it. On
    a machine without CUDA, with this module's patches: it starts with `torch.cuda.set_device(rank %
    torch.cuda.device_count())`, a ZeroDivisionError that killed it while the training processes waited for it
    forever, and synchronizes the device before it writes. A module-level function: the spawned interpreter
    receives it by name (patches.install sets it)."""
    parent_watch.on_parent_death(lambda: os._exit(1))
    if enable():
        torch.cuda.device_count = lambda: 1
        torch.cuda.set_device = lambda device: None
    return _persistent_async_loop(*args, **kwargs)

