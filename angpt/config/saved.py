"""The one reader of the flags a checkpoint recorded (its `args`, `RunConfig.flags()` at the time): today's
configuration of them, for resuming, --finetune and the Hugging Face export and import.

A checkpoint saved before a flag existed does not record it: the field's default stands in for it, which is
what the run had (each flag was added with a default that keeps the earlier behaviour). Flags a checkpoint
records that no longer exist are left out; the values derived from the flags are derived again.
"""

from __future__ import annotations

from typing import Any, Mapping

from angpt.config.sections import FIELD_SECTIONS, MEGATRON_PREFIX, RunConfig, option_of
from angpt.config.validation import derive

# The model's shape: what a checkpoint's tensors must match (a resume, --finetune) and what an export writes.
MODEL_SHAPE = ("model_family", "num_layers", "hidden_size", "num_attention_heads", "num_query_groups",
               "ffn_hidden_size", "kv_channels", "tie_embeddings_and_output_weights")
# The flags of what the model computes beyond its shape: a resume continues the same function (Megatron-LM's
# check_checkpoint_args compares its position handling too); --finetune may change them.
MODEL_FUNCTION = ("rotary_base", "rotary_percent", "rotary_interleaved", "use_rope_scaling", "angpt_post_norm",
                  "angpt_nu_p", "angpt_constant_factors", "angpt_constant_factor_multiplier", "angpt_nu_alpha",
                  "angpt_nu_alpha_multiplier", "angpt_no_nu_alpha_grad", "angpt_residual")
# GPT's architecture flags that change its parameters (the other families fix them).
GPT_SHAPE = ("untie_embeddings_and_output_weights", "max_position_embeddings", "normalization", "add_bias_linear",
             "add_qkv_bias", "qk_layernorm", "position_embedding_type", "swiglu", "quick_geglu",
             "group_query_attention")

# --use-checkpoint-args: Megatron-LM's load_args_from_checkpoint (core_v0.16.1) by our names. Those it takes where
# the command line leaves them unset (its _set_arg without force); here where neither it nor --config gives them:
TAKEN_UNLESS_GIVEN = ("num_layers", "hidden_size", "ffn_hidden_size", "seq_length", "num_attention_heads",
                      "kv_channels", "max_position_embeddings")
# Those it takes whatever was given (force), with the families' own model flags, which it lacks (MODEL_SHAPE,
# MODEL_FUNCTION, GPT_SHAPE: what a resume must match anyway).
TAKEN = tuple(name for name in dict.fromkeys(MODEL_SHAPE + MODEL_FUNCTION + GPT_SHAPE + (
    "use_rotary_position_embeddings", "squared_relu", "layernorm_zero_centered_gamma", "apply_query_key_layer_scaling",
    "attention_dropout", "hidden_dropout", "tiktoken_pattern")) if name not in TAKEN_UNLESS_GIVEN)
# Unless --no-use-tokenizer-model-from-checkpoint-args; with --use-mp-args-from-checkpoint-args (the last one
# unless given).
TOKENIZER_TAKEN = ("tokenizer_type", "tokenizer_model")
PARALLEL_TAKEN = ("tensor_model_parallel_size", "pipeline_model_parallel_size")
PARALLEL_TAKEN_UNLESS_GIVEN = ("num_layers_per_virtual_pipeline_stage",)


def checkpoint_args(saved: Mapping[str, Any], given: set[str], tokenizer: bool, parallel: bool) -> dict[str, Any]:
    """{destination: value} of what --use-checkpoint-args takes from the flags a checkpoint recorded (`saved`), as
    argparse gives them: a value the checkpoint leaves unset (None) is not taken, as in Megatron-LM. `given`: the
    destinations the command line or --config gives; `tokenizer`: not --no-use-tokenizer-model-from-checkpoint-args;
    `parallel`: --use-mp-args-from-checkpoint-args."""
    recorded = config_from_saved(saved).flags()
    forced = TAKEN + (TOKENIZER_TAKEN if tokenizer else ()) + (PARALLEL_TAKEN if parallel else ())
    unless_given = TAKEN_UNLESS_GIVEN + (PARALLEL_TAKEN_UNLESS_GIVEN if parallel else ())
    names = forced + tuple(name for name in unless_given if name not in given)
    return {name: recorded[name] for name in names if recorded[name] is not None}


def config_from_saved(saved: Mapping[str, Any]) -> RunConfig:
    """The configuration a checkpoint's recorded flags describe, at the world size it was saved with."""
    if "model_family" not in saved:
        raise ValueError("the recorded flags name no model family: not an angpt checkpoint's")
    defaults = RunConfig().flags()
    known = {key: value for key, value in saved.items()
             if key in FIELD_SECTIONS or key == "config" or key.startswith(MEGATRON_PREFIX)}
    flags = {**defaults, **known}
    return RunConfig.from_flags({**flags, **derive(flags, saved.get("world_size") or 1)})


def single_process(config: RunConfig) -> RunConfig:
    """The same model at one process (TP = PP = CP = 1, no virtual stages or sequence parallelism), in fp32
    without recompute: how the export and import build it."""
    return config.replace(
        parallel=dict(tensor_model_parallel_size=1, pipeline_model_parallel_size=1, context_parallel_size=1,
                      sequence_parallel=False, num_layers_per_virtual_pipeline_stage=None,
                      virtual_pipeline_stages=None, world_size=1, data_parallel_size=1),
        precision=dict(bf16=False, fp16=False),
        model=dict(recompute_granularity=None),
    )


def shape_differences(saved: RunConfig, run: RunConfig) -> list[str]:
    """'--flag SAVED (this run: VALUE)' for each flag of the model's shape in which a checkpoint differs."""
    return _differences(saved, run, MODEL_SHAPE + (GPT_SHAPE if run.model.model_family == saved.model.model_family
                                                   == "gpt" else ()))


def function_differences(saved: RunConfig, run: RunConfig) -> list[str]:
    """The same for the flags of what the model computes (MODEL_FUNCTION), which a resume may not change."""
    return _differences(saved, run, MODEL_FUNCTION)


def model_refusal(path: str, saved: RunConfig, run: RunConfig, finetune: bool) -> str | None:
    """The one line refusing to load the checkpoint `path` saved with `saved` into `run`'s model, or None."""
    shape = shape_differences(saved, run)
    if shape:
        return (f"{path} holds a model of another shape: {', '.join(shape)}; give the flags it was saved with (or "
                "--load another directory)")
    function = [] if finetune else function_differences(saved, run)
    if function:
        return (f"{path} was trained with other model flags: {', '.join(function)}; give the flags it was saved "
                "with to resume it, or --finetune from it")
    return None


def optimizer_refusal(path: str, saved_distributed: bool, run_distributed: bool) -> str | None:
    """The one line refusing to resume the optimizer state of `path`, saved with the distributed optimizer or
    without it, into a run of the other kind, or None: their states (the distributed optimizer's fp32 weights and
    moments; DDP's and FSDP2's moments) do not convert into each other, in Megatron-LM neither. Their weights do."""
    if saved_distributed == run_distributed:
        return None

    def kind(distributed: bool) -> str:
        return "with the distributed optimizer" if distributed else "without the distributed optimizer"

    flag = "--use-distributed-optimizer" if saved_distributed else "no --use-distributed-optimizer"
    return (f"{path} was saved {kind(saved_distributed)} and this run is {kind(run_distributed)}: its optimizer "
            f"state does not convert (Megatron-LM's neither); give --no-load-optim to load the model alone, or {flag}")


def missing_state_refusal(path: str, saved: RunConfig, load_optimizer: bool, load_rng: bool) -> str | None:
    """The one line refusing to load the optimizer state (`load_optimizer`) or RNG states (`load_rng`) of the
    checkpoint `path`, saved with `saved`, that its --no-save-optim or --no-save-rng left out, or None: a resume from
    it is not exact, and says so by the flags that load it without them (Megatron-LM's, which stops there too)."""
    lacking = [(flag, held, instead) for flag, held, instead, missing, loaded in (
        ("--no-save-optim", "no optimizer state nor learning-rate schedule", "--no-load-optim",
         saved.checkpoint.no_save_optim, load_optimizer),
        ("--no-save-rng", "no RNG states", "--no-load-rng", saved.checkpoint.no_save_rng, load_rng))
        if missing and loaded]
    if not lacking:
        return None
    flags, held, instead = (" and ".join(part) for part in zip(*lacking))
    return (f"{path} was saved with {flags}: it holds {held}, so it cannot resume exactly; give {instead} to "
            "continue it without them, or --finetune")


def vocabulary_refusal(path: str, saved_rows: int, run: RunConfig, vocab_size: int) -> str | None:
    """The one line refusing a checkpoint whose embedding has `saved_rows` rows for a run whose vocabulary of
    `vocab_size` ids pads to another size, or None."""
    padded = run.padded_vocab_size(vocab_size)
    if saved_rows == padded:
        return None
    return (f"{path} holds an embedding of {saved_rows} rows, and this run's vocabulary of {vocab_size} ids pads to "
            f"{padded} (--make-vocab-size-divisible-by {run.data.make_vocab_size_divisible_by} x "
            f"--tensor-model-parallel-size {run.parallel.tensor_model_parallel_size}): give the tokenizer (or "
            "--vocab-size) and padding it was saved with")


def _differences(saved: RunConfig, run: RunConfig, names: tuple[str, ...]) -> list[str]:
    ours, theirs, defaults = run.flags(), saved.flags(), RunConfig().flags()

    def shown(value, name):  # an on/off flag as on or off (--disable-bias-linear sets its field False)
        return ("on" if value != defaults[name] else "off") if isinstance(value, bool) else value

    return [f"{option_of(name)} {shown(theirs[name], name)} (this run: {shown(ours[name], name)})"
            for name in names if theirs[name] != ours[name]]

