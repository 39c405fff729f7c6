"""Transformer Engine (TE) layer specs of the three families: `transformer_impl="transformer_engine"`.

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

Where the normalization factors go on the TE path (TE's linear layers have no output scale):
- nu_uz and nu_acf: inside the fused SwiGLU kernel (angpt.kernels.scaled_swiglu, CUDA), no extra pass.
- nu_p: 1 by default (spec section 2), no pass; the sqrt(h/d) reading costs one pass over the d outputs.
- nu_qkv: one extra elementwise pass over the QKV GEMM output (3d per token with full attention).
- nu_d: one extra elementwise pass over the fc2 output (d per token).
  With the l2 post-norm, nu_p and nu_d (and nu_qkv on q and k, under the exact QK-norm) cancel exactly and
  could be dropped; they are kept so that hooks, the x0.5 / x2 and post-norm "none" ablations behave the
  same in both implementations.
- nu(alpha), s_qk, the post-norm and the LERP residual: the same torch element-wise ops as the local spec,
  in BF16/FP32 (never FP8).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

from megatron.core.transformer.spec_utils import ModuleSpec

from angpt.models.config import AnGPTConfig
from angpt.models.layers import FactorScaledColumn, FactorScaledRow, QKNormalization
from angpt.models.specs import NormalizedModules, normalized_layer_spec

FLAG = "--transformer-impl transformer_engine"


class TransformerEngineUnavailable(ImportError):
    """Transformer Engine was asked for and is not importable."""


@functools.cache
def transformer_engine_error() -> Optional[str]:
    """Why Transformer Engine's PyTorch package cannot be used here, or None when it can."""
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as error:  # ImportError, or an OSError of a missing CUDA / cuDNN library
        return f"{type(error).__name__}: {error}"
    return None


def unavailable_message(flag: str = FLAG, error: Optional[str] = None) -> str:
    error = error or transformer_engine_error()
    return (f"{flag} needs NVIDIA Transformer Engine, which is not importable here ({error}). Install it on "
            "a machine with CUDA and a CUDA build of torch (`pip install --no-build-isolation "
            "transformer-engine[pytorch]`, or `pip install -e '.[gpu]'`), or use the NGC PyTorch container "
            "of docker/Dockerfile, which has it; otherwise use --transformer-impl local (the default).")


def require_transformer_engine(flag: str = FLAG) -> None:
    """Raise TransformerEngineUnavailable, naming `flag` and what to install, unless TE is importable."""
    error = transformer_engine_error()
    if error is not None:
        raise TransformerEngineUnavailable(unavailable_message(flag, error))


# The Transformer Engine release from which megatron-core 0.16 builds each recipe (megatron.core.fp8_utils).
FP8_RECIPE_MIN_TE = {"delayed": None, "tensorwise": "2.2.0.dev0", "mxfp8": "2.1.0"}


def fp8_recipe_problem(recipe: str) -> Optional[str]:
    """Why the installed Transformer Engine or this GPU cannot run FP8 with `recipe`, or None. Checked at
    run time: FP8 GEMMs need compute capability 8.9 (Ada, Hopper) or newer, MXFP8 10.0 (Blackwell)."""
    import torch

    error = transformer_engine_error()
    if error is not None:
        return unavailable_message(error=error)
    from megatron.core.utils import get_te_version, is_te_min_version

    minimum = FP8_RECIPE_MIN_TE[recipe]
    if minimum and not is_te_min_version(minimum):
        return f"needs Transformer Engine >= {minimum} (installed: {get_te_version()})"
    if recipe == "mxfp8":
        import transformer_engine.common.recipe as te_recipe

        if not hasattr(te_recipe, "MXFP8BlockScaling"):
            return "the installed Transformer Engine has no MXFP8BlockScaling recipe"
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        needed = (10, 0) if recipe == "mxfp8" else (8, 9)
        if (major, minor) < needed:
            what = "MXFP8 needs Blackwell" if recipe == "mxfp8" else "FP8 needs Ada, Hopper or newer"
            return (f"{what} (compute capability >= {needed[0]}.{needed[1]}); this GPU has compute capability "
                    f"{major}.{minor}")
    return None


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
    from megatron.core.extensions.transformer_engine import (
        TEColumnParallelLinear,
        TEDotProductAttention,
        TERowParallelLinear,
    )

    return compose_normalized_modules(TEColumnParallelLinear, TERowParallelLinear, TEDotProductAttention)


def te_gptplus_layer_spec() -> ModuleSpec:
    """megatron-core's TE GPT layer with QK-norm (RMSNorm from config.normalization, SwiGLU from the config)."""
    require_transformer_engine()
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

    return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=True)


def layer_and_final_norm(config: AnGPTConfig) -> tuple[ModuleSpec, Optional[type]]:
    """(the layer spec, the final norm or None) of the config's family on Transformer Engine."""
    require_transformer_engine()
    if config.normalized:
        return normalized_layer_spec(te_normalized_modules()), None
    from megatron.core.extensions.transformer_engine import TENorm

    return te_gptplus_layer_spec(), TENorm


def build_model_with_impl(config: AnGPTConfig, vocab_size: int, max_sequence_length: int,
                          transformer_impl: Optional[str] = None, **kwargs):
    """One pipeline stage of the config's family in `transformer_impl` ("local" or "transformer_engine";
    None keeps the config's), as angpt.models.build_model builds it (kwargs: pre_process, post_process,
    vp_stage, parallel_output). For benchmarks and comparisons of the two implementations."""
    from angpt.models.gpt import build_model

    if transformer_impl is not None and transformer_impl != config.transformer_impl:
        config = dataclasses.replace(config, transformer_impl=transformer_impl)
    if config.transformer_impl == "transformer_engine":
        require_transformer_engine()
    return build_model(config, vocab_size, max_sequence_length, **kwargs)
