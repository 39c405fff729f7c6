"""Core attention of the local specs: megatron-core's DotProductAttention, or torch's fused kernels.

megatron-core's local DotProductAttention stores the [batch, heads, s, s] scores and probabilities (in fp32
for the softmax): at context 2048 that is most of a layer's activation memory and time on a GPU. With
`attention_backend` flash (or auto on a GPU), the same attention runs through
`torch.nn.functional.scaled_dot_product_attention`, which picks FlashAttention-2 or the memory-efficient
kernel and never materializes the scores. auto keeps megatron's unfused path on CPU, so CPU runs stay
bit-identical to megatron's local spec; flash forces torch's kernels everywhere, but under
batch_invariant_mode.
"""

from __future__ import annotations

import contextlib
import copy
import os

import torch
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.models.common.embeddings import rope_utils
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnBackend, AttnMaskType
from torch.nn.attention.bias import CausalBias, causal_lower_right

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
    reset_attention_mask) replaces the causal mask, as in megatron-core's softmax.

    With context parallelism (context_parallel_size N > 1) each rank holds chunks i and 2N-1-i of the 2N
    chunks of the sequence (megatron-core's `get_batch_on_this_cp_rank`): Megatron-LM's `--cp-comm-type
    all_gather`, the only one built here. Keys and values are all-gathered over the CP group (their gradients
    reduce-scattered back) and put in sequence order, and each query chunk attends to the keys up to its own
    end with its causal mask (or its rows of the given attention_mask). megatron-core's local attention has
    no CP path and asserts CP == 1: it is built with a copy of the config that says 1."""

    def __init__(self, config, *args, cp_comm_type=None, **kwargs):
        if config.context_parallel_size > 1 and cp_comm_type != "all_gather":
            raise ValueError(f"context parallelism in the local spec is all_gather (got cp_comm_type "
                             f"{cp_comm_type!r}): pass --cp-comm-type all_gather, or use --transformer-impl "
                             "transformer_engine")
        local = copy.copy(config)
        local.context_parallel_size = 1
        super().__init__(local, *args, cp_comm_type=cp_comm_type, **kwargs)
        self.config = config
        self.cp_group = getattr(self.pg_collection, "cp", None) or parallel_state.get_context_parallel_group()

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if self.config.context_parallel_size == 1:
            return self._attend(query, key, value, attention_mask, attn_mask_type, attention_bias, packed_seq_params)
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("context parallelism in the local spec takes no packed sequences or attention bias")
        key, value = (_gather_in_sequence_order(t, self.cp_group) for t in (key, value))
        size, rank = self.cp_group.size(), self.cp_group.rank()
        chunk = query.shape[0] // 2
        outputs = []
        for half, index in enumerate((rank, 2 * size - 1 - rank)):
            rows, end = slice(half * chunk, (half + 1) * chunk), (index + 1) * chunk  # keys [0, end) are visible
            if attention_mask is None:
                mask = causal_lower_right(chunk, end)
            else:  # this chunk's rows of the [b, 1, 2 chunk, s] mask (get_batch_on_this_cp_rank split its rows)
                mask = attention_mask[:, :, rows, :end]
            outputs.append(self._attend(query[rows], key[:end], value[:end], mask, attn_mask_type))
        return torch.cat(outputs)

    def _attend(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        """`attention_mask`: None (causal), a bool mask (True: masked out) or torch's lower-right causal bias."""
        mask_type = attn_mask_type or self.attn_mask_type
        fusable = (
            uses_fused_attention(self.config.attention_backend, query.device)
            # --batch-invariant-mode: megatron-core's own attention, as Megatron-LM's local spec runs it (torch's
            # kernels take no num_splits, which megatron-core sets to 1 for Transformer Engine's in this mode).
            and not self.config.batch_invariant_mode
            and mask_type == AttnMaskType.causal
            and attention_bias is None
            and packed_seq_params is None
            and self.softmax_offset is None
            and self.config.window_size is None
            and not self.config.apply_query_key_layer_scaling
        )
        if not fusable:
            if isinstance(attention_mask, CausalBias):  # megatron-core's softmax takes bool masks
                rows, columns = attention_mask.seq_len_q, attention_mask.seq_len_kv
                attention_mask = torch.ones(rows, columns, dtype=torch.bool, device=query.device).triu(
                    columns - rows + 1)
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias,
                                   packed_seq_params)
        # [s, b, heads, head_dim] -> [b, heads, s, head_dim]; grouped keys and values are broadcast by SDPA.
        query, key, value = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        dropout_p = self.attention_dropout.p if self.training else 0.0
        if attention_mask is not None and not isinstance(attention_mask, CausalBias):
            attention_mask = ~attention_mask  # SDPA's bool masks are True where attended
        # As megatron's unfused path: the mask comes from the model-parallel RNG tracker (TP ranks hold
        # different heads, which need different masks), except under sequence parallelism.
        forked = dropout_p > 0 and not self.config.sequence_parallel
        with tensor_parallel.get_cuda_rng_tracker().fork() if forked else contextlib.nullcontext():
            context = F.scaled_dot_product_attention(
                query, key, value, attn_mask=attention_mask, is_causal=attention_mask is None,
                scale=self.softmax_scale, dropout_p=dropout_p, enable_gqa=key.shape[1] != query.shape[1],
            )
        sequence, batch = context.shape[2], context.shape[0]
        return context.permute(2, 0, 1, 3).reshape(sequence, batch, -1)


def _gather_in_sequence_order(t: torch.Tensor, group) -> torch.Tensor:
    """The whole sequence of t [2 chunk, b, ...] from every rank of a CP group, each holding chunks i and 2N-1-i
    of 2N: all-gathered (gradients reduce-scattered back, megatron-core's sequence-parallel gather), in order."""
    size = group.size()
    gathered = tensor_parallel.gather_from_sequence_parallel_region(t, tensor_parallel_output_grad=True, group=group)
    # Rank r's chunks land at places 2r and 2r + 1: chunk i < N at 2i, chunk i >= N at 2(2N-1-i) + 1.
    order = [2 * i if i < size else 2 * (2 * size - 1 - i) + 1 for i in range(2 * size)]
    chunks = gathered.view(2 * size, -1, *t.shape[1:])
    return chunks[torch.tensor(order, device=t.device)].flatten(0, 1)


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
