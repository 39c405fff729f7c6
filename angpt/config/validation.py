"""Validation of the parsed flags (command line and --config file alike): impossible combinations are refused
before any process-group work, by one line naming the flags; then the values the flags imply are derived, once,
and the run's configuration (angpt.config.sections.RunConfig) is returned. Nothing rewrites it afterwards.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
from typing import Any, Optional

from angpt.config import megatron_lm, object_storage, pipeline_split, transformer_engine_support
from angpt.config.blend import as_number, parse_blend
from angpt.config.choices import (
    FAMILY_NAMES,
    GPT_DEFAULTS,
    MOE_CUDA_GRAPH_SCOPES,
    MOE_OFFLOAD_MODULES,
    NORMALIZED_FAMILIES,
    recompute_module_refusal,
)
from angpt.config.files import read_json_object, read_text
from angpt.config.sections import FIELD_SECTIONS, SECTIONS, RunConfig

# Megatron-LM's defaults of the FP8 details; they apply only with --fp8-format (None here = not given).
FP8_DEFAULTS = dict(fp8_recipe="delayed", fp8_margin=0, fp8_amax_history_len=1, fp8_amax_compute_algo="most_recent")
# The range of every numeric flag (a test holds the parser to it), checked before anything divides by one:
# (what the error says, the test, the flags). A flag left unset (None) is not checked; floats must be finite.
NUMERIC_RANGES = (
    ("must be at least 1", lambda value: value >= 1, (
        "num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size", "kv_channels",
        "seq_length", "max_position_embeddings", "rotary_base", "recompute_num_layers", "tensor_model_parallel_size",
        "pipeline_model_parallel_size", "context_parallel_size", "num_layers_per_virtual_pipeline_stage",
        "num_virtual_stages_per_pipeline_rank", "decoder_first_pipeline_num_layers",
        "hierarchical_context_parallel_sizes", "expert_tensor_parallel_size", "num_distributed_optimizer_instances",
        "decoder_last_pipeline_num_layers", "micro_batch_size",
        "global_batch_size", "train_iters", "train_samples", "lr_decay_iters", "lr_wsd_decay_iters",
        "lr_decay_samples", "lr_wsd_decay_samples",
        "fp8_amax_history_len", "vocab_size", "make_vocab_size_divisible_by", "save_interval",
        "keep_last_n_checkpoints", "save_retain_interval", "non_persistent_save_interval",
        "microbatch_group_size_per_vp_stage",
        "check_weight_hash_across_dp_replicas_interval",
        "eval_interval", "log_interval", "exit_interval", "ddp_bucket_size", "ddp_num_buckets",
        "loss_scale_window", "hysteresis", "tiktoken_num_special_tokens", "flight_recorder_trace_buffer_size",
        "straggler_minmax_count", "megatron_fp8_interval", "num_dataset_builder_threads", "log_memory_interval",
        "save_wgrads_interval", "save_dgrads_interval", "megatron_replication_factor", "megatron_replication_jump")),
    ("cannot be negative", lambda value: value >= 0, (
        "angpt_alpha_init", "timing_log_level", "min_lr", "lr_warmup_iters", "lr_warmup_samples", "lr_warmup_init",
        "weight_decay",
        "clip_grad", "seed", "fp8_margin", "eval_iters", "max_skipped_steps", "dry_run", "cuda_graph_warmup_steps",
        "megatron_local_rank", "rampup_batch_size", "manual_gc_interval", "empty_unused_memory_level",
        "num_workers", "decoupled_min_lr", "profile_step_start", "profile_step_end", "profile_ranks",
        "straggler_ctrlr_port", "error_injection_rate", "num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16",
        "wgrad_deferral_limit", "ckpt_step", "start_weight_decay", "end_weight_decay", "train_sync_interval",
        "iterations_to_skip", "mid_level_dataset_surplus", "activation_func_clamp_value", "tensorboard_log_interval",
        "tensorboard_queue_size", "logging_level", "megatron_vocab_extra_ids", "mtp_num_layers",
        "mtp_loss_scaling_factor", "cpu_offloading_num_layers", "min_offloaded_tensor_size")),
    ("must be positive", lambda value: value > 0, (
        "init_method_std", "embedding_init_method_std", "norm_epsilon",
        "angpt_constant_factor_multiplier", "angpt_nu_alpha_multiplier",
        "distributed_timeout_minutes", "distributed_timeout_seconds_after_init", "hang_timeout_minutes", "lr",
        "adam_eps", "exit_duration_in_mins",
        "loss_scale", "initial_loss_scale", "min_loss_scale", "decoupled_lr",
        "gpu_memory_gib")),
    ("must be in [0, 1)", lambda value: 0 <= value < 1, (
        "attention_dropout", "hidden_dropout", "lr_warmup_fraction", "adam_beta1", "adam_beta2")),
    ("must be in (0, 1]", lambda value: 0 < value <= 1, ("rotary_percent", "megatron_sample_rate")),
    # Probabilities: numpy's binomial draws of GPTFIMDataset raise outside [0, 1].
    ("must be in [0, 1]", lambda value: 0 <= value <= 1, ("fim_rate", "fim_spm_rate", "fim_fragment_rate")),
    ("must be a finite number", math.isfinite, ("glu_linear_offset",)),  # any offset (megatron-core's)
)


def validate(parser: argparse.ArgumentParser, args: argparse.Namespace, world_size: int) -> RunConfig:
    """Refuse impossible settings before any process-group work, naming the flags; return the run's
    configuration, with the values the flags imply (`derive`)."""
    _validate_ranges(parser, args)
    tp, pp, cp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.context_parallel_size
    if world_size % (tp * pp * cp):
        parser.error(f"the world size {world_size} is not divisible by --tensor-model-parallel-size {tp} "
                     f"x --pipeline-model-parallel-size {pp} x --context-parallel-size {cp}")
    dp = world_size // (tp * pp * cp)
    etp = args.expert_tensor_parallel_size
    if etp is not None and world_size % (etp * pp):
        parser.error(f"the world size {world_size} is not divisible by --expert-tensor-parallel-size {etp} x "
                     f"--pipeline-model-parallel-size {pp} (megatron-core's expert groups)")
    _validate_context_parallel(parser, args)
    if args.num_attention_heads % tp:
        parser.error(f"--num-attention-heads {args.num_attention_heads} is not divisible by "
                     f"--tensor-model-parallel-size {tp}")
    if args.kv_channels is None and args.hidden_size % args.num_attention_heads:
        parser.error(f"--hidden-size {args.hidden_size} is not divisible by --num-attention-heads "
                     f"{args.num_attention_heads}: give --kv-channels (Megatron-LM's check)")
    rotary = int((args.kv_channels or args.hidden_size // args.num_attention_heads) * args.rotary_percent)
    rope = (args.model_family != "gpt" or args.position_embedding_type == "rope"
            or args.use_rotary_position_embeddings)
    if rope and rotary % 2:
        parser.error(f"RoPE rotates pairs of channels: a head's {rotary} rotated channels (--kv-channels, or "
                     "--hidden-size / --num-attention-heads, x --rotary-percent) must be even")
    if args.num_query_groups and (args.num_attention_heads % args.num_query_groups or args.num_query_groups % tp):
        parser.error(f"--num-query-groups {args.num_query_groups} must divide --num-attention-heads "
                     f"{args.num_attention_heads} and be divisible by --tensor-model-parallel-size {tp}")
    try:
        pipeline_split.stage_layers(args.num_layers, args, args.mtp_num_layers)
    except ValueError as error:
        parser.error(str(error))
    _validate_virtual_stages(parser, args, pp)
    _validate_deferred_wgrad(parser, args, pp)
    if args.decrease_batch_size_if_needed:
        if args.global_batch_size < args.micro_batch_size * dp:  # megatron-core's check: a micro-batch at least
            parser.error(f"--decrease-batch-size-if-needed: --global-batch-size {args.global_batch_size} is below "
                         f"--micro-batch-size {args.micro_batch_size} x data-parallel size {dp}, which it is "
                         "decreased to a multiple of")
    elif args.global_batch_size % (args.micro_batch_size * dp):
        parser.error(f"--global-batch-size {args.global_batch_size} is not divisible by --micro-batch-size "
                     f"{args.micro_batch_size} x data-parallel size {dp} (or give --decrease-batch-size-if-needed)")
    if args.bf16 and args.fp16:
        parser.error("give one of --bf16 and --fp16")
    _validate_dependent_flags(parser, args)
    validate_fsdp2(parser, args)
    validate_megatron_fsdp(parser, args)
    if args.overlap_param_gather and not args.use_distributed_optimizer:
        parser.error("--overlap-param-gather needs --use-distributed-optimizer")
    if args.overlap_param_gather_with_optimizer_step:  # Megatron-LM's checks
        needs = [need for need, given in (("--use-distributed-optimizer", args.use_distributed_optimizer),
                                          ("--overlap-param-gather", args.overlap_param_gather),
                                          ("the interleaved schedule (virtual pipeline stages)",
                                           pipeline_split.virtual_stages(args.num_layers, args)),
                                          ("--ckpt-format torch (not distributed checkpoints)",
                                           args.ckpt_format == "torch")) if not given]
        if needs:
            parser.error(f"--overlap-param-gather-with-optimizer-step needs {', '.join(needs)} (Megatron-LM's check)")
    _validate_ddp(parser, args)
    instances = args.num_distributed_optimizer_instances
    if instances > 1 and not args.use_distributed_optimizer:
        parser.error("--num-distributed-optimizer-instances needs --use-distributed-optimizer (megatron-core's check)")
    if (dp * cp) % instances:
        parser.error(f"--num-distributed-optimizer-instances {instances} must divide the data-parallel size {dp} x "
                     f"--context-parallel-size {cp} (megatron-core's check)")
    if args.max_position_embeddings is not None and args.max_position_embeddings < args.seq_length:
        parser.error(f"--max-position-embeddings {args.max_position_embeddings} is below --seq-length "
                     f"{args.seq_length}")
    _validate_architecture(parser, args)
    _validate_dropout(parser, args)
    _validate_recompute(parser, args)
    _validate_activation_offloading(parser, args)
    _validate_distributed_saved_activations(parser, args)
    _validate_fp32_residual(parser, args)
    if getattr(args, "megatron_fp16_lm_cross_entropy", False) and not args.fp16:
        parser.error("--fp16-lm-cross-entropy needs --fp16 (Megatron-LM's check)")
    _validate_switches(parser, args)
    _validate_schedule(parser, args, dp)
    _validate_precision(parser, args)
    _validate_batch_invariant_mode(parser, args)
    _validate_checkpoints(parser, args)
    _validate_hang_timeout(parser, args)
    _validate_fake_process_group(parser, args)
    _validate_dry_run(parser, args)
    _validate_result_checks(parser, args)
    _validate_data(parser, args)
    _validate_wandb(parser, args)
    _validate_logging(parser, args)
    megatron_lm.check_implied(parser, args)
    flags = vars(args)
    return RunConfig.from_flags({**flags, **derive(flags, world_size)})


def validate_fsdp2(parser, args) -> None:
    """Megatron-LM's refusals of --use-torch-fsdp2, and what angpt has not built with it yet."""
    if not args.use_torch_fsdp2:
        if not args.torch_fsdp2_reshard_after_forward:
            parser.error("--torch-fsdp2-no-reshard-after-forward needs --use-torch-fsdp2")
        return
    untied = (args.untie_embeddings_and_output_weights if args.model_family == "gpt"
              else not args.tie_embeddings_and_output_weights)
    for given, why in (
        (args.pipeline_model_parallel_size > 1, "with pipeline parallelism (Megatron-LM's check)"),
        (args.use_distributed_optimizer, "with --use-distributed-optimizer, which it replaces (Megatron-LM's check)"),
        (not untied, "with tied embeddings: the embedding and the output layer would share a sharded weight "
                     "(Megatron-LM's check: give --untie-embeddings-and-output-weights)"),
        (args.fp16, "with --fp16 (Megatron-LM's check)"),
        (args.ckpt_format == "torch", "with --ckpt-format torch: give torch_dist (Megatron-LM's check)"),
        (args.check_weight_hash_across_dp_replicas_interval,
         "with --check-weight-hash-across-dp-replicas-interval: its ranks hold different shards, no replicas"),
    ):
        if given:
            parser.error(f"--use-torch-fsdp2 {why}")


def validate_megatron_fsdp(parser, args) -> None:
    """Megatron-LM's refusals of --use-megatron-fsdp, what megatron-core 0.16.1 gets wrong with it, and what angpt
    has not built with it yet."""
    if not args.use_megatron_fsdp:
        if args.ckpt_format == "fsdp_dtensor":
            parser.error("--ckpt-format fsdp_dtensor needs --use-megatron-fsdp (Megatron-LM's check)")
        if args.data_parallel_sharding_strategy != "no_shard" or not args.gradient_reduce_div_fusion:
            parser.error("--data-parallel-sharding-strategy and --no-gradient-reduce-div-fusion need "
                         "--use-megatron-fsdp")
        return
    for given, why in (
        (args.use_torch_fsdp2, "with --use-torch-fsdp2: give one of them"),
        (args.ckpt_format != "fsdp_dtensor", "needs --ckpt-format fsdp_dtensor (Megatron-LM's check)"),
        (not args.use_distributed_optimizer, "needs --use-distributed-optimizer, which steps its shards (Megatron-LM's "
                                             "usage; megatron-core's plain optimizer is not built with it)"),
        (args.check_weight_hash_across_dp_replicas_interval
         and args.data_parallel_sharding_strategy == "optim_grads_params",
         "--data-parallel-sharding-strategy optim_grads_params with --check-weight-hash-across-dp-replicas-interval: "
         "its ranks hold different shards of the weights, no replicas (Megatron-LM's check)"),
        (args.pipeline_model_parallel_size > 1,
         "with pipeline parallelism: megatron-core 0.16.1's Megatron-FSDP lays every rank out as data x context x "
         "expert x tensor parallel in its device mesh (an einops error while wrapping, in Megatron-LM too)"),
    ):
        if given:
            parser.error(f"--use-megatron-fsdp {why}")


def _validate_virtual_stages(parser, args, pp: int) -> None:
    """Megatron-LM's checks of the interleaved schedule's flags."""
    per_stage, per_rank = args.num_layers_per_virtual_pipeline_stage, args.num_virtual_stages_per_pipeline_rank
    if per_stage and per_rank:
        parser.error("give one of --num-layers-per-virtual-pipeline-stage and --num-virtual-stages-per-pipeline-rank")
    given = "--num-layers-per-virtual-pipeline-stage" if per_stage else "--num-virtual-stages-per-pipeline-rank"
    even = not pipeline_split.uneven(args)  # an uneven split's shares are checked by pipeline_split
    if even and per_stage and (args.num_layers // pp) % per_stage:
        parser.error("--num-layers / --pipeline-model-parallel-size is not divisible by "
                     "--num-layers-per-virtual-pipeline-stage")
    if even and per_rank and (args.num_layers // pp) % per_rank:
        parser.error(f"--num-layers / --pipeline-model-parallel-size ({args.num_layers // pp}) is not divisible by "
                     f"--num-virtual-stages-per-pipeline-rank {per_rank}")
    stages = pipeline_split.virtual_stages(args.num_layers, args)
    if stages is None:
        if args.overlap_p2p_comm_warmup_flush:
            parser.error("--overlap-p2p-communication-warmup-flush needs the interleaved schedule (two or more "
                         "virtual stages per pipeline rank)")
        return
    if pp == 1:
        parser.error(f"{given} needs --pipeline-model-parallel-size > 1")
    if not args.overlap_p2p_comm:
        if pp == 2:  # Megatron-LM's check: batched exchanges would pair two sends between the same two ranks
            parser.error("--no-overlap-p2p-communication with the interleaved schedule needs "
                         "--pipeline-model-parallel-size > 2 (Megatron-LM's check)")
        if args.overlap_p2p_comm_warmup_flush:
            parser.error("--overlap-p2p-communication-warmup-flush needs the overlap that --no-overlap-p2p-"
                         "communication turns off")


def _validate_deferred_wgrad(parser, args, pp: int) -> None:
    """megatron-core's checks of --defer-embedding-wgrad-compute (ModelParallelConfig); without it Megatron-LM
    ignores --wgrad-deferral-limit (said in one line, megatron_lm.notes)."""
    if not args.defer_embedding_wgrad_compute:
        return
    if pp == 1:
        parser.error("--defer-embedding-wgrad-compute needs --pipeline-model-parallel-size > 1: the output layer's "
                     "weight gradients are deferred to the pipeline's flush (megatron-core's check)")
    if getattr(args, "megatron_no_gradient_accumulation_fusion", False):
        parser.error("--defer-embedding-wgrad-compute needs gradient-accumulation fusion, which "
                     "--no-gradient-accumulation-fusion turns off (megatron-core's check)")


def _validate_context_parallel(parser, args) -> None:
    """Megatron-LM's checks of --context-parallel-size, and the local spec's one exchange (all_gather)."""
    cp = args.context_parallel_size
    hierarchical = args.hierarchical_context_parallel_sizes
    if hierarchical and math.prod(hierarchical) != cp:
        parser.error(f"--hierarchical-context-parallel-sizes {' '.join(map(str, hierarchical))} must multiply to "
                     f"--context-parallel-size {cp}")
    if cp == 1:
        return
    if args.seq_length % (2 * cp):
        parser.error(f"--seq-length {args.seq_length} is not divisible by 2 x --context-parallel-size {cp} (each "
                     "rank holds two of 2 x CP chunks)")
    tp = args.tensor_model_parallel_size
    if args.sequence_parallel and tp > 1 and (args.seq_length // cp) % tp:
        parser.error(f"--sequence-parallel: --seq-length {args.seq_length} / --context-parallel-size {cp} is not "
                     f"divisible by --tensor-model-parallel-size {tp}")
    kinds = args.cp_comm_type
    if kinds is None:  # derive: all_gather on local, Megatron-LM's p2p on Transformer Engine
        return
    if "a2a+p2p" in kinds and not hierarchical:
        parser.error("--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes (Megatron-LM's check)")
    if len(kinds) > 1:
        # Megatron-LM's per-layer form: megatron-core 0.16.1 reads the list at the 1-based layer number, so each
        # layer would take the next layer's value and the last one none.
        parser.error(f"--cp-comm-type takes one value here (got {len(kinds)}): megatron-core 0.16.1 misreads a list "
                     "of one per layer")
    if args.transformer_impl == "local" and kinds != ["all_gather"]:
        parser.error(f"--cp-comm-type {kinds[0]}: context parallelism on --transformer-impl local is all_gather "
                     "only: pass --cp-comm-type all_gather (or use --transformer-impl transformer_engine)")


def _validate_ranges(parser, args) -> None:
    for requirement, holds, dests in NUMERIC_RANGES:
        for dest in dests:
            given = getattr(args, dest)
            flag = "--" + dest.removeprefix("megatron_").replace("_", "-")
            for value in given if isinstance(given, list) else [] if given is None else [given]:
                if isinstance(value, float) and not math.isfinite(value):
                    parser.error(f"{flag} {value} must be a finite number")
                if not holds(value):
                    parser.error(f"{flag} {value} {requirement}")


# The anGPT switches each other family reads (docs/model.md, Families and switches); the rest would be
# ignored there, so they are refused: GPT+ and GPT have none of the normalized blocks, and nGPT normalizes exactly
# (no constant factors, no nu(alpha)) but has the post-norm, alpha and the residual update.
FAMILY_SWITCHES = {
    "gptplus": (),
    "gpt": (),
    "ngpt": ("angpt_post_norm", "angpt_alpha_init", "angpt_residual"),
}


def _validate_switches(parser, args) -> None:
    if args.model_family not in FAMILY_SWITCHES:
        return
    for action in parser._actions:
        dest = action.dest
        if dest.startswith("angpt_") and dest not in FAMILY_SWITCHES[args.model_family] \
                and getattr(args, dest) != action.default:
            parser.error(f"{action.option_strings[0]} does not apply to --model-family {args.model_family} "
                         "(docs/model.md, Families and switches)")


# What the families of the paper fix (docs/model.md), for each flag of the architecture section that could ask
# them for something else: (the value they have, the refusal of any other). Megatron-LM's default is accepted too:
# it asks for nothing. The norm flags anGPT and nGPT replace by their own normalization are accepted with them and
# said in one log line (angpt.config.megatron_lm.notes). The flags not listed are accepted with every family: the
# family's own (--swiglu, --disable-bias-linear, --qk-layernorm with GPT+, --use-rotary-position-embeddings), the
# same (GPT+'s gain w from 0 as 1 + w trains as a gain from 1, norm gains not being decayed; its softmax is in
# fp32), or followed (grouped-query attention by --num-query-groups).
ROPE = "every family uses RoPE (docs/model.md); --model-family gpt takes the others"
NO_BIAS = "no family has biases in its linear layers (docs/model.md); --model-family gpt has them"
SWIGLU = "the families use SwiGLU (docs/model.md); --model-family gpt takes the others"
NEXT_TOKEN = ("the families train next-token prediction, without multi-token prediction layers (docs/model.md); "
              "--model-family gpt builds megatron-core's")
PAPER_ARCHITECTURE = {
    "normalization": ("RMSNorm", "GPT+ normalizes with RMSNorm (docs/model.md)"),
    "add_qkv_bias": (False, NO_BIAS),
    "qk_l2_norm": (False, "GPT+ normalizes q and k with RMSNorm, not an L2 norm"),
    "apply_query_key_layer_scaling": (False, "the families' softmax scale is fixed by docs/model.md"),
    "position_embedding_type": ("rope", ROPE),
    "rotary_percent": (1.0, "RoPE rotates every channel of a head here (--rotary-percent 1.0)"),
    "rotary_interleaved": (False, "the families rotate halves of each head, not interleaved pairs"),
    "use_rope_scaling": (False, "the families' RoPE is not scaled (docs/model.md)"),
    "squared_relu": (False, SWIGLU),
    "quick_geglu": (False, SWIGLU),
    "embedding_init_method_std": (None, "the families initialize the embedding as docs/model.md says (anGPT and nGPT: "
                                        "unit rows; GPT+: --init-method-std)"),
    "glu_linear_offset": (0.0, "the families' SwiGLU multiplies by its linear half, without an offset (docs/model.md)"),
    "activation_func_clamp_value": (None, "the families' SwiGLU does not clamp (docs/model.md)"),
    "no_rope_freq": (None, "every layer of the families applies RoPE (docs/model.md)"),
    "mtp_num_layers": (0, NEXT_TOKEN),
    "mtp_loss_scaling_factor": (0.1, NEXT_TOKEN),
    "mtp_standalone": (False, NEXT_TOKEN),
}
NORM_FIELDS = ("normalization", "layernorm_zero_centered_gamma", "qk_layernorm", "qk_l2_norm")
ROPE_FIELDS = ("rotary_percent", "rotary_interleaved", "use_rope_scaling", "no_rope_freq")


def _validate_architecture(parser, args) -> None:
    """The architecture flags (ArchitectureSection): with the families of the paper, Megatron-LM's default or the
    family's value; with gpt, what megatron-core builds and Megatron-LM hands it (refused where it would do
    nothing there)."""
    flags = {action.dest: action for action in parser._actions if action.option_strings}
    family = args.model_family

    def refuse(dest: str, why: str) -> None:
        value, action = getattr(args, dest), flags[dest]
        shown = "" if action.nargs == 0 else f" {value}"
        parser.error(f"{action.option_strings[0]}{shown} with --model-family {family}: {why}")

    if family != "gpt":
        for dest, (expected, why) in PAPER_ARCHITECTURE.items():
            value = getattr(args, dest)
            if value in (default(dest), expected):
                continue
            if not (family in NORMALIZED_FAMILIES and dest in NORM_FIELDS):
                refuse(dest, why)
        if args.bias_gelu_fusion:
            refuse("bias_gelu_fusion", f"{FAMILY_NAMES[family]} has no GELU (docs/model.md)")
        return
    if args.position_embedding_type in ("mrope", "relative"):
        refuse("position_embedding_type", "megatron-core's GPTModel builds learned_absolute, rope and none here "
               "(mrope needs a multimodal model's --mrope-section; relative is T5's)")
    rope = args.position_embedding_type == "rope" or args.use_rotary_position_embeddings
    for dest in ROPE_FIELDS:
        if not rope and getattr(args, dest) != default(dest):
            refuse(dest, "it applies to --position-embedding-type rope (Megatron-LM ignores it otherwise)")
    _validate_no_rope_freq(parser, args)
    _validate_mtp(parser, args, rope)
    if args.num_query_groups is not None and not args.group_query_attention:
        parser.error(f"--num-query-groups {args.num_query_groups} with --model-family gpt needs "
                     "--group-query-attention (Megatron-LM ignores --num-query-groups without it)")
    local = args.transformer_impl == "local"
    if args.qk_l2_norm and local:
        refuse("qk_l2_norm", "Megatron-LM's pretrain_gpt.py hands it to the Transformer Engine spec only (the local "
               "spec it builds has no L2 norm); use --transformer-impl transformer_engine")
    # megatron-core's local norms are torch's (WrappedTorchNorm) for RMSNorm, and for LayerNorm without apex.
    normalization = args.normalization or GPT_DEFAULTS["normalization"]
    if local and (normalization == "RMSNorm" or importlib.util.find_spec("apex") is None):
        if args.sequence_parallel and args.tensor_model_parallel_size > 1:
            parser.error(f"--sequence-parallel with --model-family gpt --normalization {normalization} on "
                         "--transformer-impl local: megatron-core's torch norms refuse sequence parallelism (apex's "
                         "LayerNorm takes it); use --transformer-impl transformer_engine")
        if args.layernorm_zero_centered_gamma:
            refuse("layernorm_zero_centered_gamma", f"megatron-core's torch {normalization} on "
                   "--transformer-impl local has no zero-centred gain (apex's LayerNorm has); use "
                   "--transformer-impl transformer_engine")
    if args.bias_gelu_fusion and (args.swiglu or args.squared_relu or not (args.quick_geglu or args.add_bias_linear)):
        refuse("bias_gelu_fusion", "megatron-core fuses GELU with its bias (biases on) and quick GeGLU; not "
               "--swiglu (--bias-swiglu-fusion) or --squared-relu")
    if args.bias_swiglu_fusion and not args.swiglu:
        refuse("bias_swiglu_fusion", "it fuses --swiglu's activation")
    fused = args.bias_swiglu_fusion if args.swiglu else args.bias_gelu_fusion
    if args.glu_linear_offset and fused and not args.quick_geglu:
        refuse("glu_linear_offset", "megatron-core's fused activation takes an offset with --quick-geglu only (its "
               "check): give --no-bias-swiglu-fusion or --no-bias-gelu-fusion")
    if args.swiglu and args.ffn_hidden_size is None and not ffn_hidden_size(vars(args)):
        parser.error(f"--swiglu with --hidden-size {args.hidden_size}: Megatron-LM's MLP width, 8/3 x hidden rounded "
                     "down to a multiple of 64, is 0; give --ffn-hidden-size")


def _validate_mtp(parser, args, rope: bool) -> None:
    """Multi-token prediction: Megatron-LM's check (validate_args) and megatron-core's (its MTP layer's recompute)."""
    layers = args.mtp_num_layers
    if not layers:
        return
    positions = "rope" if rope else args.position_embedding_type or GPT_DEFAULTS["position_embedding_type"]
    if positions not in ("rope", "none"):
        parser.error(f"--mtp-num-layers {layers} with --position-embedding-type {positions}: multi-token prediction "
                     "takes rope or none (Megatron-LM's check)")
    if (args.recompute_granularity == "full" and args.recompute_method == "uniform"
            and args.recompute_num_layers != 1):
        parser.error(f"--mtp-num-layers {layers} with --recompute-granularity full --recompute-method uniform needs "
                     f"--recompute-num-layers 1, not {args.recompute_num_layers} (megatron-core's MTP layer asserts "
                     "it at its first forward)")


def _validate_no_rope_freq(parser, args) -> None:
    """megatron-core's checks of --no-rope-freq (TransformerConfig): N divides the layers, a pattern has one entry per
    layer; 0 asks for nothing, as there."""
    skipped = args.no_rope_freq
    if isinstance(skipped, int) and skipped < 0:
        parser.error(f"--no-rope-freq {skipped} cannot be negative")
    if isinstance(skipped, int) and skipped and args.num_layers % skipped:
        parser.error(f"--no-rope-freq {skipped} must divide --num-layers {args.num_layers} (megatron-core's check)")
    if isinstance(skipped, (list, tuple)) and len(skipped) != args.num_layers:
        parser.error(f"--no-rope-freq: the pattern has {len(skipped)} entries, one per layer of --num-layers "
                     f"{args.num_layers} (megatron-core's check)")


def _validate_fp32_residual(parser, args) -> None:
    """--fp32-residual-connection: Megatron-LM's check, and where the fp32 embeddings would meet what takes no fp32
    input with 16-bit weights."""
    if not args.fp32_residual_connection:
        return
    if not (args.bf16 or args.fp16):
        parser.error("--fp32-residual-connection needs --bf16 or --fp16 (Megatron-LM's check)")
    if args.model_family in NORMALIZED_FAMILIES:
        parser.error(f"--fp32-residual-connection with --model-family {args.model_family}: its residual stream feeds "
                     "the linear layers without a norm in between and is updated by its own normalized LERP, in the "
                     "parameters' dtype (docs/model.md, Residual update)")
    # megatron-core 0.16.1 casts the embedding's output to fp32, and its bias-dropout-add casts the residual to the
    # sub-block output's dtype: a stage with layers sends that, one with the embedding alone would send fp32.
    pp = args.pipeline_model_parallel_size
    if pp > 1 and (pipeline_split.stage_layers(args.num_layers, args, args.mtp_num_layers)[0] == 0 or (
            args.account_for_embedding_in_pipeline_split and pipeline_split.virtual_stages(args.num_layers, args))):
        parser.error("--fp32-residual-connection with a pipeline stage that holds the embedding without a layer: its "
                     "fp32 output would go to a stage that receives the parameters' dtype (megatron-core 0.16.1's "
                     "pipeline_dtype)")
    normalization = args.normalization or GPT_DEFAULTS["normalization"]
    if (args.model_family == "gpt" and args.transformer_impl == "local"
            and (normalization == "RMSNorm" or importlib.util.find_spec("apex") is None)):
        parser.error(f"--fp32-residual-connection with --model-family gpt --normalization {normalization} on "
                     "--transformer-impl local: megatron-core's torch norms take no fp32 input with 16-bit weights "
                     "(Megatron-LM fails there with 'mixed dtype'; apex's LayerNorm takes it); use --transformer-impl "
                     "transformer_engine")


def _validate_distributed_saved_activations(parser, args) -> None:
    """Megatron-LM's checks of --distribute-saved-activations, and megatron-core's (TransformerConfig)."""
    if not args.distribute_saved_activations:
        return
    if args.tensor_model_parallel_size == 1:
        parser.error("--distribute-saved-activations splits the saved inputs over the tensor-parallel ranks: it needs "
                     "--tensor-model-parallel-size > 1 (Megatron-LM's check)")
    if _recompute_granularity(vars(args)) != "full":
        parser.error("--distribute-saved-activations needs --recompute-granularity full (Megatron-LM's check)")
    if args.sequence_parallel:
        parser.error("--distribute-saved-activations with --sequence-parallel: the saved inputs are split over the "
                     "tensor-parallel ranks already (megatron-core's check)")


def ffn_hidden_size(flags: dict) -> int:
    """The MLP's width: --ffn-hidden-size, else 4 x hidden, or for gpt with --swiglu Megatron-LM's 8/3 x hidden
    rounded down to a multiple of 64 (its validate_args: about the parameters of a 4 x hidden GELU MLP)."""
    hidden = flags["hidden_size"]
    if flags["ffn_hidden_size"] is not None:
        return flags["ffn_hidden_size"]
    if flags["model_family"] == "gpt" and flags["swiglu"]:
        return int((4 * hidden * 2 / 3) / 64) * 64
    return 4 * hidden


def _validate_dropout(parser, args) -> None:
    if args.hidden_dropout and args.model_family in NORMALIZED_FAMILIES:
        # Their layers have no bias-dropout-add; megatron-core would drop out only the embeddings.
        parser.error(f"--hidden-dropout is not supported for --model-family {args.model_family} (its normalized "
                     "residual has no hidden dropout; GPT+ and GPT only); use --attention-dropout")


def _validate_recompute(parser, args) -> None:
    """--recompute-activations becomes --recompute-granularity selective (Megatron-LM's alias); each flag of the
    other granularity is refused, and each module the family or implementation lacks."""
    if args.recompute_activations and args.recompute_granularity == "full":
        parser.error("--recompute-activations is --recompute-granularity selective: give one of them")
    granularity = _recompute_granularity(vars(args))
    if granularity != "full":
        for dest in ("recompute_method", "recompute_num_layers"):
            if getattr(args, dest) != default(dest):
                parser.error(f"--{dest.replace('_', '-')} needs --recompute-granularity full")
    if granularity != "selective":
        if args.recompute_modules is not None:
            parser.error("--recompute-modules needs --recompute-granularity selective (or --recompute-activations)")
        return
    for module in args.recompute_modules or ["core_attn"]:
        refusal = recompute_module_refusal(module, args.model_family, args.transformer_impl)
        if refusal:
            parser.error(f"--recompute-modules {module} with --model-family {args.model_family}: {refusal}")


def _validate_activation_offloading(parser, args) -> None:
    """--cpu-offloading-num-layers and --fine-grained-activation-offloading: Megatron-LM's checks (validate_args) and
    megatron-core's (TransformerConfig.__post_init__, and TransformerBlock's assert of Transformer Engine), and the
    families whose layers have no offload points. That each needs CUDA is checked where the model config is built."""
    layers = args.cpu_offloading_num_layers
    if layers:  # Megatron-LM's cpu_offloading
        if layers >= args.num_layers:
            parser.error(f"--cpu-offloading-num-layers {layers}: CPU offloading can be done only for layers less than "
                         f"--num-layers {args.num_layers} (megatron-core's check)")
        if args.pipeline_model_parallel_size > 1:
            parser.error("--cpu-offloading-num-layers with --pipeline-model-parallel-size "
                         f"{args.pipeline_model_parallel_size}: megatron-core has no CPU offloading with pipeline "
                         "parallelism (its check)")
        if _recompute_granularity(vars(args)) is not None:
            parser.error("--cpu-offloading-num-layers with activation recompute: CPU offloading does not work when "
                         "activation recomputation is enabled (megatron-core's check)")
        missing = transformer_engine_support.transformer_engine_error()
        if missing is not None:
            parser.error("--cpu-offloading-num-layers needs NVIDIA Transformer Engine, whose get_cpu_offload_context "
                         "offloads the layers (megatron-core asserts: CPU Offloading is enabled when TE is not "
                         f"present); it is not importable here ({missing})")
    if not args.fine_grained_activation_offloading:
        return
    if args.model_family in NORMALIZED_FAMILIES:
        parser.error(f"--fine-grained-activation-offloading with --model-family {args.model_family}: "
                     f"{FAMILY_NAMES[args.model_family]}'s layer (NormalizedTransformerLayer) runs its own forward, "
                     "without the offload points and group commits of megatron-core's TransformerLayer that the "
                     "offloading schedules; --cpu-offloading-num-layers offloads its layers' activations")
    if args.transformer_impl != "transformer_engine":
        parser.error("--fine-grained-activation-offloading needs --transformer-impl transformer_engine (Megatron-LM's "
                     "check: fine-grained activation offloading is only supported with transformer_engine)")
    if transformer_engine_support.transformer_engine_error() is None and os.getenv("NVTE_CPU_OFFLOAD_V1", "0") != "1":
        from megatron.core.utils import is_te_min_version  # noqa: PLC0415 (only with Transformer Engine, as above)

        if is_te_min_version("2.10.0"):
            parser.error("--fine-grained-activation-offloading with Transformer Engine >= 2.10.0 needs the environment "
                         "variable NVTE_CPU_OFFLOAD_V1=1, to avoid offloading weights (Megatron-LM's check)")
    if layers:
        parser.error("--fine-grained-activation-offloading cannot be enabled with --cpu-offloading-num-layers "
                     "(megatron-core's check)")
    modules = args.offload_modules or []
    if not modules:
        parser.error("--fine-grained-activation-offloading needs --offload-modules (megatron-core asserts some)")
    moe = [module for module in modules if module in MOE_OFFLOAD_MODULES]
    if moe:
        parser.error(f"--offload-modules {moe[0]}: a module of MoE layers, and this model is dense")
    if "attn_proj" in modules and "core_attn" not in modules:
        parser.error("--offload-modules attn_proj needs core_attn too: the input of attn_proj is the output of "
                     "core_attn, which is needed in core_attn.backward() (megatron-core's check)")


# Flags that act only with another (its destination): (their destinations, that one, the error; None: "--FLAG
# needs --THAT"). Each is refused when given a value other than its default without the one it needs.
DEPENDENT_FLAGS = (
    (("loss_scale", "initial_loss_scale", "min_loss_scale", "loss_scale_window", "hysteresis"), "fp16",
     "{flag} needs --fp16 (loss scaling is for fp16)"),
    (("decoupled_min_lr",), "decoupled_lr", None),
    (("grad_reduce_in_bf16",), "bf16", None),
    (("manual_gc_interval", "manual_gc_eval"), "manual_gc", None),
    (("use_pytorch_profiler", "profile_ranks", "profile_step_start", "profile_step_end"), "profile",
     "--use-pytorch-profiler, --profile-ranks, --profile-step-start and --profile-step-end need --profile"),
    (("straggler_minmax_count", "straggler_ctrlr_port", "disable_straggler_on_startup"), "log_straggler", None),
    (("memory_snapshot_path",), "record_memory_history", None),
    (("flight_recorder_trace_buffer_size",), "flight_recorder_dump_path", None),
    # Megatron-LM's save_grads asserts a save directory.
    (("save_wgrads_interval", "save_dgrads_interval"), "save", None),
)


def _validate_dependent_flags(parser, args) -> None:
    flags = {action.dest: action.option_strings[0] for action in parser._actions if action.option_strings}
    for dests, needed, error in DEPENDENT_FLAGS:
        given = [dest for dest in dests if getattr(args, dest) != default(dest)]
        if given and not getattr(args, needed):
            parser.error((error or "{flag} needs {needed}").format(flag=flags[given[0]], needed=flags[needed]))


def _validate_rampup(parser, args, dp: int) -> None:
    """What megatron-core's ramp-up calculator asserts (or divides by zero on), as errors naming the flags: every
    batch of the ramp-up must split into micro-batches on every data-parallel rank."""
    start, increment, samples = args.rampup_batch_size
    shown = f"--rampup-batch-size {start} {increment} {samples}"
    if args.train_samples is None:
        parser.error(f"{shown} needs --train-samples (the ramp-up is counted in samples)")
    if min(start, increment, samples) < 1:  # SAMPLES 0: megatron-core divides by zero
        parser.error(f"{shown}: START, INCREMENT and SAMPLES must be at least 1")
    if start >= args.global_batch_size or (args.global_batch_size - start) % increment:
        parser.error(f"{shown}: START must be below --global-batch-size {args.global_batch_size} and reach it in "
                     "whole INCREMENTs")
    if args.decrease_batch_size_if_needed:
        if start < args.micro_batch_size * dp:  # each batch decreased to a multiple of it: START to none
            parser.error(f"{shown} with --decrease-batch-size-if-needed: START must be at least --micro-batch-size "
                         f"{args.micro_batch_size} x data-parallel size {dp}")
    elif start % (args.micro_batch_size * dp) or increment % (args.micro_batch_size * dp):
        parser.error(f"{shown}: START and INCREMENT must be multiples of --micro-batch-size {args.micro_batch_size} "
                     f"x data-parallel size {dp}")


def _validate_schedule(parser, args, dp: int) -> None:
    if args.train_iters is None and args.train_samples is None:
        parser.error("give the length of training: --train-iters or --train-samples")
    # As Megatron-LM (megatron/training/arguments.py): a run counts iterations or samples, not both.
    by_samples = args.train_samples is not None
    unit, other = ("samples", "iters") if by_samples else ("iters", "samples")
    for name in ("lr_decay", "lr_warmup", "lr_wsd_decay"):
        # A warm-up of 0 in the other unit is Megatron-LM's default, which its scripts give: it asks for nothing.
        if getattr(args, f"{name}_{other}") not in (None, 0 if name == "lr_warmup" else None):
            parser.error(f"--{name.replace('_', '-')}-{other} needs --train-{other} (this run gives --train-{unit}: "
                         f"use --{name.replace('_', '-')}-{unit})")
    if args.lr_warmup_fraction is not None and getattr(args, f"lr_warmup_{unit}") is not None:
        parser.error(f"give one of --lr-warmup-fraction and --lr-warmup-{unit}")
    if args.rampup_batch_size is not None:
        _validate_rampup(parser, args, dp)
    if by_samples and args.rampup_batch_size is None and args.train_samples < args.global_batch_size:
        parser.error(f"--train-samples {args.train_samples} is less than one --global-batch-size "
                     f"{args.global_batch_size}")
    if args.lr_decay_style == "WSD" and getattr(args, f"lr_wsd_decay_{unit}") is None:
        parser.error(f"--lr-decay-style WSD needs --lr-wsd-decay-{unit}")
    if args.min_lr is not None and args.min_lr > args.lr:
        parser.error(f"--min-lr {args.min_lr} is above --lr {args.lr}")
    if args.phase_transition_iterations is not None:
        try:
            iterations = phase_transitions(args.phase_transition_iterations)
        except ValueError:
            parser.error(f"--phase-transition-iterations {args.phase_transition_iterations!r}: not comma-separated "
                         "iterations")
        if args.rampup_batch_size is not None:
            parser.error("--phase-transition-iterations with --rampup-batch-size: multi-phase training does not "
                         "support batch size ramp-up (Megatron-LM's check)")
        if not by_samples:
            parser.error("--phase-transition-iterations needs --train-samples: the last phase ends there (Megatron-LM "
                         "reads it, and fails without it)")
        if min(iterations) < 1:
            parser.error(f"--phase-transition-iterations {args.phase_transition_iterations}: an iteration must be at "
                         "least 1 (a phase ends after a step)")


def phase_transitions(value: str) -> tuple[int, ...]:
    """--phase-transition-iterations, sorted, as Megatron-LM's validate_args reads it."""
    return tuple(sorted(int(part.strip()) for part in value.split(",")))


def _validate_precision(parser, args) -> None:
    """--transformer-impl, the fused cross-entropy and the FP8 flags (Megatron-LM's names); fills in the FP8
    defaults."""
    _validate_cuda_graphs(parser, args)
    if args.deterministic_mode:
        # Megatron-LM's checks (megatron/training/arguments.py, validate_args).
        if args.cross_entropy_loss_fusion:
            parser.error("--deterministic-mode with --cross-entropy-loss-fusion: the fused cross-entropy is not "
                         "deterministic (as Megatron-LM says); drop one of them")
        if args.attention_backend == "flash":
            parser.error("--deterministic-mode with --attention-backend flash: flash attention is not deterministic "
                         "(as Megatron-LM says); use --attention-backend auto, fused or unfused")
    if args.cross_entropy_loss_fusion and not args.bf16:
        parser.error("--cross-entropy-loss-fusion needs --bf16 (the fused cross-entropy rounds the logits' gradient "
                     "to bf16; in fp32 the unfused one is exact)")
    if args.cross_entropy_fusion_impl == "te" and transformer_engine_support.transformer_engine_error() is not None:
        parser.error(f"--cross-entropy-fusion-impl te needs NVIDIA Transformer Engine, which is not importable here "
                     f"({transformer_engine_support.transformer_engine_error()}); use --cross-entropy-fusion-impl "
                     "native (the default)")
    fp8 = args.fp8_format is not None
    if not fp8:
        for flag in ("fp8_recipe", "fp8_margin", "fp8_amax_history_len", "fp8_amax_compute_algo"):
            if getattr(args, flag) not in (None, False):
                parser.error(f"--{flag.replace('_', '-')} needs --fp8-format (FP8 is off without it)")
    recipe = args.fp8_recipe or FP8_DEFAULTS["fp8_recipe"]
    if fp8:
        if args.transformer_impl != "transformer_engine":
            parser.error(f"--fp8-format {args.fp8_format} needs --transformer-impl transformer_engine (FP8 GEMMs "
                         f"are Transformer Engine's; got --transformer-impl {args.transformer_impl})")
        if not args.bf16:
            parser.error(f"--fp8-format {args.fp8_format} needs --bf16 (the weights and activations FP8 does not "
                         "cover stay bf16)")
        if recipe != "delayed":
            for flag in ("fp8_margin", "fp8_amax_history_len", "fp8_amax_compute_algo"):
                if getattr(args, flag) not in (None, FP8_DEFAULTS[flag]):
                    parser.error(f"--{flag.replace('_', '-')} applies to --fp8-recipe delayed only (got "
                                 f"--fp8-recipe {recipe})")
        if args.first_last_layers_bf16:  # megatron-core's checks (TransformerConfig)
            if recipe == "delayed":
                parser.error("--first-last-layers-bf16: Transformer Engine's delayed scaling cannot leave layers in "
                             "BF16 (megatron-core's check): give --fp8-recipe tensorwise or mxfp8")
            per_stage = args.num_layers // args.pipeline_model_parallel_size
            for flag in ("num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16"):
                if getattr(args, flag) > per_stage:
                    parser.error(f"--{flag.replace('_', '-')} {getattr(args, flag)} must be at most the layers of a "
                                 f"pipeline stage ({per_stage})")
        multiple = 32 if recipe == "mxfp8" else 16
        ffn = ffn_hidden_size(vars(args))
        if args.hidden_size % multiple or ffn % multiple:
            parser.error(f"FP8 GEMMs (--fp8-recipe {recipe}) need --hidden-size {args.hidden_size} and "
                         f"--ffn-hidden-size {ffn} to be multiples of {multiple}")
    if args.transformer_impl == "transformer_engine":
        if transformer_engine_support.transformer_engine_error() is not None:
            parser.error(transformer_engine_support.unavailable_message())
        if fp8:
            problem = transformer_engine_support.fp8_recipe_problem(recipe)
            if problem:
                parser.error(f"--fp8-recipe {recipe}: {problem}")


def _validate_cuda_graphs(parser, args) -> None:
    """--cuda-graph-impl local with recompute, --cuda-graph-scope: Megatron-LM's checks (validate_args) and
    megatron-core's (TransformerConfig.__post_init__), which hold with --cuda-graph-impl only, but the first."""
    scope = args.cuda_graph_scope or []
    if "full" in scope and scope != ["full"]:
        parser.error(f"--cuda-graph-scope {' '.join(scope)}: full (the whole layer, deprecated) cannot be used with "
                     "other scopes (Megatron-LM's check)")
    if args.cuda_graph_impl != "local":
        return
    granularity = _recompute_granularity(vars(args))
    if granularity == "full" and scope != ["full_iteration"]:
        parser.error("--cuda-graph-impl local with --recompute-granularity full needs --cuda-graph-scope "
                     "full_iteration alone (megatron-core's check: a layer's graph cannot hold its recompute)")
    if granularity == "selective":
        parser.error("--cuda-graph-impl local with --recompute-granularity selective is not built: the recomputed "
                     "parts run inside each layer's captured graph, which no test has checked on a GPU; drop one of "
                     "them")
    moe = [value for value in scope if value in MOE_CUDA_GRAPH_SCOPES]
    if moe:
        parser.error(f"--cuda-graph-scope {moe[0]}: megatron-core graphs MoE layers with it, and this model is dense "
                     "(megatron-core's check: moe cuda graph is only supported for MoE)")
    # As Megatron-LM reads it: off with --fp16's dynamic loss scale.
    nan_check = args.check_for_nan_in_loss_and_grad and not (args.fp16 and not args.loss_scale)
    if "full_iteration" in scope and nan_check:
        parser.error("--cuda-graph-scope full_iteration needs --no-check-for-nan-in-loss-and-grad (Megatron-LM's "
                     "check: the NaN check reads the loss on the host, which a captured iteration cannot)")


def _validate_batch_invariant_mode(parser, args) -> None:
    """--batch-invariant-mode: megatron-core's check, and the families whose own reductions its kernels do not
    replace (megatron-core's batch_invariant_kernels replace aten's mm, addmm, _log_softmax and mean.dim)."""
    if not args.batch_invariant_mode:
        return
    if args.model_family != "gpt":
        ops = ("RMSNorm (angpt.models.norms: a compiled kernel on CUDA, torch's fused rms_norm otherwise)"
               if args.model_family == "gptplus" else "L2 normalizations of the hidden states, q and k (sums over "
               "the hidden dimension: compiled kernels on CUDA, aten::sum otherwise)")
        parser.error(f"--batch-invariant-mode with --model-family {args.model_family}: "
                     f"{FAMILY_NAMES[args.model_family]}'s {ops}: none of the ops megatron-core's batch-invariant "
                     "kernels replace (aten's mm, addmm, _log_softmax, mean.dim), so its results would still depend "
                     "on the batch; --model-family gpt takes it as Megatron-LM does")
    if args.attention_backend != "flash":
        parser.error(f"--batch-invariant-mode needs --attention-backend flash, not {args.attention_backend} "
                     "(megatron-core's check)")


def _validate_dry_run(parser, args) -> None:
    for flag in ("suggest_layout", "gpu_memory_gib"):
        if getattr(args, flag) not in (None, False) and args.dry_run is None:
            parser.error(f"--{flag.replace('_', '-')} is part of the dry run's report: add --dry-run WORLD_SIZE")


def _nan_checks(flags: dict) -> bool:
    """RerunSection.nan_checks."""
    return (flags["check_for_nan_in_loss_and_grad"] and flags["rerun_mode"] != "disabled"
            and not (flags["fp16"] and not flags["loss_scale"]))


def _validate_result_checks(parser, args) -> None:
    # megatron-core's real-time test reads the q and k norms' biases, which RMSNorm has not (an AttributeError in
    # Megatron-LM).
    if args.test_mode and (args.model_family == "gptplus" or (args.model_family == "gpt" and args.qk_layernorm
                                                              and args.normalization == "RMSNorm")):
        parser.error("--test-mode checks the q and k layer norms' weights and biases, and this model's are RMSNorm, "
                     "without biases (megatron-core's check needs --qk-layernorm with LayerNorm)")
    if args.error_injection_type != "transient_error" and not args.error_injection_rate:
        parser.error("--error-injection-type needs --error-injection-rate")
    checked = _nan_checks(vars(args)) or args.check_for_spiky_loss or args.check_for_large_grads
    if args.error_injection_rate and not (args.rerun_mode == "validate_results" and checked):
        parser.error("--error-injection-rate makes checks of --rerun-mode validate_results fail, and this run has "
                     "none (the NaN check is off with --no-check-for-nan-in-loss-and-grad and with --fp16's dynamic "
                     "loss scale)")


def _validate_fake_process_group(parser, args) -> None:
    if args.fake_process_group and args.save:
        parser.error("--fake-process-group with --save: megatron-core's checkpoint save checks the shards of every "
                     "rank, which a fake process group never exchanges (it fails at the first save)")


def _validate_hang_timeout(parser, args) -> None:
    hang = args.hang_timeout_minutes
    if hang is not None and hang >= args.distributed_timeout_minutes:
        parser.error(f"--hang-timeout-minutes {hang} must be below --distributed-timeout-minutes "
                     f"{args.distributed_timeout_minutes}: the stacks are for before the collective times out")
    after_init = args.distributed_timeout_seconds_after_init
    if hang is not None and after_init is not None and hang * 60 >= after_init:
        parser.error(f"--hang-timeout-minutes {hang} must be below --distributed-timeout-seconds-after-init "
                     f"{after_init} (in minutes, {after_init / 60:g}): the stacks are for before the collective times "
                     "out")


def _validate_ddp(parser, args) -> None:
    """Megatron-LM's checks of its data-parallel bucket flags (get_model), and megatron-core's of the reduce-scatter
    with fp32 accumulation (its _ParamAndGradBucketGroup asserts them)."""
    if args.ddp_num_buckets is not None and args.ddp_bucket_size is not None:
        parser.error("give one of --ddp-num-buckets and --ddp-bucket-size (Megatron-LM's check)")
    if args.reduce_scatter_with_fp32_accumulation and args.use_distributed_optimizer and not args.use_megatron_fsdp:
        if args.num_distributed_optimizer_instances > 1:
            parser.error("--ddp-reduce-scatter-with-fp32-accumulation with --num-distributed-optimizer-instances "
                         f"{args.num_distributed_optimizer_instances}: megatron-core builds it for one instance only")
        if args.average_in_collective:
            parser.error("--ddp-reduce-scatter-with-fp32-accumulation sums the gradients (megatron-core asserts "
                         "ReduceOp.SUM): not with --ddp-average-in-collective")


def _validate_checkpoints(parser, args) -> None:
    for flag in ("save_interval", "keep_last_n_checkpoints", "save_retain_interval", "async_save"):
        if getattr(args, flag) and not args.save:
            parser.error(f"--{flag.replace('_', '-')} needs --save")
    if args.ckpt_format == "torch" and args.async_save:
        parser.error("--async-save with --ckpt-format torch: Megatron-LM's torch format has no asynchronous save (it "
                     "raises NotImplementedError at the first); use --ckpt-format torch_dist")
    if args.ckpt_format == "torch" and args.use_distributed_optimizer and not args.enable_gloo_process_groups:
        parser.error("--ckpt-format torch with --use-distributed-optimizer needs megatron-core's gloo process groups "
                     "(its optimizer state is gathered on data-parallel rank 0 over them): leave out "
                     "--disable-gloo-process-groups, or use --ckpt-format torch_dist (Megatron-LM's check)")
    retain = args.save_retain_interval
    if retain and not args.save_interval:
        parser.error("--save-retain-interval needs --save-interval")
    if retain and retain % args.save_interval:
        parser.error(f"--save-retain-interval {retain} must be a multiple of --save-interval {args.save_interval} "
                     "(Megatron-LM's check)")
    given = [f"--{name}-weight-decay" for name in ("start", "end") if getattr(args, f"{name}_weight_decay") is not None]
    if args.weight_decay_incr_style == "constant" and given:  # Megatron-LM's checks
        parser.error(f"{' and '.join(given)} need{'s' if len(given) == 1 else ''} --weight-decay-incr-style linear or "
                     "cosine (constant: --weight-decay)")
    if args.weight_decay_incr_style != "constant" and len(given) < 2:
        parser.error(f"--weight-decay-incr-style {args.weight_decay_incr_style} needs --start-weight-decay and "
                     "--end-weight-decay")
    if args.override_opt_param_scheduler and args.megatron_use_checkpoint_opt_param_scheduler:
        parser.error("give one of --override-opt_param-scheduler (the flags' schedule) and "
                     "--use-checkpoint-opt_param-scheduler (the checkpoint's)")
    if (args.exit_signal_handler or args.exit_interval or args.exit_duration_in_mins) and not args.save:
        # Megatron-LM exits without saving then; a user who asks for a graceful exit wants the state.
        parser.error("--exit-signal-handler, --exit-interval and --exit-duration-in-mins need --save")
    for flag, given in (("finetune", args.finetune), ("load-fallback-to-intact", args.load_fallback_to_intact),
                        ("ckpt-step", args.ckpt_step is not None), ("use-checkpoint-args", args.use_checkpoint_args),
                        ("no-initialization", not args.perform_initialization)):
        if given and not args.load:
            parser.error(f"--{flag} needs --load")
    if args.load_main_params_from_ckpt and not args.no_load_optim:
        parser.error("--load-main-params-from-ckpt needs --no-load-optim (Megatron-LM's check)")
    if args.load_main_params_from_ckpt and (args.bf16 or args.fp16) and not args.use_distributed_optimizer:
        parser.error("--load-main-params-from-ckpt with --bf16 or --fp16 needs --use-distributed-optimizer: "
                     "megatron-core's other 16-bit optimizer takes its main weights from the model only (it asserts "
                     "'Initialize main params from state dict is not supported', in Megatron-LM too)")
    if (args.distrib_optim_fully_reshardable_mem_efficient and args.use_distributed_optimizer
            and args.ckpt_format == "torch_dist" and not args.enable_gloo_process_groups):
        parser.error("--distrib-optim-fully-reshardable-mem-efficient gathers the optimizer state over megatron-core's "
                     "gloo process groups: leave out --disable-gloo-process-groups (Megatron-LM's check)")
    _validate_non_persistent(parser, args)


def _validate_non_persistent(parser, args) -> None:
    """Megatron-LM's checks of the non-persistent checkpoints; local ones (and in_memory, which Megatron-LM 0.16's
    validate_args refuses) are not built."""
    kind = args.non_persistent_ckpt_type
    if kind == "local":
        parser.error("--non-persistent-ckpt-type local: its checkpoints are nvidia_resiliency_ext's "
                     "(LocalCheckpointManager), which is not installed here: use --non-persistent-ckpt-type global")
    if kind == "in_memory":
        parser.error("--non-persistent-ckpt-type in_memory: Megatron-LM 0.16 refuses it too (its validate_args: "
                     "'Currently only global and local checkpoints are supported'): use global")
    given = args.non_persistent_global_ckpt_dir
    if kind == "global" and args.save and given and os.path.realpath(given) == os.path.realpath(args.save):
        parser.error("--non-persistent-global-ckpt-dir is --save: each non-persistent save would delete the persistent "
                     "checkpoints there (as Megatron-LM's cleanup would): give another directory")
    if args.non_persistent_save_interval and kind is None:
        parser.error("--non-persistent-save-interval needs --non-persistent-ckpt-type global (Megatron-LM raises "
                     "NotImplementedError at the first such save without it)")
    if args.ckpt_step is not None and args.load_fallback_to_intact:
        parser.error("give one of --ckpt-step (that checkpoint) and --load-fallback-to-intact (the newest intact one)")


def _validate_wandb(parser, args) -> None:
    if not args.wandb_project:
        for flag in ("wandb_exp_name", "wandb_entity", "wandb_save_dir"):
            if getattr(args, flag):
                parser.error(f"--{flag.replace('_', '-')} needs --wandb-project (W&B is off without it)")
        return
    if not (args.wandb_save_dir or args.save):
        parser.error("--wandb-project needs --wandb-save-dir or --save (W&B's files go to <save>/wandb)")
    # Found, not imported: importing wandb takes a second, and only rank 0 uses it.
    if importlib.util.find_spec("wandb") is None:
        parser.error("--wandb-project needs the wandb package: pip install wandb")


def _read_data_args(parser, args) -> None:
    """--data-args-path and --per-split-data-args-path: the values of --data-path, or of the per-split paths, read
    from a file (Megatron-LM's get_blend_and_blend_per_split) into those flags, checked from there on as given."""
    per_split = [f"--{flag.replace('_', '-')}" for flag in ("train_data_path", "valid_data_path", "test_data_path")
                 if getattr(args, flag)]
    for path_flag, given in (("data_args_path", ["--data-path"] if args.data_path else []),
                             ("per_split_data_args_path", per_split)):
        path = getattr(args, path_flag)
        if path is None:
            continue
        name = f"--{path_flag.replace('_', '-')}"
        if given:  # Megatron-LM's check
            parser.error(f"give one of {name} and {' '.join(given)}")
        try:
            if path_flag == "data_args_path":
                args.data_path = read_text(path).split()
                if not args.data_path:
                    raise ValueError("empty: it holds --data-path's values")
                continue
            splits = read_json_object(path)
            missing = [key for key in ("train", "valid", "test") if key not in splits]
            if missing:
                raise ValueError(f"no {', '.join(missing)} (the keys are train, valid and test)")
            for key, flag in zip(("train", "valid", "test"), ("train_data_path", "valid_data_path", "test_data_path")):
                value = splits[key].split() if isinstance(splits[key], str) else splits[key]
                if value is not None and (not isinstance(value, list) or not value
                                          or not all(isinstance(v, (str, int, float)) for v in value)):
                    raise ValueError(f"{key}: {json.dumps(splits[key])} is not a list of weights and prefixes, a "
                                     "string of them or null")
                setattr(args, flag, None if value is None else [str(v) for v in value])
        except OSError as error:
            parser.error(f"{name} {path}: {error.strerror}")
        except ValueError as error:
            shown = str(error).removeprefix(f"{path}: ")
            parser.error(f"{name} {path}: {shown}")


def _validate_logging(parser, args) -> None:
    if args.log_memory_interval is not None and args.log_memory_interval % args.log_interval:
        parser.error(f"--log-memory-interval {args.log_memory_interval} must be a multiple of --log-interval "
                     f"{args.log_interval} (Megatron-LM's check)")
    if args.tensorboard_log_interval == 0 and args.tensorboard_dir:
        parser.error("--tensorboard-log-interval 0 with --tensorboard-dir: Megatron-LM divides the iteration by it "
                     "(ZeroDivisionError); give 1 or more")
    if args.save_dgrads_interval is not None and not (args.bf16 or args.fp16):
        parser.error("--save-dgrads-interval needs --bf16 or --fp16: in fp32 megatron-core's cross entropy changes "
                     "the output layer's logits in place, which the backward hook Megatron-LM puts on that layer "
                     "forbids (a RuntimeError there too)")
    if args.save_wgrads_interval is not None and (args.use_megatron_fsdp or args.use_torch_fsdp2):
        sharding = "--use-megatron-fsdp" if args.use_megatron_fsdp else "--use-torch-fsdp2"
        parser.error(f"--save-wgrads-interval: not built with {sharding} (its sharded gradients are not gathered to "
                     "be saved)")


def _validate_data(parser, args) -> None:
    _read_data_args(parser, args)
    if not (args.data_path or args.train_data_path or args.mock_data):
        parser.error("no training data: give --data-path, --train-data-path or --mock-data")
    given = [f"--{flag.replace('_', '-')}" for flag in ("data_path", "train_data_path", "mock_data")
             if getattr(args, flag)]
    if len(given) > 1:
        parser.error(f"{' and '.join(given)} both name the training data: give one")
    if args.data_path and (args.valid_data_path or args.test_data_path):
        parser.error("--data-path splits one blend into train, validation and test (--split); "
                     "--valid-data-path and --test-data-path go with --train-data-path")
    if args.mock_data and not args.vocab_size and args.tokenizer_type is None:
        parser.error("--mock-data needs --vocab-size or --tokenizer-type")
    for flag in ("tokenizer_special_tokens", "tiktoken_special_tokens", "tokenizer_hf_include_special_tokens",
                 "tokenizer_metadata"):
        if getattr(args, flag) and args.tokenizer_type is None:
            parser.error(f"--{flag.replace('_', '-')} goes with --tokenizer-type: without it the tokenizer is the "
                         "one the datasets' .json records (Megatron-LM builds none without it)")
    for flag in ("dataloader_fast_cache_load", "dataloader_defer_npy_index_mmap"):
        if getattr(args, flag) and not args.data_cache_path:  # megatron-core's checks
            parser.error(f"--{flag.replace('_', '-')} needs --data-cache-path, where the index caches are")
    if args.dataloader_fast_cache_load and args.data_path:
        parser.error("--dataloader-fast-cache-load with --data-path: megatron-core builds it from per-split paths only "
                     "(give --train-data-path, --valid-data-path and --test-data-path, or --per-split-data-args-path)")
    if args.multiple_validation_sets and not (args.full_validation or args.skip_train):
        parser.error("--multiple-validation-sets needs --full-validation (Megatron-LM's check; or --skip-train)")
    if args.full_validation:
        flag = "valid_data_path" if args.valid_data_path else "data_path" if args.data_path else None
        if flag and _is_weighted(getattr(args, flag)):
            # megatron-core's builder asserts it: a split built whole has no sample count to share out by weight.
            parser.error(f"--full-validation builds the validation split whole, and megatron-core weighs no such "
                         f"split: give --{flag.replace('_', '-')} its prefixes without weights")
    if args.fim_data:  # Megatron-LM's checks (validate_args), and what fails in its GPTFIMDataset
        if args.mock_data:
            parser.error("--fim-data with --mock-data: Megatron-LM's check (the mock dataset is not a FIM dataset)")
        if getattr(args, "megatron_legacy_tokenizer", False):
            parser.error("--fim-data with --legacy-tokenizer: Megatron-LM's check (FIM data is not built with the "
                         "legacy tokenizers)")
        for flag in ("fim_rate", "fim_spm_rate"):
            if not getattr(args, flag):
                parser.error(f"--{flag.replace('_', '-')} 0 with --fim-data: Megatron-LM's check (it asserts the "
                             "rate is given, not 0)")
        if args.fim_split_sample and args.fim_fragment_rate is None:
            parser.error("--fim-split-sample needs --fim-fragment-rate (Megatron-LM's GPTFIMDataset fails on its "
                         "default, None, at the first split document)")
    if args.reset_attention_mask and args.transformer_impl == "transformer_engine":
        parser.error("--reset-attention-mask: Transformer Engine's attention here is causal by its mask type and "
                     "takes no document mask; use --transformer-impl local")
    for flag in ("data_path", "train_data_path", "valid_data_path", "test_data_path"):
        values = getattr(args, flag)
        if not values:
            continue
        name = f"--{flag.replace('_', '-')}"
        try:
            prefixes, _ = parse_blend(values)
        except ValueError as error:
            parser.error(str(error).replace("--data-path", name))
        prefixes, _ = parse_blend(_blend_of_prefixes(values))
        for prefix in prefixes:
            if object_storage.is_object_storage_path(prefix):
                _validate_object_storage_prefix(parser, args, name, prefix)
                continue
            missing = [ext for ext in (".bin", ".idx") if not os.path.isfile(prefix + ext)]
            if missing:
                hint = (" (read as a prefix: Megatron-LM reads an odd count of values, or pairs whose weights are not "
                        "all numbers, as prefixes without weights)") if as_number(prefix) is not None else ""
                parser.error(f"{name} {prefix}: no {' or '.join(prefix + e for e in missing)}{hint}")




def _validate_object_storage_prefix(parser, args, name: str, prefix: str) -> None:
    """A prefix in object storage, as megatron-core's GPTDataset and IndexedDataset take it (their asserts), with its
    client installed and its .bin and .idx there."""
    if args.object_storage_cache_path is None:
        parser.error(f"{name} {prefix}: a dataset in object storage needs --object-storage-cache-path, where "
                     "megatron-core keeps its .idx (Megatron-LM's assert)")
    if args.mmap_bin_files:
        parser.error(f"{name} {prefix}: megatron-core reads a .bin in object storage by ranged GETs, not through a "
                     "memory map: give --no-mmap-bin-files (its IndexedDataset asserts)")
    missing = object_storage.client_missing(prefix)
    if missing:
        parser.error(f"{name} {prefix}: {missing}")
    for ext in (".bin", ".idx"):
        try:
            if not object_storage.exists(prefix + ext):
                parser.error(f"{name} {prefix}: no {prefix + ext}")
        except object_storage.ObjectStorageError as error:
            parser.error(f"{name} {prefix}: {error}")


def _gpt_derived(flags: dict) -> dict:
    """Megatron-LM's defaults of --normalization and --position-embedding-type, and what its validate_args derives
    from the architecture flags: the MLP's width, RoPE from the deprecated --use-rotary-position-embeddings, a QKV
    bias wherever the linear layers have biases, and the positions' table (required there; --seq-length here)."""
    position = flags["position_embedding_type"] or GPT_DEFAULTS["position_embedding_type"]
    return dict(
        normalization=flags["normalization"] or GPT_DEFAULTS["normalization"],
        ffn_hidden_size=ffn_hidden_size(flags),
        position_embedding_type="rope" if flags["use_rotary_position_embeddings"] else position,
        add_qkv_bias=flags["add_qkv_bias"] or flags["add_bias_linear"],
        max_position_embeddings=flags["max_position_embeddings"] or flags["seq_length"],
    )


def _is_weighted(values: list[str]) -> bool:
    try:
        return parse_blend(values)[1] is not None
    except ValueError:
        return False  # refused below, naming the flag


def _blend_of_prefixes(values: list[str]) -> list[str]:
    """A blend's values with each prefix written as one of its files (`corpus_text_document.bin`) as that prefix."""
    prefixes, _ = parse_blend(values)
    return [value[:-len(".bin")] if value in prefixes and value.endswith((".bin", ".idx")) else value
            for value in values]


def _recompute_granularity(flags: dict) -> Optional[str]:
    """--recompute-granularity, with Megatron-LM's alias --recompute-activations (selective)."""
    return "selective" if flags["recompute_activations"] else flags["recompute_granularity"]


def default(dest: str) -> Any:
    """The default of a flag field (a --config file's values are the parser's defaults, not the field's)."""
    value = SECTIONS[FIELD_SECTIONS[dest]].__dataclass_fields__[dest].default
    return list(value) if isinstance(value, tuple) else value  # as argparse gives it


def derive(flags: dict, world_size: int) -> dict:
    """The values the flags imply, computed once: the layout's sizes, sequence parallelism (off with TP 1, as in
    Megatron-LM), the recompute granularity of --recompute-activations, the steps of a run by samples, the FP8
    details' defaults, the data prefixes, the NaN checks and the exit signals. Also for the flags an older
    checkpoint recorded (angpt.config.saved)."""
    tp, pp, cp = (flags["tensor_model_parallel_size"], flags["pipeline_model_parallel_size"],
                  flags["context_parallel_size"])
    # --cp-comm-type not given: Megatron-LM's p2p, but for context parallelism on the local spec, which builds
    # all_gather only (said in one line, megatron_lm.notes). Old checkpoints record ["p2p"].
    all_gather_default = flags["cp_comm_type"] is None and cp > 1 and flags["transformer_impl"] == "local"
    derived = dict(
        world_size=world_size,
        data_parallel_size=world_size // (tp * pp * cp),
        virtual_pipeline_stages=pipeline_split.virtual_stages(flags["num_layers"], argparse.Namespace(**flags)),
        # Sequence parallelism is within the tensor-parallel group (said in one line, megatron_lm.notes).
        sequence_parallel=flags["sequence_parallel"] and tp > 1,
        sequence_parallel_disabled=flags["sequence_parallel"] and tp == 1,
        cp_comm_type_all_gather_default=all_gather_default,
        recompute_granularity=_recompute_granularity(flags),
        nan_checks=_nan_checks(flags) and not flags["fake_process_group"],
        save_and_exit_signals=tuple(sorted({"SIGTERM", *([flags["exit_signal"]] if flags["exit_signal_handler"]
                                                         else [])})) if flags["save"] else (),
    )
    if flags["fake_process_group"]:  # as Megatron-LM's validate_args (said in one line, megatron_lm.notes)
        derived.update(check_for_nan_in_loss_and_grad=False, enable_gloo_process_groups=False)
    if flags["train_samples"] is not None:
        if flags["rampup_batch_size"] is None:
            # Whole global batches; the samples of a last, partial one are left out, as in Megatron-LM.
            derived["train_iters"] = flags["train_samples"] // flags["global_batch_size"]
        else:
            # megatron-core's calculator, imported only for a ramp-up: flag errors stay instant.
            from angpt.config.batch_schedule import rampup_train_iters  # noqa: PLC0415

            derived["train_iters"] = rampup_train_iters(flags["global_batch_size"], flags["rampup_batch_size"],
                                                        flags["train_samples"])
    derived.update({flag: value for flag, value in FP8_DEFAULTS.items() if flags[flag] is None})
    if flags["cp_comm_type"] is None:
        derived["cp_comm_type"] = ("all_gather",) if all_gather_default else ("p2p",)
    if flags["model_family"] == "gpt":
        derived.update(_gpt_derived(flags))
    if flags["phase_transition_iterations"] is not None:
        derived["phase_transitions"] = phase_transitions(flags["phase_transition_iterations"])
    if flags["no_weight_decay_cond_type"] == "apply_wd_to_qk_layernorm":  # Megatron-LM's validate_args
        derived["apply_wd_to_qk_layernorm"] = True
    if flags["tiktoken_special_tokens"] and not flags["tokenizer_special_tokens"]:  # Megatron-LM's validate_args
        derived["tokenizer_special_tokens"] = flags["tiktoken_special_tokens"]
    if flags["skip_train"]:  # Megatron-LM's validate_args: nothing to step
        derived["no_load_optim"] = True
    for flag in ("data_path", "train_data_path", "valid_data_path", "test_data_path"):
        if flags[flag]:
            derived[flag] = _blend_of_prefixes(list(flags[flag]))
    return derived
