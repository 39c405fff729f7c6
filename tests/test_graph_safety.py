"""Forward and backward are graph-safe (issue 13): the host never waits for the device in them, so that
megatron-core's local CUDA graphs can capture them.

`no_host_syncs` makes every operation that would make the host wait for a CUDA device raise `HostSync`, naming
the line that asked for it: reading a value (`.item()`, `float/int/bool(tensor)`, `if tensor:`, a 0-dim tensor
as an index), ops whose output size depends on the values (`nonzero`, boolean-mask indexing, `unique`, ...),
copies to the host (`.tolist()`, `.numpy()`, `.cpu()`) and `torch.cuda.synchronize()`. Without CUDA every
tensor stands for a device tensor (there is no device to wait for, so the ops are caught, not the waits); on
a GPU only CUDA tensors count, and `torch.cuda.set_sync_debug_mode("error")` adds the device's own check
(which also sees syncs inside C++ and CUDA code). The optimizer step reads the loss (the NaN skip) and is left
out on purpose.

Three reads look like syncs on the CPU and are not on a GPU, and the mode lets them pass: megatron-core's RNG
tracker compares CPU generator states in fork(), its core_attn recompute reads a CPU tensor (HOST_TENSOR_READS),
and `x[mask] = number` (megatron-core's vocab-parallel cross entropy) becomes masked_fill_, as ATen does for CUDA
tensors.
"""

from __future__ import annotations

import contextlib
import os
import traceback
from unittest import mock

import pytest
import torch
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.enums import AttnBackend
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from angpt.megatron_compat import cpu as cpu_adapter
from angpt.models import model_config
from angpt.models.attention import clear_attention_backend_environment
from angpt.training.step import build_model_chunks, forward_step

SHAPE = dict(num_layers=2, hidden_size=64, num_attention_heads=4)
VOCAB, SEQ, BATCH = 128, 16, 2
CUDA = torch.cuda.is_available()

aten = torch.ops.aten


class HostSync(RuntimeError):
    """An operation that makes the host wait for the device ran inside `no_host_syncs`."""


READS_A_VALUE = "reads a tensor's value on the host"
# Ops that read device memory on the host, or whose output size depends on tensor values (so the host must
# wait for the values to size the output). `_local_scalar_dense` is what .item(), float(), int(), bool(),
# `if tensor:`, f"{tensor:.2f}" and a 0-dim integer tensor used as an index all come down to.
SYNCING_OPS = {
    aten._local_scalar_dense.default: READS_A_VALUE,
    aten.nonzero.default: "nonzero (output size depends on values)",
    aten.equal.default: "torch.equal (returns a Python bool)",
    aten.allclose.default: "torch.allclose (returns a Python bool)",
    aten.is_nonzero.default: "is_nonzero (returns a Python bool)",
    aten.masked_select.default: "masked_select (output size depends on values)",
    aten._unique2.default: "unique (output size depends on values)",
    aten.unique_dim.default: "unique (output size depends on values)",
    aten.unique_consecutive.default: "unique_consecutive (output size depends on values)",
    aten.bincount.default: "bincount (output size depends on values)",
}
# Indexing with a boolean mask runs nonzero inside the kernel, below the mode's reach.
INDEXING_OPS = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}
# Host copies the dispatcher does not see on CPU tensors (no-ops there, device-to-host copies on a GPU).
HOST_COPIES = {torch.Tensor.tolist: ".tolist()", torch.Tensor.numpy: ".numpy()", torch.Tensor.cpu: ".cpu()"}
# Values read from tensors that live on the host in a GPU run too, which the mode cannot tell apart without
# CUDA: (file, text of the line) -> why that read waits for no device.
HOST_TENSOR_READS = {
    ("megatron/core/tensor_parallel/random.py", "torch.get_rng_state()"):
        "the RNG tracker's fork() compares two CPU generator states (torch.get_rng_state() is a CPU tensor)",
    ("megatron/core/transformer/attention.py", "attn_mask_type.item()"):
        "selective recompute of core attention hands the mask type over as a CPU tensor (torch.tensor([value]))",
}
# Frames that only pass a call on: torch itself and the CPU adapter's device mode; and the modes below.
PASS_THROUGH = (os.path.dirname(torch.__file__) + os.sep, os.path.abspath(cpu_adapter.__file__))
MODE_FRAMES = {"_caller_frames", "sync", "synchronize", "__torch_dispatch__", "__torch_function__"}


def _caller_frames() -> list[traceback.FrameSummary]:
    return [f for f in traceback.extract_stack()
            if not os.path.abspath(f.filename).startswith(PASS_THROUGH)
            and not (f.name in MODE_FRAMES and os.path.abspath(f.filename) == __file__)]


def _where(frames: list[traceback.FrameSummary]) -> str:
    """The innermost frames outside torch, the line that asked for the sync last."""
    lines = [f"{f.filename}:{f.lineno} in {f.name}: {f.line}" for f in frames[-3:]]
    node = torch._C._current_autograd_node()
    if node is not None:  # a sync inside a C++ backward has no Python frame of its own
        lines.append(f"(in the backward of {node.name()})")
    return "\n    ".join(lines)


def _is_mask(index) -> bool:
    return isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8)


def _on_device(*values) -> bool:
    """Whether the op touches a device tensor: any tensor without CUDA, a CUDA tensor with it."""
    tensors = [leaf for leaf in tree_leaves(values) if isinstance(leaf, torch.Tensor)]
    return bool(tensors) and (not CUDA or any(t.is_cuda for t in tensors))


class _Recorder:
    """Records each sync (in case some caller catches the error and carries on) and raises it."""

    def __init__(self):
        self.syncs: list[str] = []

    def sync(self, what: str):
        frames = _caller_frames()
        if not CUDA and what == READS_A_VALUE and frames and any(
                frames[-1].filename.endswith(path) and text in (frames[-1].line or "")
                for path, text in HOST_TENSOR_READS):
            return
        message = f"host sync: {what}\n    {_where(frames)}"
        self.syncs.append(message)
        raise HostSync(message)


class _SyncingOps(TorchDispatchMode):
    def __init__(self, recorder: _Recorder):
        super().__init__()
        self.recorder = recorder
        self.masked_fill = 0  # inside `x[mask] = number`, which needs no sync (see _HostCopies)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in SYNCING_OPS and _on_device(args):
            self.recorder.sync(SYNCING_OPS[func])
        if func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None and _on_device(args):
            self.recorder.sync("repeat_interleave without output_size")
        if (func in INDEXING_OPS and not self.masked_fill and any(_is_mask(i) for i in args[1] or ())
                and _on_device(args)):
            self.recorder.sync("indexing with a boolean mask")
        return func(*args, **kwargs)


class _HostCopies(TorchFunctionMode):
    def __init__(self, recorder: _Recorder, ops: _SyncingOps):
        super().__init__()
        self.recorder, self.ops = recorder, ops

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.__setitem__ and _is_mask(args[1]) and isinstance(args[2], (int, float, bool)):
            # On a CUDA tensor, torch makes the number a CPU scalar and index_put_ takes its masked_fill_ fast
            # path (ATen's canDispatchToMaskedFill): no nonzero, no sync.
            self.ops.masked_fill += 1
            try:
                return func(*args, **kwargs)
            finally:
                self.ops.masked_fill -= 1
        if func in HOST_COPIES and _on_device(args[0]):
            self.recorder.sync(HOST_COPIES[func])
        # Only the literal "cpu": without CUDA the CPU adapter answers torch.cuda.current_device() with the CPU
        # device, so a torch.device("cpu") here may well be the GPU in a GPU run.
        if func is torch.Tensor.to and "cpu" in (*args[1:], kwargs.get("device")) and _on_device(args[0]):
            self.recorder.sync(".to('cpu')")
        return func(*args, **kwargs)


@contextlib.contextmanager
def no_host_syncs():
    """Inside, every host sync raises HostSync; on leaving, any that a caller swallowed fails too."""
    recorder = _Recorder()
    ops = _SyncingOps(recorder)

    def synchronize(*args, **kwargs):
        recorder.sync("torch.cuda.synchronize()")

    with contextlib.ExitStack() as stack:
        # The CPU adapter (angpt.megatron_compat.cpu) made torch.cuda.synchronize a no-op; here it raises.
        stack.enter_context(mock.patch.object(torch.cuda, "synchronize", synchronize))
        if CUDA:
            previous = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("error")
            stack.callback(torch.cuda.set_sync_debug_mode, previous)
        stack.enter_context(_HostCopies(recorder, ops))
        stack.enter_context(ops)
        yield
    assert not recorder.syncs, "\n".join(recorder.syncs)


def device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if CUDA else torch.device("cpu")


# --- the mode catches what it must -------------------------------------------------------------------------


class _ItemInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * grad.sum().item()


def _set_by_mask(t):
    t[t > 1] = t[0]  # a tensor value: no masked_fill_ fast path


SYNCS = {
    ".item()": lambda t: t.sum().item(),
    "if tensor": lambda t: 1 if t.sum() > 0 else 0,
    "float(tensor)": lambda t: float(t.sum()),
    "int(tensor)": lambda t: int(t.sum()),
    "format": lambda t: f"{t.sum():.3f}",
    "0-dim tensor index": lambda t: t[t.sum().long() - 5],
    "range(tensor)": lambda t: range(t.sum().long()),
    "max() of a tensor": lambda t: max(t),
    ".tolist()": lambda t: t.tolist(),
    ".numpy()": lambda t: t.numpy(),
    ".cpu()": lambda t: t.cpu(),
    ".to('cpu')": lambda t: t.to("cpu"),
    "nonzero": lambda t: t.nonzero(),
    "boolean mask": lambda t: t[t > 1],
    "boolean mask assignment": _set_by_mask,
    "torch.equal": lambda t: torch.equal(t, t),
    "allclose": lambda t: torch.allclose(t, t),
    "unique": lambda t: torch.unique(t),
    "synchronize": lambda t: torch.cuda.synchronize(),
    "item in a backward": lambda t: _ItemInBackward.apply(t.requires_grad_()).sum().backward(),
}


@pytest.mark.parametrize("name", list(SYNCS))
def test_every_kind_of_host_sync_raises(name, single_process):
    t = torch.tensor([1.0, 2.0, 3.0], device=device())
    with pytest.raises(HostSync):
        with no_host_syncs():
            SYNCS[name](t)


def test_a_swallowed_sync_still_fails(single_process):
    with pytest.raises(AssertionError, match="reads a tensor's value"):
        with no_host_syncs():
            with contextlib.suppress(RuntimeError):
                torch.ones(2, device=device()).sum().item()


def test_graph_safe_operations_pass(single_process):
    t = torch.tensor([1.0, 2.0, 3.0], device=device(), requires_grad=True)
    with no_host_syncs():
        y = torch.where(t > 1, t, 0).clamp_min(1e-6).rsqrt() * torch.isfinite(t).all()
        (y.sum() / (t > 0).sum()).backward()
        _ = t.shape[0] + t.dim() + t.numel()  # shapes are host metadata, not device values
        masked = t.detach().clone()
        masked[masked > 1] = 0.0  # index_put_'s masked_fill_ fast path


# --- the trainer's forward and backward --------------------------------------------------------------------


BF16 = dict(bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16)
# (family, config overrides beyond SHAPE): each family with megatron's attention ("unfused", the CPU default)
# and torch's scaled_dot_product_attention ("flash", the GPU default), and each switch that changes the code
# the forward runs (the multipliers and the nu_p reading only change constants).
CASES = {
    "angpt": ("angpt", {}),
    "angpt flash": ("angpt", dict(attention_backend=AttnBackend.flash)),
    "gptplus": ("gptplus", {}),
    "gptplus flash": ("gptplus", dict(attention_backend=AttnBackend.flash)),
    "gptplus GQA flash": ("gptplus", dict(num_query_groups=2, attention_backend=AttnBackend.flash)),
    "ngpt": ("ngpt", {}),
    "ngpt flash": ("ngpt", dict(attention_backend=AttnBackend.flash)),
    "angpt constant factors exact": ("angpt", dict(constant_factors="exact")),
    "angpt nu(alpha) exact": ("angpt", dict(nu_alpha_mode="exact")),
    "angpt every factor exact": ("angpt", dict(constant_factors="exact", nu_alpha_mode="exact")),
    "angpt factors off": ("angpt", dict(constant_factors="one", nu_alpha_mode="one")),
    "angpt post-norm none": ("angpt", dict(post_norm="none")),
    "angpt nu(alpha) without gradient": ("angpt", dict(nu_alpha_grad=False)),
    "angpt plain residual": ("angpt", dict(residual="plain")),
    "angpt plain residual exact": ("angpt", dict(residual="plain", nu_alpha_mode="exact")),
    "angpt plain residual nu one": ("angpt", dict(residual="plain", nu_alpha_mode="one")),
    "angpt tied embeddings": ("angpt", dict(share_embeddings_and_output_weights=True)),
    "angpt attention dropout flash": ("angpt", dict(attention_dropout=0.1, attention_backend=AttnBackend.flash)),
    "gptplus dropout": ("gptplus", dict(hidden_dropout=0.1, attention_dropout=0.1)),
    "angpt bf16": ("angpt", BF16),
    "gptplus bf16": ("gptplus", BF16),
    "ngpt bf16": ("ngpt", BF16),
    "angpt recompute full": ("angpt", dict(recompute_granularity="full", recompute_method="uniform",
                                           recompute_num_layers=1)),
    "angpt recompute selective": ("angpt", dict(recompute_granularity="selective",
                                                recompute_modules=["mlp", "qk_norm", "residual_update"])),
    "angpt recompute core_attn": ("angpt", dict(recompute_granularity="selective", recompute_modules=["core_attn"])),
    "gptplus recompute selective": ("gptplus", dict(recompute_granularity="selective",
                                                    recompute_modules=["core_attn", "mlp", "layernorm", "qk_norm"])),
}


def build(case: str, ddp_config: DistributedDataParallelConfig | None = None):
    family, overrides = CASES[case]
    # megatron-core refuses a second attention backend in one process unless its variables are cleared.
    clear_attention_backend_environment()
    return build_model_chunks(model_config(family, **SHAPE, **overrides), VOCAB, SEQ, ddp_config)


def batch(seed: int = 0) -> dict:
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(seed))
    data = dict(tokens=tokens[:, :-1], labels=tokens[:, 1:], loss_mask=torch.ones(BATCH, SEQ),
                position_ids=torch.arange(SEQ).expand(BATCH, -1))
    return {key: value.to(device()) for key, value in data.items()}


def forward_backward(chunk, data: dict) -> torch.Tensor:
    """The trainer's forward_step and loss on one micro-batch, then backward through megatron-core's DDP."""
    output, loss_func = forward_step(iter([data]), chunk)
    total, tokens, _ = loss_func(output)
    loss = total / tokens  # the micro-batch's mean, as megatron-core's schedule divides it
    loss.backward()
    return loss.detach()


def warm_up(chunks) -> None:
    """On a GPU, one step before the checked one, as CUDA graphs warm up before capture (torch.compile of the
    fused elementwise kernels, lazy initializations). On the CPU the first step is checked as well."""
    if CUDA:
        for chunk in chunks:
            forward_backward(chunk, batch(2))
            chunk.zero_grad_buffer()


@pytest.mark.parametrize("case", list(CASES))
def test_forward_and_backward_never_sync(case, seeded):
    (chunk,) = build(case)
    warm_up([chunk])
    chunk.zero_grad_buffer()
    data = batch()  # copied to the device before the checked region: the copy is not the model's
    with no_host_syncs():
        loss = forward_backward(chunk, data)
    assert torch.isfinite(loss)
    grads = [p.main_grad for p in chunk.parameters() if p.requires_grad]
    assert grads and all(torch.isfinite(g).all() and g.abs().sum() > 0 for g in grads)


@pytest.mark.parametrize("overlap", [False, True], ids=["ddp", "ddp overlap"])
@pytest.mark.parametrize("family", ["angpt", "gptplus", "ngpt"])
def test_megatron_schedule_forward_backward_never_syncs(family, overlap, seeded):
    """megatron-core's schedule around the step as the trainer calls it (two micro-batches, loss scaling,
    DDP's grad hooks, finalize_model_grads), with and without --overlap-grad-reduce; the loss stays a tensor."""
    chunks = build(family, DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=overlap))
    warm_up(chunks)
    for chunk in chunks:
        chunk.zero_grad_buffer()
    data = iter([batch(0), batch(1)])  # on the device before the checked region
    with no_host_syncs():
        losses = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=data, model=chunks,
            num_microbatches=2, seq_length=SEQ, micro_batch_size=BATCH, forward_only=False,
        )
    assert len(losses) == 2 and all(torch.isfinite(entry["lm loss"]).all() for entry in losses)


def _sync_in_forward(chunk):
    chunk.module.decoder.layers[0].mlp.register_forward_hook(lambda module, args, out: out[0].abs().max().item())


def _sync_in_backward(chunk):
    weight = chunk.module.decoder.layers[0].self_attention.linear_qkv.weight
    weight.register_hook(lambda grad: grad * bool(grad.abs().sum() > 0))


@pytest.mark.parametrize("inject", [_sync_in_forward, _sync_in_backward], ids=["forward", "backward"])
def test_a_sync_in_the_model_fails_the_check(inject, seeded):
    """The check as the tests above use it fails on a model that syncs in its forward or its backward, and
    names the line."""
    (chunk,) = build("angpt")
    inject(chunk)
    data = batch()
    with pytest.raises(HostSync, match=r"(?s)reads a tensor's value.*test_graph_safety\.py"):
        with no_host_syncs():
            forward_backward(chunk, data)
