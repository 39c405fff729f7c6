"""megatron-core ModuleSpecs of the three families (local implementation, the CPU default)."""

from __future__ import annotations

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_layer import TransformerLayerSubmodules

from angpt.models.attention import FusedDotProductAttention
from angpt.models.config import AnGPTConfig
from angpt.models.layers import (
    FactorScaledColumnParallelLinear,
    FactorScaledRowParallelLinear,
    NormalizedDotProductAttention,
    NormalizedTransformerLayer,
    ScaledSwiGLUMLP,
)
from angpt.models.norms import RMSNorm


def normalized_layer_spec() -> ModuleSpec:
    """The anGPT / nGPT layer: every linear map carries its factor, QK-norm sits in core attention."""
    return ModuleSpec(
        module=NormalizedTransformerLayer,
        submodules=TransformerLayerSubmodules(
            self_attention=ModuleSpec(
                module=SelfAttention,
                params={"attn_mask_type": AttnMaskType.causal},
                submodules=SelfAttentionSubmodules(
                    linear_qkv=ModuleSpec(module=FactorScaledColumnParallelLinear, params={"factor": "nu_qkv"}),
                    core_attention=NormalizedDotProductAttention,
                    linear_proj=ModuleSpec(module=FactorScaledRowParallelLinear, params={"factor": "nu_p"}),
                ),
            ),
            mlp=ModuleSpec(
                module=ScaledSwiGLUMLP,
                submodules=MLPSubmodules(
                    linear_fc1=ModuleSpec(module=FactorScaledColumnParallelLinear, params={"factor": "nu_uz"}),
                    linear_fc2=ModuleSpec(module=FactorScaledRowParallelLinear, params={"factor": "nu_d"}),
                ),
            ),
        ),
    )


def gptplus_layer_spec() -> ModuleSpec:
    """megatron-core's local GPT layer with pre-RMSNorm, per-head RMSNorm QK-norm and SwiGLU."""
    spec = get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm")
    spec.submodules.input_layernorm = RMSNorm
    spec.submodules.pre_mlp_layernorm = RMSNorm
    spec.submodules.self_attention.submodules.q_layernorm = RMSNorm
    spec.submodules.self_attention.submodules.k_layernorm = RMSNorm
    spec.submodules.self_attention.submodules.core_attention = FusedDotProductAttention
    return spec


def block_spec(config: AnGPTConfig, vp_stage: int | None = None) -> TransformerBlockSubmodules:
    """The layers this pipeline stage builds, and the final norm (GPT+ only: anGPT has none)."""
    if config.normalized:
        layer, final_norm = normalized_layer_spec(), None
    else:
        layer, final_norm = gptplus_layer_spec(), RMSNorm
    return TransformerBlockSubmodules(
        layer_specs=[layer] * get_num_layers_to_build(config, vp_stage=vp_stage), layer_norm=final_norm
    )
