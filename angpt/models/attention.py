"""Core attention of the local specs: megatron-core's DotProductAttention, or torch's fused kernels.

megatron-core's local DotProductAttention stores the [batch, heads, s, s] scores and probabilities (in fp32
for the softmax): at context 2048 that is most of a layer's activation memory and time on a GPU. With
`attention_backend` flash (or auto on a GPU), the same attention runs through
`torch.nn.functional.scaled_dot_product_attention`, which picks FlashAttention-2 or the memory-efficient
kernel and never materializes the scores. auto keeps megatron's unfused path on CPU, so CPU runs stay
bit-identical to megatron's local spec; flash forces torch's kernels everywhere.
"""

from __future__ import annotations

import contextlib
import os

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.models.common.embeddings import rope_utils
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnBackend, AttnMaskType

from angpt.kernels import fused_on_gpu


def clear_attention_backend_environment() -> None:
    """megatron-core exports each model's attention backend as NVTE_FLASH_ATTN / NVTE_FUSED_ATTN /
    NVTE_UNFUSED_ATTN and refuses to build a model of another backend in the same process. A training job
    builds one; benchmarks and tests that build several clear them before each build."""
    for name in ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN"):
        os.environ.pop(name, None)


def uses_fused_attention(backend: AttnBackend, device: torch.device) -> bool:
    """Whether core attention runs through scaled_dot_product_attention for this backend and device."""
    if backend == AttnBackend.flash:
        return True
    return backend == AttnBackend.auto and device.type == "cuda"


class FusedDotProductAttention(DotProductAttention):
    """softmax(scale q k^T + causal mask) v in megatron-core's layout ([s, b, heads, head_dim] in,
    [s, b, heads * head_dim] out), through torch's fused kernels where `uses_fused_attention` says so. A given
    attention_mask ([b, 1, s, s], True where masked out, causal itself: megatron-core's GPTDataset's with
    reset_attention_mask) replaces the causal mask, as in megatron-core's softmax."""

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        mask_type = attn_mask_type or self.attn_mask_type
        fusable = (
            uses_fused_attention(self.config.attention_backend, query.device)
            and mask_type == AttnMaskType.causal
            and attention_bias is None
            and packed_seq_params is None
            and self.softmax_offset is None
            and self.config.window_size is None
            and not self.config.apply_query_key_layer_scaling
        )
        if not fusable:
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias,
                                   packed_seq_params)
        # [s, b, heads, head_dim] -> [b, heads, s, head_dim]; grouped keys and values are broadcast by SDPA.
        query, key, value = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        dropout_p = self.attention_dropout.p if self.training else 0.0
        # As megatron's unfused path: the mask comes from the model-parallel RNG tracker (TP ranks hold
        # different heads, which need different masks), except under sequence parallelism.
        forked = dropout_p > 0 and not self.config.sequence_parallel
        with tensor_parallel.get_cuda_rng_tracker().fork() if forked else contextlib.nullcontext():
            context = F.scaled_dot_product_attention(
                query, key, value, attn_mask=None if attention_mask is None else ~attention_mask,
                is_causal=attention_mask is None, scale=self.softmax_scale, dropout_p=dropout_p,
                enable_gqa=key.shape[1] != query.shape[1],
            )
        sequence, batch = context.shape[2], context.shape[0]
        return context.permute(2, 0, 1, 3).reshape(sequence, batch, -1)


def rope(t: torch.Tensor, freqs: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """megatron-core's RoPE of t [s, b, heads, head_dim] by the angles freqs [s, 1, 1, rotary_dim] (cos and sin
    of the angles, the rotated half, the pass-through part)."""
    return rope_utils._apply_rotary_pos_emb_bshd(t, freqs, rotary_interleaved=interleaved)


@fused_on_gpu
def _rotary(t: torch.Tensor, freqs: torch.Tensor, interleaved: bool) -> torch.Tensor:
    # torch.compile turns megatron-core's RoPE into one kernel forward and one backward: the angles' cos and
    # sin are computed in registers, never written out, and rotate_half's negation and concatenation are
    # index arithmetic.
    return rope(t, freqs, interleaved)


def fused_rotary_pos_emb(t: torch.Tensor, freqs: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """RoPE of t [s, b, heads, head_dim] by the angles freqs [s, 1, 1, rotary_dim]: what megatron-core's
    `apply_rope_fusion` calls where Transformer Engine's fused RoPE is missing (megatron_compat.patches),
    compiled on CUDA tensors, megatron-core's eager function elsewhere."""
    return _rotary(t, freqs, interleaved)
