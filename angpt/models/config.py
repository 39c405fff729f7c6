"""Model configuration: megatron-core's TransformerConfig plus the anGPT family and its switches.

Each choice made where the paper is silent and each ablation the paper measured is one field here
(docs/model.md, Families and switches); `model_config` fills in what each family fixes (GPT+, anGPT,
nGPT) so the three share one config type.

Selective activation recompute (`recompute_granularity="selective"`, docs/guide.md, Activation recompute): the
choices of `recompute_modules` are RECOMPUTE_MODULES (angpt.config.choices, imported here for the dry run's
memory model):
- core_attn (megatron-core's): core attention, scores, softmax and context, recomputed from q, k and v; in
  anGPT and nGPT it includes their QK normalization (and RoPE), which sits inside core attention there.
- mlp (megatron-core's): the whole MLP sublayer, recomputed from its input (which the caller keeps).
- layernorm (megatron-core's): GPT+'s input_layernorm and pre_mlp_layernorm, their outputs dropped after use
  and recomputed from the residual stream (local spec only; anGPT and nGPT have no pre-norms).
- qk_norm (ours): the normalization of queries and keys, RoPE included where it is fused into it: anGPT's
  and nGPT's s_qk Norm(RoPE(q)), their outputs dropped after attention used them; GPT+'s per-head RMSNorm.
- residual_update (ours): anGPT's and nGPT's h <- Norm-based LERP update with its post-norm, recomputed from
  h and the sub-block output (refused for GPT+, whose residual is a plain add).
megatron-core checks `recompute_modules` against its own names only, so it is shown only those while it checks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Optional

import torch
from megatron.core.transformer import TransformerConfig

from angpt.config.choices import (
    FACTOR_MODES,
    MEGATRON_RECOMPUTE_MODULES,
    MODEL_FAMILIES,
    NORMALIZED_FAMILIES,
    NU_P_READINGS,
    POST_NORMS,
    RECOMPUTE_MODULES,
    RESIDUALS,
    TRANSFORMER_IMPLS,
    recompute_module_refusal,
)
from angpt.models.factors import NormalizationFactors, derive_factors


@dataclass
class AnGPTConfig(TransformerConfig):
    model_family: str = "angpt"
    # docs/model.md, Post-norm: normalize each sub-block output ("l2") or leave it to the factors ("none").
    post_norm: str = "l2"
    # docs/model.md, Normalization factors: nu_p = 1 (our reading, the default) or sqrt(h/d).
    nu_p_reading: str = "one"
    # docs/model.md, Learnable scales: initial alpha of the LERP residual; None takes the family's
    # (0.01 anGPT, 0.05 nGPT).
    alpha_init: Optional[float] = None
    # nu_qkv, nu_p, nu_uz, nu_acf, nu_d: as derived ("analytic"), all 1 ("one"), or replaced by the
    # exact 1/||x|| ("exact"); the multiplier is the x0.5 / x2 ablation.
    constant_factors: str = "analytic"
    constant_factor_multiplier: float = 1.0
    # nu(alpha) after each residual update, with the same three modes and its own multiplier.
    nu_alpha_mode: str = "analytic"
    nu_alpha_multiplier: float = 1.0
    # Gradients flow through nu(alpha) (the default) or it is treated as a constant each step.
    nu_alpha_grad: bool = True
    # The residual update: LERP with alpha (the default) or the plain sum h + x.
    residual: str = "lerp"
    # nGPT uses |alpha| in its LERP.
    alpha_abs: bool = False
    # docs/model.md, Attention: RoPE with base 10000.
    rotary_base: int = 10000
    # RoPE rotates each token by its position id rather than by its index in the sequence (Megatron-LM's
    # --reset-position-ids: the ids restart at each document; megatron-core's GPTModel rotates by index).
    rope_position_ids: bool = False
    # docs/model.md, Embedding and logits: embedding and head are untied (our reading, the default).
    share_embeddings_and_output_weights: bool = False
    # GPTModel's position embeddings (Megatron-LM's --position-embedding-type, --rotary-percent, --use-rope-scaling
    # and --max-position-embeddings, the rows of learned ones; None: the sequence length): RoPE on every channel in
    # the families of the paper, Megatron-LM's choice in gpt (docs/model.md, GPT).
    position_embedding_type: str = "rope"
    rotary_percent: float = 1.0
    use_rope_scaling: bool = False
    max_position_embeddings: Optional[int] = None
    nu_acf_samples: int = 100_000
    nu_acf_seed: int = 0
    # megatron-core defaults to Transformer Engine; this project to its own layers (angpt/models/te_specs.py).
    transformer_impl: str = "local"

    def __post_init__(self):
        for name, allowed in (
            ("model_family", MODEL_FAMILIES),
            ("post_norm", POST_NORMS),
            ("nu_p_reading", NU_P_READINGS),
            ("constant_factors", FACTOR_MODES),
            ("nu_alpha_mode", FACTOR_MODES),
            ("residual", RESIDUALS),
            ("transformer_impl", TRANSFORMER_IMPLS),
        ):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if self.fp8 and self.transformer_impl != "transformer_engine":
            raise ValueError("fp8 needs transformer_impl='transformer_engine' (FP8 GEMMs are Transformer Engine's)")
        modules = self.recompute_modules
        if self.recompute_granularity == "selective":
            for module in ["core_attn"] if modules is None else modules:  # megatron-core's default
                refusal = recompute_module_refusal(module, self.model_family, self.transformer_impl)
                if refusal:
                    raise ValueError(f"recompute_modules: {refusal}")
        if modules is not None:
            # megatron-core asserts that each name is one of its own and elsewhere only asks whether its names
            # are in the list: it checks its part, and the whole list stays (RECOMPUTE_MODULES).
            self.recompute_modules = [module for module in modules if module in MEGATRON_RECOMPUTE_MODULES]
        super().__post_init__()
        if modules is not None:
            self.recompute_modules = list(modules)

    def recomputes(self, module: str) -> bool:
        """Whether selective recompute covers `module` (one of RECOMPUTE_MODULES)."""
        assert module in RECOMPUTE_MODULES, module
        return self.recompute_granularity == "selective" and module in self.recompute_modules

    @property
    def normalized(self) -> bool:
        """anGPT and nGPT share the normalized building blocks; GPT+ and GPT use megatron-core's own."""
        return self.model_family in NORMALIZED_FAMILIES

    def normalization_factors(self) -> NormalizationFactors:
        """The constant factors in force: derived, times the multiplier, or all 1 (mode "one").
        In mode "exact" they are not used (each point divides by the actual norm)."""
        if self.constant_factors == "one":
            return NormalizationFactors(1.0, 1.0, 1.0, 1.0, 1.0)
        factors = derive_factors(
            self.hidden_size,
            self.ffn_hidden_size,
            self.num_attention_heads,
            self.kv_channels,
            self.nu_p_reading,
            self.nu_acf_samples,
            self.nu_acf_seed,
        )
        return factors.scaled(self.constant_factor_multiplier)


def _normal_init(std: float):
    def init_(tensor):
        return torch.nn.init.normal_(tensor, mean=0.0, std=std)

    return init_


def model_config(model_family: str = "angpt", **overrides) -> AnGPTConfig:
    """The config of one family with what that family fixes; `overrides` are TransformerConfig and
    AnGPTConfig fields (e.g. num_layers, hidden_size, tensor_model_parallel_size, constant_factors)."""
    if model_family not in MODEL_FAMILIES:
        raise ValueError(f"model family must be one of {MODEL_FAMILIES}, got {model_family!r}")
    known = {f.name for f in fields(AnGPTConfig)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise TypeError(f"unknown model config fields: {unknown}")
    hidden_size = overrides["hidden_size"]
    settings = dict(
        # No dropout (unless asked for) in every family.
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        use_cpu_initialization=not torch.cuda.is_available(),
    )
    if model_family == "gpt":
        # docs/model.md, GPT: megatron-core's TransformerConfig (LayerNorm, GELU, biases) and GPTModel (learned
        # positions) with Megatron-LM's defaults where they differ: the embedding tied to the output head, the
        # softmax in the parameters' precision (--attention-softmax-in-fp32 off).
        settings.update(position_embedding_type="learned_absolute", share_embeddings_and_output_weights=True,
                        attention_softmax_in_fp32=False)
    else:
        # SwiGLU MLP without biases, RMSNorm, RoPE, untied embeddings: the same in the three families of the paper.
        settings.update(gated_linear_unit=True, activation_func=torch.nn.functional.silu,
                        ffn_hidden_size=4 * hidden_size, add_bias_linear=False, normalization="RMSNorm")
    if model_family == "gptplus":
        # docs/model.md, GPT+: QK-norm (per-head RMSNorm before RoPE), softmax scale 1/sqrt(h), N(0, 0.02)
        # init with output projections at 0.02/sqrt(2L) (megatron-core's defaults).
        settings.update(qk_layernorm=True)
    elif model_family in NORMALIZED_FAMILIES:
        num_heads = overrides["num_attention_heads"]
        head_dim = overrides.get("kv_channels") or hidden_size // num_heads
        # Rows are drawn from N(0, 1) and then projected onto the unit sphere when the model is built.
        settings.update(
            softmax_scale=math.sqrt(head_dim),
            init_method=_normal_init(1.0),
            output_layer_init_method=_normal_init(1.0),
        )
    if model_family == "ngpt":
        # nGPT (docs/model.md, nGPT): no nu factors, exact normalization after each residual update, |alpha|.
        settings.update(constant_factors="one", nu_alpha_mode="exact", alpha_abs=True)
    settings.update(overrides)
    if model_family in NORMALIZED_FAMILIES and settings["hidden_dropout"]:
        # The normalized layers have no bias-dropout-add; GPTModel would drop out the embeddings alone.
        raise ValueError(f"hidden_dropout is not supported for {model_family} (GPT+ and GPT only); attention_dropout "
                         "is")
    return AnGPTConfig(model_family=model_family, **settings)
