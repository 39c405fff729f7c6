"""The dry run's memory estimate (angpt.training.memory_estimate) and layout search (angpt.training.layout_search)
against what the H200 measured, Megatron-LM's own schedule arithmetic, and the boundaries of their verdicts."""

import itertools
import json
import os
from types import SimpleNamespace

import pytest
from megatron.core.pipeline_parallel.schedules import get_pp_rank_microbatches

from angpt.config.sections import PrecisionSection, RunConfig
from angpt.models import model_config
from angpt.models.activation_memory import layer_bytes
from angpt.telemetry.performance import model_flops_per_token
from angpt.training.dry_run import memory_report
from angpt.training.layout_search import (
    DISTRIBUTED_OPTIMIZER,
    FSDP2,
    HBM_GBPS,
    MEASURED_MFU,
    MEGATRON_FSDP,
    NETWORK_GBPS,
    NVLINK_GBPS,
    Estimate,
    _collective_seconds,
    candidate_layouts,
    data_parallel_seconds,
    describe_ranking,
    describe_refusals,
    recompute_flops_per_token,
    search,
    sharding_refusal,
    step_seconds,
)
from angpt.training.memory_estimate import (
    GIB,
    Layout,
    StageMemory,
    bytes_per_parameter,
    in_flight,
    layers_activation_bytes,
    megatron_fsdp_gathered,
    stage_memory,
)

from conftest import ROOT, load_benchmark

# benchmarks/gpu_throughput.py's shapes and vocabulary (GPT-2's, padded to 50304), as the H200 ran them.
SHAPES = {"0.5b": dict(num_layers=24, hidden_size=1024, num_attention_heads=16),
          "1b": dict(num_layers=36, hidden_size=1280, num_attention_heads=20)}


def h200_rows():
    with open(os.path.join(ROOT, "docs", "results", "gpu", "throughput.json")) as file:
        results = json.load(file)
    return results, [row for row in results["rows"] if row["variant"] == "default"]


def estimate_of(row, seq_length):
    config = model_config(row["family"], **SHAPES[row["shape"]])
    stages = stage_memory(config, Layout(1, 1, 1, 1), {0: (row["parameters"], 0)}, [config.num_layers], 50304,
                          seq_length, row["micro_batch_size"], row["num_microbatches"], bf16=True,
                          distributed_optimizer=True)
    return stages[0].total / GIB


def test_the_estimate_lands_within_15_percent_of_gpt_plus_peaks_on_the_h200():
    results, rows = h200_rows()
    ratios = {}
    for row in rows:
        ratios[(row["shape"], row["family"], row["micro_batch_size"], row["num_microbatches"])] = (
            estimate_of(row, results["seq_length"]) / row["peak_memory_gib"])
    print("\n".join(f"{key}: estimate / measured peak {ratio:.3f}" for key, ratio in ratios.items()))
    gpt_plus = {key: ratio for key, ratio in ratios.items() if key[1] == "gptplus"}
    assert len(gpt_plus) == 6 and all(0.85 <= ratio <= 1.15 for ratio in gpt_plus.values()), gpt_plus
    # anGPT and nGPT peak above what their layers keep on the GPU (docs/scaling.md): the estimate is low there,
    # never high, so a layout it refuses would not have fit either.
    assert all(ratio <= 1.15 for ratio in ratios.values())


@pytest.mark.parametrize("stages,virtual", [(2, 2), (4, 2), (4, 3), (8, 5)])
def test_the_first_stage_holds_megatron_lms_interleaved_count(stages, virtual):
    # megatron/training/theoretical_memory_usage.py: the first stage keeps num_layers x (1 + (p - 1) / (p v))
    # layers' activations with enough micro-batches; ours counts in units of the stage's p-th of the layers.
    assert in_flight(0, stages, 64, virtual) / stages == pytest.approx(1 + (stages - 1) / (stages * virtual))


def test_1f1b_stages_hold_fewer_micro_batches_down_the_pipeline():
    # megatron-core's schedule: stage s warms up with min(p - s - 1, m) forward passes, then holds one more.
    assert [in_flight(s, 4, 8, None) for s in range(4)] == [4, 3, 2, 1]
    assert [in_flight(s, 4, 2, None) for s in range(4)] == [2, 2, 2, 1]  # m below p
    assert in_flight(0, 1, 8, None) == 1  # no pipeline: each micro-batch's backward runs before the next


def test_parallelism_divides_what_it_splits():
    config = model_config("angpt", num_layers=1, hidden_size=256, num_attention_heads=8, num_query_groups=2)
    tokens = 4096
    whole = layer_bytes(config, tokens)
    tp = layer_bytes(config, tokens, tensor_parallel=2)
    sp = layer_bytes(config, tokens, tensor_parallel=2, sequence_parallel=True)
    assert whole / 2 < tp < whole and sp == pytest.approx(whole / 2)
    # Context parallelism halves everything but the keys and values gathered over its group (kv wide each, BF16):
    # the keys kept whole rather than halved, and the values a copy of their own (a view of QKV's output
    # without CP).
    kv = 2 * 32
    cp = layer_bytes(config, tokens, context_parallel=2)
    assert cp == pytest.approx(whole / 2 + (tokens / 2 + tokens) * kv * 2)


def test_recompute_keeps_less():
    config = model_config("gptplus", num_layers=2, hidden_size=128, num_attention_heads=4)
    tokens = 1024
    none = layer_bytes(config, tokens)
    mlp = layer_bytes(config, tokens, recompute_modules=("mlp",))
    # SwiGLU: fc1's 2f-wide output and fc2's f-wide input, f = 4h, BF16.
    assert none - mlp == tokens * 3 * 4 * 128 * 2
    full = stage_memory(config, Layout(1, 1, 1, 1, recompute_granularity="full", recompute_num_layers=1),
                        {0: (0, 0)}, [2], 256, tokens, 1, 1, bf16=True, distributed_optimizer=False)[0]
    plain = stage_memory(config, Layout(1, 1, 1, 1), {0: (0, 0)}, [2], 256, tokens, 1, 1, bf16=True,
                         distributed_optimizer=False)[0]
    # Full recompute of 2 layers one at a time: both inputs plus one layer's activations during its backward.
    assert plain.activation_bytes - full.activation_bytes == pytest.approx(none - tokens * 128 * 2 * 2)


def test_the_verdict_at_the_gpu_memory_boundary():
    config = model_config("gptplus", num_layers=2, hidden_size=128, num_attention_heads=4)
    layout = Layout(1, 1, 1, 1)
    memory = stage_memory(config, layout, {0: (1000, 0)}, [2], 256, 512, 2, 1, bf16=True,
                          distributed_optimizer=False)
    fits = memory_report(memory, layout, PrecisionSection(bf16=True), memory[0].total, "test")
    short = memory_report(memory, layout, PrecisionSection(bf16=True), memory[0].total - 1, "test")
    assert "fits, 0.0 GiB to spare" in fits[-2] and "does NOT fit" in short[-2]


def test_every_candidate_layout_is_one_megatron_core_runs():
    config = model_config("angpt", num_layers=12, hidden_size=512, num_attention_heads=8, num_query_groups=4)
    layouts = candidate_layouts(config, 64, 4096, 512, 1, [(None, ())])
    assert layouts and len({(x.tensor_parallel, x.pipeline_parallel, x.context_parallel) for x in layouts}) == len(
        layouts)
    for x in layouts:
        assert x.tensor_parallel * x.pipeline_parallel * x.context_parallel * x.data_parallel == 64
        assert 4 % x.tensor_parallel == 0 and 12 % x.pipeline_parallel == 0
        assert 4096 % (2 * x.context_parallel) == 0 and 512 % x.data_parallel == 0
        assert x.sequence_parallel == (x.tensor_parallel > 1)
    assert {x.tensor_parallel for x in layouts} == {1, 2, 4}  # 8 does not divide the 4 key-value groups


@pytest.mark.long  # torch.compile of 12 small models: 50 s of CPU, so with the long checks (make test-long)
@pytest.mark.parametrize("family,groups,recompute", [
    ("gptplus", None, ()), ("gptplus", None, ("core_attn", "mlp", "layernorm", "qk_norm")),
    ("angpt", 2, ()), ("angpt", None, ("qk_norm", "residual_update")),
    ("ngpt", None, ()), ("ngpt", None, ("residual_update", "mlp")),
])
def test_the_layer_estimate_is_within_10_percent_of_what_the_benchmark_measures(single_process, family, groups,
                                                                                 recompute):
    benchmark = load_benchmark("activation_memory")
    args = benchmark.argparse.Namespace(hidden_size=64, num_attention_heads=4, num_query_groups=groups,
                                        seq_length=32, micro_batch_size=2, vocab_size=64, attention_backend="flash")
    measured = benchmark.per_layer(family, "compiled", args, recompute)
    assert benchmark.estimated(family, args, recompute) == pytest.approx(measured, rel=0.1)


@pytest.mark.parametrize("distributed_optimizer, per_parameter", [(False, 18), (True, 6 + 12 / 2)])
def test_fp16_weights_count_as_bf16_ones(distributed_optimizer, per_parameter):
    """fp16 and bf16 both keep 2-byte weights, fp32 gradients, fp32 main weights and two moments (Megatron-LM's
    theoretical count); fp32 keeps no main copy (16 bytes, or 8 + 8 / DP)."""
    layout = Layout(1, 1, 1, 2)
    for fp16, expected in ((True, per_parameter), (False, 8 + 8 / 2 if distributed_optimizer else 16)):
        config = model_config("gptplus", num_layers=2, hidden_size=128, num_attention_heads=4, fp16=fp16)
        memory = stage_memory(config, layout, {0: (1000, 0)}, [2], 256, 64, 1, 1, bf16=False,
                              distributed_optimizer=distributed_optimizer)
        assert memory[0].model_bytes == pytest.approx(1000 * expected)


@pytest.mark.parametrize("megatron_fsdp, sharded", [(None, 12), ("optim_grads", 16)])
def test_optimizer_instances_shard_within_their_share_of_the_data_parallel_ranks(megatron_fsdp, sharded):
    """megatron-core's partial distributed optimizer (and Megatron-FSDP's hybrid sharding) shards over DP x CP /
    instances: at DP 4 x CP 2 and bf16, the distributed optimizer's 12 bytes of main weights and moments (Megatron-FSDP
    optim_grads: also its 4 of fp32 gradients) over 8, 4 or 2 ranks; the rest (the distributed optimizer's 2-byte
    weights and 4-byte gradients) the same for any count."""
    config = model_config("gptplus", num_layers=2, hidden_size=128, num_attention_heads=4)
    model_bytes = {instances: stage_memory(config, Layout(1, 1, 2, 4), {0: (1000, 0)}, [2], 256, 64, 1, 1, bf16=True,
                                           distributed_optimizer=True, megatron_fsdp=megatron_fsdp,
                                           optimizer_instances=instances)[0].model_bytes for instances in (1, 2, 4)}
    if megatron_fsdp is None:
        assert model_bytes[1] == pytest.approx(1000 * (6 + 12 / 8))
    for instances in (2, 4):
        assert model_bytes[instances] - model_bytes[1] == pytest.approx(1000 * sharded * (instances - 1) / 8)


@pytest.mark.parametrize("stages", [2, 4])
@pytest.mark.parametrize("virtual", [None, 2, 3])
@pytest.mark.parametrize("micro_batches", [1, 2, 4, 12])
def test_in_flight_is_megatron_cores_warm_up_plus_one_on_every_stage(stages, virtual, micro_batches):
    """megatron-core's get_pp_rank_microbatches: a stage runs its warm-up's forward passes, then holds one more
    until the first backward, or all its micro-batches (times the chunks) when the warm-up takes them all."""
    for stage in range(stages):
        pipeline = SimpleNamespace(pp_group=SimpleNamespace(size=lambda: stages, rank=lambda: stage),
                                   virtual_pipeline_model_parallel_size=virtual)
        total, all_in_warm_up, warm_up, _ = get_pp_rank_microbatches(micro_batches, virtual or 1, stages,
                                                                     p2p_communicator=pipeline)
        held = total if all_in_warm_up else warm_up + 1
        assert in_flight(stage, stages, micro_batches, virtual) == pytest.approx(held / (virtual or 1))


def test_a_two_stage_pipelines_first_and_last_stages_add_the_embedding_and_the_logits():
    """TP 2 with sequence parallelism, CP 2, 4 micro-batches of 2 x 64 tokens, BF16: each rank holds 2 x 64 / 2 = 64
    tokens. Stage 0 adds the embedding's output (64 tokens x 128 / 2 wide x 2 bytes) and the int64 token ids, and
    holds 2 micro-batches (1F1B); the last adds the final norm's and output layer's inputs (2 x 128 / 2 wide) and
    10 bytes per token of its 256 / 2 vocabulary entries, once. Weights: 18 bytes per parameter, or 6 + 12 over the
    distributed optimizer's data x context group of 2."""
    config = model_config("gptplus", num_layers=2, hidden_size=128, num_attention_heads=4)
    layout = Layout(2, 2, 2, 1, sequence_parallel=True)
    one_layer = layer_bytes(config, 128, tensor_parallel=2, sequence_parallel=True, context_parallel=2)
    for distributed_optimizer, per_parameter in ((False, 18), (True, 6 + 12 / 2)):
        first, last = stage_memory(config, layout, {0: (1000, 10), 1: (2000, 20)}, [1, 1], 256, 64, 2, 4, bf16=True,
                                   distributed_optimizer=distributed_optimizer)
        assert first.activation_bytes == pytest.approx(2 * (one_layer + 64 * (64 * 2 + 8)))
        assert last.activation_bytes == pytest.approx(one_layer + 64 * (2 * 64 * 2 + 10 * 128))
        assert (first.micro_batches_in_flight, last.micro_batches_in_flight) == (2, 1)
        assert (first.parameters, last.parameters) == (510, 1020)
        assert (first.model_bytes, last.model_bytes) == pytest.approx((510 * per_parameter, 1020 * per_parameter))
        assert first.total == first.model_bytes + first.activation_bytes


@pytest.mark.parametrize("method, group, inputs, whole_layers", [
    ("uniform", 2, 3, 2),  # 5 layers in groups of 2: 3 groups' inputs, one group's activations in its backward
    ("uniform", 5, 1, 5),
    ("uniform", 9, 1, 5),  # a group longer than the stage: the stage's layers
    ("block", 2, 2, 3 + 1),  # the first 2 layers recompute (1 at a time), the other 3 keep everything
    ("block", 5, 5, 1),
    ("block", 0, 0, 5),  # no layer recomputes: all keep everything
])
def test_full_recompute_keeps_the_groups_inputs_and_one_groups_activations(method, group, inputs, whole_layers):
    """Megatron-LM's --recompute-method: uniform checkpoints groups of --recompute-num-layers layers, keeping each
    group's input ([tokens, h]); block checkpoints the first --recompute-num-layers layers one by one. TP 2 with
    sequence parallelism and CP 2 split the input's tokens: 2 x 64 / 2 / 2 tokens x 128 wide x 2 bytes."""
    config = model_config("gptplus", num_layers=5, hidden_size=128, num_attention_heads=4)
    common = dict(sequence_parallel=True, recompute_granularity="full")
    layout = Layout(2, 1, 2, 1, recompute_method=method, recompute_num_layers=group, **common)
    one_layer = layer_bytes(config, 128, tensor_parallel=2, sequence_parallel=True, context_parallel=2)
    layer_input = 128 / 2 / 2 * 128 * 2
    # To the byte: a stray byte is a wrong term.
    assert layers_activation_bytes(config, 5, 128, layout, 2) == pytest.approx(inputs * layer_input
                                                                               + whole_layers * one_layer, abs=0.5)


def test_selective_recompute_and_fp32_count_what_the_layer_keeps():
    config = model_config("gptplus", num_layers=2, hidden_size=128, num_attention_heads=4)
    selective = Layout(1, 1, 1, 1, recompute_granularity="selective", recompute_modules=("mlp",))
    assert layers_activation_bytes(config, 3, 64, selective, 2) == 3 * layer_bytes(config, 64,
                                                                                    recompute_modules=("mlp",))
    assert layers_activation_bytes(config, 3, 64, Layout(1, 1, 1, 1), 4) == 3 * layer_bytes(config, 64,
                                                                                            bytes_per_element=4)
    fp32 = stage_memory(config, Layout(1, 1, 1, 1), {0: (0, 0)}, [2], 256, 64, 1, 1, bf16=False,
                        distributed_optimizer=False)[0]
    # Two layers, then the embedding's output (4-byte) and token ids, and the last stage's inputs and logits.
    assert fp32.activation_bytes == pytest.approx(2 * layer_bytes(config, 64, bytes_per_element=4)
                                                  + 64 * (128 * 4 + 8) + 64 * (2 * 128 * 4 + 10 * 256))


def test_a_layout_describes_itself_as_the_suggestions_list_it():
    assert Layout(2, 4, 1, 8, virtual_stages=2, sequence_parallel=True).describe() == \
        "TP 2 x PP 4 x CP 1 x DP 8 (VP 2), SP"
    assert Layout(1, 1, 2, 4, recompute_granularity="full", recompute_method="block",
                  recompute_num_layers=3).describe() == "TP 1 x PP 1 x CP 2 x DP 4, full recompute (block, 3)"
    assert Layout(1, 1, 1, 1, recompute_granularity="selective", recompute_modules=("mlp", "core_attn")
                  ).describe() == "TP 1 x PP 1 x CP 1 x DP 1, recompute mlp,core_attn"


@pytest.mark.parametrize("family", ["gptplus", "gpt"])
def test_recompute_flops_are_the_forward_passes_they_repeat(family):
    """Full recompute repeats every layer's forward pass: the model's forward FLOPs (Megatron-LM's count, a third of
    the training FLOPs) less the output head's 2 x h x vocab. Selective recompute repeats the MLP's matmuls
    (2 FLOPs per multiply-add of its 3 matrices with SwiGLU, 2 without) or core attention's scores and values
    (2 x 2 x q x s / 2, causal)."""
    config = model_config(family, num_layers=3, hidden_size=128, num_attention_heads=4, num_query_groups=2)
    h, s, vocab, layers = 128, 64, 256, 3
    q, f = config.kv_channels * 4, config.ffn_hidden_size
    mlp = layers * 2 * (3 if config.gated_linear_unit else 2) * f * h
    attention = layers * 2 * q * s
    full = Layout(1, 1, 1, 1, recompute_granularity="full")
    assert recompute_flops_per_token(config, full, s) == pytest.approx(
        model_flops_per_token(config, s, vocab) / 3 - 2 * h * vocab)
    for modules, expected in ((("mlp",), mlp), (("core_attn",), attention), (("core_attn", "mlp"), mlp + attention),
                              (("layernorm", "qk_norm"), 0)):
        selective = Layout(1, 1, 1, 1, recompute_granularity="selective", recompute_modules=modules)
        assert recompute_flops_per_token(config, selective, s) == expected
    assert recompute_flops_per_token(config, Layout(1, 1, 1, 1), s) == 0


def test_a_collective_moves_all_but_its_own_share_at_nvlinks_or_the_networks_bandwidth():
    assert _collective_seconds(1e9, 1, True) == 0
    assert _collective_seconds(1e9, 2, True) == pytest.approx(0.5e9 / (NVLINK_GBPS * 1e9))
    assert _collective_seconds(1e9, 4, False) == pytest.approx(0.75e9 / (NETWORK_GBPS * 1e9))


@pytest.mark.parametrize("world_size, seq_length, global_batch, groups", [
    (24, 96, 12, 4),  # PP 6 (all 6 layers) fits 24 GPUs; 24 GPUs would split a batch of 12
    (32, 128, 24, None),  # CP 32: 128 tokens in 64 chunks of 2; TP 8 with 8 heads
    (32, 99, 32, None),  # an odd sequence: no context nor tensor parallelism at all
])
def test_the_candidates_are_every_layout_the_rules_allow(world_size, seq_length, global_batch, groups):
    """Every TP of 1, 2, 4 or 8 dividing the 8 heads and the key-value groups, CP of 1 to 32 cutting the sequence
    into 2 x CP chunks whose tokens split over TP, PP dividing the 6 layers, DP the rest of the GPUs dividing the
    global batch in micro-batches of 1; each with each recompute choice; whole numbers, as the suggestions print."""
    config = model_config("angpt", num_layers=6, hidden_size=256, num_attention_heads=8, num_query_groups=groups)
    choices = [(None, ()), ("selective", ("mlp",))]
    expected = set()
    for tp, cp, pp in itertools.product((1, 2, 4, 8), (1, 2, 4, 8, 16, 32), range(1, 7)):
        dp, rest = divmod(world_size, tp * cp * pp)
        if (not rest and (groups or 8) % tp == 0 and 6 % pp == 0 and (cp == 1 or seq_length % (2 * cp) == 0)
                and seq_length // cp % tp == 0 and global_batch % dp == 0):
            expected |= {(tp, pp, cp, dp, tp > 1, *choice) for choice in choices}
    layouts = candidate_layouts(config, world_size, seq_length, global_batch, 1, choices)
    got = [(x.tensor_parallel, x.pipeline_parallel, x.context_parallel, x.data_parallel, x.sequence_parallel,
            x.recompute_granularity, x.recompute_modules) for x in layouts]
    assert len(got) == len(set(got)) and set(got) == expected
    assert all(type(value) is int for layout in got for value in layout[:4])


def test_the_ranking_counts_a_layout_that_fills_the_memory_exactly_as_fitting():
    stage = StageMemory(0, 1, 10 * GIB, 6 * GIB, 1)
    estimates = [Estimate(Layout(1, 1, 1, 1), [stage], dict(compute=2.0, bubble=0.5))]
    fits = describe_ranking(estimates, 16 * GIB)
    assert fits[0] == "  1 of 1 layouts fit 16.0 GiB; the fastest by the estimate:"
    assert fits[2].split()[-3:] == ["16.0", "2.50", "2.00/0.50"]
    assert describe_ranking(estimates, 16 * GIB - 1) == [
        "  none of 1 layouts fits 16.0 GiB; the smallest needs 16.0 GiB (TP 1 x PP 1 x CP 1 x DP 1, "
        "--use-distributed-optimizer)"]


def layer(family, tokens=64, **kwargs):
    config = model_config(family, num_layers=1, hidden_size=128, num_attention_heads=4,
                          num_query_groups=kwargs.pop("groups", None))
    return layer_bytes(config, tokens, **kwargs)


def test_recomputing_core_attention_frees_what_the_families_make_inside_it():
    """64 tokens, 4 heads of 32 (q = 128), BF16. GPT+'s QK-norm and RoPE come before core attention: recomputing it
    frees only the softmax's fp32 log-sum-exp per head. anGPT's and nGPT's run inside it: it frees the normalized
    queries and keys too (q + kv), as recomputing the QK normalization alone does."""
    lse, queries_and_keys = 64 * 4 * 4, 64 * (128 + 128) * 2
    assert layer("gptplus") - layer("gptplus", recompute_modules=("core_attn",)) == lse
    for family in ("angpt", "ngpt"):
        assert layer(family) - layer(family, recompute_modules=("core_attn",)) == lse + queries_and_keys
        assert layer(family) - layer(family, recompute_modules=("qk_norm",)) == queries_and_keys
        assert layer(family, recompute_modules=("qk_norm", "core_attn")) == layer(family,
                                                                                  recompute_modules=("core_attn",))


def test_the_norms_and_residual_updates_free_what_they_keep():
    """GPT+'s layernorm recompute frees the two RMSNorms' outputs (2h); nGPT's residual_update its exact
    normalizations' intermediates (2h); anGPT's normalization is approximate and keeps none of its own; the MLP
    of GELU (not gated) keeps an f-wide fc1 output and fc2 input."""
    two_h = 64 * 2 * 128 * 2
    assert layer("gptplus") - layer("gptplus", recompute_modules=("layernorm",)) == two_h
    assert layer("ngpt") - layer("ngpt", recompute_modules=("residual_update",)) == two_h
    assert layer("ngpt") - layer("angpt") == two_h
    assert layer("angpt", recompute_modules=("residual_update", "layernorm")) == layer("angpt")
    assert layer("gpt") - layer("gpt", recompute_modules=("mlp",)) == 64 * (512 + 512) * 2


def test_grouped_keys_and_values_keep_a_copy_of_the_queries():
    """2 groups of 32 (kv = 64) rather than 4: the QKV output and the normalized keys shrink by 64 per token each
    (the keys and the values of the QKV output), and megatron-core's copy of the queries (q = 128) is added."""
    assert layer("angpt", groups=2) - layer("angpt") == 64 * (-2 * 64 - 64 + 128) * 2
    assert layer("gptplus", groups=2) - layer("gptplus") == 64 * (-2 * 64 - 64 + 128) * 2


@pytest.mark.parametrize("family", ["angpt", "gptplus", "ngpt"])
def test_context_parallelism_splits_everything_when_core_attention_is_recomputed(family):
    """With core attention recomputed, it keeps no keys and values gathered over the context-parallel group: CP 2
    halves the whole layer. Without, GPT+ keeps the gathered keys and values of the whole sequence (2 x 128 each,
    BF16) instead of its local keys."""
    recomputed = ("core_attn",)
    assert layer(family, context_parallel=2, recompute_modules=recomputed) == layer(family,
                                                                                    recompute_modules=recomputed) / 2
    if family == "gptplus":
        assert layer(family, context_parallel=2) == layer(family) / 2 - 32 * 128 * 2 + 64 * 2 * 128 * 2


def test_fp32_training_doubles_all_but_what_is_fp32_anyway():
    """The log-sum-exp is fp32 whatever the precision: 4 heads x 4 bytes per token, once."""
    for family in ("angpt", "gptplus"):
        assert layer(family, bytes_per_element=4) == 2 * layer(family) - 64 * 4 * 4


def test_a_steps_parts_follow_the_model_of_docs_scaling():
    """TP 2 (SP) x PP 2 x CP 2 x DP 2 = 16 GPUs (two nodes), a global batch of 8 sequences of 64 tokens in
    micro-batches of 1: 4 per DP rank. Each part as docs/scaling.md models it, a collective moving (n - 1) / n of
    its bytes (an all-reduce twice that) at NVLink's bandwidth within a node of 8, the network's beyond:
    - the bubble: (p - 1) / m of the compute;
    - TP: 4 all-reduces of a micro-batch's [64 / 2 CP tokens, 128] BF16 per layer (2 of the 4 per stage);
    - CP: keys and values (2 x 128 / TP wide, 64 tokens, BF16) all-gathered forward, reduce-scattered backward;
    - PP: each micro-batch's [32 tokens, 128 / TP] sent forward and its gradient back;
    - DP: fp32 gradients reduce-scattered and BF16 parameters all-gathered over DP x CP = 4, across nodes,
      unless overlapped."""
    config = model_config("gptplus", num_layers=4, hidden_size=128, num_attention_heads=4)
    layout = Layout(2, 2, 2, 2, sequence_parallel=True)
    parts = step_seconds(config, layout, 256, 64, 8, 1, 1000, 1e12, overlap_grad_reduce=False,
                         overlap_param_gather=False)
    nvlink, network = NVLINK_GBPS * 1e9, NETWORK_GBPS * 1e9
    compute = 8 * 64 * model_flops_per_token(config, 64, 256) / (16 * 1e12 * MEASURED_MFU["gptplus"])
    assert parts == pytest.approx(dict(
        compute=compute, bubble=compute / 4,
        tensor_parallel=4 * 2 * 4 * 2 * (1 / 2) * 32 * 128 * 2 / nvlink,
        context_parallel=4 * 2 * 2 * (1 / 2) * 64 * 2 * 128 / 2 * 2 / nvlink,
        pipeline=4 * 2 * 32 * 128 / 2 * 2 / nvlink,
        data_parallel=(3 / 4) * (1000 * 4 + 1000 * 2) / network))
    overlapped = step_seconds(config, layout, 256, 64, 8, 1, 1000, 1e12, overlap_grad_reduce=True,
                              overlap_param_gather=True)
    assert overlapped["data_parallel"] == 0
    # Full recompute repeats the forward pass: its collectives too (3 passes rather than 2), and its FLOPs.
    full = step_seconds(config, Layout(2, 2, 2, 2, sequence_parallel=True, recompute_granularity="full"), 256, 64,
                        8, 1, 1000, 1e12, overlap_grad_reduce=True, overlap_param_gather=True)
    assert full["tensor_parallel"] == pytest.approx(parts["tensor_parallel"] * 3 / 2)
    assert full["context_parallel"] == pytest.approx(parts["context_parallel"] * 3 / 2)
    assert full["compute"] == pytest.approx(compute * (1 + recompute_flops_per_token(
        config, Layout(1, 1, 1, 1, recompute_granularity="full"), 64) / model_flops_per_token(config, 64, 256)))
    estimate = Estimate(layout, [StageMemory(0, 1, 3.0, 2.0, 2), StageMemory(1, 1, 1.0, 1.0, 1)], parts)
    assert estimate.peak_bytes == 5.0 and estimate.step_seconds == pytest.approx(sum(parts.values()))


def test_an_elementwise_recompute_costs_twice_the_bytes_it_saves_at_hbm_bandwidth():
    """Recomputing GPT+'s norms reads their inputs and writes the outputs they had kept (2h per token, BF16): twice
    those bytes per micro-batch (8 of 64 tokens) and layer (4, on one stage), at the HBM's bandwidth."""
    config = model_config("gptplus", num_layers=4, hidden_size=128, num_attention_heads=4)
    plain, norms = (step_seconds(config, Layout(1, 1, 1, 1, recompute_granularity=granularity,
                                                recompute_modules=modules), 256, 64, 8, 1, 1000, 1e12, True, True)
                    for granularity, modules in ((None, ()), ("selective", ("layernorm",))))
    assert norms["compute"] - plain["compute"] == pytest.approx(8 * 4 * 2 * (64 * 2 * 128 * 2) / (HBM_GBPS * 1e9))


@pytest.mark.parametrize("family, hidden_width", [("gptplus", 4), ("angpt", 4), ("ngpt", 6)])
@pytest.mark.parametrize("layout", [{}, {"groups": 2}, {"context_parallel": 2}], ids=["MHA", "GQA", "CP 2"])
def test_tensor_parallelism_without_sequence_parallelism_splits_only_the_heads_and_the_mlp(family, hidden_width,
                                                                                           layout):
    """The residual stream's tensors (GPT+: the RMSNorms' inputs and outputs; anGPT: the projections' and residual
    updates' inputs; nGPT: those and its exact normalizations', 4h or 6h in all) stay whole on each TP rank; the
    rest, the queries' copy of grouped attention and the keys and values gathered over CP included, is split."""
    hidden = 64 * hidden_width * 128 * 2 / layout.get("context_parallel", 1)
    assert layer(family, tensor_parallel=2, **layout) == pytest.approx(hidden + (layer(family, **layout) - hidden) / 2)


def test_the_head_width_is_kv_channels_where_given():
    """Heads of 64 (kv_channels) rather than 128 / 4 = 32: every query, key and value entry doubles (GPT+: the
    QKV output 3q, core attention's output q, the normalized queries and keys 2q, per token)."""
    config = model_config("gptplus", num_layers=1, hidden_size=128, num_attention_heads=4, kv_channels=64)
    assert layer_bytes(config, 64) - layer("gptplus") == 64 * (3 + 1 + 2) * 128 * 2


@pytest.mark.parametrize("data_parallel", [2, 4])
def test_the_estimate_of_each_sharding_is_the_memory_measured_on_its_ranks(data_parallel):
    """benchmarks/sixteen_bit_optimizer.py counted the storages each rank holds after a bf16 step of GPT+ (DDP's
    16-bit optimizer, the distributed optimizer, FSDP2): the dry run's bytes a parameter, as counted."""
    with open(os.path.join(ROOT, "docs", "results", f"memory_dp{data_parallel}.json")) as file:
        measured = json.load(file)
    assert measured["data_parallel"] == data_parallel
    for name, (distributed_optimizer, fsdp2) in {"without": (False, False), "distributed optimizer": (True, False),
                                                 "fsdp2": (False, True)}.items():
        per_parameter = measured["rows"][name]["total"] * 2**20 / measured["parameters"]
        assert per_parameter == pytest.approx(bytes_per_parameter(True, distributed_optimizer, data_parallel, fsdp2),
                                              rel=1e-3)


@pytest.mark.parametrize("data_parallel", [2, 4])
def test_megatron_fsdps_estimate_is_the_memory_measured_on_its_ranks(data_parallel):
    """benchmarks/sixteen_bit_optimizer.py read Megatron-FSDP's buffers after a bf16 step of GPT+ (6.29M parameters, 4
    layers, 2 x 4096 x 256 of them in the untied embedding and head): bf16 weights (2 bytes), fp32 gradients (4),
    fp32 main weights and moments (12), of which no_shard shards none (as DDP's 16-bit optimizer, measured beside it),
    optim 12, optim_grads 16, optim_grads_params all 18, which
    also keeps every weight gathered between steps (fewer than its all-gather's 5e8 elements of prefetch): 2 more.
    no_shard's and optim's buckets are views of their whole buffers: nothing more in the backward pass.
    At the backward pass's end, optim_grads holds its fp32 gradients whole in one bucket (4 more), optim_grads_params
    them too (its 1e9-element queue holds them all), and the weights outside the layers and one layer's (the rest
    freed after their backward): the dry run's estimate of it within 10%, under it by no more than the buffers'
    padding."""
    with open(os.path.join(ROOT, "docs", "results", f"memory_dp{data_parallel}.json")) as file:
        measured = json.load(file)
    parameters, dp = measured["parameters"], data_parallel
    outside = 2 * 4096 * 256
    layer = (parameters - outside) / 4
    between_steps = {"no_shard": 18, "optim": 6 + 12 / dp, "optim_grads": 2 + 16 / dp,
                     "optim_grads_params": 18 / dp + 2}
    backward = {"no_shard": 18, "optim": 6 + 12 / dp, "optim_grads": 2 + 16 / dp + 4,
                "optim_grads_params": 18 / dp + 2 * (outside + layer) / parameters + 4}
    for strategy in MEGATRON_FSDP:
        row = measured["rows"][f"megatron-fsdp {strategy}"]
        assert row["total"] * 2**20 / parameters == pytest.approx(between_steps[strategy], rel=5e-3)  # padding
        assert row["estimate"] * 2**20 / parameters == pytest.approx(between_steps[strategy], rel=1e-6)
        assert row["backward_peak"] * 2**20 / parameters == pytest.approx(backward[strategy], rel=5e-3)
        assert 0.9 <= row["backward_peak_measured_over_estimate"] <= 1.01  # 1%: the buffers' padding
    # The distributed optimizer's and DDP's figures, measured beside them in the same run.
    assert measured["rows"]["megatron-fsdp optim"]["total"] == pytest.approx(
        measured["rows"]["distributed optimizer"]["total"], rel=1e-3)
    assert measured["rows"]["megatron-fsdp no_shard"]["total"] == pytest.approx(measured["rows"]["without"]["total"],
                                                                                 rel=1e-3)


@pytest.mark.parametrize("bf16, weight", [(True, 2), (False, 4)])
def test_megatron_fsdps_buffers_per_parameter(bf16, weight):
    """megatron-core's Megatron-FSDP (param_and_grad_buffer.py): a weight buffer at the weights' dtype, an fp32 main
    weight buffer even at fp32 (preserve_fp32_weights), an fp32 gradient buffer, and Adam's two fp32 moments; no_shard
    distributes none (the model's own weights in place of the weight buffer), optim the main weights (and so the
    moments), optim_grads the gradients too, optim_grads_params the weights too. Over one rank nothing is
    distributed."""
    for dp in (1, 2, 8):
        assert bytes_per_parameter(bf16, True, dp, megatron_fsdp="no_shard") == weight + 4 + 4 + 8
        assert bytes_per_parameter(bf16, True, dp, megatron_fsdp="optim") == weight + 4 + (4 + 8) / dp
        assert bytes_per_parameter(bf16, True, dp, megatron_fsdp="optim_grads") == weight + (4 + 4 + 8) / dp
        assert bytes_per_parameter(bf16, True, dp, megatron_fsdp="optim_grads_params") == (weight + 16) / dp
    # At fp32 optim keeps 4 bytes more than the distributed optimizer (its fp32 weights double as the main copy).
    assert bytes_per_parameter(False, True, 4, megatron_fsdp="optim") - bytes_per_parameter(False, True, 4) == 1


def test_megatron_fsdp_holds_whole_its_gathered_weights_and_queued_gradients_up_to_its_unit():
    """A rank of 4e9 parameters in 40 layers and 4e8 outside them (an untied embedding and head of 50000 x 4000):
    optim_grads_params gathers the 4e8, a layer (9e7) and 5e8 prefetched (half its 1e9-element unit): 9.9e8 weights;
    as the backward pass starts they are held with the gradients of the 4e8 and one layer, as it ends the 4e8 and a
    layer's weights with the 4e8's gradients, two layers' and the queue's 1e9 (fp32). optim_grads: every gradient,
    fp32, in its one bucket; optim and no_shard: nothing beyond their buffers. Over one rank nothing is gathered."""
    starts = 9.9e8 * 2 + 4.9e8 * 4
    ends = 4.9e8 * 2 + (4e8 + 1.8e8 + 1e9) * 4
    assert ends > starts
    assert megatron_fsdp_gathered("optim_grads_params", 4e9, 9e7, 4e8, 2) == pytest.approx((9.9e8, ends))
    assert megatron_fsdp_gathered("optim_grads", 4e9, 9e7, 4e8, 2) == (0, 4 * 4e9)
    assert megatron_fsdp_gathered("optim", 4e9, 9e7, 4e8, 2) == (0, 0)
    assert megatron_fsdp_gathered("no_shard", 4e9, 9e7, 4e8, 2) == (0, 0)
    # A small model: every weight gathered and every gradient queued, the ends' 2 + 4 bytes outweighing the starts'.
    assert megatron_fsdp_gathered("optim_grads_params", 1e6, 2e5, 2e5, 2) == pytest.approx((1e6, 4e5 * 2 + 4e6))
    # In the dry run: a stage of 4e9 over DP 4, its outside parameters the vocabulary's two matrices (50000 x 4000).
    config = model_config("gptplus", num_layers=40, hidden_size=4000, num_attention_heads=40)

    def model_bytes(strategy, dp=4, bf16=True):
        return stage_memory(config, Layout(1, 1, 1, dp), {0: (4e9, 0)}, [40], 50000, 64, 1, 1, bf16=bf16,
                            distributed_optimizer=True, megatron_fsdp=strategy)[0].model_bytes

    assert model_bytes("optim_grads_params") == pytest.approx(4e9 * 18 / 4 + ends)
    assert model_bytes("optim_grads_params", bf16=False) == pytest.approx(
        4e9 * 20 / 4 + max(9.9e8 * 4 + 4.9e8 * 4, 4.9e8 * 4 + (4e8 + 1.8e8 + 1e9) * 4))
    assert model_bytes("optim_grads") == pytest.approx(4e9 * (2 + 16 / 4) + 4e9 * 4)
    assert model_bytes("optim") == pytest.approx(4e9 * (6 + 12 / 4))
    assert model_bytes("no_shard") == pytest.approx(4e9 * 18)
    assert model_bytes("no_shard", bf16=False) == pytest.approx(4e9 * 20)
    assert model_bytes("optim_grads_params", dp=1) == model_bytes("optim_grads", dp=1) == pytest.approx(4e9 * 18)


def test_the_ranking_lists_the_ten_fastest_that_fit_or_the_smallest_that_does_not():
    """12 layouts, the k-th taking 12 - k seconds and k GiB: with 20 GiB all fit, and the 10 fastest are listed,
    fastest first, under a header of the columns; with 0.5 GiB none fits, and the smallest (1 GiB) is named."""
    estimates = [Estimate(Layout(1, 1, 1, k), [StageMemory(0, 1, k * GIB, 0.0, 1)], dict(compute=12.0 - k))
                 for k in range(1, 13)]
    lines = describe_ranking(estimates, 20 * GIB)
    assert lines[0] == "  12 of 12 layouts fit 20.0 GiB; the fastest by the estimate:"
    assert lines[1].split() == ["layout", "sharding", "GiB", "step", "s", "compute/bubble/TP/CP/PP/DP", "s"]
    assert [line.split()[10] for line in lines[2:]] == [str(k) for k in range(12, 2, -1)]  # DP k
    assert all(line.split()[11] == "--use-distributed-optimizer" for line in lines[2:])
    # The fastest's overlapped collectives, where it has any: beside the compute that hides them.
    estimates[-1].overlapped = 1.5
    assert describe_ranking(estimates, 20 * GIB)[12:] == [
        "  the first's overlapped data-parallel collectives: 1.50 s beside 0.00 s of compute (its DP part: what "
        "exceeds the compute)"]
    assert describe_ranking(estimates, GIB / 2) == [
        "  none of 12 layouts fits 0.5 GiB; the smallest needs 1.0 GiB (TP 1 x PP 1 x CP 1 x DP 1, "
        "--use-distributed-optimizer)"]


def test_only_the_elementwise_recomputes_cost_hbm_traffic_with_sequence_parallel_bytes():
    """Selective recompute of the MLP, core attention and the norms: the first two cost FLOPs (counted in the
    recompute FLOPs), only the norms HBM traffic: twice their saved bytes, which sequence parallelism splits over
    TP 2 (64 / 2 tokens x 2h x 2 bytes per layer and micro-batch, 8 micro-batches, 4 layers)."""
    config = model_config("gptplus", num_layers=4, hidden_size=128, num_attention_heads=4)
    modules = ("mlp", "core_attn", "layernorm")
    layout = Layout(2, 1, 1, 1, sequence_parallel=True, recompute_granularity="selective", recompute_modules=modules)
    flops = 8 * 64 * (model_flops_per_token(config, 64, 256) + recompute_flops_per_token(config, layout, 64))
    expected = flops / (2 * 1e12 * MEASURED_MFU["gptplus"]) + 8 * 4 * 2 * (32 * 2 * 128 * 2) / (HBM_GBPS * 1e9)
    assert step_seconds(config, layout, 256, 64, 8, 1, 1000, 1e12, True, True)["compute"] == pytest.approx(expected)


def test_fsdp2_keeps_its_shard_and_gathers_a_layer_or_every_weight():
    """FSDP2 over DP 2 x CP 2 = 4 ranks: 18 bytes a parameter at bf16 (16 at fp32) over the 4, plus what it gathers
    (the docstring of stage_memory): a layer's weights and their gradients, 2 x 4000 / 4 layers, or with
    reshard_after_forward off every weight, 4000; a stage without layers gathers its parameters as one."""
    config = model_config("gptplus", num_layers=4, hidden_size=128, num_attention_heads=4)
    layout = Layout(1, 1, 2, 2)

    def model_bytes(layers=4, bf16=True, **fsdp2):
        return stage_memory(config, layout, {0: (4000, 0)}, [layers], 256, 64, 1, 1, bf16=bf16,
                            distributed_optimizer=False, fsdp2=True, **fsdp2)[0].model_bytes

    assert model_bytes() == pytest.approx(4000 * 18 / 4 + 2 * 4000 / 4 * 2)
    assert model_bytes(reshard_after_forward=True) == model_bytes()
    assert model_bytes(reshard_after_forward=False) == pytest.approx(4000 * 18 / 4 + 4000 * 2)
    assert model_bytes(bf16=False) == pytest.approx(4000 * 16 / 4 + 2 * 4000 / 4 * 4)
    assert model_bytes(layers=0) == pytest.approx(4000 * 18 / 4 + 2 * 4000 * 2)
    assert bytes_per_parameter(True, False, 4) == 18  # FSDP2 only where asked


def test_without_sequence_parallelism_the_hidden_tensors_stay_whole_on_each_tp_rank():
    """TP 2 without SP: the embedding's output, the last stage's inputs, and full recompute's kept layer inputs
    are 64 tokens x 128 wide on each rank, not 128 / 2."""
    config = model_config("gptplus", num_layers=2, hidden_size=128, num_attention_heads=4)
    layout = Layout(2, 1, 1, 1)
    one_layer = layer_bytes(config, 64, tensor_parallel=2)
    stage = stage_memory(config, layout, {0: (0, 0)}, [2], 256, 64, 1, 1, bf16=True, distributed_optimizer=False)[0]
    assert stage.activation_bytes == pytest.approx(2 * one_layer + 64 * (128 * 2 + 8)
                                                   + 64 * (2 * 128 * 2 + 10 * 128))
    full = Layout(2, 1, 1, 1, recompute_granularity="full", recompute_num_layers=1)
    assert layers_activation_bytes(config, 2, 64, full, 2) == pytest.approx(2 * 64 * 128 * 2 + one_layer)


def test_an_interleaved_pipelines_stage_holds_megatron_cores_chunks():
    """VP 2 over PP 2 with 4 micro-batches: stage 0 holds in_flight(0, 2, 4, 2) of its layers' activations (checked
    against megatron-core above), more than 1F1B's 2."""
    config = model_config("gptplus", num_layers=4, hidden_size=128, num_attention_heads=4)
    first = stage_memory(config, Layout(1, 2, 1, 1, virtual_stages=2), {0: (0, 0), 1: (0, 0)}, [2, 2], 256, 64, 1,
                         4, bf16=True, distributed_optimizer=False)[0]
    assert first.micro_batches_in_flight == in_flight(0, 2, 4, 2) == 2.5
    assert first.activation_bytes == pytest.approx(2.5 * (2 * layer_bytes(config, 64) + 64 * (128 * 2 + 8)))


def modelled_step(config, layout, seq_length, global_batch, parameters, peak_flops, overlap, fsdp2=False,
                  reshard=True):
    """One step's parts as docs/scaling.md and layout_search's docstring describe them, written out here: every
    collective moves (n - 1) / n of its bytes per rank (an all-reduce twice that) at NVLink's bandwidth when its
    group fits in a node of 8, the network's otherwise; full recompute repeats the forward pass (3 passes). The
    data-parallel part: the distributed optimizer's fp32 gradients reduce-scattered and BF16 weights gathered once,
    FSDP2's BF16 weights gathered in each micro-batch's forward (and backward when resharded) and its BF16
    gradients reduce-scattered; an overlapped collective counts only beyond the compute."""
    tp, pp, cp, dp = layout.tensor_parallel, layout.pipeline_parallel, layout.context_parallel, layout.data_parallel
    micro_batches, world, layers = global_batch // dp, tp * pp * cp * dp, config.num_layers / pp

    def ring(nbytes, group, within_node):
        return nbytes * (group - 1) / group / ((NVLINK_GBPS if within_node else NETWORK_GBPS) * 1e9)

    passes = 3 if layout.recompute_granularity == "full" else 2
    hidden = seq_length / cp * config.hidden_size * 2  # one micro-batch of 1 sequence, [tokens, h] in BF16
    kv = config.kv_channels * (config.num_query_groups or config.num_attention_heads)
    compute = global_batch * seq_length * (model_flops_per_token(config, seq_length, 256) + recompute_flops_per_token(
        config, layout, seq_length)) / (world * peak_flops * MEASURED_MFU[config.model_family])
    if layout.recompute_granularity == "selective":  # the norms (the only elementwise choice here): 2h per token
        norms = seq_length / cp * 2 * config.hidden_size / (tp if layout.sequence_parallel else 1) * 2
        compute += micro_batches * layers * 2 * norms / (HBM_GBPS * 1e9)
    gather, reduce = ring(parameters * 2, dp * cp, world <= 8), ring(parameters * 4, dp * cp, world <= 8)
    if fsdp2:
        data = max(0.0, micro_batches * (3 if reshard else 2) * gather - compute)
    else:
        data = max(0.0, gather + reduce - compute) if overlap else gather + reduce
    return dict(
        compute=compute, bubble=compute * (pp - 1) / (micro_batches * (layout.virtual_stages or 1)),
        tensor_parallel=micro_batches * layers * 2 * passes * 2 * ring(hidden, tp, True),
        context_parallel=micro_batches * layers * passes * ring(seq_length * 2 * kv / tp * 2, cp, tp * cp <= 8),
        pipeline=(micro_batches * 2 * hidden / (tp if layout.sequence_parallel else 1)
                  / ((NVLINK_GBPS if tp * cp * pp <= 8 else NETWORK_GBPS) * 1e9)) if pp > 1 else 0,
        data_parallel=data)


@pytest.mark.parametrize("layout", [
    Layout(2, 2, 1, 2, virtual_stages=2, recompute_granularity="selective", recompute_modules=("layernorm",)),
    Layout(4, 4, 2, 1, sequence_parallel=True),  # CP's group of 8 GPUs in one node; PP's 32 across nodes
    Layout(8, 1, 2, 1, sequence_parallel=True),  # CP's group of 16 across nodes; no pipeline
    Layout(2, 1, 1, 4, recompute_granularity="full"),  # exactly one node of 8: DP within it
], ids=["VP 2, 8 GPUs", "TP 4 x CP 2 = 8", "TP 8 x CP 2 = 16", "full recompute, DP 4"])
def test_each_part_of_a_step_at_the_node_boundaries(layout):
    """Grouped attention (2 groups), micro-batches of 1 sequence of 64 tokens, a global batch of 8; 1000 weights a
    rank, whose collectives the compute hides when overlapped, and 1e9, whose collectives it does not; the
    distributed optimizer, and FSDP2 resharding after the forward pass or not."""
    config = model_config("gptplus", num_layers=8, hidden_size=256, num_attention_heads=8, num_query_groups=2)
    for overlap, parameters, (fsdp2, reshard) in itertools.product((False, True), (1000, 1e9),
                                                                   ((False, True), (True, True), (True, False))):
        assert step_seconds(config, layout, 256, 64, 8, 1, parameters, 1e12, overlap, overlap, fsdp2=fsdp2,
                            reshard_after_forward=reshard) == pytest.approx(
            modelled_step(config, layout, 64, 8, parameters, 1e12, overlap, fsdp2, reshard))


def test_fsdp2_gathers_each_micro_batchs_weights_and_reduce_scatters_their_gradients():
    """FSDP2 over DP 16 (two nodes: the network), a global batch of 64 sequences of 64 tokens in micro-batches of 1:
    4 per rank. Each collective moves 15/16 of a rank's 1e9 BF16 weights (2e9 bytes), or of their BF16 gradients:
    0.0417 s at 45 GB/s; three a micro-batch (forward gather, backward gather, reduce-scatter), two without
    resharding, at FP32 twice the bytes. FSDP2 overlaps them all: the compute hides its own seconds of them."""
    config = model_config("gptplus", num_layers=4, hidden_size=128, num_attention_heads=4)

    def data_parallel(layout, reshard=True, weight_bytes=2):
        return step_seconds(config, layout, 256, 64, 64, 1, 1e9, 1e12, False, False, weight_bytes=weight_bytes,
                            fsdp2=True, reshard_after_forward=reshard)["data_parallel"]

    collective = 2e9 * 15 / 16 / 45e9
    compute = 64 * 64 * model_flops_per_token(config, 64, 256) / (16 * 1e12 * MEASURED_MFU["gptplus"])
    assert collective == pytest.approx(0.041667, rel=1e-4) and compute < collective
    assert data_parallel(Layout(1, 1, 1, 16)) == pytest.approx(4 * 3 * collective - compute)
    assert data_parallel(Layout(1, 1, 1, 16), reshard=False) == pytest.approx(4 * 2 * collective - compute)
    assert data_parallel(Layout(1, 1, 1, 16), weight_bytes=4) == pytest.approx(4 * 3 * 2 * collective - compute)
    # The boundary: alone in its data-parallel group, a rank holds every weight: no FSDP2 collective at all.
    assert data_parallel(Layout(1, 1, 1, 1)) == 0
    assert data_parallel(Layout(2, 1, 1, 1, sequence_parallel=True)) == 0
    # Context parallelism shards too (FSDP2's group is data x context): CP 2 in one node, 64 micro-batches, half
    # the bytes at NVLink's 360 GB/s.
    cp2 = step_seconds(config, Layout(1, 1, 2, 1), 256, 64, 64, 1, 1e9, 1e12, False, False, fsdp2=True)
    assert cp2["data_parallel"] == pytest.approx(64 * 3 * 2e9 / 2 / 360e9 - cp2["compute"])


def test_an_overlapped_collective_counts_only_beyond_the_compute_it_runs_beside():
    """The distributed optimizer over DP 16 (the network), 1e9 weights a rank: fp32 gradients reduce-scattered
    (4e9 bytes) and BF16 weights gathered (2e9), 15/16 of each at 45 GB/s, once a step. Overlapped, the compute
    hides its own seconds of them; one overlapped, the other counts in full; at 1000 weights nothing is left."""
    config = model_config("gptplus", num_layers=4, hidden_size=128, num_attention_heads=4)
    reduce, gather = 4e9 * 15 / 16 / 45e9, 2e9 * 15 / 16 / 45e9
    compute = 64 * 64 * model_flops_per_token(config, 64, 256) / (16 * 1e12 * MEASURED_MFU["gptplus"])

    def data_parallel(overlap_grad_reduce, overlap_param_gather, parameters=1e9):
        return step_seconds(config, Layout(1, 1, 1, 16), 256, 64, 64, 1, parameters, 1e12, overlap_grad_reduce,
                            overlap_param_gather)["data_parallel"]

    assert data_parallel(False, False) == pytest.approx(reduce + gather)
    assert data_parallel(True, True) == pytest.approx(reduce + gather - compute)
    assert data_parallel(True, False) == pytest.approx(gather + reduce - compute)
    assert data_parallel(False, True) == pytest.approx(reduce + gather - compute)
    assert data_parallel(True, True, parameters=1000) == 0
    assert data_parallel(False, False, parameters=1000) == pytest.approx(1000 * 6 * 15 / 16 / 45e9)


def search_run(family="gptplus", layers=2, **sections):
    """A run of 64 GPUs' search: 4 heads (TP up to 4), 64 sequences of 64 tokens in micro-batches of 1, BF16, the
    distributed optimizer's collectives overlapped."""
    model = dict(model_family=family, num_layers=layers, hidden_size=128, num_attention_heads=4, seq_length=64)
    changes = dict(model=model, training=dict(global_batch_size=64, micro_batch_size=1), precision=dict(bf16=True),
                   parallel=dict(overlap_grad_reduce=True, overlap_param_gather=True))
    for section, fields in sections.items():
        changes[section] = {**changes.get(section, {}), **fields}
    return RunConfig().replace(**changes)


def searched(run, parameters=1e10):
    """The search over 64 GPUs, `parameters` weights in all (tensor-parallel), spread evenly over the stages."""
    model = run.model
    config = model_config(model.model_family, num_layers=model.num_layers, hidden_size=model.hidden_size,
                          num_attention_heads=model.num_attention_heads, fp16=run.precision.fp16)
    return search(config, run, 64, 256, 1e15, lambda split: {stage: (parameters / len(split), 0)
                                                              for stage in range(len(split))}, [(None, ())])


def test_the_search_shards_with_fsdp2_where_only_it_fits_and_the_distributed_optimizer_where_both_fit():
    """1e10 weights over 2 layers, 64 GPUs. The distributed optimizer keeps at least 6 bytes a weight over TP x PP
    (at most 4 x 2: 7.5e9 bytes), FSDP2 18 over all 64 GPUs plus a layer's weights and gradients gathered (2 x 2
    bytes x 1e10 / 4 / 2: 2.8e9 + 5e9): only FSDP2 fits between. Where both fit, the same layout (TP 4 x DP 16)
    steps faster under the distributed optimizer: FSDP2 moves each micro-batch's weights three times over the
    network, which the little compute of 64 tokens does not hide, the distributed optimizer once a step."""
    estimates, refusals = searched(search_run())
    estimates = [e for e in estimates if e.sharding in (FSDP2, DISTRIBUTED_OPTIMIZER)]  # Megatron-FSDP: below
    fsdp2 = [e for e in estimates if e.sharding == FSDP2]
    distributed = [e for e in estimates if e.sharding == DISTRIBUTED_OPTIMIZER]
    assert fsdp2 and len(distributed) == len(estimates) - len(fsdp2)
    smallest = min(e.peak_bytes for e in distributed)
    assert min(e.peak_bytes for e in fsdp2) < smallest
    tight = describe_ranking(estimates, smallest - 1)
    assert len(tight) > 3 and all(f" {FSDP2} " in line for line in tight[2:-1])
    assert f" {DISTRIBUTED_OPTIMIZER} " in describe_ranking(estimates, 1e15)[2]
    same = {e.sharding: e for e in estimates if e.layout == Layout(4, 1, 1, 16, sequence_parallel=True)}
    assert same[FSDP2].peak_bytes < same[DISTRIBUTED_OPTIMIZER].peak_bytes
    assert same[FSDP2].step_seconds > same[DISTRIBUTED_OPTIMIZER].step_seconds
    # A rank's 1e10 / 4 weights over DP 16 across nodes: FSDP2 4 micro-batches x 3 collectives of 2 bytes a weight,
    # the distributed optimizer 4 + 2 bytes once; the compute hides its own seconds of either.
    ring = 1e10 / 4 * 15 / 16 / 45e9
    assert same[FSDP2].overlapped == pytest.approx(4 * 3 * 2 * ring)
    assert same[DISTRIBUTED_OPTIMIZER].overlapped == pytest.approx((4 + 2) * ring)
    for estimate in same.values():
        assert estimate.seconds["data_parallel"] == pytest.approx(estimate.overlapped - estimate.seconds["compute"])
    assert {part: seconds for part, seconds in same[FSDP2].seconds.items() if part != "data_parallel"} == \
        {part: seconds for part, seconds in same[DISTRIBUTED_OPTIMIZER].seconds.items() if part != "data_parallel"}


def test_the_search_weighs_fsdp2_and_megatron_fsdp_only_without_pipeline_parallelism():
    """As angpt.config.validation has it: FSDP2 and Megatron-FSDP (each strategy alike) refuse pipeline parallelism
    and take context parallelism, sharding over the data x context ranks: a rank of TP 4 x CP 2 x DP 8 holds what
    one of TP 4 x DP 16 does."""
    estimates, refusals = searched(search_run())
    assert {e.layout.pipeline_parallel for e in estimates} == {1, 2}
    for sharding in (FSDP2, *MEGATRON_FSDP.values()):
        assert {e.layout.pipeline_parallel for e in estimates if e.sharding == sharding} == {1}
        assert {e.layout.context_parallel for e in estimates if e.sharding == sharding} == {1, 2, 4, 8, 16, 32}
        cp2, dp16 = ([e for e in estimates if e.sharding == sharding and e.layout == layout]
                     for layout in (Layout(4, 1, 2, 8, sequence_parallel=True),
                                    Layout(4, 1, 1, 16, sequence_parallel=True)))
        assert cp2[0].stages[0].model_bytes == dp16[0].stages[0].model_bytes
    assert {e.sharding for e in estimates if e.layout == Layout(1, 1, 1, 64)} == {DISTRIBUTED_OPTIMIZER, FSDP2,
                                                                                 *MEGATRON_FSDP.values()}
    fsdp2, megatron_fsdp = describe_refusals(refusals)
    assert fsdp2 == "  FSDP2 not weighed with PP 2: --use-torch-fsdp2 with pipeline parallelism (Megatron-LM's check)"
    assert megatron_fsdp.startswith("  Megatron-FSDP not weighed with PP 2: --use-megatron-fsdp with pipeline "
                                    "parallelism")


@pytest.mark.parametrize("family, sections, why", [
    ("gptplus", dict(model=dict(tie_embeddings_and_output_weights=True)), "with tied embeddings"),
    ("gpt", {}, "with tied embeddings"),  # gpt ties unless told otherwise
    ("gptplus", dict(precision=dict(bf16=False, fp16=True)), "with --fp16 (Megatron-LM's check)"),
    ("gptplus", dict(checkpoint=dict(ckpt_format="torch")), "with --ckpt-format torch"),
])
def test_the_search_never_weighs_fsdp2_where_the_run_refuses_it(family, sections, why):
    estimates, refusals = searched(search_run(family, **sections))
    assert estimates and all(e.sharding != FSDP2 for e in estimates)
    assert {pp for pp, _ in refusals[FSDP2]} == {1, 2} and why in refusals[FSDP2][1, 1]
    assert "pipeline parallelism" in refusals[FSDP2][2, 1]
    (line,) = [line for line in describe_refusals(refusals) if line.startswith("  FSDP2")]
    assert line.startswith("  FSDP2 not weighed: --use-torch-fsdp2 ") and why in line


def test_fsdp2_is_refused_in_the_parsers_words_and_only_where_the_parser_refuses_it():
    run = search_run()
    assert sharding_refusal(run, FSDP2, 1) is None
    assert sharding_refusal(run, FSDP2, 2) == "--use-torch-fsdp2 with pipeline parallelism (Megatron-LM's check)"
    # The run's own sharding is what FSDP2 replaces: given the distributed optimizer, FSDP2 is still weighed.
    assert sharding_refusal(search_run(parallel=dict(use_distributed_optimizer=True)), FSDP2, 1) is None
    assert sharding_refusal(search_run("gptplus", precision=dict(bf16=False)), FSDP2, 1) is None  # fp32
    assert sharding_refusal(search_run("gpt", model=dict(untie_embeddings_and_output_weights=True)), FSDP2, 1) is None


def test_megatron_fsdp_is_refused_in_the_parsers_words_and_only_where_the_parser_refuses_it():
    """Megatron-FSDP takes the distributed optimizer and fsdp_dtensor checkpoints, and the run's
    --overlap-grad-reduce and --overlap-param-gather (search_run gives both): weighed at PP 1 with any CP, whatever
    the run's own sharding or checkpoint format; the parser's refusals otherwise."""
    for strategy in MEGATRON_FSDP.values():
        for context_parallel in (1, 2):
            assert sharding_refusal(search_run(), strategy, 1, context_parallel) is None
        assert sharding_refusal(search_run(checkpoint=dict(ckpt_format="torch")), strategy, 1) is None
        assert sharding_refusal(search_run(parallel=dict(use_torch_fsdp2=True)), strategy, 1) is None
        assert sharding_refusal(search_run(), strategy, 2).startswith(
            "--use-megatron-fsdp with pipeline parallelism")
    estimates, refusals = searched(search_run(rerun=dict(check_weight_hash_across_dp_replicas_interval=1)))
    assert {e.sharding for e in estimates} & set(MEGATRON_FSDP.values()) == set(MEGATRON_FSDP.values()) - {
        MEGATRON_FSDP["optim_grads_params"]}
    # Refused otherwise by one strategy alone: each strategy's own line (the others' at PP 2).
    pipeline = sharding_refusal(search_run(), MEGATRON_FSDP["optim"], 2)
    assert [line for line in describe_refusals(refusals) if "Megatron-FSDP" in line] == [
        *(f"  {MEGATRON_FSDP[strategy]} not weighed with PP 2: {pipeline}"
          for strategy in ("no_shard", "optim", "optim_grads")),
        "  Megatron-FSDP optim_grads_params not weighed: --use-megatron-fsdp --data-parallel-sharding-strategy "
        "optim_grads_params with --check-weight-hash-across-dp-replicas-interval: its ranks hold different shards of "
        "the weights, no replicas (Megatron-LM's check)"]
    for taken in (dict(precision=dict(bf16=False, fp16=True)),  # taken at fp16 since
                  dict(parallel=dict(num_distributed_optimizer_instances=2))):  # and in hybrid sharding
        estimates, _ = searched(search_run(**taken))
        assert {e.sharding for e in estimates} >= set(MEGATRON_FSDP.values())


def test_megatron_fsdps_collectives_by_strategy():
    """Megatron-FSDP over DP 16 (two nodes: the network), 4 micro-batches a rank, 1e9 BF16 weights a rank with fp32
    gradients: each all-gather moves 15/16 of 2e9 bytes, each reduce-scatter of 4e9 (an all-reduce twice that), at
    45 GB/s. no_shard: an all-reduce a step, overlapped with the run's --overlap-grad-reduce; optim: a reduce-scatter
    and an all-gather a step, overlapped with the run's flags, as the distributed optimizer; optim_grads: a
    reduce-scatter a micro-batch, overlapped (Megatron-FSDP turns it on), the all-gather after the step with the
    run's --overlap-param-gather; optim_grads_params: per micro-batch two all-gathers and a reduce-scatter,
    overlapped."""
    gather, reduce = 2e9 * 15 / 16 / 45e9, 4e9 * 15 / 16 / 45e9

    def seconds(strategy, overlap=True):
        return data_parallel_seconds(Layout(1, 1, 1, 16), 4, 1e9, overlap, overlap, 4, 2, False, True, strategy)

    assert seconds("no_shard") == pytest.approx((0, 2 * reduce))
    assert seconds("no_shard", overlap=False) == pytest.approx((2 * reduce, 0))
    assert seconds("optim") == pytest.approx((0, reduce + gather))
    assert seconds("optim", overlap=False) == pytest.approx((reduce + gather, 0))
    assert seconds("optim_grads") == pytest.approx((0, gather + 4 * reduce))
    assert seconds("optim_grads", overlap=False) == pytest.approx((gather, 4 * reduce))
    assert seconds("optim_grads_params") == pytest.approx((0, 4 * (2 * gather + reduce)))
    assert seconds("optim_grads_params", overlap=False) == seconds("optim_grads_params")
    config = model_config("gptplus", num_layers=4, hidden_size=128, num_attention_heads=4)
    step = step_seconds(config, Layout(1, 1, 1, 16), 256, 64, 64, 1, 1e9, 1e12, False, False,
                        megatron_fsdp="optim_grads")
    assert step["data_parallel"] == pytest.approx(gather + 4 * reduce - step["compute"])
    # Alone in its data-parallel group, a rank moves nothing.
    assert data_parallel_seconds(Layout(8, 1, 1, 1), 4, 1e9, True, True, 4, 2, False, True,
                                 "optim_grads_params") == (0, 0)


def test_megatron_fsdp_is_weighed_with_the_runs_overlap_flags():
    """search_run's layout TP 4 x DP 16 (4 micro-batches a rank, 1e10 / 4 weights: 15/16 of a byte each over the
    network, `ring` s) with the run's --overlap-grad-reduce and --overlap-param-gather, and without: optim as the
    distributed optimizer either way; no_shard's all-reduce of fp32 gradients (2 x 4 bytes) overlapped or waited for
    as the run says; optim_grads_params overlapping its own (per micro-batch: two all-gathers, a reduce-scatter)."""
    ring = 1e10 / 4 * 15 / 16 / 45e9
    for overlap in (True, False):
        estimates, _ = searched(search_run(parallel=dict(overlap_grad_reduce=overlap, overlap_param_gather=overlap)))
        same = {e.sharding: e for e in estimates if e.layout == Layout(4, 1, 1, 16, sequence_parallel=True)}
        assert same[MEGATRON_FSDP["optim"]].seconds == same[DISTRIBUTED_OPTIMIZER].seconds
        assert same[MEGATRON_FSDP["optim"]].overlapped == pytest.approx(overlap * (4 + 2) * ring)
        assert same[MEGATRON_FSDP["no_shard"]].overlapped == pytest.approx(overlap * 2 * 4 * ring)
        assert same[MEGATRON_FSDP["no_shard"]].seconds["data_parallel"] == pytest.approx(
            (not overlap) * 2 * 4 * ring + max(0.0, overlap * 2 * 4 * ring - same[DISTRIBUTED_OPTIMIZER].seconds[
                "compute"]))
        assert same[MEGATRON_FSDP["optim_grads_params"]].overlapped == pytest.approx(4 * (2 * 2 + 4) * ring)


def test_the_ranking_names_megatron_fsdps_flags():
    estimates = [Estimate(Layout(1, 1, 1, 8), [StageMemory(0, 1, GIB, 0.0, 1)], dict(compute=1.0),
                          MEGATRON_FSDP["optim_grads"])]
    lines = describe_ranking(estimates, 2 * GIB)
    assert lines[2].split()[11:13] == ["Megatron-FSDP", "optim_grads"]
    assert lines[3] == ("  Megatron-FSDP optim_grads: --use-megatron-fsdp --data-parallel-sharding-strategy "
                        "optim_grads --ckpt-format fsdp_dtensor, with --use-distributed-optimizer and the run's "
                        "other flags")
    # Only the strategies shown are named.
    assert not any("optim_grads_params" in line for line in lines)
