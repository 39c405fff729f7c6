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

The list was read off the saved-tensor hooks of `benchmarks/activation_memory.py` (compiled, FlashAttention),
module by module, and each entry says why it is kept.
"""

from __future__ import annotations

from dataclasses import dataclass

from angpt.models.config import AnGPTConfig


@dataclass(frozen=True)
class Saved:
    what: str
    elements: int  # per token, before any parallel split
    region: str  # "hidden" or "tensor" (above)
    fp32: bool = False  # kept in fp32 whatever the training precision
    whole_sequence: bool = False  # gathered over the context-parallel group


def layer_saved(config: AnGPTConfig, context_parallel: int = 1, recompute_modules: tuple[str, ...] = ()
                ) -> list[Saved]:
    """The tensors one layer of `config`'s family keeps for backward (module docstring), with the regions of
    `--recompute-granularity selective --recompute-modules` recomputed. A recomputed region keeps its inputs
    (megatron-core's checkpoint), so it frees only what it makes inside: GPT+'s QK-norm and RoPE precede
    core attention, whose recompute then frees only the log-sum-exp; anGPT's and nGPT's QK normalization
    and RoPE run inside it, so `core_attn` (or `qk_norm`) frees the normalized queries and keys."""
    recomputes = set(recompute_modules)
    h = config.hidden_size
    head_dim = config.kv_channels or h // config.num_attention_heads
    q = config.num_attention_heads * head_dim
    kv = (config.num_query_groups or config.num_attention_heads) * head_dim
    ffn = config.ffn_hidden_size
    gathered = context_parallel > 1 and "core_attn" not in recomputes
    kept = [
        Saved("the QKV projection's output (the QK normalization's input; the values are a view of it)", q + 2 * kv,
              "tensor"),
        Saved("core attention's output (the output projection's input)", q, "tensor"),
    ]
    if "core_attn" not in recomputes:
        kept.append(Saved("the softmax's log-sum-exp per head", config.num_attention_heads, "tensor", fp32=True))
    if not (config.normalized and recomputes & {"core_attn", "qk_norm"}):
        kept.append(Saved("queries, normalized and rotated", q, "tensor"))
        if not gathered:
            kept.append(Saved("keys, normalized and rotated", kv, "tensor"))
    if gathered:  # all-gathered in core attention: the whole sequence's keys and values on every CP rank
        kept.append(Saved("keys and values, gathered over the context-parallel group", 2 * kv, "tensor",
                          whole_sequence=True))
    if kv < q:  # grouped keys and values: megatron-core copies the queries out of the grouped QKV layout
        kept.append(Saved("queries, copied out of the grouped QKV layout", q, "tensor"))
    if "mlp" not in recomputes:
        kept.append(Saved("the MLP's first projection's output", (2 if config.gated_linear_unit else 1) * ffn,
                          "tensor"))
        kept.append(Saved("the MLP's second projection's input (the activation's output)", ffn, "tensor"))
    if config.normalized:
        kept.append(Saved("the QKV projection's input (the residual stream)", h, "hidden"))
        kept.append(Saved("the MLP's first projection's input (the residual stream)", h, "hidden"))
        kept.append(Saved("the two residual updates' inputs", 2 * h, "hidden"))
        if config.model_family == "ngpt" and "residual_update" not in recomputes:
            kept.append(Saved("the exact normalizations' intermediates, one per update", 2 * h, "hidden"))
    else:
        kept.append(Saved("the input and pre-MLP RMSNorms' inputs", 2 * h, "hidden"))
        if "layernorm" not in recomputes:
            kept.append(Saved("the QKV and MLP projections' inputs (the RMSNorms' outputs)", 2 * h, "hidden"))
    return kept


def layer_bytes(config: AnGPTConfig, tokens: int, tensor_parallel: int = 1, sequence_parallel: bool = False,
                context_parallel: int = 1, recompute_modules: tuple[str, ...] = (),
                bytes_per_element: int = 2) -> float:
    """Bytes one layer keeps on one rank for a micro-batch of `tokens` tokens (micro-batch x sequence length,
    before the context-parallel split), activations of `bytes_per_element` bytes (2 for BF16/FP16)."""
    total = 0.0
    for saved in layer_saved(config, context_parallel, recompute_modules):
        elements = saved.elements * tokens / (1 if saved.whole_sequence else context_parallel)
        if saved.region == "tensor" or sequence_parallel:
            elements /= tensor_parallel
        total += elements * (4 if saved.fp32 else bytes_per_element)
    return total
