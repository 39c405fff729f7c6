"""The dry run's memory estimate (angpt.training.memory_estimate) and layout search (angpt.training.layout_search)
against what the H200 measured, Megatron-LM's own schedule arithmetic, and the boundaries of their verdicts."""

import json
import os

import pytest

from angpt.config.sections import PrecisionSection
from angpt.models import model_config
from angpt.models.activation_memory import layer_bytes
from angpt.training.dry_run import memory_report
from angpt.training.layout_search import candidate_layouts
from angpt.training.memory_estimate import GIB, Layout, in_flight, stage_memory

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
