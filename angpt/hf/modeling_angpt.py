"""anGPT and nGPT for Hugging Face `transformers`, as exported by angpt (tools/convert_to_hf.py).

Self-contained (only `torch` and `transformers`): it is copied next to the weights of every exported model and
loaded with `AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)`. It reads like the layer of
angpt's docs/model.md (see its Export section) with the constant factors nu_qkv, nu_p, nu_uz, nu_acf, nu_d
and the sqrt(d) gains folded in by the converter (config.json lists them): a factor in front of an exact
normalization (QK-norm, the post-norm) cancels in it and is left out; nu_uz and the gains join the multipliers
of s_u and s_v; with post_norm "none" the others multiply the rows of the weight they follow
(`folded_factors`). No constant costs a multiply.

    q, k, v = W_q h, W_k h, W_v h                        per head
    q, k    = s_qk Norm(RoPE(q)), s_qk Norm(RoPE(k))
    h_A     = Norm(W_o concat_i softmax(sqrt(h) q_i k_i^T + mask) v_i)
    h       = nu(alpha_A) (h + alpha_A (h_A - h))
    h_M     = Norm(W_down ((s_u W_up h) * SiLU(s_v W_gate h)))
    h       = nu(alpha_M) (h + alpha_M (h_M - h))
    logits  = s_z (W_head h)

Learnable scales are kept as in training, s = multiplier * s_hat (docs/model.md, Learnable scales), so that
the exported model computes what the trained one does, number for number, and converts back to it bit for bit.
"""

import math
from typing import Optional

import torch
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_angpt import AnGPTConfig


def l2_normalize(x: torch.Tensor, eps: float = 1e-12) -> torch.Tensor:
    """x / ||x||_2 over the last dim (Norm in angpt's docs/model.md), as angpt computes it."""
    squared = x.float().pow(2).sum(dim=-1, keepdim=True)
    return x * torch.rsqrt(squared.clamp_min(eps * eps)).to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


class Scale(nn.Module):
    """A learnable scale s = multiplier * s_hat."""

    def __init__(self, size: int, multiplier: float):
        super().__init__()
        self.multiplier = multiplier
        self.s_hat = nn.Parameter(torch.ones(size))

    def forward(self) -> torch.Tensor:
        return self.multiplier * self.s_hat.float()


class RotaryEmbedding(nn.Module):
    """RoPE with rotate-half pairs (dimension i with i + h/2), as megatron-core applies it."""

    def __init__(self, config: AnGPTConfig):
        super().__init__()
        self.head_dim, self.base = config.head_dim, config.rope_theta

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """x: [batch, heads, tokens, head_dim]; position_ids: [batch, tokens]."""
        # Computed here rather than kept as a buffer, which from_pretrained would leave uninitialized.
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=x.device) / self.head_dim
        inv_freq = 1.0 / (self.base**exponents)
        freqs = position_ids[:, None, :, None].float() * inv_freq
        angles = torch.cat((freqs, freqs), dim=-1)
        rotated = x.float() * angles.cos() + rotate_half(x.float()) * angles.sin()
        return rotated.to(x.dtype)


class NormalizedResidual(nn.Module):
    """h <- nu(alpha) (h + alpha (x - h)) with nu(alpha) = 1/sqrt((1-alpha)^2 + alpha^2); nGPT's
    Norm(h + |alpha| (x - h)); or the plain nu (h + x)."""

    def __init__(self, config: AnGPTConfig):
        super().__init__()
        self.config = config
        if config.residual == "lerp":
            self.alpha = Scale(config.hidden_size, config.scale_multipliers["alpha"])

    def forward(self, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        config = self.config
        if config.residual == "lerp":
            alpha = self.alpha()
            if config.alpha_abs:
                alpha = alpha.abs()
            out = h + alpha.to(h.dtype) * (x - h)
            nu = torch.rsqrt((1 - alpha) ** 2 + alpha**2)
        else:
            out = h + x
            nu = torch.tensor(config.nu_alpha_plain, dtype=torch.float32)
        if config.nu_alpha_mode == "exact":
            return l2_normalize(out)
        if config.nu_alpha_mode == "one":
            return out
        return out * (config.nu_alpha_multiplier * nu).to(out.dtype)


class PostNorm(nn.Module):
    def __init__(self, config: AnGPTConfig):
        super().__init__()
        self.enabled = config.post_norm == "l2"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return l2_normalize(x) if self.enabled else x


class Attention(nn.Module):
    def __init__(self, config: AnGPTConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = h = config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * h, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * h, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * h, bias=False)
        self.o_proj = nn.Linear(self.num_heads * h, config.hidden_size, bias=False)
        # anGPT: one s_qk of size h shared by all heads; nGPT: one per head.
        s_qk_size = self.num_heads * h if config.model_family == "ngpt" else h
        self.s_qk = Scale(s_qk_size, config.scale_multipliers["s_qk"])
        self.softmax_scale = math.sqrt(h)

    def forward(self, x, rotary, position_ids, mask, cache: Optional[Cache]):
        batch, tokens, _ = x.shape
        q = self.q_proj(x).view(batch, tokens, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, tokens, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, tokens, self.num_kv_heads, self.head_dim).transpose(1, 2)
        s_qk = self.s_qk().view(-1, 1, self.head_dim).to(x.dtype)  # [heads or 1, 1, h]
        q = s_qk * l2_normalize(rotary(q, position_ids))
        k = s_qk * l2_normalize(rotary(k, position_ids))  # nGPT has as many key heads as query heads
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        groups = self.num_heads // self.num_kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        scores = self.softmax_scale * torch.matmul(q, k.transpose(-1, -2))
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        probs = torch.softmax(scores.float(), dim=-1).to(v.dtype)
        out = torch.matmul(probs, v).transpose(1, 2).reshape(batch, tokens, -1)
        return self.o_proj(out)


class MLP(nn.Module):
    def __init__(self, config: AnGPTConfig):
        super().__init__()
        d, f = config.hidden_size, config.intermediate_size
        self.up_proj = nn.Linear(d, f, bias=False)
        self.gate_proj = nn.Linear(d, f, bias=False)
        self.down_proj = nn.Linear(f, d, bias=False)
        self.s_u = Scale(f, config.scale_multipliers["s_u"])
        self.s_v = Scale(f, config.scale_multipliers["s_v"])

    def forward(self, x):
        u = self.s_u().to(x.dtype) * self.up_proj(x)
        z = self.s_v().to(x.dtype) * self.gate_proj(x)
        return self.down_proj(u * nn.functional.silu(z))


class DecoderLayer(nn.Module):
    def __init__(self, config: AnGPTConfig, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(config, layer_idx)
        self.attention_post_norm = PostNorm(config)
        self.attention_residual = NormalizedResidual(config)
        self.mlp = MLP(config)
        self.mlp_post_norm = PostNorm(config)
        self.mlp_residual = NormalizedResidual(config)

    def forward(self, h, rotary, position_ids, mask, cache):
        h = self.attention_residual(h, self.attention_post_norm(self.self_attn(h, rotary, position_ids, mask, cache)))
        return self.mlp_residual(h, self.mlp_post_norm(self.mlp(h)))


class AnGPTPreTrainedModel(PreTrainedModel):
    config_class = AnGPTConfig
    base_model_prefix = "model"
    _no_split_modules = ["DecoderLayer"]

    def _init_weights(self, module):
        # Exported weights are always loaded; fresh ones get unit rows (angpt's docs/model.md, Initialization).
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight)
            with torch.no_grad():
                module.weight.div_(module.weight.norm(dim=1, keepdim=True))


class AnGPTModel(AnGPTPreTrainedModel):
    def __init__(self, config: AnGPTConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.rotary = RotaryEmbedding(config)
        self.post_init()

    def forward(self, input_ids, attention_mask=None, position_ids=None, cache=None, use_cache=False):
        batch, tokens = input_ids.shape
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        past = cache.get_seq_length() if cache is not None else 0
        total = past + tokens
        if attention_mask is None:
            attention_mask = torch.ones(batch, total, dtype=torch.long, device=input_ids.device)
        keep = attention_mask[:, -total:].bool()
        if position_ids is None:
            # Left padding: positions count the real tokens only.
            position_ids = (keep.long().cumsum(-1) - 1).clamp_min(0)[:, -tokens:]
        causal = torch.arange(total, device=input_ids.device)[None, :] <= \
            torch.arange(past, total, device=input_ids.device)[:, None]
        mask = (causal[None] & keep[:, None, :])[:, None]  # [batch, 1, tokens, total]
        h = self.embed_tokens(input_ids)
        for layer in self.layers:
            h = layer(h, self.rotary, position_ids, mask, cache)
        return h, cache


class AnGPTForCausalLM(AnGPTPreTrainedModel, GenerationMixin):
    def __init__(self, config: AnGPTConfig):
        super().__init__(config)
        self.model = AnGPTModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.s_z = Scale(config.vocab_size, config.scale_multipliers["s_z"])
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def get_output_embeddings(self):
        return self.lm_head

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, past_key_values=None,
                labels=None, use_cache=None, logits_to_keep=0, **kwargs):
        cache = cache if cache is not None else past_key_values
        use_cache = self.config.use_cache if use_cache is None else use_cache
        h, cache = self.model(input_ids, attention_mask, position_ids, cache, use_cache)
        if logits_to_keep:
            h = h[:, -logits_to_keep:]
        logits = self.lm_head(h) * self.s_z().to(h.dtype)
        loss = None
        if labels is not None:
            loss = nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(),
                                               ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits, cache=cache if use_cache else None)
