"""The weights between angpt's megatron-core model and the Hugging Face one, both ways: megatron-core's names and
fused layouts (QKV rows by query group, fc1 as two halves) against transformers' per-projection tensors, with
anGPT's and nGPT's constant normalization factors folded into the exported weights and the scale multipliers
(and divided back out on import); and the safetensors files that hold the export's."""

from __future__ import annotations

import json
import math
import os

import torch
from safetensors.torch import save_file

from angpt.config.choices import EXPORT_DTYPES
from angpt.hf.errors import ExportError
from angpt.models import AnGPTConfig
from angpt.models.scales import scale_init

DTYPES = dict(zip(EXPORT_DTYPES, (torch.float32, torch.bfloat16)))
LAYER = "decoder.layers."


def split_qkv(qkv: torch.Tensor, num_heads: int, num_groups: int, head_dim: int):
    """megatron-core's fused QKV rows, [q heads of group g; k_g; v_g] for each query group g, as (q, k, v)."""
    per_group = num_heads // num_groups
    grouped = qkv.view(num_groups, (per_group + 2) * head_dim, -1)
    q, k, v = grouped.split([per_group * head_dim, head_dim, head_dim], dim=1)
    return q.reshape(-1, qkv.shape[-1]), k.reshape(-1, qkv.shape[-1]), v.reshape(-1, qkv.shape[-1])


def join_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_groups: int) -> torch.Tensor:
    """The inverse of `split_qkv`."""
    hidden = q.shape[-1]
    grouped = [t.reshape(num_groups, -1, hidden) for t in (q, k, v)]
    return torch.cat(grouped, dim=1).reshape(-1, hidden)


def constant_factors(config: AnGPTConfig):
    """The constant factors of anGPT / nGPT's config (nGPT's are all 1)."""
    if config.constant_factors == "exact":
        raise ExportError("the 'exact' constant-factor ablation normalizes activations where the factors were; "
                          "the exported model folds constant factors only")
    return config.normalization_factors()


def folded_factors(config: AnGPTConfig) -> dict[str, float]:
    """What each exported weight of anGPT / nGPT is multiplied by: the constant factor after it, unless an
    exact normalization cancels it (QK-norm after W_q and W_k; the post-norm after W_v, W_o and W_down,
    whose outputs reach it through linear maps only) or a learnable scale takes it (W_up, W_gate: see
    `scale_multipliers`). With the post-norm (the default) no weight changes, so the import is exact."""
    nu = constant_factors(config)
    cancelled = config.post_norm == "l2"
    return {
        "q_proj": 1.0,
        "k_proj": 1.0,
        "v_proj": 1.0 if cancelled else nu.nu_qkv,
        "o_proj": 1.0 if cancelled else nu.nu_p,
        "up_proj": 1.0,
        "gate_proj": 1.0,
        "down_proj": 1.0 if cancelled else nu.nu_acf * nu.nu_d,
    }


def scale_multipliers(config: AnGPTConfig) -> dict[str, float]:
    """s = multiplier * s_hat for each learnable scale: s_init / s_scale (docs/model.md, Learnable scales),
    and for s_u and s_v also the constants in front of them, nu_uz and the sqrt(d) gains of z (and of u in
    nGPT)."""
    multipliers = {}
    for name in ("alpha", "s_qk", "s_u", "s_v", "s_z"):
        s_init, s_scale = scale_init(config, name)
        multipliers[name] = s_init / s_scale
    nu_uz, sqrt_d = constant_factors(config).nu_uz, math.sqrt(config.hidden_size)
    multipliers["s_u"] *= nu_uz * (sqrt_d if config.model_family == "ngpt" else 1.0)
    multipliers["s_v"] *= nu_uz * sqrt_d
    return multipliers


def normalized_state_dict(tensors: dict, config: AnGPTConfig, size: int) -> dict[str, torch.Tensor]:
    """The remote-code model's tensors from the checkpoint's (anGPT, nGPT)."""
    t = tensors
    factors = folded_factors(config)
    f = config.ffn_hidden_size
    state = {"model.embed_tokens.weight": t["embedding.word_embeddings.weight"][:size]}
    head = t.get("output_layer.weight", t["embedding.word_embeddings.weight"])
    state["lm_head.weight"] = head[:size]
    state["s_z.s_hat"] = t["output_layer.logit_scale.s_hat"][:size]
    for i in range(config.num_layers):
        prefix = f"model.layers.{i}."
        q, k, v = split_qkv(t[LAYER + "self_attention.linear_qkv.weight"][i], config.num_attention_heads,
                            config.num_query_groups, config.kv_channels)
        fc1 = t[LAYER + "mlp.linear_fc1.weight"][i]
        weights = {
            "self_attn.q_proj": q, "self_attn.k_proj": k, "self_attn.v_proj": v,
            "self_attn.o_proj": t[LAYER + "self_attention.linear_proj.weight"][i],
            "mlp.up_proj": fc1[:f], "mlp.gate_proj": fc1[f:],  # angpt's fc1 is [u; z], SiLU on z
            "mlp.down_proj": t[LAYER + "mlp.linear_fc2.weight"][i],
        }
        for name, weight in weights.items():
            factor = factors[name.split(".")[1]]
            state[f"{prefix}{name}.weight"] = weight if factor == 1.0 else weight * factor
        state[prefix + "self_attn.s_qk.s_hat"] = t[LAYER + "self_attention.core_attention.s_qk.s_hat"][i]
        state[prefix + "mlp.s_u.s_hat"] = t[LAYER + "mlp.s_u.s_hat"][i]
        state[prefix + "mlp.s_v.s_hat"] = t[LAYER + "mlp.s_v.s_hat"][i]
        if config.residual == "lerp":
            state[prefix + "attention_residual.alpha.s_hat"] = t[LAYER + "attention_residual.alpha.s_hat"][i]
            state[prefix + "mlp_residual.alpha.s_hat"] = t[LAYER + "mlp_residual.alpha.s_hat"][i]
    return state


def qwen3_state_dict(tensors: dict, config: AnGPTConfig, size: int) -> dict[str, torch.Tensor]:
    """Qwen3ForCausalLM's tensors from a GPT+ checkpoint's (megatron-core stores each pre-norm's weight
    with the linear layer after it, as Transformer Engine fuses them)."""
    t = tensors
    f = config.ffn_hidden_size
    state = {
        "model.embed_tokens.weight": t["embedding.word_embeddings.weight"][:size],
        "model.norm.weight": t["decoder.final_layernorm.weight"],
        "lm_head.weight": t.get("output_layer.weight", t["embedding.word_embeddings.weight"])[:size],
    }
    for i in range(config.num_layers):
        prefix = f"model.layers.{i}."
        q, k, v = split_qkv(t[LAYER + "self_attention.linear_qkv.weight"][i], config.num_attention_heads,
                            config.num_query_groups, config.kv_channels)
        fc1 = t[LAYER + "mlp.linear_fc1.weight"][i]
        state.update({
            prefix + "input_layernorm.weight": t[LAYER + "self_attention.linear_qkv.layer_norm_weight"][i],
            prefix + "self_attn.q_proj.weight": q,
            prefix + "self_attn.k_proj.weight": k,
            prefix + "self_attn.v_proj.weight": v,
            prefix + "self_attn.q_norm.weight": t[LAYER + "self_attention.q_layernorm.weight"][i],
            prefix + "self_attn.k_norm.weight": t[LAYER + "self_attention.k_layernorm.weight"][i],
            prefix + "self_attn.o_proj.weight": t[LAYER + "self_attention.linear_proj.weight"][i],
            prefix + "post_attention_layernorm.weight": t[LAYER + "mlp.linear_fc1.layer_norm_weight"][i],
            # megatron-core's gated fc1 is [gate; up], SiLU on the first half.
            prefix + "mlp.gate_proj.weight": fc1[:f],
            prefix + "mlp.up_proj.weight": fc1[f:],
            prefix + "mlp.down_proj.weight": t[LAYER + "mlp.linear_fc2.weight"][i],
        })
    return state


def exported_state_dict(tensors: dict, config: AnGPTConfig, size: int, dtype: str) -> dict[str, torch.Tensor]:
    """The Hugging Face model's tensors in `dtype` (one of DTYPES) from a checkpoint's, the vocabulary trimmed
    to `size`: transformers' Qwen3 for GPT+, the remote-code model for anGPT and nGPT."""
    if config.model_family == "gptplus":
        state = qwen3_state_dict(tensors, config, size)
    else:
        state = normalized_state_dict(tensors, config, size)
    return {name: tensor.to(DTYPES[dtype]) for name, tensor in state.items()}


def save_safetensors(state: dict[str, torch.Tensor], output: str, max_shard_bytes: int) -> None:
    """model.safetensors, or model-0000i-of-0000n.safetensors and their index above `max_shard_bytes`."""
    shards, current, current_bytes = [], {}, 0
    for name, tensor in state.items():
        size = tensor.numel() * tensor.element_size()
        if current and current_bytes + size > max_shard_bytes:
            shards.append(current)
            current, current_bytes = {}, 0
        current[name] = tensor.contiguous()
        current_bytes += size
    shards.append(current)
    if len(shards) == 1:
        save_file(shards[0], os.path.join(output, "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for index, shard in enumerate(shards, start=1):
        name = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(output, name), metadata={"format": "pt"})
        weight_map.update({key: name for key in shard})
    total = sum(t.numel() * t.element_size() for t in state.values())
    with open(os.path.join(output, "model.safetensors.index.json"), "w") as file:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, file, indent=2)


def layer_weights(config_json: dict, tensors: dict, config: AnGPTConfig) -> dict[str, torch.Tensor]:
    """angpt's (unstacked) parameter names and values of the model `config`, from the Hugging Face ones of a model
    directory with this config.json, the folded factors divided back out."""
    normalized = config_json["model_type"] == "angpt"
    factors = config_json.get("folded_factors", {}) if normalized else {}
    groups = config.num_query_groups

    def weight(prefix: str, name: str) -> torch.Tensor:
        value = tensors[f"{prefix}{name}.weight"].float()
        factor = factors.get(name.split(".")[-1], 1.0)
        return value if factor == 1.0 else value / factor

    state = {}
    for i in range(config.num_layers):
        hf, ours = f"model.layers.{i}.", f"decoder.layers.{i}."
        q, k, v = (weight(hf, f"self_attn.{name}_proj") for name in "qkv")
        up, gate = weight(hf, "mlp.up_proj"), weight(hf, "mlp.gate_proj")
        state.update({
            ours + "self_attention.linear_qkv.weight": join_qkv(q, k, v, groups),
            ours + "self_attention.linear_proj.weight": weight(hf, "self_attn.o_proj"),
            # angpt's fc1 is [u; z] with SiLU on z; GPT+'s (megatron-core's) is [gate; up].
            ours + "mlp.linear_fc1.weight": torch.cat([up, gate] if normalized else [gate, up]),
            ours + "mlp.linear_fc2.weight": weight(hf, "mlp.down_proj"),
        })
        if normalized:
            state[ours + "self_attention.core_attention.s_qk.s_hat"] = tensors[hf + "self_attn.s_qk.s_hat"]
            state[ours + "mlp.s_u.s_hat"] = tensors[hf + "mlp.s_u.s_hat"]
            state[ours + "mlp.s_v.s_hat"] = tensors[hf + "mlp.s_v.s_hat"]
            for residual in ("attention_residual", "mlp_residual"):
                if hf + f"{residual}.alpha.s_hat" in tensors:
                    state[ours + f"{residual}.alpha.s_hat"] = tensors[hf + f"{residual}.alpha.s_hat"]
        else:
            state.update({
                ours + "input_layernorm.weight": tensors[hf + "input_layernorm.weight"],
                ours + "self_attention.q_layernorm.weight": tensors[hf + "self_attn.q_norm.weight"],
                ours + "self_attention.k_layernorm.weight": tensors[hf + "self_attn.k_norm.weight"],
                ours + "pre_mlp_layernorm.weight": tensors[hf + "post_attention_layernorm.weight"],
            })
    return state


# The tensors vocabulary_weights gives that are indexed by token: the directory's rows, padded with zeros to the
# model's.
BY_TOKEN = ("embedding.word_embeddings.weight", "output_layer.weight", "output_layer.logit_scale.s_hat")


def vocabulary_weights(config_json: dict, tensors: dict) -> dict[str, torch.Tensor]:
    """The tensors indexed by token (padded later) and GPT+'s final norm, of a model directory with this
    config.json."""
    state = {"embedding.word_embeddings.weight": tensors["model.embed_tokens.weight"]}
    if "lm_head.weight" in tensors:
        state["output_layer.weight"] = tensors["lm_head.weight"]
    if config_json["model_type"] == "angpt":
        state["output_layer.logit_scale.s_hat"] = tensors["s_z.s_hat"]
    else:
        state["decoder.final_layernorm.weight"] = tensors["model.norm.weight"]
    return state
