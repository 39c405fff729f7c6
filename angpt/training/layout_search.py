"""`--dry-run WORLD_SIZE --suggest-layout`: the parallel layouts and recompute choices that fit the GPU's memory
(angpt.training.memory_estimate), ranked by an estimate of step time. The model of time and its assumptions
are in docs/scaling.md; in short, one step is

    compute (model FLOPs + recompute FLOPs at the family's measured MFU, and the elementwise recomputes at
             HBM bandwidth: reading their inputs and writing what they had kept, twice the bytes they save)
    + the pipeline bubble ((p - 1) / (m x v) of the compute)
    + tensor-parallel collectives (4 all-reduces of a layer's [tokens, h] per micro-batch and layer)
    + context-parallel all-gathers of keys and values (and their gradients' reduce-scatters)
    + pipeline sends of each micro-batch's [tokens, h] at each stage boundary
    + the data-parallel collectives over the data x context-parallel ranks: the distributed optimizer's gradient
      reduce-scatter and weight all-gather once a step; FSDP2's (--use-torch-fsdp2) all-gather of each layer's
      weights in every micro-batch's forward pass, again in its backward pass when it reshards after the forward
      (Megatron-LM's default), and the reduce-scatter of its gradients, at the dtype of the weights;
      Megatron-FSDP's (--use-megatron-fsdp, megatron-core 0.16.1's megatron_fsdp.py): no_shard all-reduces the
      gradients (at their reduction dtype) at the last micro-batch and gathers nothing (its weights are whole);
      optim reduce-scatters them there and all-gathers the updated weights after the step, as the distributed
      optimizer; optim_grads reduce-scatters them in every micro-batch, overlapped (it turns --overlap-grad-reduce
      on itself), and all-gathers the weights after the step; optim_grads_params gathers each layer's weights in
      every micro-batch's forward and again in its backward pass and reduce-scatters its gradients, all overlapped

each collective moving (n - 1) / n of its bytes per rank (twice that for an all-reduce) at NVLink's
bandwidth when its group fits in one node of GPUS_PER_NODE, at the network's otherwise. An overlapped
collective (the distributed optimizer's with --overlap-grad-reduce, --overlap-param-gather, as Megatron-FSDP's
where it does not turn them on itself; FSDP2's always, on its own streams) runs beside the step's compute: only
what exceeds the compute counts. Nothing else overlaps (pessimistic where megatron-core overlaps a collective with
compute).

The search weighs each layout under the distributed optimizer and, where the run can take them (sharding_refusal:
the parser's checks), under FSDP2 and Megatron-FSDP's four strategies; plain DDP is not weighed: it keeps and
moves what no_shard does (at fp32, 4 bytes a parameter less: no main copy).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Callable

from angpt.config.sections import RunConfig
from angpt.config.validation import validate_fsdp2, validate_megatron_fsdp
from angpt.models.activation_memory import layer_bytes
from angpt.models.config import AnGPTConfig
from angpt.telemetry.performance import model_flops_per_token
from angpt.training.memory_estimate import GIB, Layout, StageMemory, stage_memory

GPUS_PER_NODE = 8
# NCCL's bus bandwidth in GB/s: NVLink 4 within an 8-GPU H100/H200 node (nccl-tests' all-reduce reaches
# 360-480), and one 400 Gb/s NDR InfiniBand link per GPU across nodes (50 GB/s, ~90% achieved).
NVLINK_GBPS = 360.0
NETWORK_GBPS = 45.0
HBM_GBPS = 3350.0  # H100 SXM's HBM3 (the H200's HBM3e: 4800)
# BF16 MFU of each family, measured on one H200 at 1B parameters, 2048 tokens of context, micro-batch 8
# (docs/results/gpu/throughput.json, 2026-11-30). GPT, not measured, takes GPT+'s: the same megatron-core layers.
MEASURED_MFU = {"gptplus": 0.453, "angpt": 0.428, "ngpt": 0.418, "gpt": 0.453}
# The data-parallel shardings the search weighs, by the flag that chooses each (Megatron-FSDP's: MEGATRON_FSDP_FLAGS).
DISTRIBUTED_OPTIMIZER = "--use-distributed-optimizer"
FSDP2 = "--use-torch-fsdp2"
MEGATRON_FSDP = {strategy: f"Megatron-FSDP {strategy}"
                 for strategy in ("no_shard", "optim", "optim_grads", "optim_grads_params")}
MEGATRON_FSDP_FLAGS = "--use-megatron-fsdp --data-parallel-sharding-strategy {} --ckpt-format fsdp_dtensor"
# What each sharding changes of the run's flags (its overlap flags stay as given).
SHARDING_FLAGS = {
    DISTRIBUTED_OPTIMIZER: {},
    FSDP2: dict(use_torch_fsdp2=True, use_distributed_optimizer=False, use_megatron_fsdp=False),
    **{name: dict(use_megatron_fsdp=True, data_parallel_sharding_strategy=strategy, use_distributed_optimizer=True,
                  use_torch_fsdp2=False, ckpt_format="fsdp_dtensor")
       for strategy, name in MEGATRON_FSDP.items()},
}


@dataclass
class Estimate:
    layout: Layout
    stages: list[StageMemory]
    seconds: dict[str, float]  # the step's parts (module docstring)
    sharding: str = DISTRIBUTED_OPTIMIZER
    overlapped: float = 0.0  # seconds of data-parallel collectives beside the compute, which hides them up to its own

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


def data_parallel_seconds(layout: Layout, micro_batches: int, parameters_per_rank: float, overlap_grad_reduce: bool,
                          overlap_param_gather: bool, grad_reduce_bytes: int, weight_bytes: int, fsdp2: bool,
                          reshard_after_forward: bool, megatron_fsdp: str | None = None) -> tuple[float, float]:
    """The seconds of a step's data-parallel collectives (module docstring): (those the step waits for, those
    overlapped with its compute). `parameters_per_rank`: a rank's weights before data-parallel sharding;
    `megatron_fsdp`: Megatron-FSDP's strategy, where it shards."""
    shards = layout.data_parallel * layout.context_parallel
    within = layout.tensor_parallel * layout.pipeline_parallel * shards <= GPUS_PER_NODE
    gather = _collective_seconds(parameters_per_rank * weight_bytes, shards, within)
    if fsdp2:  # per micro-batch: gathered forward (and backward when resharded), gradients reduce-scattered
        return 0.0, micro_batches * (2 + reshard_after_forward) * gather
    reduce = _collective_seconds(parameters_per_rank * grad_reduce_bytes, shards, within)
    if megatron_fsdp == "optim_grads_params":
        return 0.0, micro_batches * (2 * gather + reduce)
    if megatron_fsdp == "no_shard":  # an all-reduce (twice a reduce-scatter's bytes); its weights are whole
        gather, reduce = 0.0, 2 * reduce
    if megatron_fsdp == "optim_grads":  # Megatron-FSDP overlaps its reduce-scatters itself
        overlap_grad_reduce, reduce = True, micro_batches * reduce
    return ((not overlap_grad_reduce) * reduce + (not overlap_param_gather) * gather,
            overlap_grad_reduce * reduce + overlap_param_gather * gather)


def step_seconds(config: AnGPTConfig, layout: Layout, vocab_size: int, seq_length: int, global_batch: int,
                 micro_batch: int, parameters_per_rank: float, peak_flops: float, overlap_grad_reduce: bool,
                 overlap_param_gather: bool, grad_reduce_bytes: int = 4, weight_bytes: int = 2, fsdp2: bool = False,
                 reshard_after_forward: bool = True, megatron_fsdp: str | None = None) -> dict[str, float]:
    """The parts of one step's time on one GPU (module docstring). `parameters_per_rank`: a rank's weights before
    data-parallel sharding, of `weight_bytes` each."""
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
    waited, overlapped = data_parallel_seconds(layout, micro_batches, parameters_per_rank, overlap_grad_reduce,
                                               overlap_param_gather, grad_reduce_bytes, weight_bytes, fsdp2,
                                               reshard_after_forward, megatron_fsdp)
    data = waited + max(0.0, overlapped - compute)  # the compute hides an overlapped collective up to its own time
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


class _Refused(Exception):
    pass


class _Refusing:
    """The parser's part in angpt.config.validation's checks: its refusal raised, not printed and exited on."""

    @staticmethod
    def error(message: str):
        raise _Refused(message)


def sharding_refusal(run: RunConfig, sharding: str, pipeline_parallel: int, context_parallel: int = 1) -> str | None:
    """Why `run` at `pipeline_parallel` stages and `context_parallel` ranks, sharded by `sharding` in place of its own
    choice (SHARDING_FLAGS), would be refused, in the parser's words (angpt.config.validation: Megatron-LM's refusals
    and what angpt has not built), or None."""
    flags = argparse.Namespace(**{**run.flags(), **SHARDING_FLAGS[sharding],
                                  "pipeline_model_parallel_size": pipeline_parallel,
                                  "context_parallel_size": context_parallel})
    try:
        validate_fsdp2(_Refusing, flags)
        validate_megatron_fsdp(_Refusing, flags)
    except _Refused as refusal:
        return str(refusal)
    return None


def search(config: AnGPTConfig, run: RunConfig, world_size: int, vocab_size: int, peak_flops: float,
           parameters_by_stage: Callable[[list[int]], dict], recompute_choices: list[tuple]
           ) -> tuple[list[Estimate], dict[str, dict[tuple[int, int], str | None]]]:
    """Every candidate layout's memory and step time under the distributed optimizer and, where `run` can take them,
    FSDP2 and Megatron-FSDP's strategies; and {sharding: {(pipeline stages, context-parallel ranks): why it is
    refused there, or None}}. `parameters_by_stage(layer_split)`: {stage: (tensor-parallel, replicated)} parameter
    counts (angpt.training.dry_run.parameters_by_stage). The run's --num-distributed-optimizer-instances shard the
    state of a layout whose data x context ranks they divide (one instance elsewhere, as Megatron-LM requires)."""
    training, parallel, precision, seq_length = run.training, run.parallel, run.precision, run.model.seq_length
    reshard = parallel.torch_fsdp2_reshard_after_forward
    instances = 1 if parallel.use_torch_fsdp2 else parallel.num_distributed_optimizer_instances
    strategies = {name: strategy for strategy, name in MEGATRON_FSDP.items()}
    estimates, stages = [], {}
    refusals = {sharding: {} for sharding in SHARDING_FLAGS if sharding != DISTRIBUTED_OPTIMIZER}
    for layout in candidate_layouts(config, world_size, seq_length, training.global_batch_size,
                                    training.micro_batch_size, recompute_choices):
        pp, cp = layout.pipeline_parallel, layout.context_parallel
        split = [config.num_layers // pp] * pp
        if pp not in stages:
            stages[pp] = parameters_by_stage(split)
        for sharding, refused in refusals.items():
            if (pp, cp) not in refused:
                refused[pp, cp] = sharding_refusal(run, sharding, pp, cp)
        micro_batches = training.global_batch_size // (training.micro_batch_size * layout.data_parallel)
        for sharding in SHARDING_FLAGS:
            if sharding != DISTRIBUTED_OPTIMIZER and refusals[sharding][pp, cp] is not None:
                continue
            fsdp2, megatron_fsdp = sharding == FSDP2, strategies.get(sharding)
            memory = stage_memory(config, layout, stages[pp], split, vocab_size, seq_length, training.micro_batch_size,
                                  micro_batches, precision.bf16, sharding == DISTRIBUTED_OPTIMIZER, fsdp2, reshard,
                                  megatron_fsdp, instances if (layout.data_parallel * cp) % instances == 0 else 1)
            data_parallel = (parallel.overlap_grad_reduce, parallel.overlap_param_gather,
                             2 if precision.grad_reduce_in_bf16 else 4,
                             2 if precision.bf16 or precision.fp16 else 4, fsdp2, reshard, megatron_fsdp)
            parameters = max(m.parameters for m in memory)
            seconds = step_seconds(config, layout, vocab_size, seq_length, training.global_batch_size,
                                   training.micro_batch_size, parameters, peak_flops, *data_parallel)
            _, overlapped = data_parallel_seconds(layout, micro_batches, parameters, *data_parallel)
            estimates.append(Estimate(layout, memory, seconds, sharding, overlapped))
    return estimates, refusals


def _where(keys: list[tuple[int, int]]) -> str:
    """The layouts of `keys` ((pipeline stages, context-parallel ranks)) in words."""
    if all(pp > 1 for pp, _ in keys):
        return " with PP " + ", ".join(map(str, sorted({pp for pp, _ in keys})))
    if all(cp > 1 for _, cp in keys):
        return " with CP " + ", ".join(map(str, sorted({cp for _, cp in keys})))
    return " with " + ", ".join(f"PP {pp} x CP {cp}" for pp, cp in sorted(keys))


def describe_refusals(refusals: dict[str, dict[tuple[int, int], str | None]]) -> list[str]:
    """The lines saying where the search did not weigh a sharding and why: one per reason, or where it was weighed
    nowhere the first refusal (at the fewest stages and context-parallel ranks); Megatron-FSDP's strategies in
    one where the parser refuses them alike."""
    named = dict(refusals)
    alike = [named.pop(name) for name in MEGATRON_FSDP.values() if name in named]
    if alike and all(refused == alike[0] for refused in alike):
        named["Megatron-FSDP"] = alike[0]
    else:
        named.update({name: refusals[name] for name in MEGATRON_FSDP.values() if name in refusals})
    lines = []
    for name, refused in named.items():
        name = "FSDP2" if name == FSDP2 else name
        if refused and all(refused.values()):
            lines.append(f"  {name} not weighed: {refused[min(refused)]}")
            continue
        by_reason = {}
        for key, why in sorted(refused.items()):
            if why:
                by_reason.setdefault(why, []).append(key)
        lines += [f"  {name} not weighed{_where(keys)}: {why}" for why, keys in by_reason.items()]
    return lines


def describe_ranking(estimates: list[Estimate], usable: float, top: int = 10) -> list[str]:
    """The `top` layouts that fit in `usable` bytes (the GPU's less the CUDA context), fastest first, each with
    the flag of its data-parallel sharding."""
    fits = sorted((e for e in estimates if e.peak_bytes <= usable), key=lambda e: e.step_seconds)
    lines = [f"  {len(fits)} of {len(estimates)} layouts fit {usable / GIB:.1f} GiB; the fastest by the estimate:"]
    if not fits:
        smallest = min(estimates, key=lambda e: e.peak_bytes)
        return [f"  none of {len(estimates)} layouts fits {usable / GIB:.1f} GiB; the smallest needs "
                f"{smallest.peak_bytes / GIB:.1f} GiB ({smallest.layout.describe()}, {smallest.sharding})"]
    lines.append(f"  {'layout':68} {'sharding':32} {'GiB':>6} {'step s':>8}  compute/bubble/TP/CP/PP/DP s")
    for estimate in fits[:top]:
        parts = "/".join(f"{seconds:.2f}" for seconds in estimate.seconds.values())
        lines.append(f"  {estimate.layout.describe():68} {estimate.sharding:32} {estimate.peak_bytes / GIB:6.1f} "
                     f"{estimate.step_seconds:8.2f}  {parts}")
    for strategy, name in MEGATRON_FSDP.items():
        if any(estimate.sharding == name for estimate in fits[:top]):
            lines.append(f"  {name}: {MEGATRON_FSDP_FLAGS.format(strategy)}, with --use-distributed-optimizer "
                         "and the run's other flags")
    if fits[0].overlapped:
        lines.append(f"  the first's overlapped data-parallel collectives: {fits[0].overlapped:.2f} s beside "
                     f"{fits[0].seconds['compute']:.2f} s of compute (its DP part: what exceeds the compute)")
    return lines
