"""Gradient-accumulation fusion without apex.

megatron-core's linear layers with `gradient_accumulation_fusion` (which --defer-embedding-wgrad-compute needs)
accumulate each weight gradient into the weight's `main_grad` through apex's `fused_weight_gradient_mlp_cuda`
extension, and refuse to build without it. Where apex is not installed (the CPU; GPUs without apex), `install`
puts torch's addmm in its place: main_grad += grad_output^T input, 16-bit operands widened to main_grad's dtype
(exactly) and accumulated in it, as apex's GEMM accumulates bf16 products in fp32.
"""

from __future__ import annotations

import importlib.util
import sys
import types

import torch
from megatron.core.tensor_parallel import layers

APEX_MODULE = "fused_weight_gradient_mlp_cuda"


def wgrad_gemm_accum(input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    """apex's wgrad_gemm_accum_fp32 and _fp16: input [tokens, in], grad_output [tokens, out], main_grad [out, in]."""
    main_grad.addmm_(grad_output.t().to(main_grad.dtype), input.to(main_grad.dtype))


def install() -> None:
    """Stand in for apex's extension where it is missing (megatron-core imports it at import time, and its pipeline
    flush imports it again by name)."""
    if APEX_MODULE in sys.modules or importlib.util.find_spec(APEX_MODULE) is not None:
        return
    module = types.ModuleType(APEX_MODULE, "angpt.megatron_compat.wgrad_fusion's stand-in for apex's extension")
    module.wgrad_gemm_accum_fp32 = module.wgrad_gemm_accum_fp16 = wgrad_gemm_accum
    sys.modules[APEX_MODULE] = module
    layers.fused_weight_gradient_mlp_cuda = module
    layers._grad_accum_fusion_available = True
