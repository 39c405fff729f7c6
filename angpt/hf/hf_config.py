"""The config.json of an export: transformers' Qwen3Config for GPT+; for anGPT and nGPT the remote code's
AnGPTConfig (configuration_angpt.py, copied into the export with modeling_angpt.py), with the folded factors,
the scale multipliers and the training flags that shape the model."""

from __future__ import annotations

import os

from transformers import PretrainedConfig, Qwen3Config

from angpt.hf import configuration_angpt
from angpt.hf.checkpoint_reader import Checkpoint
from angpt.hf.tokenizer_export import Vocabulary
from angpt.hf.weights import folded_factors, scale_multipliers
from angpt.models import AnGPTConfig
from angpt.models.factors import NU_PLAIN_RESIDUAL

HERE = os.path.dirname(os.path.abspath(__file__))
REMOTE_CODE = ("configuration_angpt.py", "modeling_angpt.py")
AUTO_MAP = {"AutoConfig": "configuration_angpt.AnGPTConfig", "AutoModelForCausalLM": "modeling_angpt.AnGPTForCausalLM"}
# The training flags that shape an anGPT / nGPT model, recorded in its config.json (`angpt_args`) so that
# tools/convert_from_hf.py rebuilds the same model and unfolds the same factors.
MODEL_FLAGS = ("model_family", "num_layers", "hidden_size", "num_attention_heads", "num_query_groups",
               "ffn_hidden_size", "kv_channels", "seq_length", "rotary_base", "tie_embeddings_and_output_weights",
               "angpt_post_norm", "angpt_nu_p", "angpt_alpha_init", "angpt_constant_factors",
               "angpt_constant_factor_multiplier", "angpt_nu_alpha", "angpt_nu_alpha_multiplier",
               "angpt_no_nu_alpha_grad", "angpt_residual", "norm_epsilon")


def hf_config(checkpoint: Checkpoint, config: AnGPTConfig, vocab: Vocabulary, dtype: str) -> PretrainedConfig:
    """The Hugging Face config of the checkpoint's model `config` (at one process), its vocabulary trimmed to
    the tokenizer's."""
    common = dict(
        vocab_size=vocab.size, hidden_size=config.hidden_size, intermediate_size=config.ffn_hidden_size,
        num_hidden_layers=config.num_layers, num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_query_groups, head_dim=config.kv_channels,
        max_position_embeddings=checkpoint.config.model.seq_length, tie_word_embeddings=False,
        bos_token_id=vocab.eos_token_id, eos_token_id=vocab.eos_token_id, dtype=dtype,
    )
    if checkpoint.family == "gptplus":
        return Qwen3Config(**common, rms_norm_eps=config.layernorm_epsilon, attention_bias=False, hidden_act="silu",
                           rope_parameters={"rope_type": "default", "rope_theta": float(config.rotary_base)},
                           architectures=["Qwen3ForCausalLM"])
    hf = configuration_angpt.AnGPTConfig(
        **common, rope_theta=float(config.rotary_base), model_family=config.model_family, post_norm=config.post_norm,
        residual=config.residual, nu_alpha_mode=config.nu_alpha_mode, nu_alpha_multiplier=config.nu_alpha_multiplier,
        nu_alpha_plain=NU_PLAIN_RESIDUAL, alpha_abs=config.alpha_abs, scale_multipliers=scale_multipliers(config),
        architectures=["AnGPTForCausalLM"], folded_factors=folded_factors(config),
        # As the checkpoint records them (None where it does not), for tools/convert_from_hf.py.
        angpt_args={flag: checkpoint.args.get(flag) for flag in MODEL_FLAGS},
    )
    hf.auto_map = AUTO_MAP
    return hf
