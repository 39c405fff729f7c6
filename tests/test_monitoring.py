"""angpt.telemetry.monitoring: FLOPs and peaks, metrics.jsonl, TensorBoard, telemetry, the log line, the progress
bar, and the HealthProbe against norms computed by hand, alone and at TP 2 / PP 2."""

import io
import json
import math
import os
import sys
from types import SimpleNamespace

import pytest
import torch
from megatron.core.pipeline_parallel import get_forward_backward_func
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from angpt.models import model_config
from angpt.models.bounding import constrained_parameters
from angpt.telemetry.health import HealthProbe
from angpt.telemetry.metrics import MetricsLogger, ProgressBar, format_log_line
from angpt.telemetry.performance import DeviceTelemetry, memory_stats, model_flops_per_token, peak_flops_per_device
from angpt.training.distributed import set_random_seed
from angpt.training.step import build_model_chunks, forward_step

from conftest import ROOT, run_workers

sys.path.insert(0, os.path.join(ROOT, "tests", "distributed"))
from common import MICRO_BATCH, S, V, fixed_batches, small_config

# --- throughput -------------------------------------------------------------------------------------------


def test_model_flops_per_token_matches_hand_count():
    # d = 8, 2 heads of 4 sharing 1 key/value group, f = 32 per SwiGLU half, 2 layers, s = 16, V = 64.
    config = model_config("gptplus", num_layers=2, hidden_size=8, num_attention_heads=2, num_query_groups=1,
                          ffn_hidden_size=32)
    qkv = 2 * 8 * (8 + 4 + 4)
    attention_scores_and_values = 2 * (2 * 8 * 16 / 2)  # causal: s/2 keys per query on average
    attention_output = 2 * 8 * 8
    fc1 = 2 * 8 * 64
    fc2 = 2 * 32 * 8
    head = 2 * 8 * 64
    forward = 2 * (qkv + attention_scores_and_values + attention_output + fc1 + fc2) + head
    assert model_flops_per_token(config, seq_length=16, vocab_size=64) == 3 * forward == 16128


def test_peak_flops_by_device_name_and_precision():
    assert peak_flops_per_device(torch.bfloat16, "NVIDIA H100 80GB HBM3") == 989.5e12
    assert peak_flops_per_device(torch.float16, "NVIDIA H100 PCIe") == 756.5e12
    assert peak_flops_per_device(torch.bfloat16, "NVIDIA GH200 480GB") == 989.5e12
    assert peak_flops_per_device(torch.float8_e4m3fn, "NVIDIA H200") == 1979e12
    assert peak_flops_per_device(torch.bfloat16, "NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_flops_per_device(torch.float8_e4m3fn, "NVIDIA A100-SXM4-80GB") is None
    assert peak_flops_per_device(torch.bfloat16, "NVIDIA L40S") == 362e12
    assert peak_flops_per_device(torch.bfloat16, "NVIDIA L4") == 121e12
    assert peak_flops_per_device(torch.bfloat16, "NVIDIA GeForce GTX 1080") is None
    assert peak_flops_per_device(torch.float32, "NVIDIA A100-SXM4-80GB") == 19.5e12
    default = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")  # TF32 matmuls
    try:
        assert peak_flops_per_device(torch.float32, "NVIDIA A100-SXM4-80GB") == 156e12
    finally:
        torch.set_float32_matmul_precision(default)
    if not torch.cuda.is_available():
        assert peak_flops_per_device(torch.bfloat16) is None


# --- memory and telemetry ---------------------------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU behaviour")
def test_telemetry_and_memory_on_cpu_are_quiet(capsys):
    telemetry = DeviceTelemetry()
    assert telemetry.read() == {}
    assert telemetry.read() == {}
    assert capsys.readouterr() == ("", "")
    memory = memory_stats()
    assert set(memory) == {"memory_rss_gib"} and 0 < memory["memory_rss_gib"] < 1024


# --- metrics.jsonl, TensorBoard, log line, progress bar ---------------------------------------------------


def strict_json(line: str) -> dict:
    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")

    return json.loads(line, parse_constant=refuse)


def test_metrics_jsonl_is_valid_json_with_nan_and_appends_across_loggers(tmp_path):
    path = tmp_path / "run" / "metrics.jsonl"
    first = MetricsLogger(str(path), None, enabled=True)
    first.log({"kind": "train", "iteration": 1, "lm_loss": torch.tensor(5.5), "grad_norm": float("inf")})
    # Flushed per line: readable before close.
    assert strict_json(path.read_text().splitlines()[0])["lm_loss"] == 5.5
    first.log({"kind": "train", "iteration": 2, "lm_loss": float("nan"), "skipped": 1})
    first.close()
    resumed = MetricsLogger(str(path), None, enabled=True)
    resumed.log({"kind": "eval", "iteration": 2, "lm_loss": 5.25})
    resumed.close()
    MetricsLogger(str(path), None, enabled=False).log({"kind": "eval", "iteration": 3, "lm_loss": 1.0})

    records = [strict_json(line) for line in path.read_text().splitlines()]
    assert [(r["kind"], r["iteration"]) for r in records] == [("train", 1), ("train", 2), ("eval", 2)]
    assert records[0]["grad_norm"] is None and records[1]["lm_loss"] is None and records[1]["skipped"] == 1
    assert records[2]["lm_loss"] == 5.25
    assert all(isinstance(r["time"], float) for r in records)


def test_tensorboard_has_the_scalars(tmp_path):
    logger = MetricsLogger(None, str(tmp_path / "tb"), enabled=True)
    logger.log({"kind": "train", "iteration": 10, "lm_loss": 4.5, "lr": torch.tensor(3e-3),
                "health/residual_norm/layer_01": 1.25, "note": "not a number"})
    logger.log({"kind": "train", "iteration": 20, "lm_loss": 4.0, "lr": 2e-3})
    logger.log({"kind": "eval", "iteration": 20, "split": "validation", "lm_loss": 4.25})
    logger.log({"kind": "eval", "iteration": 20, "split": "test", "lm_loss": 4.375})  # the same step
    logger.close()

    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert set(events.Tags()["scalars"]) == {
        "train/lm_loss", "train/lr", "train/health/residual_norm/layer_01", "validation/lm_loss", "test/lm_loss"
    }
    assert [(e.step, e.value) for e in events.Scalars("train/lm_loss")] == [(10, 4.5), (20, 4.0)]
    assert [(e.step, e.value) for e in events.Scalars("validation/lm_loss")] == [(20, 4.25)]
    assert [(e.step, e.value) for e in events.Scalars("test/lm_loss")] == [(20, 4.375)]
    assert events.Scalars("train/lr")[0].value == pytest.approx(3e-3)


def test_log_line():
    record = {"kind": "train", "iteration": 10, "train_iters": 100, "consumed_tokens": 40960, "lm_loss": 5.1234,
              "global_batch_size": 32, "lr": 3e-3, "loss_scale": 65536.0, "grad_norm": 0.5123, "ms_per_step": 812.34,
              "tokens_per_s_per_device": 2521.4, "mfu": 0.4123, "memory_max_allocated_gib": 1.234, "skipped": 0,
              "health/rows_at_bound": 1.0}
    assert format_log_line(record) == (
        " iteration       10/     100 | consumed tokens: 40960 | global batch size: 32 | lm loss: 5.1234E+00"
        " | learning rate: 3.000E-03 | loss scale: 65536.0 | grad norm: 0.512 | ms per step: 812.3"
        " | tokens/s/device: 2521 | MFU: 41.2% | mem: 1.23 GiB | skipped: 0"
    )
    # Unknown MFU, a skipped step's missing grad norm, memory as RSS.
    del record["mfu"], record["memory_max_allocated_gib"]
    line = format_log_line({**record, "grad_norm": None, "memory_rss_gib": 0.5})
    assert "MFU" not in line and "grad norm" not in line and "mem: 0.50 GiB" in line
    assert format_log_line({"kind": "eval", "iteration": 10, "lm_loss": 5.0, "lm_loss_ppl": math.exp(5.0)}) == (
        " validation at iteration       10 | lm loss: 5.0000E+00 | lm loss PPL: 1.4841E+02"
    )


def test_progress_bar_without_terminal_prints_plain_lines(capsys):
    bar = ProgressBar(total=100, initial=10, enabled=True)  # pytest's stderr is not a terminal
    bar.update(1, {"loss": 5.0})
    bar.write("line one")
    bar.close()
    silent = ProgressBar(total=100, initial=0, enabled=False)
    silent.update(1)
    silent.write("not shown")
    silent.close()
    assert capsys.readouterr() == ("line one\n", "")


def test_progress_bar_on_a_terminal(monkeypatch, capsys):
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    bar = ProgressBar(total=100, initial=10, enabled=True)
    bar.update(5, {"loss": 5.0123456})
    bar.write("a log line")
    bar.close()
    assert "a log line\n" in capsys.readouterr().out
    assert "15/100" in terminal.getvalue() and "loss=5.012" in terminal.getvalue()


# --- HealthProbe ------------------------------------------------------------------------------------------


def build(family: str):
    return build_model_chunks(small_config(family), V, S)


def forward(chunks, probe=None):
    """Loss of the fixed micro-batches through megatron-core's schedule, inside probe.capture() if given."""
    batches = fixed_batches()

    def run():
        return get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(batches), model=chunks,
            num_microbatches=len(batches), seq_length=S, micro_batch_size=MICRO_BATCH, forward_only=True,
        )

    if probe is None:
        return torch.stack([loss["lm loss"] for loss in run()])
    with probe.capture():
        return torch.stack([loss["lm loss"] for loss in run()])


@torch.no_grad()
def norms_by_hand(model) -> dict[str, float]:
    """Mean norms over the fixed micro-batches, running the layers as NormalizedTransformerLayer.forward
    does, with the sums and token counts kept here."""
    sums, counts = {}, {}

    def add(name, x):
        norms = x.double().norm(dim=-1)
        sums[name] = sums.get(name, 0.0) + norms.sum().item()
        counts[name] = counts.get(name, 0) + norms.numel()

    for batch in fixed_batches():
        h = model.embedding(input_ids=batch["tokens"], position_ids=batch["position_ids"])
        rope = model.rotary_pos_emb(S)
        for layer in model.decoder.layers:
            name = f"layer_{layer.layer_number:02d}"
            attention, _ = layer.self_attention(h, attention_mask=None, rotary_pos_emb=rope)
            add(f"health/post_norm_input/attention/{name}", attention)
            h = layer.attention_residual(h, attention)  # which applies the post-norm
            mlp, _ = layer.mlp(h)
            add(f"health/post_norm_input/mlp/{name}", mlp)
            h = layer.mlp_residual(h, mlp)
            add(f"health/residual_norm/{name}", h)
    return {name: sums[name] / counts[name] for name in sums}


def hook_count(model) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def build_angpt_with_varied_alphas():
    """A seeded anGPT model whose alphas differ from layer to layer and from their initial value."""
    set_random_seed(1234)
    chunks = build("angpt")
    with torch.no_grad():
        for name, param in chunks[0].module.named_parameters():
            if name.endswith("alpha.s_hat"):
                param.uniform_(0.5 * param[0].item(), 3 * param[0].item())
    return chunks


@pytest.fixture(scope="module")
def angpt_chunks(single_process):
    return build_angpt_with_varied_alphas()


def test_health_probe_matches_norms_by_hand(angpt_chunks):
    model = angpt_chunks[0].module
    probe = HealthProbe(angpt_chunks)
    forward(angpt_chunks, probe)
    summary = probe.summary()

    expected = norms_by_hand(model)
    layers = [f"layer_{n:02d}" for n in range(1, model.config.num_layers + 1)]
    for layer in model.decoder.layers:
        name = f"layer_{layer.layer_number:02d}"
        expected[f"health/alpha_attention/{name}"] = layer.attention_residual.alpha().mean().item()
        expected[f"health/alpha_mlp/{name}"] = layer.mlp_residual.alpha().mean().item()
    expected["health/rows_at_bound"] = 1.0  # rows are normalized to exactly 1 at init
    assert set(summary) == set(expected)
    assert len([k for k in summary if k.startswith("health/residual_norm/")]) == len(layers)
    for name, value in expected.items():
        assert summary[name] == pytest.approx(value, rel=1e-5), name
    # The alphas really differ (the comparison above is not between initial values).
    alphas = [v for k, v in summary.items() if "alpha" in k]
    assert max(alphas) - min(alphas) > 1e-3
    # A second summary without a capture in between has no norms: the first one forgot them.
    assert not any("norm" in name for name in probe.summary())


def test_health_probe_costs_nothing_outside_capture(angpt_chunks):
    model = angpt_chunks[0].module
    hooks = hook_count(model)
    probe = HealthProbe(angpt_chunks)
    plain = forward(angpt_chunks)
    assert hook_count(model) == hooks
    assert not any("norm" in name for name in probe.summary())
    captured = forward(angpt_chunks, probe)
    assert hook_count(model) == hooks
    assert torch.equal(plain, captured)
    assert any("residual_norm" in name for name in probe.summary())


def test_rows_at_bound_drops_when_rows_shrink(angpt_chunks):
    model = angpt_chunks[0].module
    probe = HealthProbe(angpt_chunks)
    assert probe.summary()["health/rows_at_bound"] == 1.0
    fc1 = model.decoder.layers[0].mlp.linear_fc1.weight
    rows = sum(p.shape[0] for p in constrained_parameters([model]))
    original = fc1.detach().clone()
    try:
        with torch.no_grad():
            fc1[:10].mul_(0.5)
        assert probe.summary()["health/rows_at_bound"] == pytest.approx(1 - 10 / rows)
    finally:
        with torch.no_grad():
            fc1.copy_(original)


def test_health_probe_on_ngpt_reports_alpha_magnitudes_but_not_rows(single_process):
    chunks = build("ngpt")
    layer = chunks[0].module.decoder.layers[0]
    with torch.no_grad():
        layer.attention_residual.alpha.s_hat.neg_()  # nGPT's LERP uses |alpha|
    summary = HealthProbe(chunks).summary()
    assert "health/rows_at_bound" not in summary  # nGPT normalizes every row exactly
    name = f"health/alpha_attention/layer_{layer.layer_number:02d}"
    assert summary[name] > 0
    assert summary[name] == pytest.approx(layer.attention_residual.alpha().abs().mean().item())


def test_health_probe_on_gptplus_has_residual_norms_only(single_process):
    chunks = build("gptplus")
    probe = HealthProbe(chunks)
    forward(chunks, probe)
    summary = probe.summary()
    layers = chunks[0].module.config.num_layers
    assert sorted(summary) == [f"health/residual_norm/layer_{n:02d}" for n in range(1, layers + 1)]
    assert all(value > 0 for value in summary.values())


@pytest.mark.multiprocess
def test_health_probe_summary_at_tp2_and_pp2_equals_single_process(single_process, tmp_path):
    chunks = build_angpt_with_varied_alphas()
    model = chunks[0].module
    with torch.no_grad():
        # Rows inside the ball in a column-parallel weight and in a row-parallel one (whose rows are
        # split over TP ranks), so that rows_at_bound < 1.
        model.decoder.layers[0].mlp.linear_fc1.weight[5:20] *= 0.5
        model.decoder.layers[1].self_attention.linear_proj.weight[:7] *= 0.9
    probe = HealthProbe(chunks)
    forward(chunks, probe)
    reference = probe.summary()
    assert reference["health/rows_at_bound"] < 1

    torch.save({name: param.detach() for name, param in model.named_parameters()}, tmp_path / "weights.pt")
    output = run_workers("monitoring_worker.py", "--weights", str(tmp_path / "weights.pt"))
    results = [json.loads(line[len("RESULT "):]) for line in output.splitlines() if line.startswith("RESULT ")]
    assert [r["layout"] for r in results] == ["tp2_sequence_parallel", "pp2"]
    for result in results:
        summary = result["summary"]
        assert set(summary) == set(reference), result["layout"]
        for name, value in reference.items():
            assert summary[name] == pytest.approx(value, rel=1e-5), (result["layout"], name)


@pytest.mark.parametrize("fp8_format, margin, grad_max", [("hybrid", 0, 57344.0), ("e4m3", 1, 448.0)])
def test_health_probe_reports_the_amax_behind_each_fp8_scale(fp8_format, margin, grad_max, single_process):
    """Under delayed scaling TE sets scale = fp8_max / amax / 2^margin (E4M3's max 448 forward, E5M2's 57344
    backward in the hybrid format); the probe reads the amaxes back from the scales TE keeps per module."""
    chunks = build("gptplus")
    model = chunks[0].module
    model.config.fp8, model.config.fp8_margin = fp8_format, margin
    layer = model.decoder.layers[1]
    # Stand-ins for TE's state on one linear: input amax 2, weight amax 0.5, grad_output amax 8; the output
    # and grad_input columns are not reported.
    amax = {"input": 2.0, "weight": 0.5, "grad_output": 8.0}
    layer.self_attention.linear_qkv.fp8_meta = {
        "scaling_fwd": SimpleNamespace(scale=torch.tensor([448 / 2.0, 448 / 0.5, 7.0]) / 2**margin),
        "scaling_bwd": SimpleNamespace(scale=torch.tensor([grad_max / 8.0, 3.0]) / 2**margin),
        "recipe": "not a scaling state",
    }
    try:
        summary = HealthProbe(chunks).summary()
    finally:
        del layer.self_attention.linear_qkv.fp8_meta
        model.config.fp8, model.config.fp8_margin = None, 0
    name = f"layer_{layer.layer_number:02d}/self_attention.linear_qkv"
    reported = {key: value for key, value in summary.items() if "fp8" in key}
    assert reported == pytest.approx({f"health/fp8_amax_{operand}/{name}": value for operand, value in amax.items()})
