"""Import a Hugging Face model directory as an angpt checkpoint (tools/convert_from_hf.py): anGPT and nGPT
directories written by tools/convert_to_hf.py, and Qwen3-shaped models as GPT+. The checkpoint holds the
model at TP = PP = 1 (distributed checkpoints load at any layout) and the trainer takes it with
`--load DIR --finetune`."""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import asdict

import torch
from megatron.core import dist_checkpointing
from safetensors import SafetensorError
from safetensors.torch import load_file

from angpt.config.arguments import settings_to_argv
from angpt.config.files import read_json_object
from angpt.config.saved import config_from_saved, single_process
from angpt.config.sections import RunConfig
from angpt.data.tokenizers import describe_file, read_huggingface_tokenizer
from angpt.hf.checkpoint_reader import ensure_process_group
from angpt.hf.errors import ExportError
from angpt.hf.hf_config import MODEL_FLAGS
from angpt.hf.weights import BY_TOKEN, layer_weights, vocabulary_weights
from angpt.models.gpt import build_model
from angpt.training import checkpointing
from angpt.training.megatron_configs import transformer_config

logger = logging.getLogger("angpt.hf")


def read_hf(directory: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json, every tensor by name) of a Hugging Face model directory, sharded or not."""
    config_path = os.path.join(directory, "config.json")
    if not os.path.isfile(config_path):
        raise ExportError(f"{directory} is not a Hugging Face model directory: it has no config.json")
    config = _read_json_object(config_path)
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.isfile(index):
        weight_map = _read_json_object(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(name, str) for name in weight_map.values()):
            raise ExportError(f"{index}: no weight_map of tensor names to files")
        files = sorted(set(weight_map.values()))
    elif os.path.isfile(os.path.join(directory, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        raise ExportError(f"{directory} has no safetensors weights (model.safetensors or its index)")
    tensors = {}
    for name in files:
        path = os.path.join(directory, name)
        try:
            tensors.update(load_file(path))
        except FileNotFoundError:
            raise ExportError(f"{path}: no such file (its index names it)") from None
        except SafetensorError as error:
            raise ExportError(f"{path}: not a safetensors file: {error}") from None
    return config, tensors


def _read_json_object(path: str) -> dict:
    try:
        return read_json_object(path)
    except ValueError as error:
        raise ExportError(str(error)) from None


def default_args() -> dict:
    """The trainer's flags at their defaults, as a checkpoint records them."""
    return RunConfig().flags()


def model_flags(args: dict) -> str:
    """The command-line flags of the model in `args` that differ from the trainer's defaults."""
    defaults = default_args()
    changed = {name: args[name] for name in MODEL_FLAGS if args.get(name) != defaults.get(name)}
    return " ".join(settings_to_argv(changed))


def qwen3_args(config: dict) -> dict:
    """The training flags of a Qwen3 model as GPT+, refusing what GPT+ does not have."""
    rope = config.get("rope_parameters") or {"rope_type": "default", "rope_theta": config.get("rope_theta", 10000)}
    unsupported = {
        "attention_bias": config.get("attention_bias"), "use_sliding_window": config.get("use_sliding_window"),
        "rope_type": rope.get("rope_type") != "default", "hidden_act": config.get("hidden_act", "silu") != "silu",
    }
    refused = [name for name, value in unsupported.items() if value]
    if refused:
        raise ExportError(f"this Qwen3 model has {', '.join(refused)}, which GPT+ does not")
    return {
        "model_family": "gptplus", "num_layers": config["num_hidden_layers"], "hidden_size": config["hidden_size"],
        "num_attention_heads": config["num_attention_heads"], "num_query_groups": config["num_key_value_heads"],
        "kv_channels": config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"],
        "ffn_hidden_size": config["intermediate_size"], "seq_length": config["max_position_embeddings"],
        "rotary_base": int(rope["rope_theta"]), "norm_epsilon": config.get("rms_norm_eps", 1e-5),
        "tie_embeddings_and_output_weights": config.get("tie_word_embeddings", False),
    }


def tokenizer_description(directory: str, eos_token_id: int):
    """The description the trainer saves with a checkpoint, of the directory's tokenizer.json."""
    path = os.path.join(directory, "tokenizer.json")
    if not os.path.isfile(path):
        return None
    try:
        tokenizer = read_huggingface_tokenizer(path)
    except ValueError as error:
        raise ExportError(str(error)) from None
    return {"type": "HuggingFaceTokenizer", "model": describe_file(path),
            "eod_token": tokenizer.id_to_token(eos_token_id)}


def import_hf(directory: str, save: str, make_vocab_size_divisible_by: int = 128, tensor_parallel: int = 1) -> dict:
    """Write `directory` as the checkpoint `save`/iter_0000000; returns its training flags. The vocabulary
    is padded as the trainer pads it at `tensor_parallel` ranks, with zero rows."""
    config, tensors = read_hf(directory)
    tokenizer = tokenizer_description(directory, config.get("eos_token_id"))  # read before anything is written
    if config.get("model_type") == "angpt":
        if not config.get("angpt_args"):
            raise ExportError(f"{directory}: an anGPT config without angpt_args was not written by convert_to_hf.py")
        model_args = config["angpt_args"]
    elif config.get("model_type") == "qwen3":
        model_args = qwen3_args(config)
    else:
        raise ExportError(f"{directory}: model type {config.get('model_type')!r} cannot be imported "
                          "(anGPT/nGPT exported by angpt, or Qwen3 as GPT+)")
    vocab_size = config["vocab_size"]
    args = {**default_args(), **{k: v for k, v in model_args.items() if k in MODEL_FLAGS},
            "vocab_size": vocab_size, "make_vocab_size_divisible_by": make_vocab_size_divisible_by}
    ensure_process_group()
    run = config_from_saved(args)
    model_config = transformer_config(single_process(run))
    padded = run.replace(parallel=dict(tensor_model_parallel_size=tensor_parallel)).padded_vocab_size(vocab_size)
    model = build_model(model_config, padded, run.model.seq_length)
    fit = f"do not fit the model its config.json describes ({model_flags(args)})"
    try:
        state = {**layer_weights(config, tensors, model_config), **vocabulary_weights(config, tensors)}
    except KeyError as error:  # a tensor the config's layers need is in none of the files
        raise ExportError(f"{directory}: its safetensors files have no tensor {error.args[0]}, which its config.json's "
                          f"model has") from None
    except RuntimeError as error:  # the query, key and value rows of another shape than the config's heads
        raise ExportError(f"{directory}: its tensors {fit}: {str(error).splitlines()[0]}") from None
    parameters = dict(model.named_parameters())
    missing = sorted(set(parameters) - set(state))
    if missing:
        raise ExportError(f"{directory} lacks tensors for {missing[:5]}")
    # Each tensor of the config's shape, the vocabulary's at most its padded rows.
    wrong = [f"{name} {tuple(state[name].shape)}, the model's {tuple(parameter.shape)}"
             for name, parameter in parameters.items() if not (
                 state[name].shape == parameter.shape
                 or name in BY_TOKEN and state[name].shape[1:] == parameter.shape[1:]
                 and state[name].shape[0] <= parameter.shape[0])]
    if wrong:
        raise ExportError(f"{directory}: its tensors {fit}: {'; '.join(wrong[:3])}"
                          f"{f' and {len(wrong) - 3} more' if len(wrong) > 3 else ''}")
    with torch.no_grad():
        for name, parameter in parameters.items():
            value = state[name].to(parameter.dtype)
            if value.shape != parameter.shape:  # the vocabulary, padded
                parameter.zero_()
                parameter[: value.shape[0]] = value
            else:
                parameter.copy_(value)
    staging = checkpointing.checkpoint_dir(save, 0) + checkpointing.INCOMPLETE
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(staging)
    dist_checkpointing.save({
        "model": model.sharded_state_dict(), "args": args, "checkpoint_version": 3.0,
        "train_state": asdict(checkpointing.TrainState()), "layout": {"tensor": 1, "pipeline": 1, "data": 1},
    }, staging)
    checkpointing.commit_checkpoint(save, 0, tokenizer)
    return args
