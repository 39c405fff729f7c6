"""RMSNorm for GPT+ when neither apex nor Transformer Engine is installed."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel

from angpt.kernels import fused_on_gpu
from angpt.models.config import AnGPTConfig


@fused_on_gpu(eager=lambda x, weight, eps: F.rms_norm(x, weight.shape, weight, eps))
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / sqrt(mean(x^2) + eps) over the last dimension, in fp32, rounded once to x's dtype.
    On CUDA one compiled kernel forward and one backward (torch's own RMSNorm kernels take a thread block
    per row, several times slower for GPT+'s rows of 1024 and its QK-norm's rows of 64 on an H200); torch's
    RMSNorm elsewhere."""
    x32 = x.float()
    normalized = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (normalized * weight.float()).to(x.dtype)


class RMSNorm(torch.nn.RMSNorm):
    """torch's RMSNorm, usable with sequence parallelism, and compiled on GPUs (`rms_norm`).

    megatron-core's torch fallback (WrappedTorchNorm) refuses sequence_parallel; all a norm needs for it
    is that its weight is tagged, so that finalize_model_grads sums the weight's partial gradients over
    the tensor-parallel group.

    `qk_norm`: GPT+'s per-head QK-norm, recomputed in the backward pass under selective recompute of qk_norm
    (it then keeps only its input, a view of the QKV projection's output that attention keeps for v)."""

    def __init__(self, config: AnGPTConfig, hidden_size: int, eps: float = 1e-5, qk_norm: bool = False, **kwargs):
        # On the GPU from the start, as megatron-core's own layers are (DDP moves only what its buffers hold).
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype, device=device)
        self.weight.sequence_parallel = config.sequence_parallel
        self.recompute = qk_norm and config.recomputes("qk_norm")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.recompute and torch.is_grad_enabled():
            return tensor_parallel.checkpoint(self._normalize, False, x)
        return self._normalize(x)

    def _normalize(self, x: torch.Tensor) -> torch.Tensor:
        # In the weight's dtype, as apex's and Transformer Engine's norms give it: under --fp32-residual-connection
        # the fp32 residual stream reaches the 16-bit linear layers through the norms (a no-op otherwise).
        return rms_norm(x, self.weight, self.eps).to(self.weight.dtype)
