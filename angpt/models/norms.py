"""RMSNorm for GPT+ when neither apex nor Transformer Engine is installed."""

from __future__ import annotations

import torch

from angpt.models.config import AnGPTConfig


class RMSNorm(torch.nn.RMSNorm):
    """torch's RMSNorm, usable with sequence parallelism.

    megatron-core's torch fallback (WrappedTorchNorm) refuses sequence_parallel; all a norm needs for it
    is that its weight is tagged, so that finalize_model_grads sums the weight's partial gradients over
    the tensor-parallel group."""

    def __init__(self, config: AnGPTConfig, hidden_size: int, eps: float = 1e-5, **kwargs):
        # On the GPU from the start, as megatron-core's own layers are (DDP moves only what its buffers hold).
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype, device=device)
        self.weight.sequence_parallel = config.sequence_parallel
