"""`--dry-run WORLD_SIZE --suggest-layout`: the parallel layouts and recompute choices that fit the GPU's memory
(angpt.training.memory_estimate), ranked by an estimate of step time. The model of time and its assumptions
are in docs/scaling.md; in short, one step is

    compute (model FLOPs + recompute FLOPs at the family's measured MFU, and the elementwise recomputes at
             HBM bandwidth: reading their inputs and writing what they had kept, twice the bytes they save)
    + the pipeline bubble ((p - 1) / (m x v) of the compute)
    + tensor-parallel collectives (4 all-reduces of a layer's [tokens, h] per micro-batch and layer)
    + context-parallel all-gathers of keys and values (and their gradients' reduce-scatters)
    + pipeline sends of each micro-batch's [tokens, h] at each stage boundary
    + the data-parallel gradient reduce-scatter and parameter all-gather, unless overlapped with the
      backward pass (--overlap-grad-reduce, --overlap-param-gather)

each collective moving (n - 1) / n of its bytes per rank (twice that for an all-reduce) at NVLink's
bandwidth when its group fits in one node of GPUS_PER_NODE, at the network's otherwise. Nothing else
overlaps (pessimistic where megatron-core overlaps a collective with compute).
"""

from __future__ import annotations

from dataclasses import dataclass

from angpt.models.activation_memory import layer_bytes
from angpt.models.config import AnGPTConfig
from angpt.telemetry.performance import model_flops_per_token
from angpt.training.memory_estimate import GIB, Layout, StageMemory

GPUS_PER_NODE = 8
# NCCL's bus bandwidth in GB/s: NVLink 4 within an 8-GPU H100/H200 node (nccl-tests' all-reduce reaches
# 360-480), and one 400 Gb/s NDR InfiniBand link per GPU across nodes (50 GB/s, ~90% achieved).
NVLINK_GBPS = 360.0
NETWORK_GBPS = 45.0
HBM_GBPS = 3350.0  # H100 SXM's HBM3 (the H200's HBM3e: 4800)
# BF16 MFU of each family, measured on one H200 at 1B parameters, 2048 tokens of context, micro-batch 8
# (docs/results/gpu/throughput.json, 2026-11-30). GPT, not measured, takes GPT+'s: the same megatron-core layers.
MEASURED_MFU = {"gptplus": 0.453, "angpt": 0.428, "ngpt": 0.418, "gpt": 0.453}


@dataclass
class Estimate:
    layout: Layout
    stages: list[StageMemory]
    seconds: dict[str, float]  # the step's parts (module docstring)

    @property
    def step_seconds(self) -> float:
        return sum(self.seconds.values())

    @property
    def peak_bytes(self) -> float:
        return max(stage.total for stage in self.stages)


def recompute_flops_per_token(config: AnGPTConfig, layout: Layout, seq_length: int) -> float:
    """FLOPs the backward pass spends recomputing, per token (matmuls and attention only, as model FLOPs)."""
    h = config.hidden_size
    q = config.kv_channels * config.num_attention_heads
    kv = config.kv_channels * (config.num_query_groups or config.num_attention_heads)
    mlp = 2 * (3 if config.gated_linear_unit else 2) * config.ffn_hidden_size * h
    attention = 2 * q * seq_length / 2 * 2
    if layout.recompute_granularity == "full":
        return config.num_layers * (2 * h * (q + 2 * kv) + attention + 2 * q * h + mlp)
    if layout.recompute_granularity == "selective":
        return config.num_layers * (("mlp" in layout.recompute_modules) * mlp
                                    + ("core_attn" in layout.recompute_modules) * attention)
    return 0.0


def _collective_seconds(bytes_moved: float, group: int, within_node: bool) -> float:
    if group == 1:
        return 0.0
    return bytes_moved * (group - 1) / group / ((NVLINK_GBPS if within_node else NETWORK_GBPS) * 1e9)


def step_seconds(config: AnGPTConfig, layout: Layout, vocab_size: int, seq_length: int, global_batch: int,
                 micro_batch: int, parameters_per_rank: float, peak_flops: float, overlap_grad_reduce: bool,
                 overlap_param_gather: bool, grad_reduce_bytes: int = 4) -> dict[str, float]:
    """The parts of one step's time on one GPU (module docstring)."""
    tp, pp, cp, dp = (layout.tensor_parallel, layout.pipeline_parallel, layout.context_parallel,
                      layout.data_parallel)
    world = tp * pp * cp * dp
    micro_batches = global_batch // (micro_batch * dp)
    tokens = global_batch * seq_length
    flops = tokens * (model_flops_per_token(config, seq_length, vocab_size)
                      + recompute_flops_per_token(config, layout, seq_length))
    compute = flops / (world * peak_flops * MEASURED_MFU[config.model_family])
    if layout.recompute_granularity == "selective":
        elementwise = tuple(m for m in layout.recompute_modules if m not in ("mlp", "core_attn"))
        kept = [layer_bytes(config, micro_batch * seq_length, tp, layout.sequence_parallel, cp, modules)
                for modules in ((), elementwise)]
        compute += (global_batch // (micro_batch * dp)) * config.num_layers / pp * 2 * (kept[0] - kept[1]) / (
            HBM_GBPS * 1e9)
    local_tokens = micro_batch * seq_length / cp
    layers_per_stage = config.num_layers / pp
    activation = local_tokens * config.hidden_size * 2  # one micro-batch's [tokens, h] in BF16
    head_dim = config.kv_channels
    kv = head_dim * (config.num_query_groups or config.num_attention_heads)
    # Each micro-batch passes every layer of the stage forward and backward; full recompute repeats the forward.
    passes = 3 if layout.recompute_granularity == "full" else 2
    tensor = micro_batches * layers_per_stage * passes * 2 * 2 * _collective_seconds(activation, tp, True)
    # All-gathers of keys and values forward (and again in a recompute), reduce-scatters of their gradients.
    cp_bytes = micro_batch * seq_length * 2 * kv / tp * 2
    context = micro_batches * layers_per_stage * passes * _collective_seconds(
        cp_bytes, cp, tp * cp <= GPUS_PER_NODE)
    pipeline = 0.0
    if pp > 1:
        send = activation / (tp if layout.sequence_parallel else 1)
        pipeline = micro_batches * 2 * send / ((NVLINK_GBPS if tp * cp * pp <= GPUS_PER_NODE else NETWORK_GBPS)
                                               * 1e9)
    shards = dp * cp
    within = tp * pp * cp * dp <= GPUS_PER_NODE
    data = ((not overlap_grad_reduce) * _collective_seconds(parameters_per_rank * grad_reduce_bytes, shards, within)
            + (not overlap_param_gather) * _collective_seconds(parameters_per_rank * 2, shards, within))
    return dict(compute=compute, bubble=compute * (pp - 1) / (micro_batches * (layout.virtual_stages or 1)),
                tensor_parallel=tensor, context_parallel=context, pipeline=pipeline, data_parallel=data)


def candidate_layouts(config: AnGPTConfig, world_size: int, seq_length: int, global_batch: int,
                      micro_batch: int, recompute_choices: list[tuple]) -> list[Layout]:
    """Every layout of `world_size` GPUs megatron-core can run for this model: TP within a node dividing the
    heads and key-value groups, PP dividing the layers evenly, CP splitting the sequence into 2 x CP chunks
    (and each rank's tokens over TP for sequence parallelism),
    DP the rest and dividing the global batch in micro-batches; sequence parallelism with any TP."""
    heads, groups = config.num_attention_heads, config.num_query_groups or config.num_attention_heads
    layouts = []
    for tp in (1, 2, 4, 8):
        if tp > GPUS_PER_NODE or heads % tp or groups % tp or world_size % tp:
            continue
        for cp in (1, 2, 4, 8, 16, 32):
            if (world_size // tp) % cp or (cp > 1 and seq_length % (2 * cp)) or (seq_length // cp) % tp:
                continue
            for pp in range(1, config.num_layers + 1):
                if config.num_layers % pp or (world_size // (tp * cp)) % pp:
                    continue
                dp = world_size // (tp * cp * pp)
                if global_batch % (micro_batch * dp):
                    continue
                for granularity, modules in recompute_choices:
                    layouts.append(Layout(tp, pp, cp, dp, sequence_parallel=tp > 1,
                                          recompute_granularity=granularity, recompute_modules=modules))
    return layouts


def describe_ranking(estimates: list[Estimate], usable: float, top: int = 10) -> list[str]:
    """The `top` layouts that fit in `usable` bytes (the GPU's less the CUDA context), fastest first."""
    fits = sorted((e for e in estimates if e.peak_bytes <= usable), key=lambda e: e.step_seconds)
    lines = [f"  {len(fits)} of {len(estimates)} layouts fit {usable / GIB:.1f} GiB; the fastest by the estimate:"]
    if not fits:
        smallest = min(estimates, key=lambda e: e.peak_bytes)
        return [f"  none of {len(estimates)} layouts fits {usable / GIB:.1f} GiB; the smallest needs "
                f"{smallest.peak_bytes / GIB:.1f} GiB ({smallest.layout.describe()})"]
    lines.append(f"  {'layout':68} {'GiB':>6} {'step s':>8}  compute/bubble/TP/CP/PP/DP s")
    for estimate in fits[:top]:
        parts = "/".join(f"{seconds:.2f}" for seconds in estimate.seconds.values())
        lines.append(f"  {estimate.layout.describe():68} {estimate.peak_bytes / GIB:6.1f} "
                     f"{estimate.step_seconds:8.2f}  {parts}")
    return lines
