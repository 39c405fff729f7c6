"""megatron-core's configs from the run's configuration, as Megatron-LM's `core_transformer_config_from_args`
fills them (and angpt.training.optimizer its OptimizerConfig): every field of a section whose name is a field of
megatron-core's config goes there by name, so a Megatron-LM flag whose destination is such a field reaches
megatron-core with Megatron-LM's meaning without code of its own. Then the named overrides: flags whose names
differ from the fields, and what a family fixes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.activations import squared_relu
from megatron.core.distributed import DistributedDataParallelConfig, TorchFullyShardedDataParallelConfig
from megatron.core.fusions.fused_bias_geglu import quick_gelu
from megatron.core.transformer.enums import AttnBackend

from angpt.config import transformer_engine_support
from angpt.config.sections import SECTIONS, ArchitectureSection, RunConfig
from angpt.models import AnGPTConfig, model_config

# anGPT's switches and the model config's fields they set (docs/model.md, Families and switches).
SWITCH_FIELDS = dict(angpt_post_norm="post_norm", angpt_nu_p="nu_p_reading", angpt_alpha_init="alpha_init",
                     angpt_constant_factors="constant_factors",
                     angpt_constant_factor_multiplier="constant_factor_multiplier", angpt_nu_alpha="nu_alpha_mode",
                     angpt_nu_alpha_multiplier="nu_alpha_multiplier", angpt_residual="residual")


def by_name(config: RunConfig, megatron_config: type) -> dict[str, Any]:
    """{field: value} of the run's fields that `megatron_config` (a dataclass) has by name; tuples as lists."""
    fields = {field.name for field in dataclasses.fields(megatron_config)}
    values = {}
    for name in SECTIONS:
        for key, value in dataclasses.asdict(getattr(config, name)).items():
            if key in fields:
                values[key] = list(value) if isinstance(value, tuple) else value
    return values


def params_dtype(config: RunConfig) -> torch.dtype:
    precision = config.precision
    return torch.bfloat16 if precision.bf16 else torch.float16 if precision.fp16 else torch.float32


def transformer_config(config: RunConfig) -> AnGPTConfig:
    """The model config of the run (Megatron-LM's `core_transformer_config_from_args`)."""
    model, parallel, precision = config.model, config.parallel, config.precision
    values = by_name(config, AnGPTConfig)
    if model.model_family == "gpt":
        values.update(_gpt_architecture(config))
    else:  # The families of the paper fix their architecture (the flags that contradict it were refused).
        for field in [*(field.name for field in dataclasses.fields(ArchitectureSection)), "max_position_embeddings"]:
            values.pop(field, None)
        values["share_embeddings_and_output_weights"] = model.tie_embeddings_and_output_weights
    values.update(
        # Flags named otherwise than the fields they set.
        num_layers_in_first_pipeline_stage=parallel.decoder_first_pipeline_num_layers,
        num_layers_in_last_pipeline_stage=parallel.decoder_last_pipeline_num_layers,
        virtual_pipeline_model_parallel_size=parallel.virtual_pipeline_stages,
        layernorm_epsilon=model.norm_epsilon,
        rope_position_ids=config.data.reset_position_ids,
        params_dtype=params_dtype(config),
        pipeline_dtype=params_dtype(config),
        attention_backend=AttnBackend[precision.attention_backend],
        # One exchange for all layers (validated): megatron-core reads a list per layer. None: a configuration
        # not derived by validation, megatron-core's default.
        cp_comm_type=parallel.cp_comm_type[0] if parallel.cp_comm_type else None,
        nu_alpha_grad=not config.switches.angpt_no_nu_alpha_grad,
        # megatron-core defers the output layer's weight-gradient GEMMs only with the fused accumulation into
        # main_grad (apex's kernel, or angpt.megatron_compat.wgrad_fusion's); off otherwise, as "implied" says.
        gradient_accumulation_fusion=parallel.defer_embedding_wgrad_compute,
        **{field: getattr(config.switches, switch) for switch, field in SWITCH_FIELDS.items()},
        **_fusions(config),
        **_activation_offloading(config),
        # The recompute flags' defaults are Megatron-LM's for full recompute: each applies to its granularity.
        recompute_method=model.recompute_method if model.recompute_granularity == "full" else None,
        recompute_num_layers=model.recompute_num_layers if model.recompute_granularity == "full" else None,
        recompute_modules=(list(model.recompute_modules) if model.recompute_granularity == "selective"
                           and model.recompute_modules else None),
    )
    # FP8 GEMMs in the transformer layers (Transformer Engine; docs/fp8.md): --fp8-format is Megatron-LM's `fp8`.
    values["fp8"] = precision.fp8_format
    if model.model_family == "ngpt":  # nGPT fixes its own factors.
        for key in ("constant_factors", "nu_alpha_mode"):
            values.pop(key)
    # As Megatron-LM: the interleaved schedule overlaps its exchanges unless --no-overlap-p2p-communication, and
    # batches them otherwise; there is nothing to overlap without it.
    overlap = parallel.virtual_pipeline_stages is not None and parallel.overlap_p2p_comm
    values.update(overlap_p2p_comm=overlap, batch_p2p_comm=not overlap)
    if not torch.cuda.is_available():
        # gloo matches the messages between two ranks in the order they are posted: the interleaved schedule's
        # batched exchanges gave wrong gradients at PP=2, and with its overlapped ones the equivalence job hung in one
        # of four full-suite runs (the likely cause; said in one line, megatron_lm.notes). One exchange at a time.
        values.update(batch_p2p_comm=False, batch_p2p_sync=False, overlap_p2p_comm=False,
                      overlap_p2p_comm_warmup_flush=False)
    return model_config(values.pop("model_family"), **values)


def _gpt_architecture(config: RunConfig) -> dict:
    """GPT's flags named otherwise than the fields they set, as Megatron-LM's core_transformer_config_from_args
    and gpt_builders set them: the activation, grouped-query attention (one group unless --num-query-groups) and
    the tied embedding (unless --untie-embeddings-and-output-weights)."""
    architecture = config.architecture
    values = dict(
        num_query_groups=(config.model.num_query_groups or 1) if architecture.group_query_attention else None,
        share_embeddings_and_output_weights=not config.model.untie_embeddings_and_output_weights,
    )
    if architecture.swiglu:
        values.update(activation_func=F.silu, gated_linear_unit=True)
    elif architecture.squared_relu:
        values.update(activation_func=squared_relu)
    elif architecture.quick_geglu:
        values.update(activation_func=quick_gelu, gated_linear_unit=True)
    return values


def _activation_offloading(config: RunConfig) -> dict:
    """megatron-core's activation offloading fields (validated): Megatron-LM turns cpu_offloading on with
    --cpu-offloading-num-layers above 0. Both kinds copy to the host on CUDA streams."""
    memory = config.memory
    offloading = {"--cpu-offloading-num-layers": memory.cpu_offloading_num_layers > 0,
                  "--fine-grained-activation-offloading": memory.fine_grained_activation_offloading}
    for flag, on in offloading.items():
        if on and not torch.cuda.is_available():
            raise ValueError(f"{flag} offloads activations to the host on CUDA streams: it needs a CUDA device; "
                             "there is none here")
    return dict(cpu_offloading=offloading["--cpu-offloading-num-layers"],
                offload_modules=list(memory.offload_modules or ()))


def _fusions(config: RunConfig) -> dict:
    """The fusions (on by default with a GPU, where each pays for its compilation) and CUDA graphs."""
    on_gpu = torch.cuda.is_available()
    fusion, precision = config.fusion, config.precision
    rope_fusion = fusion.apply_rope_fusion
    if fusion.cuda_graph_impl != "none" and not on_gpu:
        raise ValueError(f"--cuda-graph-impl {fusion.cuda_graph_impl} needs a CUDA device; there is none here")
    if config.data.reset_position_ids and transformer_engine_support.transformer_engine_error() is None:
        # Transformer Engine's fused RoPE takes one angle per position ([s, 1, 1, dim]), not one per token.
        if rope_fusion:
            raise ValueError("--rope-fusion: Transformer Engine's fused RoPE cannot follow --reset-position-ids "
                             "(one angle per position, not per token); leave --rope-fusion out")
        rope_fusion = False
    cross_entropy_fusion = precision.cross_entropy_loss_fusion
    # megatron-core's SwiGLU fusion, used by GPT+'s MLP (the normalized families' MLP has its own kernel).
    activation_fusion, fusable = fusion.bias_swiglu_fusion, True
    if config.model.model_family == "gpt":
        architecture = config.architecture
        # As Megatron-LM: --swiglu's fusion, or GELU's (quick GeGLU's; GELU's needs the biases, squared ReLU has none).
        rope_fusion = rope_fusion if architecture.position_embedding_type == "rope" else False
        if not architecture.swiglu:
            activation_fusion = fusion.bias_gelu_fusion
            fusable = architecture.quick_geglu or (architecture.add_bias_linear and not architecture.squared_relu)
        # megatron-core's fused activations take no offset but quick GeGLU's, and no clamp (angpt.config.validation).
        fusable = fusable and not architecture.glu_linear_offset and architecture.activation_func_clamp_value is None
    return dict(
        apply_rope_fusion=on_gpu if rope_fusion is None else rope_fusion,
        bias_activation_fusion=on_gpu and fusable if activation_fusion is None else activation_fusion,
        # Where it is exact and pays for its compilation (angpt.config.validation); not deterministic.
        cross_entropy_loss_fusion=(precision.bf16 and on_gpu and not config.training.deterministic_mode
                                   if cross_entropy_fusion is None else cross_entropy_fusion),
    )


def ddp_config(config: RunConfig) -> DistributedDataParallelConfig:
    """Data-parallel gradient reduction (Megatron-LM's `get_model`): in fp32 unless --grad-reduce-in-bf16; the local
    grads checked before it (the rerun state machine's checks). With --use-torch-fsdp2, FSDP2's config (which
    angpt.training.step wraps the model for); with --use-megatron-fsdp, Megatron-FSDP's settings are fields of it.
    --ddp-num-buckets sets the bucket size from the model's size (angpt.training.step.build_model_chunks)."""
    parallel = config.parallel
    if parallel.use_torch_fsdp2:
        return TorchFullyShardedDataParallelConfig(reshard_after_forward=parallel.torch_fsdp2_reshard_after_forward)
    return DistributedDataParallelConfig(**{
        **by_name(config, DistributedDataParallelConfig),
        "use_custom_fsdp": parallel.use_megatron_fsdp,  # Megatron-LM sets its deprecated name with it
        "check_for_nan_in_grad": config.rerun.nan_checks,
        "grad_reduce_in_fp32": not config.precision.grad_reduce_in_bf16,
        "bucket_size": config.parallel.ddp_bucket_size,
        # As Megatron-LM's validate_args: stages gather their weights at once only in the interleaved schedule.
        "align_param_gather": parallel.align_param_gather and parallel.virtual_pipeline_stages is not None,
    })
