"""megatron-core ModuleSpecs of the families.

`transformer_impl` "local" (the default, and the CPU path) builds them from megatron-core's own layers;
"transformer_engine" from Transformer Engine's (angpt/models/te_specs.py), with the same anGPT building
blocks around them: one layer structure per family, only the linear layers, core attention and norms differ.
"""

from __future__ import annotations

from typing import NamedTuple

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.attention import SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import TransformerLayerSubmodules

from angpt.models.attention import FusedDotProductAttention
from angpt.models.config import AnGPTConfig
from angpt.models.layers import (
    FactorScaledColumnParallelLinear,
    FactorScaledRowParallelLinear,
    NormalizedDotProductAttention,
    NormalizedSelfAttention,
    NormalizedTransformerLayer,
    ScaledSwiGLUMLP,
)
from angpt.models.norms import RMSNorm


class NormalizedModules(NamedTuple):
    """The implementation-specific modules of the normalized layer."""

    column_linear: type  # W_qkv, W_uz: a column-parallel linear layer with a `factor` (FactorScaledColumn)
    row_linear: type  # W_p, W_d: a row-parallel linear layer with a `factor` (FactorScaledRow)
    core_attention: type  # QK-normalized core attention (QKNormalization)


LOCAL_NORMALIZED_MODULES = NormalizedModules(
    FactorScaledColumnParallelLinear, FactorScaledRowParallelLinear, NormalizedDotProductAttention
)


def normalized_layer_spec(modules: NormalizedModules = LOCAL_NORMALIZED_MODULES) -> ModuleSpec:
    """The anGPT / nGPT layer: every linear map carries its factor, QK-norm sits in core attention."""
    column, row, core_attention = modules
    return ModuleSpec(
        module=NormalizedTransformerLayer,
        submodules=TransformerLayerSubmodules(
            self_attention=ModuleSpec(
                module=NormalizedSelfAttention,
                params={"attn_mask_type": AttnMaskType.causal},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=ModuleSpec(module=column, params={"factor": "nu_qkv"}),
                    core_attention=core_attention,
                    linear_proj=ModuleSpec(module=row, params={"factor": "nu_p"}),
                ),
            ),
            mlp=ModuleSpec(
                module=ScaledSwiGLUMLP,
                submodules=MLPSubmodules(
                    linear_fc1=ModuleSpec(module=column, params={"factor": "nu_uz"}),
                    linear_fc2=ModuleSpec(module=row, params={"factor": "nu_d"}),
                ),
            ),
        ),
    )


def gptplus_layer_spec() -> ModuleSpec:
    """megatron-core's local GPT layer with pre-RMSNorm, per-head RMSNorm QK-norm and SwiGLU."""
    spec = get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm")
    spec.submodules.input_layernorm = RMSNorm
    spec.submodules.pre_mlp_layernorm = RMSNorm
    qk_norm = ModuleSpec(module=RMSNorm, params={"qk_norm": True})
    spec.submodules.self_attention.submodules.q_layernorm = qk_norm
    spec.submodules.self_attention.submodules.k_layernorm = qk_norm
    spec.submodules.self_attention.submodules.core_attention = FusedDotProductAttention
    return spec


def gpt_layer_spec(config: AnGPTConfig) -> ModuleSpec:
    """GPT's layer: megatron-core's local GPT layer as Megatron-LM's gpt_builders asks for it (its QK-norm and its
    norms from the flags; no --qk-l2-norm, which it hands to the Transformer Engine spec only), with core attention
    through torch's fused kernels where the attention backend says so (FusedDotProductAttention; megatron-core's own
    unfused attention on CPU by default)."""
    spec = get_gpt_layer_local_spec(qk_layernorm=config.qk_layernorm, normalization=config.normalization)
    spec.submodules.self_attention.submodules.core_attention = FusedDotProductAttention
    return spec
