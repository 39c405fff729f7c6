"""The values each enumerated model setting may take: one place for the model config's checks
(angpt.models.config) and the command line's choices (angpt.config.arguments). It imports nothing, so that the
command line parses (and `--help` prints) before torch and megatron-core are loaded.
"""

MODEL_FAMILIES = ("angpt", "gptplus", "ngpt", "gpt")
# As the paper writes them; "gpt" is megatron-core's GPT as Megatron-LM's pretrain_gpt.py builds it.
FAMILY_NAMES = {"angpt": "anGPT", "gptplus": "GPT+", "ngpt": "nGPT", "gpt": "GPT"}
# The families built of angpt's normalized blocks (angpt/models/layers.py); GPT+ and GPT are megatron-core's layers.
NORMALIZED_FAMILIES = ("angpt", "ngpt")
# What each family is, as the model card of a Hugging Face export says it (angpt.hf.model_card).
FAMILY_DESCRIPTIONS = {
    "angpt": "anGPT (the Approximately Normalized GPT; Franke et al., NeurIPS 2025, arXiv 2505.22014)",
    "gptplus": "GPT+ (a pre-norm GPT with RMSNorm, RoPE, SwiGLU and QK-norm: the block of Qwen3)",
    "ngpt": "nGPT (the normalized Transformer; Loshchilov et al., ICLR 2025)",
    "gpt": "GPT (megatron-core's GPT as Megatron-LM's pretrain_gpt.py builds it from its flags)",
}
# The normalization factors: as derived, all 1, or the exact 1/||x|| (docs/model.md, Normalization factors).
FACTOR_MODES = ("analytic", "one", "exact")
# The two readings of nu_p (docs/model.md, Normalization factors).
NU_P_READINGS = ("one", "sqrt_h_over_d")
POST_NORMS = ("l2", "none")
RESIDUALS = ("lerp", "plain")
# megatron-core's layers ("local", the default and the CPU path) or Transformer Engine's (GPU, needed for FP8).
TRANSFORMER_IMPLS = ("local", "transformer_engine")
# Megatron-LM's choices of --normalization and --position-embedding-type (core_v0.16.1), and its defaults, which
# --model-family gpt takes when they are not given (the other families have their own).
NORMALIZATIONS = ("LayerNorm", "RMSNorm")
POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope", "mrope", "relative", "none")
GPT_DEFAULTS = dict(normalization="LayerNorm", position_embedding_type="learned_absolute")
# The weights' dtype of a Hugging Face export (tools/convert_to_hf.py).
EXPORT_DTYPES = ("float32", "bfloat16")
# --recompute-modules of --recompute-granularity selective (docs/guide.md, Activation recompute): megatron-core's
# names (core attention, the MLP sublayer, GPT+'s pre-norms), then ours (the QK normalization, the normalized
# residual update of anGPT and nGPT). angpt/models/config.py hands megatron-core only its own.
RECOMPUTE_MODULES = ("core_attn", "mlp", "layernorm", "qk_norm", "residual_update")
MEGATRON_RECOMPUTE_MODULES = ("core_attn", "mlp", "layernorm")
# --cuda-graph-scope: megatron-core's CudaGraphScope names, and "full", Megatron-LM's deprecated name of no scope.
CUDA_GRAPH_SCOPES = ("full", "full_iteration", "attn", "mlp", "moe", "moe_router", "moe_preprocess", "mamba")
MOE_CUDA_GRAPH_SCOPES = ("moe", "moe_router", "moe_preprocess")
# --offload-modules of --fine-grained-activation-offloading: megatron-core's names (TransformerConfig's check), the
# MoE ones last (refused here: the models are dense).
OFFLOAD_MODULES = ("attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm", "expert_fc1", "moe_act")
MOE_OFFLOAD_MODULES = ("expert_fc1", "moe_act")


def recompute_module_refusal(module: str, model_family: str, transformer_impl: str = "local") -> str | None:
    """Why `module` cannot be recomputed selectively in this family and implementation, or None if it can."""
    name = FAMILY_NAMES[model_family]
    if module not in RECOMPUTE_MODULES:
        return f"{module!r} is not one of {', '.join(RECOMPUTE_MODULES)}"
    if module == "layernorm" and model_family in NORMALIZED_FAMILIES:
        return (f"{name} has no pre-norms (input_layernorm, pre_mlp_layernorm); its norms are qk_norm and "
                "residual_update")
    if module == "layernorm" and transformer_impl == "transformer_engine":
        return (f"Transformer Engine fuses {name}'s pre-norms into the QKV and fc1 GEMMs: there is no norm output to "
                "drop")
    if module == "qk_norm" and model_family == "gptplus" and transformer_impl == "transformer_engine":
        return "GPT+'s QK-norm on Transformer Engine is megatron-core's TENorm, which angpt does not wrap"
    if module == "qk_norm" and model_family == "gpt":
        return "GPT's QK-norm is megatron-core's own norm module, which angpt does not wrap"
    if module == "residual_update" and model_family not in NORMALIZED_FAMILIES:
        return f"{name}'s residual is a plain add, which keeps nothing for its backward pass"
    return None
