"""README.md of an export: a model card of what the model is, how it was trained (as the checkpoint and the run's
metrics.jsonl record it) and how to load it, under Hugging Face's front matter."""

from __future__ import annotations

import os

from angpt.config.choices import FAMILY_DESCRIPTIONS
from angpt.hf.checkpoint_reader import Checkpoint
from angpt.hf.tokenizer_export import Vocabulary, tokenizer_description
from angpt.models import AnGPTConfig
from angpt.telemetry.metrics_reader import MetricsError, read_metrics


def metrics_path(checkpoint: Checkpoint) -> str:
    """The run's metrics.jsonl: --metrics-file, or beside its checkpoints (angpt.telemetry.monitoring's default)."""
    return checkpoint.config.logging.metrics_file or os.path.join(os.path.dirname(checkpoint.path), "metrics.jsonl")


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


def model_card(checkpoint: Checkpoint, config: AnGPTConfig, vocab: Vocabulary, parameters: int, dtype: str,
               output: str) -> str:
    """README.md of the export of the checkpoint's model `config` (at one process): what the model is, how it
    was trained (as the checkpoint and the run's metrics.jsonl record it) and how to load it, under Hugging
    Face's front matter."""
    run, family = checkpoint.config, checkpoint.family
    state = checkpoint.train_state or {}
    iteration = state.get("iteration")
    tags = dict.fromkeys(["angpt", family, "text-generation", "megatron-core",
                          "qwen3" if family == "gptplus" else "custom_code"])
    if iteration is None:
        trained = "- iterations and tokens: not recorded in the checkpoint"
        train_loss = validation_loss = "not available (the checkpoint records no iteration)"
    else:
        samples = state.get("consumed_samples")
        tokens = "not recorded" if samples is None else f"{samples * run.model.seq_length:,}"
        trained = (f"- {iteration} iterations of {run.training.global_batch_size} sequences of "
                   f"{run.model.seq_length} tokens; tokens seen: {tokens}")
        train_loss, validation_loss = recorded_losses(checkpoint, iteration)
    if run.data.mock_data:
        data = "synthetic token sequences (--mock-data): the weights have learned nothing about text"
    else:
        data = " ".join(str(item) for item in run.data.data_path or run.data.train_data_path or ()) or "not recorded"
    if run.checkpoint.finetune:
        data += f"; fine-tuned from {run.checkpoint.load}, the figures below count the fine-tuning only"
    architecture = "transformers' `Qwen3ForCausalLM`" if family == "gptplus" else \
        "`AnGPTForCausalLM`, remote code in `modeling_angpt.py` (load with `trust_remote_code=True`)"
    return "\n".join([
        "---", "library_name: transformers", "pipeline_tag: text-generation", "tags:", *(f"- {t}" for t in tags),
        "---", "", f"# {os.path.basename(output)}", "",
        f"A language model of the family {FAMILY_DESCRIPTIONS[family]}, trained with angpt (Megatron-style "
        f"pretraining on megatron-core), exported by `tools/convert_to_hf.py` from `{checkpoint.path}`.", "",
        "## Model", "",
        f"- architecture: {architecture}",
        f"- parameters: {parameters:,} as exported ({dtype} safetensors; the input embedding and the output head "
        "stored apart)",
        f"- layers {config.num_layers}, hidden size {config.hidden_size}, attention heads "
        f"{config.num_attention_heads} ({config.num_query_groups} key-value groups, head size {config.kv_channels}), "
        f"feed-forward size {config.ffn_hidden_size}, RoPE base {config.rotary_base}",
        f"- context length: {run.model.seq_length} tokens",
        f"- tokenizer: {tokenizer_summary(checkpoint, vocab)}", "",
        "## Training", "",
        f"- data: {data}", trained,
        f"- learning rate {run.optimizer.lr}, {run.optimizer.lr_decay_style} decay; "
        f"{'bf16' if run.precision.bf16 else 'fp32'} training",
        f"- final training loss: {train_loss}",
        f"- final validation loss: {validation_loss}", "",
        "## How to load", "", "```python", load_snippet(checkpoint, vocab, output), "```", "",
        "## License", "",
        "Not set by the export: the terms of the weights depend on the training data. Add a `license:` entry to the "
        "front matter above before publishing.", ""])
