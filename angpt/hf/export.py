"""Export an angpt checkpoint to a Hugging Face model directory (tools/convert_to_hf.py).

anGPT and nGPT become the remote-code model of `modeling_angpt.py` (copied into the output), with the
constant normalization factors folded into the scale multipliers and weights; GPT+ becomes transformers'
own `Qwen3ForCausalLM` (the same block: pre-RMSNorm, per-head QK RMSNorm before RoPE, SwiGLU, final
RMSNorm). The checkpoint is read in one CPU process whatever layout saved it (`checkpoint_reader`), its
weights mapped (`weights`), its tokenizer converted (`tokenizer_export`), README.md written as a model card
(`model_card`) and the directory staged beside the output and moved into place (`staging`).
"""

from __future__ import annotations

import os
import shutil
from typing import Optional

from transformers import GenerationConfig

from angpt.hf.checkpoint_reader import Checkpoint, model_config, read_checkpoint
from angpt.hf.errors import ExportError
from angpt.hf.hf_config import HERE, REMOTE_CODE, hf_config
from angpt.hf.model_card import model_card
from angpt.hf.staging import checked_output, staged
from angpt.hf.tokenizer_export import save_tokenizer, vocabulary
from angpt.hf.weights import DTYPES, exported_state_dict, save_safetensors

__all__ = ["Checkpoint", "ExportError", "export"]


def export(load: str, output: str, iteration: Optional[int] = None, dtype: str = "float32",
           max_shard_bytes: int = 5 * 2**30, overwrite: bool = False) -> Checkpoint:
    """Write the Hugging Face directory of a checkpoint; returns the checkpoint read. An `output` that is
    not empty is refused unless `overwrite`, and is then replaced whole. The export is written to a
    sibling directory and moved into place when complete."""
    if dtype not in DTYPES:
        raise ExportError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    output = checked_output(load, output, overwrite)
    checkpoint = read_checkpoint(load, iteration)
    config = model_config(checkpoint)
    vocab = vocabulary(checkpoint)
    state = exported_state_dict(checkpoint.tensors, config, vocab.size, dtype)
    with staged(output) as staging:
        hf_config(checkpoint, config, vocab, dtype).save_pretrained(staging)
        if checkpoint.family != "gptplus":
            for name in REMOTE_CODE:
                shutil.copy(os.path.join(HERE, name), os.path.join(staging, name))
        save_safetensors(state, staging, max_shard_bytes)
        save_tokenizer(vocab, staging, checkpoint.config.model.seq_length)
        parameters = sum(tensor.numel() for tensor in state.values())
        with open(os.path.join(staging, "README.md"), "w", encoding="utf-8") as file:
            file.write(model_card(checkpoint, config, vocab, parameters, dtype, output))
        GenerationConfig(bos_token_id=vocab.eos_token_id, eos_token_id=vocab.eos_token_id,
                         pad_token_id=vocab.eos_token_id).save_pretrained(staging)
    return checkpoint
