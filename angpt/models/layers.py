"""Building blocks shared by anGPT and nGPT (docs/model.md), as megatron-core modules.

Every normalization factor is applied by a `NuScale` module named after it (so hooks can watch each
intermediate), every learnable scale is a `LearnableScale`, and the layer reads like docs/model.md:

    h_A = Norm(nu_p W_p Attention(nu_qkv W_qkv h))       h = nu(alpha_A) (h + alpha_A (h_A - h))
    h_M = Norm(nu_d W_d SwiGLU_s(nu_uz W_uz h))          h = nu(alpha_M) (h + alpha_M (h_M - h))
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import torch
import torch.distributed.nn.functional as dist_fn
from megatron.core import parallel_state, tensor_parallel
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_layer import TransformerLayer
from torch.utils.checkpoint import checkpoint

from angpt import kernels
from angpt.models.attention import FusedDotProductAttention, rope
from angpt.models.config import AnGPTConfig
from angpt.models.factors import NU_PLAIN_RESIDUAL, nu_alpha
from angpt.models.scales import LearnableScale


def l2_normalize(
    x: torch.Tensor, group_size: Optional[int] = None, tp_group=None, eps: float = 1e-12
) -> torch.Tensor:
    """x / ||x||_2 over the last dim, or over consecutive groups of `group_size` (heads) of it.

    With `tp_group`, the last dim is split over those ranks and the squared norms are summed across
    them (in autograd, both ways)."""
    shape = x.shape
    if group_size is not None:
        x = x.reshape(*shape[:-1], shape[-1] // group_size, group_size)
    squared = x.float().pow(2).sum(dim=-1, keepdim=True)
    if tp_group is not None and tp_group.size() > 1:
        squared = dist_fn.all_reduce(squared, group=tp_group)
    return (x * torch.rsqrt(squared.clamp_min(eps * eps)).to(x.dtype)).reshape(shape)


class _ScaledL2Normalize(torch.autograd.Function):
    """scale * Norm(x) over the last dim (Norm(x) for scale None), the forward pass as `l2_normalize`'s, the
    backward written out in fewer eager ops: with y = Norm(x) and r = 1 / max(||x||, eps),
    d/dx = r (g - y <g, y>), where the projection term vanishes while the clamp holds (as in autograd's
    clamp_min). Reductions are in fp32 (at least)."""

    @staticmethod
    def forward(ctx, x, scale, eps=1e-12):
        squared = x.float().pow(2).sum(dim=-1, keepdim=True)
        r = torch.rsqrt(squared.clamp_min(eps * eps)).to(x.dtype)
        y = x * r
        ctx.eps = eps
        ctx.save_for_backward(y, r, squared, scale)
        return y if scale is None else scale * y

    @staticmethod
    def backward(ctx, grad):
        y, r, squared, scale = ctx.saved_tensors
        acc = torch.promote_types(grad.dtype, torch.float32)
        grad_scale = None
        if scale is not None:
            if ctx.needs_input_grad[1]:
                lead = grad.dim() - scale.dim()
                dims = [*range(lead), *(lead + i for i, n in enumerate(scale.shape) if n == 1)]
                grad_scale = torch.sum(grad * y, dims, keepdim=True, dtype=acc).view(scale.shape).to(scale.dtype)
            grad = grad * scale
        projection = torch.sum(grad * y, dim=-1, keepdim=True, dtype=acc)
        projection = torch.where(squared >= ctx.eps * ctx.eps, projection, 0).to(grad.dtype)
        return torch.addcmul(grad, y, projection, value=-1) * r, grad_scale, None


@kernels.fused_on_gpu(eager=_ScaledL2Normalize.apply)
def scaled_l2_normalize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """scale * x / ||x||_2 over the last dim (QK normalization), one fused kernel on GPUs."""
    return scale * l2_normalize(x)


def _qk_scale(query: torch.Tensor, s_hat: torch.Tensor, multiplier: float) -> torch.Tensor:
    """s_qk = multiplier * s_hat (Learnable scales), a row per head (nGPT) or one row (anGPT), in q's dtype."""
    scale = s_hat if multiplier == 1.0 else multiplier * s_hat
    return scale.view(-1, query.shape[-1]).to(query.dtype)


def _rotary_qk(normalize, query, key, q_freqs, k_freqs, s_hat, multiplier, interleaved):
    """normalize(RoPE(x), s_qk) of q and of k."""
    scale = _qk_scale(query, s_hat, multiplier)
    return tuple(normalize(rope(x, freqs, interleaved), scale) for x, freqs in ((query, q_freqs), (key, k_freqs)))


@kernels.fused_on_gpu(eager=functools.partial(_rotary_qk, _ScaledL2Normalize.apply))
def rotary_qk_normalize(query: torch.Tensor, key: torch.Tensor, q_freqs: torch.Tensor, k_freqs: torch.Tensor,
                        s_hat: torch.Tensor, multiplier: float, interleaved: bool) -> tuple:
    """(s_qk Norm(RoPE(q)), s_qk Norm(RoPE(k))) with s_qk = multiplier * s_hat: RoPE, QK normalization and the
    scale's own multiply and cast for q and k in one compiled graph, one kernel forward and one backward on GPUs
    (rather than a pair of kernels each, and the scale's launches around them). Its backward recomputes RoPE from
    q and k, views of the qkv projection's output that attention keeps anyway (for v), so q and k cost no memory
    of their own before attention's inputs; without the checkpoint torch.compile keeps RoPE(q) and RoPE(k)
    (benchmarks/activation_memory.py)."""
    return checkpoint(lambda query, key, s_hat: _rotary_qk(lambda x, scale: scale * l2_normalize(x), query, key,
                                                           q_freqs, k_freqs, s_hat, multiplier, interleaved),
                      query, key, s_hat, use_reentrant=False)


@kernels.fused_on_gpu(eager=lambda x: _ScaledL2Normalize.apply(x, None))
def fused_l2_normalize(x: torch.Tensor) -> torch.Tensor:
    """x / ||x||_2 over the last dim, one fused kernel on GPUs."""
    return l2_normalize(x)


@kernels.fused_on_gpu
def lerp_update(h: torch.Tensor, x: torch.Tensor, alpha: torch.Tensor, nu: torch.Tensor) -> torch.Tensor:
    """nu * (h + alpha (x - h)), one fused kernel on GPUs (alpha and nu in fp32, applied in h's dtype)."""
    return (h + alpha.to(h.dtype) * (x - h)) * nu.to(h.dtype)


class _NuLerpUpdate(torch.autograd.Function):
    """`nu_lerp_update` in fewer eager ops: with q = (1 - alpha)^2 + alpha^2 and out = nu (h + alpha (x - h)),
    d out / d alpha = nu (x - h) + out (1 - 2 alpha) / q, the second term dropped without gradients through
    nu(alpha). The reductions over tokens are in fp32 (at least)."""

    @staticmethod
    def forward(ctx, h, x, s_hat, ratio, multiplier, nu_grad):
        alpha = ratio * s_hat
        q = (1 - alpha) ** 2 + alpha**2
        nu = torch.rsqrt(q)
        if multiplier != 1.0:
            nu = multiplier * nu
        diff = x - h
        out = torch.addcmul(h, diff, alpha.to(h.dtype)) * nu.to(h.dtype)
        ctx.ratio, ctx.nu_grad = ratio, nu_grad
        if nu_grad:
            ctx.save_for_backward(diff, alpha, nu, out, (1 - 2 * alpha) / q)
        else:
            ctx.save_for_backward(diff, alpha, nu)
        return out

    @staticmethod
    def backward(ctx, grad):
        diff, alpha, nu, *nu_terms = ctx.saved_tensors
        tokens = tuple(range(grad.dim() - 1))
        grad_lerp = grad * nu.to(grad.dtype)
        grad_x = grad_lerp * alpha.to(grad.dtype)
        acc = torch.promote_types(grad.dtype, alpha.dtype)  # fp32 under bf16, fp64 for gradcheck
        grad_alpha = torch.sum(grad_lerp * diff, tokens, dtype=acc)
        if ctx.nu_grad:
            out, slope = nu_terms
            grad_alpha = torch.addcmul(grad_alpha, torch.sum(grad * out, tokens, dtype=acc), slope)
        return grad_lerp - grad_x, grad_x, ctx.ratio * grad_alpha, None, None, None


def _nu_lerp(h: torch.Tensor, x: torch.Tensor, s_hat: torch.Tensor, ratio: float, multiplier: float,
             nu_grad: bool) -> torch.Tensor:
    alpha = ratio * s_hat
    nu = multiplier * nu_alpha(alpha)
    if not nu_grad:
        nu = nu.detach()
    return (h + alpha.to(h.dtype) * (x - h)) * nu.to(h.dtype)


@kernels.fused_on_gpu(eager=_NuLerpUpdate.apply)
def nu_lerp_update(h: torch.Tensor, x: torch.Tensor, s_hat: torch.Tensor, ratio: float, multiplier: float,
                   nu_grad: bool) -> torch.Tensor:
    """multiplier nu(alpha) (h + alpha (x - h)) with alpha = ratio s_hat, the LERP residual of anGPT from
    alpha's surrogate, as docs/model.md writes it: one fused kernel on GPUs, alpha and nu(alpha) included."""
    return _nu_lerp(h, x, s_hat, ratio, multiplier, nu_grad)


@kernels.fused_on_gpu(eager=lambda h, x, *factors: _NuLerpUpdate.apply(h, _ScaledL2Normalize.apply(x, None), *factors))
def post_norm_nu_lerp_update(h: torch.Tensor, x: torch.Tensor, s_hat: torch.Tensor, ratio: float, multiplier: float,
                             nu_grad: bool) -> torch.Tensor:
    """nu_lerp_update(h, Norm(x), ...): the post-norm and anGPT's residual update in one fused kernel on GPUs,
    which keeps h and x for the backward pass and recomputes Norm(x) there, rather than also keeping Norm(x)
    (one [tokens, hidden] tensor less per sub-block; benchmarks/activation_memory.py)."""
    return _nu_lerp(h, l2_normalize(x), s_hat, ratio, multiplier, nu_grad)


@kernels.fused_on_gpu(eager=lambda h, x, alpha: _ScaledL2Normalize.apply(h + alpha.to(h.dtype) * (x - h), None))
def normalized_lerp_update(h: torch.Tensor, x: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """Norm(h + alpha (x - h)), nGPT's residual update, one fused kernel on GPUs."""
    return l2_normalize(h + alpha.to(h.dtype) * (x - h))


class NuScale(torch.nn.Module):
    """Applies one constant factor nu_g, or in the "exact" ablation 1/||x|| (docs/model.md, Normalization factors).

    `group_size` and `tp_reduced` say what a vector is for the exact norm: one head (nu_qkv), one of the
    u / z halves of a TP shard of fc1 split over TP ranks (nu_uz), and so on. A constant factor that a
    fused kernel applies (nu_uz and nu_acf, in the fused SwiGLU) is marked `fused` by its parent
    (`ScaledSwiGLUMLP`), which hands `value` to `kernels.scaled_swiglu`: the module then passes its input
    through, so nu_uz's hooks see u and z unscaled and nu_acf's see the finished activation (docs/model.md,
    Fused kernels).

    With the post-norm, nu_qkv, nu_p and nu_d are `cancelled`: a positive constant reaching an exact
    normalization through linear maps only changes neither the forward pass nor the gradients (QK-norm
    after q and k; the post-norm after v, W_p and W_d; docs/model.md, "Which factors matter with the
    post-norm"), so the module passes its input through rather than launch a multiply forward and backward.
    Its hooks then see the output unscaled. Without the post-norm v carries nu_qkv, so it is applied."""

    # The factors an exact normalization follows through linear maps only when post_norm="l2".
    CANCELLED_BY_POST_NORM = ("nu_qkv", "nu_p", "nu_d")

    def __init__(self, config: AnGPTConfig, name: str, group_size: Optional[int] = None, tp_reduced=False):
        super().__init__()
        self.name = name
        self.exact = config.constant_factors == "exact"
        self.value = getattr(config.normalization_factors(), name)
        self.group_size = group_size
        self.tp_group = parallel_state.get_tensor_model_parallel_group() if tp_reduced else None
        self.fused = False
        # Only for a positive value: Norm(-x) = -Norm(x).
        self.cancelled = (not self.exact and self.value > 0 and config.post_norm == "l2"
                          and name in self.CANCELLED_BY_POST_NORM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.exact:
            return l2_normalize(x, self.group_size, self.tp_group)
        # fused: a pass-through, the parent's fused kernel applies self.value (docs/model.md, Fused kernels).
        return x if self.fused or self.cancelled or self.value == 1.0 else x * self.value

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """Nothing to checkpoint (megatron-core's MLP asks every child for its sharded state)."""
        return {}

    def extra_repr(self) -> str:
        if self.exact:
            return f"{self.name}=exact"
        note = " (fused)" if self.fused else " (cancelled by the post-norm)" if self.cancelled else ""
        return f"{self.name}={self.value:.6g}{note}"


class NormalizedResidual(MegatronModule):
    """h <- nu(alpha) (h + alpha (x - h)), the LERP residual of anGPT; nGPT's Norm(h + |alpha| (x - h));
    or the plain nu (h + x) of the ablation; x = Norm(sub-block output), the post-norm (docs/model.md,
    Post-norm), or the output itself with post_norm="none". The post-norm is computed here so that anGPT's
    update can fuse it (post_norm_nu_lerp_update)."""

    def __init__(self, config: AnGPTConfig):
        super().__init__(config=config)
        self.post_norm = config.post_norm == "l2"
        self.lerp = config.residual == "lerp"
        if self.lerp:
            # alpha multiplies sequence-sharded activations under sequence parallelism.
            self.alpha = LearnableScale(
                config, "alpha", config.hidden_size, reduce_grad_over_tp=config.sequence_parallel
            )

    def forward(self, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """`x`: the sub-block's output, before the post-norm."""
        config = self.config
        if self.lerp and config.nu_alpha_mode == "analytic" and not config.alpha_abs:
            # anGPT: alpha, nu(alpha) and the post-norm inside one kernel
            update = post_norm_nu_lerp_update if self.post_norm else nu_lerp_update
            return update(h, x, self.alpha.surrogate(), self.alpha.multiplier, config.nu_alpha_multiplier,
                          config.nu_alpha_grad)
        if self.post_norm:
            x = fused_l2_normalize(x)
        if not self.lerp:  # the plain-residual ablation
            out = h + x
            if config.nu_alpha_mode == "exact":
                return l2_normalize(out)
            if config.nu_alpha_mode == "one":
                return out
            nu = torch.tensor(NU_PLAIN_RESIDUAL, dtype=torch.float32)
            return out * (config.nu_alpha_multiplier * nu).to(out.dtype)
        alpha = self.alpha()
        if config.alpha_abs:
            alpha = alpha.abs()
        if config.nu_alpha_mode == "exact":  # nGPT
            return normalized_lerp_update(h, x, alpha)
        if config.nu_alpha_mode == "one":
            return lerp_update(h, x, alpha, torch.ones_like(alpha))
        nu = nu_alpha(alpha)
        if not config.nu_alpha_grad:
            nu = nu.detach()
        return lerp_update(h, x, alpha, config.nu_alpha_multiplier * nu)


class FactorScaledColumn:
    """Mixin for a column-parallel linear layer (W_qkv, W_uz) whose output is scaled by one normalization
    factor: megatron-core's ColumnParallelLinear (local spec) or Transformer Engine's (TE spec)."""

    def __init__(self, *args, factor: str, config: AnGPTConfig, **kwargs):
        super().__init__(*args, config=config, **kwargs)
        if factor == "nu_qkv":
            self.nu = NuScale(config, factor, group_size=config.kv_channels)
        else:  # nu_uz: the local output is [u shard; z shard], each a vector split over TP ranks.
            self.nu = NuScale(config, factor, group_size=self.weight.shape[0] // 2, tp_reduced=True)

    def forward(self, *args, **kwargs):
        output, bias = super().forward(*args, **kwargs)
        return self.nu(output), bias


class FactorScaledRow:
    """Mixin for a row-parallel linear layer (W_p, W_d) whose reduced output is scaled by one
    normalization factor, on megatron-core's RowParallelLinear or Transformer Engine's."""

    def __init__(self, *args, factor: str, config: AnGPTConfig, **kwargs):
        super().__init__(*args, config=config, **kwargs)
        self.nu = NuScale(config, factor)

    def forward(self, *args, **kwargs):
        output, bias = super().forward(*args, **kwargs)
        return self.nu(output), bias


class FactorScaledColumnParallelLinear(FactorScaledColumn, tensor_parallel.ColumnParallelLinear):
    """A column-parallel linear layer whose output is scaled by one normalization factor."""


class FactorScaledRowParallelLinear(FactorScaledRow, tensor_parallel.RowParallelLinear):
    """A row-parallel linear layer (W_p, W_d) whose reduced output is scaled by one normalization factor."""


def is_row_parallel_linear(module: torch.nn.Module) -> bool:
    """megatron-core's RowParallelLinear, or a Transformer Engine linear layer in row-parallel mode (TE's
    layers are not megatron-core subclasses). nGPT normalizes these weights along dim 0."""
    return isinstance(module, tensor_parallel.RowParallelLinear) or getattr(module, "parallel_mode", None) == "row"


class QKNormalization:
    """Mixin for core attention: softmax(sqrt(h) (s_qk Norm(q)) (s_qk Norm(k))^T + causal) v, applied after
    RoPE, on megatron-core's DotProductAttention (local spec) or Transformer Engine's (TE spec).

    anGPT shares one s_qk of size h across heads; nGPT has one per head (size d, split over heads and
    therefore over TP ranks). The sqrt(h) softmax scale is config.softmax_scale, which SelfAttention
    passes to either core attention."""

    def __init__(self, config: AnGPTConfig, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        self.rotary_pos_emb = None  # RoPE's angles for the current forward pass (NormalizedSelfAttention)
        head_dim = config.kv_channels
        if config.model_family == "ngpt":
            if config.num_query_groups != config.num_attention_heads:
                raise ValueError("nGPT's per-head s_qk needs num_query_groups == num_attention_heads")
            self.s_qk = LearnableScale(config, "s_qk", config.num_attention_heads * head_dim, partitioned=True)
        else:
            self.s_qk = LearnableScale(config, "s_qk", head_dim, reduce_grad_over_tp=True)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, **kwargs):
        # Selective recompute of qk_norm (core_attn recomputes this whole forward, QK-norm included): the
        # normalized q and k, which attention keeps, are dropped once it ran and recomputed from q and k (views
        # of the QKV projection's output, which attention keeps for v) when its gradient arrives, as
        # megatron-core recomputes GPT+'s pre-norms. fp8 as the config's: CheckpointWithoutOutput's default
        # (False) would take Transformer Engine's FP8 path.
        recompute = (self.config.recomputes("qk_norm") and not self.config.recomputes("core_attn")
                     and torch.is_grad_enabled())
        if recompute:
            checkpoint = tensor_parallel.CheckpointWithoutOutput(fp8=self.config.fp8)
            query, key = checkpoint.checkpoint(functools.partial(self._normalize, self.rotary_pos_emb), query, key)
        else:
            query, key = self._normalize(self.rotary_pos_emb, query, key)
        output = super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias,
                                 packed_seq_params, **kwargs)
        if recompute:
            checkpoint.discard_output_and_register_recompute(output)
        return output

    def _normalize(self, rotary_pos_emb, query, key):
        """(s_qk Norm(q), s_qk Norm(k)), after RoPE by `rotary_pos_emb` (q's and k's angles) unless None."""
        # query, key: [s, b, heads, h] in both implementations (TE's "sbhd").
        if rotary_pos_emb is None:
            s_qk = _qk_scale(query, self.s_qk.surrogate(), self.s_qk.multiplier)  # [heads or 1, h]
            return scaled_l2_normalize(query, s_qk), scaled_l2_normalize(key, s_qk)
        # RoPE, handed over by NormalizedSelfAttention, then the normalization, q and k in one kernel each way
        q_freqs, k_freqs = rotary_pos_emb
        return rotary_qk_normalize(query, key, q_freqs, k_freqs, self.s_qk.surrogate(), self.s_qk.multiplier,
                                   self.config.rotary_interleaved)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        # The core attention checkpoints only its own softmax offset (or TE's extra state).
        state = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        state.update(self.s_qk.sharded_state_dict(f"{prefix}s_qk.", sharded_offsets, metadata))
        return state


class NormalizedSelfAttention(SelfAttention):
    """megatron-core's self-attention, whose QK-normalized core attention applies RoPE itself, fused with the
    normalization that follows it (rotary_qk_normalize), rather than megatron-core applying RoPE in
    between. Where megatron-core's RoPE does more than rotate by the angles (a KV cache, packed sequences,
    YaRN's scaling) it stays megatron-core's."""

    def forward(self, hidden_states, attention_mask, *args, rotary_pos_emb=None, **kwargs):
        core = self.core_attention
        handed_over = (rotary_pos_emb is not None and kwargs.get("inference_context") is None
                       and kwargs.get("packed_seq_params") is None and not self.config.multi_latent_attention
                       and not hasattr(self.config, "yarn_rotary_scaling_factor"))
        if handed_over:
            core.rotary_pos_emb = rotary_pos_emb if isinstance(rotary_pos_emb, tuple) else (rotary_pos_emb,) * 2
            rotary_pos_emb = None
        try:
            return super().forward(hidden_states, attention_mask, *args, rotary_pos_emb=rotary_pos_emb, **kwargs)
        finally:
            core.rotary_pos_emb = None

    def _checkpointed_attention_forward(self, query, key, value, attention_mask, rotary_pos_emb=None,
                                        attn_mask_type=None, attention_bias=None, packed_seq_params=None):
        """megatron-core's selective recompute of core attention (core_attn), with the RoPE angles that forward()
        handed to the core attention handed over again for the recomputation: by the backward pass forward() has
        taken them back (and another micro-batch may have handed over its own)."""
        core, handed_over = self.core_attention, self.core_attention.rotary_pos_emb
        mask_type = attn_mask_type or self.attn_mask_type

        def attention(query, key, value, attention_mask):
            core.rotary_pos_emb = handed_over
            try:
                return core(query, key, value, attention_mask, attn_mask_type=mask_type,
                            attention_bias=attention_bias, packed_seq_params=packed_seq_params)
            finally:
                core.rotary_pos_emb = None

        return tensor_parallel.checkpoint(attention, False, query, key, value, attention_mask)


class NormalizedDotProductAttention(QKNormalization, FusedDotProductAttention):
    """The normalized core attention of the local spec (see QKNormalization)."""


class ScaledSwiGLUMLP(MLP):
    """a = nu_acf (s_u u) SiLU(s_v sqrt(d) z) with u, z = nu_uz W_u h, nu_uz W_z h; output nu_d W_d a.

    nGPT scales u by sqrt(d) too and has no nu factors (they are 1 in its config)."""

    def __init__(self, config: AnGPTConfig, submodules, **kwargs):
        kwargs.setdefault("ffn_hidden_size", config.ffn_hidden_size)
        super().__init__(config, submodules, **kwargs)
        f = config.ffn_hidden_size
        self.s_u = LearnableScale(config, "s_u", f, partitioned=True)
        self.s_v = LearnableScale(config, "s_v", f, partitioned=True)
        sqrt_d = math.sqrt(config.hidden_size)
        self.u_gain = sqrt_d if config.model_family == "ngpt" else 1.0
        self.z_gain = sqrt_d
        self.nu_acf = NuScale(config, "nu_acf", tp_reduced=True)
        # The fused SwiGLU takes over two factors: its child linear_fc1's nu_uz and its own nu_acf become
        # pass-throughs (NuScale.fused) and forward() hands their values to kernels.scaled_swiglu. The exact
        # ablation's norms stay in the NuScale modules (docs/model.md, Fused kernels).
        self.linear_fc1.nu.fused = self.nu_acf.fused = not self.nu_acf.exact

    def forward(self, hidden_states, per_token_scale=None, **kwargs):
        uz, _ = self.linear_fc1(hidden_states)
        nu_uz, nu_acf = (self.linear_fc1.nu.value, self.nu_acf.value) if self.nu_acf.fused else (1.0, 1.0)
        # s_u = u_factor s_u_hat and s_v = z_factor s_v_hat, their constants handed to the kernel rather than
        # multiplied in (a launch each way per scale): with input factor nu_uz z_factor on both u and z, u's
        # product comes out z_factor / u_factor too large, which the output factor takes back.
        u_factor, z_factor = self.u_gain * self.s_u.multiplier, self.z_gain * self.s_v.multiplier
        a = self.nu_acf(kernels.scaled_swiglu(uz, self.s_u.surrogate(), self.s_v.surrogate(), nu_uz * z_factor,
                                              nu_acf * u_factor / z_factor))
        return self.linear_fc2(a)


class NormalizedTransformerLayer(TransformerLayer):
    """The anGPT / nGPT layer: no pre-norms, normalized residuals that post-norm each sub-block's output."""

    def __init__(self, config: AnGPTConfig, submodules, *args, **kwargs):
        super().__init__(config, submodules, *args, **kwargs)
        self.attention_residual = NormalizedResidual(config)
        self.mlp_residual = NormalizedResidual(config)

    def forward(self, hidden_states, attention_mask=None, context=None, rotary_pos_emb=None,
                inference_context=None, packed_seq_params=None, sequence_len_offset=None, **kwargs):
        h = hidden_states
        h_attention, _ = self.self_attention(
            h,
            attention_mask=attention_mask,
            rotary_pos_emb=rotary_pos_emb,
            inference_context=inference_context,
            packed_seq_params=packed_seq_params,
            sequence_len_offset=sequence_len_offset,
        )
        h = self._residual(self.attention_residual, h, h_attention)
        h_mlp, _ = self._mlp(h)
        h = self._residual(self.mlp_residual, h, h_mlp)
        return h, context

    def _mlp(self, h):
        """The MLP, recomputed in the backward pass under selective recompute of mlp (TransformerLayer sets
        recompute_mlp), as TransformerLayer runs it: Transformer Engine's checkpoint under FP8."""
        if not self.recompute_mlp:
            return self.mlp(h)
        if self.config.fp8:
            from megatron.core.extensions.transformer_engine import te_checkpoint  # noqa: PLC0415 (optional: TE)

            return te_checkpoint(self.mlp, False, tensor_parallel.random.get_cuda_rng_tracker, self.pg_collection.tp, h)
        return tensor_parallel.checkpoint(self.mlp, False, h)

    def _residual(self, residual: NormalizedResidual, h, x):
        """h <- the residual update, recomputed in the backward pass from h and x under selective recompute of
        residual_update (it then keeps h, which the next linear layer keeps anyway, and x)."""
        if self.config.recomputes("residual_update") and torch.is_grad_enabled():
            return tensor_parallel.checkpoint(residual, False, h, x)
        return residual(h, x)


class ScaledOutputLayer(tensor_parallel.ColumnParallelLinear):
    """GPTModel's output layer with the logit scale: logits = s_Z * (W_head h), s_Z split over the
    vocabulary like W_head. Installed on an existing layer by `attach`.

    It computes (s_Z * W_head) h, the same product: scaling W_head's [vocab, d] rows costs d/tokens of scaling
    the [tokens, vocab] logits (9 ms of a 249 ms step at 0.5B, micro-batch 16, on an H200, forward and
    backward)."""

    logit_scale: LearnableScale

    @classmethod
    def attach(cls, layer: tensor_parallel.ColumnParallelLinear, config: AnGPTConfig, vocab_size: int):
        # GPTModel builds its output layer inline, so it is converted in place rather than rebuilt (a
        # megatron-core workaround: angpt/megatron_compat).
        layer.__class__ = cls
        layer.logit_scale = LearnableScale(config, "s_z", vocab_size, partitioned=True)

    def forward(self, input_, weight=None, runtime_gather_output=None):
        gather = self.gather_output if runtime_gather_output is None else runtime_gather_output
        weight = self.weight if weight is None else weight  # the embedding's, with tied embeddings
        if self.config.gradient_accumulation_fusion:
            # megatron-core then accumulates the GEMM's weight gradient into weight.main_grad itself (deferred to
            # the pipeline's flush with --defer-embedding-wgrad-compute): the GEMM must see W_head, and s_Z
            # scales its output.
            logits, bias = super().forward(input_, weight, runtime_gather_output=False)
            logits = self.logit_scale().to(logits.dtype) * logits
        else:
            scaled_weight = self.logit_scale().to(weight.dtype).unsqueeze(1) * weight
            logits, bias = super().forward(input_, scaled_weight, runtime_gather_output=False)
        if gather:
            logits = tensor_parallel.gather_from_tensor_model_parallel_region(logits, group=self.tp_group)
        return logits, bias

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        state = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        state.update(self.logit_scale.sharded_state_dict(f"{prefix}logit_scale.", sharded_offsets, metadata))
        return state
