"""`python -m angpt.pretrain ... --dry-run [WORLD_SIZE]`: the configuration checked for a world size and
resolved, without starting training: the parallel layout, the batch arithmetic, the data, and the
parameters counted on a model built on the meta device (no memory, no initialization) in this one process.

With a world size it also estimates the memory of each pipeline stage's GPUs (angpt.training.memory_estimate)
and, with --suggest-layout, ranks the layouts that fit (angpt.training.layout_search).
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import Optional

import torch
from megatron.core import tensor_parallel

from angpt import kernels
from angpt.config.batch_schedule import ramp
from angpt.config.choices import recompute_module_refusal
from angpt.config.pipeline_split import mtp_stage, stage_layers, stage_of_layer, uneven
from angpt.config.sections import PrecisionSection, RunConfig
from angpt.data.gpt_datasets import dataset_vocabulary
from angpt.data.indexed import check_indexed_dataset
from angpt.models.gpt import build_model
from angpt.telemetry.performance import peak_flops_per_device
from angpt.training import distributed
from angpt.training.layout_search import describe_ranking, describe_refusals, search
from angpt.training.megatron_configs import transformer_config
from angpt.training.memory_estimate import CUDA_CONTEXT_BYTES, GIB, Layout, stage_memory

H100_BF16_FLOPS = 989.5e12  # the dense BF16 peak --suggest-layout assumes without a GPU here
_TENSOR_PARALLEL_MODULES = (tensor_parallel.ColumnParallelLinear, tensor_parallel.RowParallelLinear,
                            tensor_parallel.VocabParallelEmbedding)


def parameters_by_stage(model: torch.nn.Module, layer_split: list[int], mtp_at: Optional[int] = None) -> dict:
    """{stage: (tensor-parallel parameters, replicated parameters)} of a whole model built without parallelism: the
    embedding on the first stage, `layer_split[s]` layers on stage s (angpt.config.pipeline_split), the final norm
    (with MTP: the last layer's stage) and head on the last, which then holds a copy of the word embedding too where
    the head is tied to it (megatron-core's output layer keeps one there), the MTP layers on stage `mtp_at` (default
    the last), which holds a copy too unless it is the first (megatron-core's MTP layers embed the tokens ahead).
    Tensor-parallel: the weights of megatron-core's parallel linear layers and embedding, and the vectors split with
    them (our scales mark themselves `tensor_model_parallel`)."""
    pipeline_stages = len(layer_split)
    mtp_at = pipeline_stages - 1 if mtp_at is None else mtp_at
    split_params = set()
    for module in model.modules():
        if isinstance(module, _TENSOR_PARALLEL_MODULES):
            split_params.update(id(p) for p in module.parameters(recurse=False))
    counts = defaultdict(lambda: [0, 0])
    for name, param in model.named_parameters():
        parts = name.split(".")
        if parts[:2] == ["decoder", "layers"]:
            stage = stage_of_layer(layer_split, int(parts[2]))
        elif parts[0] == "embedding":
            stage = 0
        elif parts[0] == "mtp":
            stage = mtp_at
        elif parts[:2] == ["decoder", "final_layernorm"] and hasattr(model, "mtp"):  # megatron-core puts it after
            stage = stage_of_layer(layer_split, sum(layer_split) - 1)  # the last decoder layer with MTP
        else:  # the final norm, the output layer and its logit scale
            stage = pipeline_stages - 1
        split = id(param) in split_params or getattr(param, "tensor_model_parallel", False)
        counts[stage][0 if split else 1] += param.numel()
        if name == "embedding.word_embeddings.weight":
            copies = {pipeline_stages - 1} if model.share_embeddings_and_output_weights else set()
            copies |= {mtp_at} if hasattr(model, "mtp") else set()
            for stage in copies - {0}:
                counts[stage][0] += param.numel()
    return {stage: tuple(counts[stage]) for stage in range(pipeline_stages)}


def _count(n: float) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return f"{n:.0f}"


def describe(run: RunConfig) -> str:
    """The report of a configuration validated for its world size (--dry-run's WORLD_SIZE)."""
    parallel, training, seq_length = run.parallel, run.training, run.model.seq_length
    world_size = parallel.world_size
    tp, pp, cp = (parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size,
                  parallel.context_parallel_size)
    vp, dp = parallel.virtual_pipeline_stages, parallel.data_parallel_size
    micro_batches = training.global_batch_size // (training.micro_batch_size * dp)
    steps = ramp(training)
    tokens = sum(size * count for size, count in steps) * seq_length
    tokens_per_step = training.global_batch_size * seq_length
    vocabulary = dataset_vocabulary(run.data)  # the trainer's checks of the data, and its vocabulary
    vocab_size = run.padded_vocab_size(vocabulary.vocab_size)

    distributed.initialize()  # one process: the model is built whole, on the meta device
    config = dataclasses.replace(transformer_config(run), tensor_model_parallel_size=1,
                                 pipeline_model_parallel_size=1, virtual_pipeline_model_parallel_size=None,
                                 num_layers_in_first_pipeline_stage=None, num_layers_in_last_pipeline_stage=None,
                                 account_for_embedding_in_pipeline_split=False,
                                 account_for_loss_in_pipeline_split=False, pipeline_model_parallel_layout=None,
                                 sequence_parallel=False, context_parallel_size=1, use_cpu_initialization=True,
                                 perform_initialization=False)
    with torch.device("meta"), kernels.reference_only():  # no fused kernel for tensors without data
        model = build_model(config, vocab_size, seq_length)
    total = sum(p.numel() for p in model.parameters())
    embedding = model.embedding.word_embeddings.weight.numel()
    head = 0 if config.share_embeddings_and_output_weights else model.output_layer.weight.numel()
    layer_split = stage_layers(run.model.num_layers, parallel, run.architecture.mtp_num_layers)
    stages = parameters_by_stage(model, layer_split, mtp_stage(parallel))
    per_rank = {stage: split / tp + replicated for stage, (split, replicated) in stages.items()}
    lines = [
        f"dry run of --model-family {run.model.model_family} on {world_size} processes: the configuration is valid",
        "",
        "layout",
        f"  tensor parallel {tp} x pipeline parallel {pp} x context parallel {cp} x data parallel {dp} = "
        f"{world_size} processes"
        + (f"; {vp} virtual stages per pipeline rank" if vp else "")
        + ("; sequence parallel" if parallel.sequence_parallel else "")
        + (f"; each sequence in {2 * cp} chunks of {seq_length // (2 * cp)} tokens, 2 per context-parallel rank "
           f"(--cp-comm-type {' '.join(parallel.cp_comm_type)})" if cp > 1 else ""),
        f"  {run.model.num_layers} layers: "
        + (f"{layer_split[0]} per pipeline stage" if len(set(layer_split)) == 1 else
           "by pipeline stage " + ", ".join(map(str, layer_split)) + f" ({', '.join(uneven(parallel))})")
        + ((f", {run.model.num_layers // pp // vp} per virtual stage"
            if len(set(layer_split)) == 1 and not parallel.pipeline_model_parallel_layout else
            f", each stage's share in {vp} virtual stages") if vp else ""),
        "",
        "batch",
        f"  global batch {training.global_batch_size} sequences = micro-batch {training.micro_batch_size} x "
        f"{micro_batches} micro-batches x data parallel {dp}",
        f"  {tokens_per_step:,} tokens per step (sequence length {seq_length}); {training.train_iters:,} steps = "
        f"{tokens / 1e9:.3g}B tokens",
    ]
    if training.rampup_batch_size:
        lines.append("  ramp-up (--rampup-batch-size): " + ", ".join(f"{count:,} steps at {size}"
                                                                      for size, count in steps))
    if training.train_samples is not None:
        trained = tokens // seq_length
        left_out = training.train_samples - trained
        lines.append(f"  --train-samples {training.train_samples:,}: {trained:,} samples in whole global batches"
                     + (f", the last {left_out:,} left out" if left_out > 0 else ""))
    if pp > 1:
        bubble = (pp - 1) / (micro_batches * (vp or 1))
        lines.append(f"  pipeline bubble (p - 1) / (m x v) = {bubble:.1%} of a step")
    evaluation = run.evaluation
    if evaluation.eval_iters and evaluation.eval_interval:
        lines.append(f"  evaluation every {evaluation.eval_interval} steps on "
                     f"{evaluation.eval_iters * training.global_batch_size:,} sequences")
    lines += ["", "data"]
    if run.data.mock_data:
        lines.append(f"  mock data, vocabulary {vocabulary.vocab_size}, padded to {vocab_size}")
    else:
        tokenizer = vocabulary.unique_identifiers.get("tokenizer") or {}
        lines.append(f"  vocabulary {vocabulary.vocab_size} (tokenizer {tokenizer.get('type', 'unknown')}), "
                     f"padded to {vocab_size} (a multiple of {run.data.make_vocab_size_divisible_by} x TP {tp})")
        for prefix in run.data.prefixes():
            tokens = check_indexed_dataset(prefix, run.data.object_storage_cache_path).get("tokens")
            lines.append(f"  {prefix}: {tokens:,} tokens" if tokens is not None else f"  {prefix}")
    lines += [
        "",
        "parameters",
        f"  {_count(total)} ({total:,}): embedding {_count(embedding)}"
        + (f", output layer {_count(head)}" if head else " (tied to the output layer)")
        + f", the rest {_count(total - embedding - head)}",
        "  per process, by pipeline stage: " + ", ".join(f"stage {s} {_count(n)}" for s, n in per_rank.items()),
    ]
    layout = layout_of(run)
    gpu_bytes, gpu = gpu_memory(run)
    memory = stage_memory(config, layout, stages, layer_split, vocab_size, seq_length, training.micro_batch_size,
                          micro_batches, run.precision.bf16, parallel.use_distributed_optimizer,
                          parallel.use_torch_fsdp2, parallel.torch_fsdp2_reshard_after_forward,
                          parallel.data_parallel_sharding_strategy if parallel.use_megatron_fsdp else None,
                          parallel.num_distributed_optimizer_instances)
    lines += ["", *memory_report(memory, layout, run.precision, gpu_bytes - CUDA_CONTEXT_BYTES, gpu)]
    if run.dry_run.suggest_layout:
        lines += ["", f"layouts of {world_size} GPUs (--suggest-layout; the model of time: docs/scaling.md)",
                  *suggest(model, config, run, world_size, vocab_size, gpu_bytes - CUDA_CONTEXT_BYTES)]
    lines += ["", "nothing was started (--dry-run)"]
    return "\n".join(lines)


def layout_of(run: RunConfig) -> Layout:
    parallel, model = run.parallel, run.model
    selective = model.recompute_granularity == "selective"
    return Layout(parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size,
                  parallel.context_parallel_size, parallel.data_parallel_size, parallel.virtual_pipeline_stages,
                  parallel.sequence_parallel, model.recompute_granularity,
                  tuple(model.recompute_modules or ("core_attn",)) if selective else (), model.recompute_method,
                  model.recompute_num_layers)


def gpu_memory(run: RunConfig) -> tuple[float, str]:
    """The bytes of one GPU the estimate is held against, and where that figure comes from."""
    if run.dry_run.gpu_memory_gib:
        return run.dry_run.gpu_memory_gib * GIB, "--gpu-memory-gib"
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory, torch.cuda.get_device_name()
    return 80 * GIB, "no GPU here: 80 GiB assumed, set --gpu-memory-gib"


def memory_report(memory: list, layout: Layout, precision: PrecisionSection, usable: float, gpu: str) -> list[str]:
    """The table of stages and its verdict against `usable` bytes (the GPU's less the CUDA context)."""
    dtype = "BF16" if precision.bf16 else "FP16" if precision.fp16 else "FP32"
    lines = [f"memory per GPU, estimated ({dtype} activations of the GPU's code path, "
             f"{layout.describe()}; docs/scaling.md)",
             f"  {'stage':>5} {'weights, grads, optimizer':>26} {'activations':>12} {'micro-batches held':>19} "
             f"{'total':>10}"]
    shown = memory if len(memory) <= 8 else sorted({memory[0], memory[1], memory[-1],
                                                    max(memory, key=lambda m: m.total)}, key=lambda m: m.stage)
    for stage in shown:
        lines.append(f"  {stage.stage:>5} {stage.model_bytes / GIB:>22.1f} GiB "
                     f"{stage.activation_bytes / GIB:>8.1f} GiB {stage.micro_batches_in_flight:>19.3g} "
                     f"{stage.total / GIB:>6.1f} GiB")
    fullest = max(memory, key=lambda m: m.total)
    verdict = (f"fits, {(usable - fullest.total) / GIB:.1f} GiB to spare" if fullest.total <= usable else
               "does NOT fit: more tensor, pipeline or context parallelism, recompute (--recompute-granularity), "
               "or a smaller --micro-batch-size; --suggest-layout ranks the layouts that fit")
    lines.append(f"  the fullest GPU (stage {fullest.stage}) needs {fullest.total / GIB:.1f} GiB of "
                 f"{usable / GIB:.1f} GiB ({gpu}, less {CUDA_CONTEXT_BYTES / GIB:g} GiB for the CUDA context): "
                 f"{verdict}")
    lines.append("  not counted: the allocator's fragmentation, kernels' transient workspaces")
    return lines


def suggest(model: torch.nn.Module, config, run: RunConfig, world_size: int, vocab_size: int,
            usable: float) -> list[str]:
    """The layouts that fit, fastest first, and where FSDP2 or Megatron-FSDP was not weighed
    (angpt.training.layout_search)."""
    elementwise = tuple(module for module in ("layernorm", "qk_norm", "residual_update")
                        if recompute_module_refusal(module, config.model_family) is None)
    recompute_choices = [(None, ()), ("selective", elementwise), ("selective", (*elementwise, "mlp")),
                         ("full", ())]
    peak = peak_flops_per_device(torch.bfloat16) or H100_BF16_FLOPS
    estimates, refusals = search(config, run, world_size, vocab_size, peak,
                                 lambda split: parameters_by_stage(model, split), recompute_choices)
    return [*describe_refusals(refusals), *describe_ranking(estimates, usable)]
