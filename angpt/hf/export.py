"""Export an angpt checkpoint to a Hugging Face model directory (tools/convert_to_hf.py).

anGPT and nGPT become the remote-code model of `modeling_angpt.py` (copied into the output), with the
constant normalization factors folded into the scale multipliers and weights; GPT+ becomes transformers'
own `Qwen3ForCausalLM` (the same block: pre-RMSNorm, per-head QK RMSNorm before RoPE, SwiGLU, final
RMSNorm). The checkpoint is read in one CPU process whatever layout saved it: distributed checkpoints
store tensors by global name. The tokenizer the checkpoint records becomes a Hugging Face fast tokenizer
(tokenizer.json: copied, or converted from GPT-2's vocab.json + merges.txt, a tiktoken ranks file or
Megatron-LM's TikTokenizer .json vocabulary), and README.md is a model card of what was trained and how to load it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
from dataclasses import dataclass
from typing import Optional

import torch
from megatron.core import dist_checkpointing, parallel_state
from safetensors.torch import save_file
from tokenizers import Tokenizer
from transformers import GenerationConfig, Qwen3Config
from transformers.convert_slow_tokenizer import TikTokenConverter

from angpt.config.choices import EXPORT_DTYPES
from angpt.data.tokenizers import (
    EOD_TOKEN,
    GPT2_SPLIT_PATTERN,
    MegatronCoreTokenizer,
    TikTokenizer,
    load_gpt2_vocab_merges,
)
from angpt.hf import configuration_angpt
from angpt.megatron_compat import checkpoint_unpickling
from angpt.models.factors import NU_PLAIN_RESIDUAL
from angpt.models.scales import scale_init
from angpt.telemetry.metrics_reader import MetricsError, read_metrics
from angpt.training import checkpointing, distributed
from angpt.training.config_from_args import model_config_from_args

HERE = os.path.dirname(os.path.abspath(__file__))
REMOTE_CODE = ("configuration_angpt.py", "modeling_angpt.py")
AUTO_MAP = {"AutoConfig": "configuration_angpt.AnGPTConfig", "AutoModelForCausalLM": "modeling_angpt.AnGPTForCausalLM"}
DTYPES = dict(zip(EXPORT_DTYPES, (torch.float32, torch.bfloat16)))
LAYER = "decoder.layers."
# The training flags that shape an anGPT / nGPT model, recorded in its config.json (`angpt_args`) so that
# tools/convert_from_hf.py rebuilds the same model and unfolds the same factors.
MODEL_FLAGS = ("model_family", "num_layers", "hidden_size", "num_attention_heads", "num_query_groups",
               "ffn_hidden_size", "kv_channels", "seq_length", "rotary_base", "tie_embeddings_and_output_weights",
               "angpt_post_norm", "angpt_nu_p", "angpt_alpha_init", "angpt_constant_factors",
               "angpt_constant_factor_multiplier", "angpt_nu_alpha", "angpt_nu_alpha_multiplier",
               "angpt_no_nu_alpha_grad", "angpt_residual", "norm_epsilon")


class ExportError(ValueError):
    """A checkpoint that cannot be exported; the message says why."""


@dataclass
class Checkpoint:
    path: str  # the iter_XXXXXXX directory
    args: dict  # the training flags it was saved with
    tensors: dict  # the model's tensors by global name, layers stacked: [num_layers, ...]
    train_state: Optional[dict] = None  # checkpointing.TrainState as saved: iteration, consumed_samples

    @property
    def family(self) -> str:
        return self.args["model_family"]


def ensure_process_group() -> None:
    """megatron-core's checkpoint loading needs a process group: a one-process gloo group will do."""
    if not parallel_state.model_parallel_is_initialized():
        distributed.initialize()


def checkpoint_path(load: str, iteration: Optional[int] = None) -> str:
    """The iter_XXXXXXX directory of `iteration`, or of the latest one under `load`."""
    if not os.path.isdir(load):
        raise ExportError(f"{load}: no such directory")
    if iteration is None:
        try:
            iteration = checkpointing.read_latest_iteration(load)
        except checkpointing.CheckpointError as error:
            raise ExportError(str(error)) from error
        if iteration is None:
            raise ExportError(f"{load} is not a checkpoint directory: it has no {checkpointing.LATEST}")
    path = checkpointing.checkpoint_dir(load, iteration)
    if not os.path.isdir(path):
        found = checkpointing.complete_iterations(load)
        raise ExportError(f"{load} has no checkpoint of iteration {iteration} (it has {found or 'none'})")
    return path


def read_checkpoint(load: str, iteration: Optional[int] = None) -> Checkpoint:
    path = checkpoint_path(load, iteration)
    ensure_process_group()
    try:
        checkpointing.verify_checkpoint(path)
    except checkpointing.CheckpointError as error:
        raise ExportError(str(error)) from None
    try:
        common = dist_checkpointing.load_common_state_dict(path)
    except Exception as error:  # megatron-core raises several kinds for a directory it cannot read
        if isinstance(error, checkpoint_unpickling.UnsafeCheckpointError):
            raise ExportError(str(error)) from None
        raise ExportError(f"{path} is not a readable distributed checkpoint: {error}") from error
    args = common.get("args")
    if not isinstance(args, dict) or "model_family" not in args:
        raise ExportError(f"{path} records no training arguments with a model family: not an angpt checkpoint")
    if args["model_family"] not in ("angpt", "ngpt", "gptplus"):
        raise ExportError(f"{path}: unknown model family {args['model_family']!r} "
                          "(angpt, ngpt or gptplus can be exported)")
    try:
        checkpoint_unpickling.check_metadata(path)
        loaded = dist_checkpointing.load_plain_tensors(path)
    except Exception as error:
        unsafe = checkpoint_unpickling.refusal_in(error)
        if unsafe is None:
            raise
        raise ExportError(str(unsafe)) from None
    tensors = {key: value for key, value in loaded.items()
               if isinstance(value, torch.Tensor) and not key.startswith("optimizer")}
    return Checkpoint(path, args, tensors, common.get("train_state"))


def single_process_args(args: dict) -> argparse.Namespace:
    """The saved flags at one process (TP = PP = CP = 1, no virtual stages), in fp32."""
    return argparse.Namespace(**{
        **args, "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1, "context_parallel_size": 1,
        "sequence_parallel": False,
        "num_layers_per_virtual_pipeline_stage": None, "bf16": False, "recompute_granularity": None,
    })


def model_config(checkpoint: Checkpoint):
    return model_config_from_args(single_process_args(checkpoint.args))


def tokenizer_description(checkpoint: Checkpoint) -> Optional[dict]:
    path = os.path.join(checkpoint.path, "tokenizer", "angpt_tokenizer.json")
    if not os.path.isfile(path):
        return None
    with open(path) as file:
        return json.load(file)


@dataclass
class Vocabulary:
    size: int  # the tokenizer's, to which the padded vocabulary is trimmed
    eos_token_id: int
    tokenizer_file: Optional[str]  # tokenizer.json copied with the checkpoint, when there is one
    eos_token: Optional[str]
    # Converted from the checkpoint's GPT-2 BPE or tiktoken files, to be written as tokenizer.json.
    converted: Optional[Tokenizer] = None


def tokenizer_copy(checkpoint: Checkpoint, description: dict, name: str) -> str:
    """The copy in the checkpoint of the tokenizer file `name` of the description."""
    path = os.path.join(checkpoint.path, "tokenizer", os.path.basename(description[name]["path"]))
    if not os.path.isfile(path):
        raise ExportError(f"{path} is missing: {checkpoint.path}/tokenizer/angpt_tokenizer.json names it as its "
                          f"{name}")
    return path


def tiktoken_tokenizer(path: str, tokenizer_type: str) -> Tokenizer:
    """The byte-level BPE of a tiktoken ranks file (transformers' conversion: vocabulary = ranks, and a
    merge for each way of splitting a token into two tokens, in rank order), split as our TikTokenizer splits
    (GPT-2's pattern), with its end-of-document token as a special token."""
    ours = TikTokenizer(path, tokenizer_type)
    converted = TikTokenConverter(vocab_file=path, pattern=GPT2_SPLIT_PATTERN,
                                  extra_special_tokens=[EOD_TOKEN]).converted()
    if converted.token_to_id(EOD_TOKEN) != ours.eod:  # the added token takes the next free id, or its own rank
        raise ExportError(f"{path}: {EOD_TOKEN} would be id {converted.token_to_id(EOD_TOKEN)} in the export, "
                          f"not {ours.eod} as in training (ranks with gaps, or a ranks file that holds it)")
    return converted


def megatron_tiktoken_tokenizer(path: str, description: dict) -> Tokenizer:
    """Megatron-LM's TikTokenizer (a .json vocabulary) as a byte-level BPE: transformers' conversion of the ranks
    tiktoken encodes with (shifted past the special tokens and cut to --vocab-size by megatron-core), split with
    its pattern, its special tokens at their ids 0..N-1."""
    ours = MegatronCoreTokenizer(description["type"], path, tiktoken_pattern=description["pattern"],
                                 tiktoken_num_special_tokens=description["num_special_tokens"],
                                 vocab_size=description["vocab_size"])
    encoding = ours.encoder  # tiktoken keeps its ranks, special tokens and pattern private
    specials = encoding._special_tokens
    converter = TikTokenConverter(pattern=encoding._pat_str, extra_special_tokens=list(specials))
    converter.load_tiktoken_bpe = lambda _: encoding._mergeable_ranks  # megatron-core's, not a ranks file's
    vocab, merges = converter.extract_vocab_merges_from_model(path)
    # In the BPE's vocabulary, the special tokens keep their ids when added. (A rank spelt as one, which the
    # merge replaces, is never reached: tiktoken and the export both match the special token first.)
    converter.extract_vocab_merges_from_model = lambda _: ({**vocab, **specials}, merges)
    return converter.converted()


def vocabulary(checkpoint: Checkpoint) -> Vocabulary:
    description = tokenizer_description(checkpoint)
    if description is None:  # --mock-data: ids 0..vocab_size-1, the last one ending documents
        size = checkpoint.args["vocab_size"]
        return Vocabulary(size, size - 1, None, None)
    kind = description.get("type")
    if kind == "HuggingFaceTokenizer":
        path = tokenizer_copy(checkpoint, description, "model")
        tokenizer, converted = Tokenizer.from_file(path), None
        eos = description["eod_token"]
    elif kind == "TikTokenizer" and "num_special_tokens" in description:  # Megatron-LM's, not a ranks file
        path, eos = None, description["eod_token"]
        tokenizer = converted = megatron_tiktoken_tokenizer(tokenizer_copy(checkpoint, description, "model"),
                                                            description)
    elif kind in ("TikTokenizer", "GPT2BPETokenizer"):  # GPT2BPETokenizer: vocab.json + merges.txt, or ranks
        path, eos = None, EOD_TOKEN
        if "model" in description:
            tokenizer = converted = tiktoken_tokenizer(tokenizer_copy(checkpoint, description, "model"), kind)
        else:
            tokenizer = converted = load_gpt2_vocab_merges(tokenizer_copy(checkpoint, description, "vocab_file"),
                                                           tokenizer_copy(checkpoint, description, "merge_file")
                                                           ).tokenizer
    else:
        raise ExportError(f"{checkpoint.path}/tokenizer/angpt_tokenizer.json: tokenizer type {kind!r} cannot be "
                          "exported (HuggingFaceTokenizer, TikTokenizer and GPT2BPETokenizer can)")
    size = max(tokenizer.get_vocab(with_added_tokens=True).values()) + 1
    return Vocabulary(size, tokenizer.token_to_id(eos), path, eos, converted)


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


def constant_factors(config):
    """The constant factors of anGPT / nGPT's config (nGPT's are all 1)."""
    if config.constant_factors == "exact":
        raise ExportError("the 'exact' constant-factor ablation normalizes activations where the factors were; "
                          "the exported model folds constant factors only")
    return config.normalization_factors()


def folded_factors(config) -> dict[str, float]:
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


def scale_multipliers(config) -> dict[str, float]:
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


def head_dim(args: dict) -> int:
    return args.get("kv_channels") or args["hidden_size"] // args["num_attention_heads"]


def query_groups(args: dict) -> int:
    return args.get("num_query_groups") or args["num_attention_heads"]


def normalized_state_dict(checkpoint: Checkpoint, config, size: int) -> dict[str, torch.Tensor]:
    """The remote-code model's tensors from the checkpoint's (anGPT, nGPT)."""
    t, args = checkpoint.tensors, checkpoint.args
    factors = folded_factors(config)
    f = config.ffn_hidden_size
    state = {"model.embed_tokens.weight": t["embedding.word_embeddings.weight"][:size]}
    head = t.get("output_layer.weight", t["embedding.word_embeddings.weight"])
    state["lm_head.weight"] = head[:size]
    state["s_z.s_hat"] = t["output_layer.logit_scale.s_hat"][:size]
    for i in range(args["num_layers"]):
        prefix = f"model.layers.{i}."
        q, k, v = split_qkv(t[LAYER + "self_attention.linear_qkv.weight"][i], args["num_attention_heads"],
                            query_groups(args), head_dim(args))
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


def qwen3_state_dict(checkpoint: Checkpoint, config, size: int) -> dict[str, torch.Tensor]:
    """Qwen3ForCausalLM's tensors from a GPT+ checkpoint's (megatron-core stores each pre-norm's weight
    with the linear layer after it, as Transformer Engine fuses them)."""
    t, args = checkpoint.tensors, checkpoint.args
    f = config.ffn_hidden_size
    state = {
        "model.embed_tokens.weight": t["embedding.word_embeddings.weight"][:size],
        "model.norm.weight": t["decoder.final_layernorm.weight"],
        "lm_head.weight": t.get("output_layer.weight", t["embedding.word_embeddings.weight"])[:size],
    }
    for i in range(args["num_layers"]):
        prefix = f"model.layers.{i}."
        q, k, v = split_qkv(t[LAYER + "self_attention.linear_qkv.weight"][i], args["num_attention_heads"],
                            query_groups(args), head_dim(args))
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


def hf_config(checkpoint: Checkpoint, config, vocab: Vocabulary, dtype: str):
    args = checkpoint.args
    common = dict(
        vocab_size=vocab.size, hidden_size=config.hidden_size, intermediate_size=config.ffn_hidden_size,
        num_hidden_layers=config.num_layers, num_attention_heads=config.num_attention_heads,
        num_key_value_heads=query_groups(args), head_dim=head_dim(args),
        max_position_embeddings=args["seq_length"], tie_word_embeddings=False,
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
        angpt_args={flag: args.get(flag) for flag in MODEL_FLAGS},
    )
    hf.auto_map = AUTO_MAP
    return hf


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


def save_tokenizer(vocab: Vocabulary, output: str, max_length: int) -> None:
    if vocab.tokenizer_file is not None:
        shutil.copy(vocab.tokenizer_file, os.path.join(output, "tokenizer.json"))
    elif vocab.converted is not None:
        vocab.converted.save(os.path.join(output, "tokenizer.json"))
    else:
        return
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": vocab.eos_token, "bos_token": vocab.eos_token,
              "pad_token": vocab.eos_token, "model_max_length": max_length, "clean_up_tokenization_spaces": False}
    with open(os.path.join(output, "tokenizer_config.json"), "w") as file:
        json.dump(config, file, indent=2)


FAMILY_NAMES = {
    "angpt": "anGPT (the Approximately Normalized GPT; Franke et al., NeurIPS 2025, arXiv 2505.22014)",
    "ngpt": "nGPT (the normalized Transformer; Loshchilov et al., ICLR 2025)",
    "gptplus": "GPT+ (a pre-norm GPT with RMSNorm, RoPE, SwiGLU and QK-norm: the block of Qwen3)",
}


def metrics_path(checkpoint: Checkpoint) -> str:
    """The run's metrics.jsonl: --metrics-file, or beside its checkpoints (angpt.telemetry.monitoring's default)."""
    return checkpoint.args.get("metrics_file") or os.path.join(os.path.dirname(checkpoint.path), "metrics.jsonl")


def recorded_losses(checkpoint: Checkpoint, iteration: int) -> tuple[str, str]:
    """The last training and validation loss the run logged up to `iteration`, as the model card states them,
    or why there is none (no invented figure)."""
    path = metrics_path(checkpoint)
    try:
        records = read_metrics(path, warn=False)
    except MetricsError as error:
        return (f"not available ({error})",) * 2
    lines = []
    for kind, split, averaged in (("train", None, "the steps since the previous log line"),
                                  ("eval", "validation", "the evaluation's batches")):
        found = [record for record in records if record["kind"] == kind and record["iteration"] <= iteration
                 and (split is None or record.get("split") == split)]
        if not found:
            lines.append(f"not recorded ({path} has no {split or kind} loss up to iteration {iteration})")
        elif found[-1].get("lm_loss") is None:  # metrics.jsonl writes a NaN or infinite loss as null
            lines.append(f"not finite at iteration {found[-1]['iteration']}")
        else:
            lines.append(f"{found[-1]['lm_loss']:.4f} (lm loss at iteration {found[-1]['iteration']}, mean over "
                         f"{averaged})")
    return lines[0], lines[1]


def tokenizer_summary(checkpoint: Checkpoint, vocab: Vocabulary) -> str:
    description = tokenizer_description(checkpoint)
    if description is None:
        return (f"none: trained on synthetic token ids (--mock-data), so the export has no tokenizer; ids 0 to "
                f"{vocab.size - 1}, of which {vocab.eos_token_id} ends documents")
    files = ", ".join(os.path.basename(entry["path"]) for entry in description.values()
                      if isinstance(entry, dict) and "path" in entry)
    source = {"HuggingFaceTokenizer": f"the Hugging Face tokenizer it was trained with ({files}), copied",
              "TikTokenizer": f"tiktoken BPE ranks ({files}) with GPT-2's split pattern, converted",
              }.get(description["type"], f"GPT-2's byte-level BPE ({files}), converted")
    if "num_special_tokens" in description:
        source = (f"Megatron-LM's TikTokenizer vocabulary ({files}; {description['num_special_tokens']} special tokens "
                  f"first, pattern {description['pattern']}), converted")
    return (f"{source} to `tokenizer.json`; {vocab.size} tokens, `{vocab.eos_token}` (id {vocab.eos_token_id}) "
            "ends documents and is the eos token")


def load_snippet(checkpoint: Checkpoint, vocab: Vocabulary, output: str) -> str:
    remote = "" if checkpoint.family == "gptplus" else ", trust_remote_code=True"
    path = f'path = "{output}"  # this directory, or its Hub repository id once uploaded'
    if vocab.converted is None and vocab.tokenizer_file is None:
        return "\n".join([
            "import torch", "from transformers import AutoModelForCausalLM", "", path,
            f"model = AutoModelForCausalLM.from_pretrained(path{remote})",
            f"ids = torch.tensor([[1, 2, 3]])  # no tokenizer: token ids below {vocab.size}",
            "output = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, do_sample=False)",
            "print(output[0].tolist())"])
    return "\n".join([
        "from transformers import AutoModelForCausalLM, AutoTokenizer", "", path,
        f"tokenizer = AutoTokenizer.from_pretrained(path{remote})",
        f"model = AutoModelForCausalLM.from_pretrained(path{remote})",
        'inputs = tokenizer("The quick brown fox", return_tensors="pt")',
        "output = model.generate(**inputs, max_new_tokens=40, do_sample=False)",
        "print(tokenizer.decode(output[0]))"])


def model_card(checkpoint: Checkpoint, config, vocab: Vocabulary, parameters: int, dtype: str, output: str) -> str:
    """README.md of the export: what the model is, how it was trained (as the checkpoint and the run's
    metrics.jsonl record it) and how to load it, under Hugging Face's front matter."""
    args, family = checkpoint.args, checkpoint.family
    state = checkpoint.train_state or {}
    iteration = state.get("iteration")
    tags = dict.fromkeys(["angpt", family, "text-generation", "megatron-core",
                          "qwen3" if family == "gptplus" else "custom_code"])
    if iteration is None:
        trained = "- iterations and tokens: not recorded in the checkpoint"
        train_loss = validation_loss = "not available (the checkpoint records no iteration)"
    else:
        samples = state.get("consumed_samples")
        tokens = "not recorded" if samples is None else f"{samples * args['seq_length']:,}"
        trained = (f"- {iteration} iterations of {args['global_batch_size']} sequences of {args['seq_length']} "
                   f"tokens; tokens seen: {tokens}")
        train_loss, validation_loss = recorded_losses(checkpoint, iteration)
    if args.get("mock_data"):
        data = "synthetic token sequences (--mock-data): the weights have learned nothing about text"
    else:
        data = " ".join(str(item) for item in args.get("data_path") or args.get("train_data_path") or []) \
            or "not recorded"
    if args.get("finetune"):
        data += f"; fine-tuned from {args.get('load')}, the figures below count the fine-tuning only"
    architecture = "transformers' `Qwen3ForCausalLM`" if family == "gptplus" else \
        "`AnGPTForCausalLM`, remote code in `modeling_angpt.py` (load with `trust_remote_code=True`)"
    return "\n".join([
        "---", "library_name: transformers", "pipeline_tag: text-generation", "tags:", *(f"- {t}" for t in tags),
        "---", "", f"# {os.path.basename(output)}", "",
        f"A language model of the family {FAMILY_NAMES[family]}, trained with angpt (Megatron-style pretraining on "
        f"megatron-core), exported by `tools/convert_to_hf.py` from `{checkpoint.path}`.", "",
        "## Model", "",
        f"- architecture: {architecture}",
        f"- parameters: {parameters:,} as exported ({dtype} safetensors; the input embedding and the output head "
        "stored apart)",
        f"- layers {config.num_layers}, hidden size {config.hidden_size}, attention heads "
        f"{config.num_attention_heads} ({query_groups(args)} key-value groups, head size {head_dim(args)}), "
        f"feed-forward size {config.ffn_hidden_size}, RoPE base {config.rotary_base}",
        f"- context length: {args['seq_length']} tokens",
        f"- tokenizer: {tokenizer_summary(checkpoint, vocab)}", "",
        "## Training", "",
        f"- data: {data}", trained,
        f"- learning rate {args.get('lr')}, {args.get('lr_decay_style')} decay; "
        f"{'bf16' if args.get('bf16') else 'fp32'} training",
        f"- final training loss: {train_loss}",
        f"- final validation loss: {validation_loss}", "",
        "## How to load", "", "```python", load_snippet(checkpoint, vocab, output), "```", "",
        "## License", "",
        "Not set by the export: the terms of the weights depend on the training data. Add a `license:` entry to the "
        "front matter above before publishing.", ""])


def _replace_directory(staging: str, output: str) -> None:
    """Put the finished `staging` where `output` is: what was there goes (no stale file stays beside the
    new export: an old model.safetensors would shadow new shards)."""
    if not os.path.exists(output):
        os.rename(staging, output)
        return
    previous = staging + ".previous"
    os.rename(output, previous)
    os.rename(staging, output)
    shutil.rmtree(previous)


def export(load: str, output: str, iteration: Optional[int] = None, dtype: str = "float32",
           max_shard_bytes: int = 5 * 2**30, overwrite: bool = False) -> Checkpoint:
    """Write the Hugging Face directory of a checkpoint; returns the checkpoint read. An `output` that is
    not empty is refused unless `overwrite`, and is then replaced whole. The export is written to a
    sibling directory and moved into place when complete."""
    if dtype not in DTYPES:
        raise ExportError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if os.path.exists(output) and not os.path.isdir(output):
        raise ExportError(f"{output} exists and is not a directory")
    output = os.path.abspath(output)
    if os.path.commonpath([output, os.path.abspath(load)]) == output:  # replacing it would delete the checkpoint
        raise ExportError(f"{output} holds the checkpoint {load}: export to another directory")
    if os.path.isdir(output) and os.listdir(output) and not overwrite:
        raise ExportError(f"{output} is not empty: give --overwrite to replace it with the new export")
    checkpoint = read_checkpoint(load, iteration)
    config = model_config(checkpoint)
    vocab = vocabulary(checkpoint)
    if checkpoint.family == "gptplus":
        state = qwen3_state_dict(checkpoint, config, vocab.size)
    else:
        state = normalized_state_dict(checkpoint, config, vocab.size)
    state = {name: tensor.to(DTYPES[dtype]) for name, tensor in state.items()}
    staging = os.path.join(os.path.dirname(output), f".{os.path.basename(output)}.incomplete-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(staging)
    try:
        hf_config(checkpoint, config, vocab, dtype).save_pretrained(staging)
        if checkpoint.family != "gptplus":
            for name in REMOTE_CODE:
                shutil.copy(os.path.join(HERE, name), os.path.join(staging, name))
        save_safetensors(state, staging, max_shard_bytes)
        save_tokenizer(vocab, staging, checkpoint.args["seq_length"])
        parameters = sum(tensor.numel() for tensor in state.values())
        with open(os.path.join(staging, "README.md"), "w", encoding="utf-8") as file:
            file.write(model_card(checkpoint, config, vocab, parameters, dtype, output))
        GenerationConfig(bos_token_id=vocab.eos_token_id, eos_token_id=vocab.eos_token_id,
                         pad_token_id=vocab.eos_token_id).save_pretrained(staging)
        _replace_directory(staging, output)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return checkpoint
