"""Memory per GPU before launching: weights, gradients and optimizer state, and the activations each pipeline
stage keeps, for `--dry-run WORLD_SIZE` (angpt.training.dry_run) and `--suggest-layout`
(angpt.training.layout_search).

Activations: one layer's saved tensors (angpt.models.activation_memory, the GPU's code path) times the layers
a stage holds times the micro-batches its schedule keeps in flight (megatron-core's 1F1B: stage s of p holds
min(p - s, m); interleaved: the warm-up micro-batch chunks plus one, as schedules.py counts them), plus the
embedding's output on the first stage and the output layer's input and logits on the last. The logits cost
10 bytes per vocabulary entry and token: the BF16 logits, the FP32 probabilities megatron-core's vocab-parallel
cross entropy keeps, and their FP32 gradient in the backward pass (measured: H200 rows, docs/scaling.md).
Not counted in a stage's total: the CUDA context and libraries (about 0.5-1 GiB outside torch's allocator, so
the verdicts hold the totals against the GPU's memory less CUDA_CONTEXT_BYTES), the allocator's
fragmentation, transient workspaces of single kernels.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from angpt.models.activation_memory import layer_bytes
from angpt.models.config import AnGPTConfig

GIB = 2**30
LOGIT_BYTES = 2 + 4 + 4  # per vocabulary entry and token (module docstring)
CUDA_CONTEXT_BYTES = GIB
# Megatron-FSDP's (--use-megatron-fsdp) communication unit without --suggested-communication-unit-size, in elements of
# a rank's buffers (megatron-core 0.16.1's MegatronFSDP: max(1e9, twice a layer's)): the weights' all-gathers
# prefetch up to half of it beyond the bucket asked for, and whole gradient buckets wait for their reduce-scatter
# until those queued exceed it.
MEGATRON_FSDP_UNIT_ELEMENTS = 1_000_000_000


@dataclass(frozen=True)
class Layout:
    tensor_parallel: int
    pipeline_parallel: int
    context_parallel: int
    data_parallel: int
    virtual_stages: int | None = None  # interleaved schedule: model chunks per pipeline rank
    sequence_parallel: bool = False
    recompute_granularity: str | None = None  # None, "selective" or "full"
    recompute_modules: tuple[str, ...] = ()  # with "selective"
    recompute_method: str = "uniform"  # with "full": "uniform" or "block"
    recompute_num_layers: int = 1

    def describe(self) -> str:
        text = (f"TP {self.tensor_parallel} x PP {self.pipeline_parallel} x CP {self.context_parallel} x "
                f"DP {self.data_parallel}" + (f" (VP {self.virtual_stages})" if self.virtual_stages else "")
                + (", SP" if self.sequence_parallel else ""))
        if self.recompute_granularity == "full":
            return text + f", full recompute ({self.recompute_method}, {self.recompute_num_layers})"
        if self.recompute_granularity == "selective":
            return text + ", recompute " + ",".join(self.recompute_modules)
        return text


def bytes_per_parameter(bf16: bool, distributed_optimizer: bool, data_parallel: int, fsdp2: bool = False,
                        megatron_fsdp: str | None = None) -> float:
    """Weights, gradients and Adam's state per parameter, as Megatron-LM's theoretical memory report counts
    them: bf16 (or fp16) weights, fp32 gradients, fp32 main weights and two moments (12 bytes) sharded over the
    data-parallel ranks by the distributed optimizer; fp32 training has no main copy. With context
    parallelism the distributed optimizer shards over the data x context group. FSDP2 shards everything: bf16
    weights, the 16-bit optimizer's fp32 gradients (the bf16 ones FSDP2 reduce-scatters are freed once copied into
    them), main weights and moments, 2 + 4 + 12 bytes (measured: benchmarks/sixteen_bit_optimizer.py); fp32 ones,
    4 + 4 + 8. Megatron-FSDP's buffers (its `megatron_fsdp` strategy; param_and_grad_buffer.py) keep an fp32 main
    copy at fp32 too (preserve_fp32_weights): weights 2 (fp32: 4), fp32 gradients 4, main weights and moments 12,
    none sharded by no_shard (the model's own weights, gradients all-reduced); optim shards the last 12;
    optim_grads: and the gradients; optim_grads_params: all. What it holds whole beyond these for a while:
    megatron_fsdp_gathered."""
    if megatron_fsdp:
        weights = 2 if bf16 else 4
        sharded = {"no_shard": 0, "optim": 12, "optim_grads": 16, "optim_grads_params": weights + 16}[megatron_fsdp]
        return weights + 16 - sharded + sharded / data_parallel
    if fsdp2:
        return (18 if bf16 else 16) / data_parallel
    if bf16:
        return 6 + 12 / data_parallel if distributed_optimizer else 18
    return 8 + 8 / data_parallel if distributed_optimizer else 16


def megatron_fsdp_gathered(strategy: str, parameters: float, layer_parameters: float, outside_layers: float,
                           weight_bytes: int) -> tuple[float, float]:
    """What Megatron-FSDP's `strategy` holds whole beyond its shards (megatron-core 0.16.1 over more than one rank,
    without --ddp-bucket-size): (the weights it keeps gathered between steps, in parameters; the most bytes of
    weights and gradients it holds so in the backward pass). no_shard and optim: nothing (their weight and gradient
    buffers are whole, their buckets views of them). optim_grads reduces its fp32 gradients in one bucket,
    whole from the first gradient to the reduce-scatter at the end of the backward pass. optim_grads_params gathers
    the parameters outside its layers (the embedding, the output layer) in the forward pass and frees them after the
    step, and each layer's weights with those its all-gather prefetches behind them (MEGATRON_FSDP_UNIT_ELEMENTS / 2;
    between steps too, from the step's all-gather), freeing each layer's after its backward; its gradients wait whole
    for their reduce-scatter until those queued pass MEGATRON_FSDP_UNIT_ELEMENTS, the bucket outside the layers until
    the embedding's gradient, the last. Its most: as the backward pass starts (the weights gathered, the gradients of
    the first layer and of the parameters outside the layers) or as it ends (those weights and a layer's, the
    gradients queued). `parameters`: a rank's, `layer_parameters` one layer's, `outside_layers` the rest's."""
    if strategy == "optim_grads":
        return 0.0, 4 * parameters
    if strategy != "optim_grads_params":
        return 0.0, 0.0
    unit = max(MEGATRON_FSDP_UNIT_ELEMENTS, 2 * layer_parameters)
    gathered = min(parameters, outside_layers + layer_parameters + unit / 2)
    starts = gathered * weight_bytes + 4 * min(parameters, outside_layers + layer_parameters)
    ends = (min(parameters, outside_layers + layer_parameters) * weight_bytes
            + 4 * min(parameters, outside_layers + 2 * layer_parameters + unit))
    return gathered, max(starts, ends)


def in_flight(stage: int, pipeline_parallel: int, micro_batches: int, virtual_stages: int | None) -> float:
    """Micro-batches whose activations stage `stage` holds at its peak, in units of its whole set of layers
    (an interleaved schedule holds chunks of 1 / virtual_stages of them)."""
    if pipeline_parallel == 1:
        return 1
    if not virtual_stages:
        return min(pipeline_parallel - stage, micro_batches)
    chunks = min((pipeline_parallel - stage - 1) * 2 + (virtual_stages - 1) * pipeline_parallel + 1,
                 micro_batches * virtual_stages)
    return chunks / virtual_stages


def layers_activation_bytes(config: AnGPTConfig, layers: int, tokens: int, layout: Layout,
                            bytes_per_element: int) -> float:
    """What `layers` layers keep for one micro-batch of `tokens` tokens on one rank. Full recompute keeps each
    recomputed group's input (one [tokens, h] tensor) and, during the backward pass, one group's activations."""
    def one(modules=()):
        return layer_bytes(config, tokens, layout.tensor_parallel, layout.sequence_parallel,
                           layout.context_parallel, modules, bytes_per_element)

    if layout.recompute_granularity == "selective":
        return layers * one(layout.recompute_modules)
    if layout.recompute_granularity != "full":
        return layers * one()
    split = layout.tensor_parallel if layout.sequence_parallel else 1
    layer_input = tokens / layout.context_parallel * config.hidden_size / split * bytes_per_element
    group = min(layout.recompute_num_layers, layers)
    if layout.recompute_method == "block":  # the first `group` layers recompute, the rest keep everything
        return group * layer_input + (layers - group) * one() + (one() if group else 0)
    return math.ceil(layers / group) * layer_input + group * one()


@dataclass
class StageMemory:
    stage: int
    parameters: float  # on one rank of this stage
    model_bytes: float  # weights, gradients, optimizer state
    activation_bytes: float
    micro_batches_in_flight: float

    @property
    def total(self) -> float:
        return self.model_bytes + self.activation_bytes


def stage_memory(config: AnGPTConfig, layout: Layout, stage_parameters: dict[int, tuple[int, int]],
                 layer_split: list[int], vocab_size: int, seq_length: int, micro_batch_size: int,
                 micro_batches: int, bf16: bool, distributed_optimizer: bool, fsdp2: bool = False,
                 reshard_after_forward: bool = True, megatron_fsdp: str | None = None,
                 optimizer_instances: int = 1) -> list[StageMemory]:
    """Per pipeline stage, one rank's bytes. `stage_parameters`: {stage: (tensor-parallel, replicated)}
    parameter counts of the whole model (angpt.training.dry_run.parameters_by_stage). Under FSDP2 the sharded state,
    plus what it gathers: a layer's weights and, in the backward pass, their gradients before the reduce-scatter
    (a layer: the stage's parameters over its layers); without `reshard_after_forward`, every weight stays gathered
    from the forward to the backward pass. Under Megatron-FSDP's strategy `megatron_fsdp`, its buffers and what
    megatron_fsdp_gathered holds whole: fp32 gradients, weights at their dtype (outside the layers: the embedding,
    and the output layer where untied, split over TP). With `optimizer_instances`
    (--num-distributed-optimizer-instances, or Megatron-FSDP's hybrid sharding) the state is sharded within each
    instance's share of the data x context ranks."""
    tp, cp = layout.tensor_parallel, layout.context_parallel
    half = bf16 or config.fp16  # fp16 weights and activations take what bf16 ones do
    bytes_per_element = 2 if half else 4
    tokens = micro_batch_size * seq_length
    local_tokens = tokens / cp
    hidden_split = tp if layout.sequence_parallel else 1
    shard_over = layout.data_parallel * cp // optimizer_instances
    rows = []
    for stage, layers in enumerate(layer_split):
        split, replicated = stage_parameters[stage]
        parameters = split / tp + replicated
        activations = layers_activation_bytes(config, layers, tokens, layout, bytes_per_element)
        if stage == 0:  # the embedding's output and the token ids
            activations += local_tokens * (config.hidden_size / hidden_split * bytes_per_element + 8)
        flight = in_flight(stage, layout.pipeline_parallel, micro_batches, layout.virtual_stages)
        activations *= flight
        if stage == len(layer_split) - 1:  # the final norm's and output layer's inputs, the logits (1 in flight)
            # and --mtp-num-layers' MTP layers, each a layer and logits of its own (megatron-core: on the last stage)
            mtp = config.mtp_num_layers or 0
            if mtp:
                activations += layers_activation_bytes(config, mtp, tokens, layout, bytes_per_element) * flight
            activations += (1 + mtp) * local_tokens * (2 * config.hidden_size / hidden_split * bytes_per_element
                                                       + LOGIT_BYTES * vocab_size / tp)
        model_bytes = parameters * bytes_per_parameter(half, distributed_optimizer, shard_over, fsdp2, megatron_fsdp)
        if megatron_fsdp and shard_over > 1:
            outside = min(parameters, vocab_size * config.hidden_size / tp
                          * ((stage == 0) + (stage == len(layer_split) - 1 and
                                             not config.share_embeddings_and_output_weights)))
            model_bytes += megatron_fsdp_gathered(megatron_fsdp, parameters, (parameters - outside) / max(layers, 1),
                                                  outside, bytes_per_element)[1]
        if fsdp2:
            gathered = parameters if not reshard_after_forward else 2 * parameters / max(layers, 1)
            model_bytes += gathered * bytes_per_element
        rows.append(StageMemory(stage, parameters, model_bytes, activations, flight))
    return rows
