"""The adapters from parsed flags (angpt.config.arguments) to the objects they configure: the model config,
the padded vocabulary, the virtual pipeline, the data. Beside the arguments, as in Megatron-LM, so that the
trainer, the Hugging Face export and import and the benchmarks build the same objects from the same flags.
(angpt.config.arguments itself imports nothing heavy, so that `--help` is quick.)
"""

from __future__ import annotations

import argparse
from typing import Optional

import torch
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.transformer.enums import AttnBackend

from angpt.config import transformer_engine_support
from angpt.data.gpt_datasets import DataArguments
from angpt.data.tiktoken_layout import TIKTOKEN_NUM_SPECIAL_TOKENS
from angpt.models import AnGPTConfig, model_config
from angpt.training import rerun


def params_dtype(args: argparse.Namespace) -> torch.dtype:
    if args.bf16:
        return torch.bfloat16
    return torch.float16 if getattr(args, "fp16", False) else torch.float32


def padded_vocab_size(vocab_size: int, divisible_by: int, tensor_parallel: int) -> int:
    """Megatron-LM's padding of the vocabulary, so the head splits evenly over tensor-parallel ranks."""
    multiple = divisible_by * tensor_parallel
    return -(-vocab_size // multiple) * multiple


def model_config_from_args(args: argparse.Namespace) -> AnGPTConfig:
    """The model config the flags describe (Megatron-LM's `core_transformer_config_from_args`). Also reads
    the flags a checkpoint recorded (angpt.hf), from before some flags existed."""
    pp = args.pipeline_model_parallel_size
    overrides = dict(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=virtual_pipeline_stages(args),
        sequence_parallel=args.sequence_parallel,
        # Checkpoints saved before these flags existed record neither; one exchange for all layers (validated).
        context_parallel_size=getattr(args, "context_parallel_size", 1),
        cp_comm_type=getattr(args, "cp_comm_type", ["p2p"])[0],
        bf16=args.bf16,
        fp16=getattr(args, "fp16", False),  # not recorded before the flag existed
        params_dtype=params_dtype(args),
        pipeline_dtype=params_dtype(args),
        init_method_std=args.init_method_std,
        layernorm_epsilon=getattr(args, "norm_epsilon", 1e-5),  # not recorded before the flag existed
        calculate_per_token_loss=getattr(args, "calculate_per_token_loss", False),
        post_norm=args.angpt_post_norm,
        nu_p_reading=args.angpt_nu_p,
        alpha_init=args.angpt_alpha_init,
        constant_factors=args.angpt_constant_factors,
        constant_factor_multiplier=args.angpt_constant_factor_multiplier,
        nu_alpha_mode=args.angpt_nu_alpha,
        nu_alpha_multiplier=args.angpt_nu_alpha_multiplier,
        nu_alpha_grad=not args.angpt_no_nu_alpha_grad,
        residual=args.angpt_residual,
        share_embeddings_and_output_weights=args.tie_embeddings_and_output_weights,
        rotary_base=args.rotary_base,
        # Megatron-LM's uneven pipeline splits (angpt.config.pipeline_split); getattr: checkpoints saved before
        # these flags existed record none of them.
        num_layers_in_first_pipeline_stage=getattr(args, "decoder_first_pipeline_num_layers", None),
        num_layers_in_last_pipeline_stage=getattr(args, "decoder_last_pipeline_num_layers", None),
        account_for_embedding_in_pipeline_split=getattr(args, "account_for_embedding_in_pipeline_split", False),
        account_for_loss_in_pipeline_split=getattr(args, "account_for_loss_in_pipeline_split", False),
        pipeline_model_parallel_layout=getattr(args, "pipeline_model_parallel_layout", None),
        rope_position_ids=getattr(args, "reset_position_ids", False),
        # Checkpoints saved before these flags existed record neither.
        attention_dropout=getattr(args, "attention_dropout", 0.0),
        hidden_dropout=getattr(args, "hidden_dropout", 0.0),
    )
    if args.model_family == "ngpt":  # nGPT fixes its own factors.
        for key in ("constant_factors", "nu_alpha_mode"):
            overrides.pop(key)
    for key in ("ffn_hidden_size", "kv_channels", "num_query_groups"):
        if getattr(args, key):
            overrides[key] = getattr(args, key)
    overrides["transformer_impl"] = getattr(args, "transformer_impl", "local")
    fused_cross_entropy = getattr(args, "cross_entropy_loss_fusion", None)
    if fused_cross_entropy is None:  # where it is exact and pays for its compilation (angpt.config.arguments)
        fused_cross_entropy = args.bf16 and torch.cuda.is_available()
    overrides.update(cross_entropy_loss_fusion=fused_cross_entropy,
                     cross_entropy_fusion_impl=getattr(args, "cross_entropy_fusion_impl", "native"))
    overrides["attention_backend"] = AttnBackend[args.attention_backend]
    overrides.update(speed_overrides(args))
    if getattr(args, "fp8_format", None):
        # FP8 GEMMs in the transformer layers (Transformer Engine); docs/fp8.md.
        overrides.update(fp8=args.fp8_format, fp8_recipe=args.fp8_recipe, fp8_margin=args.fp8_margin,
                         fp8_amax_history_len=args.fp8_amax_history_len,
                         fp8_amax_compute_algo=args.fp8_amax_compute_algo)
    if args.recompute_granularity == "full":
        overrides.update(recompute_granularity="full", recompute_method=args.recompute_method,
                         recompute_num_layers=args.recompute_num_layers)
    elif args.recompute_granularity == "selective":
        overrides.update(recompute_granularity="selective", recompute_modules=args.recompute_modules)
    if not torch.cuda.is_available():
        # The interleaved schedule's batched p2p gives wrong gradients on gloo at PP=2.
        overrides.update(batch_p2p_comm=False, batch_p2p_sync=False)
    return model_config(args.model_family, **overrides)


def ddp_config_from_args(args: argparse.Namespace) -> DistributedDataParallelConfig:
    """Data-parallel gradient reduction (Megatron-LM's `get_model`): in fp32 unless --grad-reduce-in-bf16; the local
    grads checked before it (the rerun state machine's checks)."""
    grad_checks = rerun.checks(args)
    return DistributedDataParallelConfig(
        check_for_nan_in_grad=grad_checks.nan,
        check_for_large_grads=grad_checks.large_grads,
        grad_reduce_in_fp32=not args.grad_reduce_in_bf16,
        use_distributed_optimizer=args.use_distributed_optimizer,
        overlap_grad_reduce=args.overlap_grad_reduce,
        overlap_param_gather=args.overlap_param_gather,
        bucket_size=args.ddp_bucket_size,
    )


def speed_overrides(args: argparse.Namespace) -> dict:
    """The fusions (on by default with a GPU, where each pays for its compilation) and CUDA graphs. Read with
    getattr: checkpoints saved before these flags existed record none of them."""
    on_gpu = torch.cuda.is_available()
    rope_fusion = getattr(args, "apply_rope_fusion", None)
    swiglu_fusion = getattr(args, "bias_swiglu_fusion", None)
    cuda_graph_impl = getattr(args, "cuda_graph_impl", "none")
    if cuda_graph_impl != "none" and not on_gpu:
        raise ValueError(f"--cuda-graph-impl {cuda_graph_impl} needs a CUDA device; there is none here")
    if getattr(args, "reset_position_ids", False) and transformer_engine_support.transformer_engine_error() is None:
        # Transformer Engine's fused RoPE takes one angle per position ([s, 1, 1, dim]), not one per token.
        if rope_fusion:
            raise ValueError("--rope-fusion: Transformer Engine's fused RoPE cannot follow --reset-position-ids "
                             "(one angle per position, not per token); leave --rope-fusion out")
        rope_fusion = False
    return dict(
        apply_rope_fusion=on_gpu if rope_fusion is None else rope_fusion,
        # megatron-core's SwiGLU fusion, used by GPT+'s MLP (the normalized families' MLP has its own kernel).
        bias_activation_fusion=on_gpu if swiglu_fusion is None else swiglu_fusion,
        cuda_graph_impl=cuda_graph_impl,
        cuda_graph_warmup_steps=getattr(args, "cuda_graph_warmup_steps", 3),
    )


def virtual_pipeline_stages(args) -> Optional[int]:
    if not args.num_layers_per_virtual_pipeline_stage:
        return None
    return args.num_layers // args.pipeline_model_parallel_size // args.num_layers_per_virtual_pipeline_stage


def data_arguments(args: argparse.Namespace) -> DataArguments:
    return DataArguments(
        data_path=args.data_path, split=args.split, train_data_path=args.train_data_path,
        valid_data_path=args.valid_data_path, test_data_path=args.test_data_path,
        data_cache_path=args.data_cache_path, mock_data=args.mock_data, vocab_size=args.vocab_size,
        tokenizer_type=args.tokenizer_type, tokenizer_model=args.tokenizer_model, vocab_file=args.vocab_file,
        merge_file=args.merge_file, tiktoken_pattern=getattr(args, "tiktoken_pattern", None),
        tiktoken_num_special_tokens=getattr(args, "tiktoken_num_special_tokens", TIKTOKEN_NUM_SPECIAL_TOKENS),
        mmap_bin_files=getattr(args, "mmap_bin_files", True),
        eod_mask_loss=getattr(args, "eod_mask_loss", False),
        reset_position_ids=getattr(args, "reset_position_ids", False),
        reset_attention_mask=getattr(args, "reset_attention_mask", False),
    )
