"""What each family's transformer layer keeps for its backward pass, per token, on the GPU's code path.

The tensors are those autograd saves in one layer of angpt/models/layers.py with the fused chains compiled
(angpt.kernels, as on a GPU) and core attention through FlashAttention (torch's SDPA or Transformer
Engine's, which keep their inputs, output and the softmax's log-sum-exp rather than the [s, s] scores).
`benchmarks/activation_memory.py` measures the same with saved-tensor hooks; tests/test_memory_estimate.py
holds the two within 10%. Each entry is counted once even where several functions save it (autograd
keeps one storage).

Where each tensor lives decides how parallelism divides it:
- "hidden": the residual stream's width h. Tensor parallelism replicates it, unless sequence parallelism
  splits its tokens over the TP ranks (megatron-core's column-parallel layers then keep their input
  scattered and gather it again in backward).
- "tensor": heads or the MLP's width, split over the TP ranks.
- Context parallelism splits every token dimension over the CP ranks, except the keys and values core
  attention keeps after all-gathering them over the CP group (the whole sequence on every CP rank).

`recompute` names the `--recompute-modules` choice that discards a tensor: the region recomputes it in the
backward pass from inputs that are kept anyway.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from angpt.models.config import AnGPTConfig


@dataclass(frozen=True)
class Saved:
    what: str
    elements: int  # per token, before any parallel split
    region: str  # "hidden" or "tensor" (above)
    fp32: bool = False  # kept in fp32 whatever the training precision
    whole_sequence: bool = False  # gathered over the context-parallel group
    context_parallel_only: bool = False  # exists only with context parallelism
    recompute: Optional[str] = None


def layer_saved(config: AnGPTConfig) -> list[Saved]:
    """The tensors one layer of `config`'s family keeps for backward (module docstring)."""
    h = config.hidden_size
    head_dim = config.kv_channels or h // config.num_attention_heads
    q = config.num_attention_heads * head_dim
    kv = (config.num_query_groups or config.num_attention_heads) * head_dim
    ffn = config.ffn_hidden_size
    saved = [
        Saved("the QKV projection's input", h, "hidden", recompute="layernorm" if not config.normalized else None),
        Saved("the QKV projection's output (input of the QK normalization and RoPE)", q + 2 * kv, "tensor",
              recompute="qk_norm"),
        Saved("queries, normalized and rotated", q, "tensor", recompute="core_attn"),
        Saved("keys, normalized and rotated", kv, "tensor", whole_sequence=True, recompute="core_attn"),
        # Without context parallelism the values are a view of the QKV output; with it, a gathered copy.
        Saved("values, gathered over the context-parallel group", kv, "tensor", whole_sequence=True,
              context_parallel_only=True, recompute="core_attn"),
        Saved("core attention's output (the output projection's input)", q, "tensor"),
        Saved("the softmax's log-sum-exp per head", config.num_attention_heads, "tensor", fp32=True,
              recompute="core_attn"),
        Saved("the MLP's first projection's input", h, "hidden", recompute="layernorm" if not config.normalized
              else None),
        Saved("the MLP's first projection's output", (2 if config.gated_linear_unit else 1) * ffn, "tensor",
              recompute="mlp"),
        Saved("the MLP's second projection's input (the activation's output)", ffn, "tensor", recompute="mlp"),
    ]
    if kv < q:
        # Grouped keys and values: megatron-core copies the queries out of the grouped QKV layout.
        saved.append(Saved("queries, copied out of the grouped QKV layout", q, "tensor", recompute="qk_norm"))
    if config.normalized:
        # anGPT keeps one [tokens, h] tensor per residual update, nGPT (exact normalization) two.
        per_update = 2 if config.model_family == "ngpt" else 1
        for sublayer in ("attention", "MLP"):
            saved.append(Saved(f"the {sublayer} residual update's inputs", per_update * h, "hidden",
                               recompute="residual_update"))
    else:
        for norm in ("input", "pre-MLP"):
            saved.append(Saved(f"the {norm} RMSNorm's input", h, "hidden"))
    return saved


def layer_bytes(config: AnGPTConfig, tokens: int, tensor_parallel: int = 1, sequence_parallel: bool = False,
                context_parallel: int = 1, recompute_modules: tuple[str, ...] = (),
                bytes_per_element: int = 2) -> float:
    """Bytes one layer keeps on one rank for a micro-batch of `tokens` tokens (micro-batch x sequence length,
    before the context-parallel split), activations of `bytes_per_element` bytes (2 for BF16/FP16)."""
    total = 0.0
    for saved in layer_saved(config):
        if saved.recompute in recompute_modules or (saved.context_parallel_only and context_parallel == 1):
            continue
        elements = saved.elements * tokens / (1 if saved.whole_sequence else context_parallel)
        if saved.region == "tensor" or sequence_parallel:
            elements /= tensor_parallel
        total += elements * (4 if saved.fp32 else bytes_per_element)
    return total
