"""Learnable scales with effective learning rates (docs/model.md, Learnable scales).

A scale s is stored as a surrogate s_hat with s_hat(0) = s_scale and used as s = (s_init / s_scale) * s_hat,
so Adam with one global lr moves s at lr * s_init / s_scale. Surrogates are fp32 and get no weight decay
(megatron-core's optimizer exempts 1-D parameters).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, make_sharded_tensors_for_checkpoint

from angpt.models.config import AnGPTConfig


def scale_init(config: AnGPTConfig, name: str) -> tuple[float, float]:
    """(s_init, s_scale) of each scale, as in the table of docs/model.md, Learnable scales."""
    inverse_sqrt_d = 1 / math.sqrt(config.hidden_size)
    if name == "alpha":
        default_alpha = 0.05 if config.model_family == "ngpt" else 0.01
        return (default_alpha if config.alpha_init is None else config.alpha_init), inverse_sqrt_d
    if name in ("s_z", "s_qk"):
        return 1.0, inverse_sqrt_d
    if name in ("s_u", "s_v"):
        return 1.0, 1.0
    raise KeyError(f"no learnable scale named {name!r}")


class LearnableScale(MegatronModule):
    """One learnable scale vector.

    `partitioned`: the vector is split over tensor-parallel ranks along its only dim (s_u, s_v over f,
    s_Z over the vocabulary, nGPT's s_qk over heads).
    `reduce_grad_over_tp`: the vector is replicated but multiplies activations that differ across TP
    ranks (other heads, or other tokens under sequence parallelism), so each rank's gradient is a partial
    sum; the all-reduce happens in autograd, so gradients are right whatever runs the backward pass.
    """

    def __init__(
        self,
        config: AnGPTConfig,
        name: str,
        size: int,
        partitioned: bool = False,
        reduce_grad_over_tp: bool = False,
    ):
        super().__init__(config=config)
        self.s_init, self.s_scale = scale_init(config, name)
        self.multiplier = self.s_init / self.s_scale
        self.tp_group = parallel_state.get_tensor_model_parallel_group()
        tp_size = self.tp_group.size()
        local_size = size // tp_size if partitioned else size
        if partitioned and size % tp_size:
            raise ValueError(f"{name} of size {size} does not split over {tp_size} tensor-parallel ranks")
        self.partitioned = partitioned
        self.reduce_grad_over_tp = reduce_grad_over_tp and tp_size > 1 and not partitioned
        # On the GPU like megatron-core's own parameters (the DDP buffers of the distributed optimizer
        # would move it there, plain DDP would not).
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        self.s_hat = torch.nn.Parameter(torch.full((local_size,), self.s_scale, dtype=torch.float32, device=device))
        if partitioned:
            tensor_parallel.set_tensor_model_parallel_attributes(self.s_hat, True, 0, 1)

    def _apply(self, fn, recurse=True):
        # Stay fp32 when the model is cast to bf16/fp16 (megatron-core's Float16Module casts everything),
        # with the fp32 values as they were: a round trip through bf16 would round s_hat (1/sqrt(d) at init).
        fp32 = self.s_hat.data
        super()._apply(fn, recurse)
        if self.s_hat.dtype != torch.float32:
            self.s_hat.data = fp32.to(device=self.s_hat.device)
        return self

    def surrogate(self) -> torch.Tensor:
        """s_hat, for a caller that applies `multiplier` itself (through the tensor-parallel copy whose
        backward all-reduces the gradient, with `reduce_grad_over_tp`)."""
        if self.reduce_grad_over_tp:
            return tensor_parallel.copy_to_tensor_model_parallel_region(self.s_hat, group=self.tp_group)
        return self.s_hat

    def forward(self, gain: float = 1.0) -> torch.Tensor:
        """gain * s = (gain * s_init / s_scale) * s_hat: one multiply, none where that constant is 1."""
        factor = gain * self.multiplier
        s_hat = self.surrogate()
        return s_hat if factor == 1.0 else factor * s_hat

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        return make_sharded_tensors_for_checkpoint(
            self.state_dict(prefix="", keep_vars=True),
            prefix,
            {"s_hat": 0} if self.partitioned else {},
            sharded_offsets,
            tp_group=self.tp_group,
            dp_cp_group=metadata["dp_cp_group"],
        )

    def extra_repr(self) -> str:
        return f"size={self.s_hat.numel()}, s_init={self.s_init:g}, s_scale={self.s_scale:g}"
