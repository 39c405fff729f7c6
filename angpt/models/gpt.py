"""The model of each family on megatron-core's GPTModel."""

from __future__ import annotations

import copy
import dataclasses
from typing import Optional

from megatron.core import tensor_parallel
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

from angpt.config.transformer_engine_support import require_transformer_engine
from angpt.models.bounding import project_parameters_
from angpt.models.config import AnGPTConfig
from angpt.models.layers import ScaledOutputLayer, is_row_parallel_linear
from angpt.models.norms import RMSNorm
from angpt.models.scales import LearnableScale
from angpt.models.specs import gpt_layer_spec, gptplus_layer_spec, normalized_layer_spec
from angpt.models.te_specs import layer_and_final_norm, te_gpt_layer_spec

# What happens to each family's weight matrices after every optimizer step (docs/model.md, Bounding).
WEIGHT_CONSTRAINTS = {"angpt": "bound", "ngpt": "normalize", "gptplus": None, "gpt": None}


def block_spec(config: AnGPTConfig, vp_stage: int | None = None) -> TransformerBlockSubmodules | ModuleSpec:
    """The layers this pipeline stage builds, and the final norm (GPT+ only: anGPT has none), in the
    config's `transformer_impl`. GPT's is its layer's spec, to which megatron-core's TransformerBlock adds the
    final norm of its choice, as it does in Megatron-LM."""
    if config.model_family == "gpt":
        return te_gpt_layer_spec(config) if config.transformer_impl == "transformer_engine" else gpt_layer_spec(config)
    if config.transformer_impl == "transformer_engine":
        layer, final_norm = layer_and_final_norm(config)
    elif config.normalized:
        layer, final_norm = normalized_layer_spec(), None
    else:
        layer, final_norm = gptplus_layer_spec(), RMSNorm
    return TransformerBlockSubmodules(
        layer_specs=[layer] * get_num_layers_to_build(config, vp_stage=vp_stage), layer_norm=final_norm
    )


class PositionedGPTModel(GPTModel):
    """megatron-core's GPTModel, whose RoPE rotates each token by its position id when the config says so
    (rope_position_ids): megatron-core's rotates by the index in the sequence and leaves position ids to
    learned position embeddings (GPT's --position-embedding-type learned_absolute)."""

    def _preprocess(self, input_ids, position_ids, *args, **kwargs):
        decoder_input, rotary_pos_emb, *rest = super()._preprocess(input_ids, position_ids, *args, **kwargs)
        if self.config.rope_position_ids and rotary_pos_emb is not None and position_ids is not None:
            # The angles of index p are those of position p: [s, 1, 1, dim] rows taken per token by its
            # [b, s] position ids (all below s), giving [s, b, 1, dim], which RoPE broadcasts over heads. Under
            # context parallelism megatron-core's angles are this rank's chunks only, while the position ids
            # (split alike) count in the whole sequence: their rows come from the whole sequence's angles.
            cp = self.config.context_parallel_size
            if cp > 1:
                rotary_pos_emb = self.rotary_pos_emb.get_emb(rotary_pos_emb.shape[0] * cp)
            rotary_pos_emb = rotary_pos_emb[position_ids.t()].squeeze(2)
        return decoder_input, rotary_pos_emb, *rest


class NormalizedGPTModel(PositionedGPTModel):
    """anGPT and nGPT: GPTModel with the logit scale s_Z, no final norm, and every weight matrix
    initialized on the unit sphere and tagged for the post-step projection."""

    def __init__(self, config: AnGPTConfig, vocab_size: int, **kwargs):
        super().__init__(config, block_spec(config, kwargs.get("vp_stage")), vocab_size, **kwargs)
        if self.post_process:
            ScaledOutputLayer.attach(self.output_layer, config, vocab_size)
        for module in self.modules():
            if isinstance(module, LearnableScale):
                continue
            for param in module.parameters(recurse=False):
                if param.dim() == 2:
                    # A row is one output unit's weights (dim 1). nGPT normalizes along the embedding
                    # dimension, which is dim 0 of the output projections W_p and W_d.
                    along_columns = config.model_family == "ngpt" and is_row_parallel_linear(module)
                    param.unit_norm_dim = 0 if along_columns else 1
        if config.perform_initialization:  # else --no-initialization: the checkpoint gives them
            # Rows drawn from N(0, 1), normalized to exactly 1 (docs/model.md, Initialization).
            project_parameters_([self], "normalize")


def build_model(
    config: AnGPTConfig,
    vocab_size: int,
    max_sequence_length: int,
    pre_process: bool = True,
    post_process: bool = True,
    vp_stage: int | None = None,
    parallel_output: bool = True,
) -> GPTModel:
    """One pipeline stage (or virtual stage) of the configured family; GPT's as Megatron-LM's gpt_builders
    builds it, the learned positions' table `config.max_position_embeddings` rows (default
    `max_sequence_length`)."""
    kwargs = dict(
        max_sequence_length=config.max_position_embeddings or max_sequence_length,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=parallel_output,
        share_embeddings_and_output_weights=config.share_embeddings_and_output_weights,
        position_embedding_type=config.position_embedding_type,
        rotary_percent=config.rotary_percent,
        rotary_base=config.rotary_base,
        rope_scaling=config.use_rope_scaling,
        vp_stage=vp_stage,
    )
    if config.normalized:
        model = NormalizedGPTModel(config, vocab_size, **kwargs)
    else:
        spec = block_spec(config, vp_stage)
        model = PositionedGPTModel(config, spec, vocab_size, mtp_block_spec=_mtp_block_spec(config, spec, vp_stage),
                                   **kwargs)
    if config.model_family == "gpt" and config.transformer_impl == "local":
        # Megatron-LM runs a 16-bit GPT in its Float16Module, which casts the whole model: the learned positions'
        # table (a torch Embedding) and the local spec's torch norms ignore params_dtype, and the 16-bit linear
        # layers after them refuse their fp32 outputs.
        model.to(config.params_dtype)
    if config.defer_embedding_wgrad_compute:
        _defer_only_the_output_layers_wgrad(model)
    if getattr(model, "mtp_process", False) and model.share_embeddings_and_output_weights and not model.pre_process:
        # megatron-core 0.16.1 allocates the output layer's weight on an MTP stage without the embedding, computes
        # its logits with that stage's copy of the embedding instead, and asserts at the save that the output layer
        # has no weight: every save of a tied GPT with MTP and pipeline parallelism failed (a megatron-core
        # workaround: angpt/megatron_compat). The weight nothing reads is dropped.
        model.output_layer.weight = None
    return model


def _mtp_block_spec(config: AnGPTConfig, layer_spec, vp_stage: int | None):
    """GPT's multi-token prediction layers on this stage (--mtp-num-layers; None where it holds none), as Megatron-LM's
    gpt_builders asks megatron-core for them: each an MTP layer around the decoder's layer spec."""
    if config.mtp_num_layers is None:
        return None
    return get_gpt_mtp_block_spec(config, layer_spec, use_transformer_engine=config.transformer_impl ==
                                  "transformer_engine", vp_stage=vp_stage)


def _defer_only_the_output_layers_wgrad(model: GPTModel) -> None:
    """megatron-core's ColumnParallelLinear defers its weight gradient whenever its config says
    defer_embedding_wgrad_compute, but only GPTModel's output layer has the buffers to defer into (Transformer Engine's
    layers, Megatron-LM's default, never look): the local spec's W_qkv and fc1 raised TypeError at the first forward.
    They compute their weight gradients as they go, under a copy of the config that says so (a megatron-core
    workaround: angpt/megatron_compat)."""
    for module in model.modules():
        if isinstance(module, tensor_parallel.ColumnParallelLinear) and module.embedding_activation_buffer is None:
            module.config = copy.copy(module.config)
            module.config.defer_embedding_wgrad_compute = False


def build_model_with_impl(config: AnGPTConfig, vocab_size: int, max_sequence_length: int,
                          transformer_impl: Optional[str] = None, **kwargs):
    """One pipeline stage of the config's family in `transformer_impl` ("local" or "transformer_engine";
    None keeps the config's), as angpt.models.build_model builds it (kwargs: pre_process, post_process,
    vp_stage, parallel_output). For benchmarks and comparisons of the two implementations."""
    if transformer_impl is not None and transformer_impl != config.transformer_impl:
        config = dataclasses.replace(config, transformer_impl=transformer_impl)
    if config.transformer_impl == "transformer_engine":
        require_transformer_engine()
    return build_model(config, vocab_size, max_sequence_length, **kwargs)
