"""Transformer Engine (TE) layer specs of the families: `transformer_impl="transformer_engine"`.

The layers are the local specs' (angpt/models/specs.py) with TE's modules in the implementation-specific
places, so that FP8 (TE's `fp8_autocast`, entered per layer by megatron-core's TransformerBlock) reaches
their GEMMs:

- anGPT / nGPT: `normalized_layer_spec` with TEColumnParallelLinear (W_qkv, W_uz) and TERowParallelLinear
  (W_p, W_d) carrying the anGPT factor mixins, and TEDotProductAttention (FlashAttention / cuDNN) behind the
  same QK normalization as the local spec (s_qk Norm(q), s_qk Norm(k) after RoPE, softmax scale
  config.softmax_scale = sqrt(h)). Parameter names are the local spec's, so checkpoints and the
  bounded-weight projection (which finds weights by their `unit_norm_dim`) treat both alike.
- GPT+: megatron-core's own TE spec with QK-norm: the pre-attention and pre-MLP RMSNorms fused into the
  QKV and fc1 GEMMs (TELayerNormColumnParallelLinear), TENorm for the per-head QK-norm and the final norm.
- GPT: megatron-core's own TE spec as Megatron-LM builds it (`te_gpt_layer_spec`).

Where the normalization factors go on the TE path (TE's linear layers have no output scale; docs/model.md,
Fused kernels):
- nu_uz and nu_acf: inside the fused SwiGLU kernel (angpt.kernels.scaled_swiglu, CUDA), no extra pass.
- nu_p: 1 by default (docs/model.md, Normalization factors), no pass; the sqrt(h/d) reading costs one pass
  over the d outputs.
- nu_qkv: one extra elementwise pass over the QKV GEMM output (3d per token with full attention).
- nu_d: one extra elementwise pass over the fc2 output (d per token).
  With the l2 post-norm, nu_p and nu_d (and nu_qkv on q and k, under the exact QK-norm) cancel exactly and
  could be dropped; they are kept so that hooks, the x0.5 / x2 and post-norm "none" ablations behave the
  same in both implementations.
- nu(alpha), s_qk, the post-norm and the LERP residual: the same torch element-wise ops as the local spec,
  in BF16/FP32 (never FP8).
"""

from __future__ import annotations

import functools
from typing import Optional

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
from megatron.core.transformer.spec_utils import ModuleSpec

from angpt.config.transformer_engine_support import require_transformer_engine
from angpt.models.config import AnGPTConfig
from angpt.models.layers import FactorScaledColumn, FactorScaledRow, QKNormalization
from angpt.models.specs import NormalizedModules, normalized_layer_spec


def compose_normalized_modules(column_base: type, row_base: type, attention_base: type) -> NormalizedModules:
    """The normalized layer's modules on any implementation's column-parallel linear, row-parallel linear
    and core attention: the same anGPT mixins as the local spec, on other bases."""

    def compose(mixin: type, base: type, what: str) -> type:
        return type(f"{mixin.__name__}{base.__name__}", (mixin, base),
                    {"__module__": __name__, "__doc__": f"{base.__name__} with {what} ({mixin.__name__})."})

    return NormalizedModules(
        compose(FactorScaledColumn, column_base, "its output scaled by a normalization factor"),
        compose(FactorScaledRow, row_base, "its reduced output scaled by a normalization factor"),
        compose(QKNormalization, attention_base, "anGPT's QK normalization"),
    )


@functools.cache
def te_normalized_modules() -> NormalizedModules:
    require_transformer_engine()
    from megatron.core.extensions.transformer_engine import (  # noqa: PLC0415 (optional: Transformer Engine)
        TEColumnParallelLinear,
        TEDotProductAttention,
        TERowParallelLinear,
    )

    return compose_normalized_modules(TEColumnParallelLinear, TERowParallelLinear, TEDotProductAttention)


def te_gptplus_layer_spec() -> ModuleSpec:
    """megatron-core's TE GPT layer with QK-norm (RMSNorm from config.normalization, SwiGLU from the config)."""
    require_transformer_engine()
    return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=True)


def te_gpt_layer_spec(config: AnGPTConfig) -> ModuleSpec:
    """GPT's layer on Transformer Engine: megatron-core's TE GPT layer as Megatron-LM's gpt_builders asks for it
    (the norms from config.normalization, fused into the QKV and fc1 GEMMs)."""
    require_transformer_engine()
    return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=config.qk_layernorm, qk_l2_norm=config.qk_l2_norm)


def layer_and_final_norm(config: AnGPTConfig) -> tuple[ModuleSpec, Optional[type]]:
    """(the layer spec, the final norm or None) of the config's family on Transformer Engine."""
    require_transformer_engine()
    if config.normalized:
        return normalized_layer_spec(te_normalized_modules()), None
    from megatron.core.extensions.transformer_engine import TENorm  # noqa: PLC0415 (optional: Transformer Engine)

    return te_gptplus_layer_spec(), TENorm
