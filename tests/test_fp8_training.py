"""benchmarks/fp8_training.py: its summary of the FP8 amax figures against values worked out by hand, and the
script end to end on the CPU (BF16 on the local layers; FP8 needs Transformer Engine on a GPU)."""

import json
import os
import sys

import pytest

from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import fp8_training  # noqa: E402


def test_summary_of_losses_and_amaxes():
    name = "health/fp8_amax_{}/layer_{:02d}/self_attention.linear_qkv"
    records = [{"kind": "start", "iteration": 0}]
    # Two layers' input amaxes over three logs: layer 1 1, 2, 3; layer 2 4, 4, 12; weights 0.5 and 1 throughout;
    # no grad_output figures (reported only where logged); a zero amax (a scale not set yet) is left out.
    for step, (a, b) in enumerate([(1.0, 4.0), (2.0, 4.0), (3.0, 12.0)], start=1):
        records.append({"kind": "train", "iteration": 10 * step, "lm_loss": 5.0 - step, "ms_per_step": 100.0 * step,
                        name.format("input", 1): a, name.format("input", 2): b,
                        name.format("weight", 1): 0.5, name.format("weight", 2): 1.0 if step > 1 else 0.0})
    records.append({"kind": "eval", "split": "validation", "iteration": 30, "lm_loss": 2.5})
    summary = fp8_training.summarize(records)
    assert summary["iterations"] == [10, 20, 30] and summary["losses"] == [4.0, 3.0, 2.0]
    assert summary["final_train_loss"] == pytest.approx(3.0) and summary["final_valid_loss"] == 2.5
    assert summary["ms_per_step"] == 250.0  # the median without the first log
    assert summary["amax_input"] == pytest.approx(dict(tensors=2, min=1.0, max=12.0, range=12.0,
                                                       final_range_over_layers=4.0, max_growth_between_logs=3.0))
    assert summary["amax_weight"] == pytest.approx(dict(tensors=2, min=0.5, max=1.0, range=2.0,
                                                        final_range_over_layers=2.0, max_growth_between_logs=1.0))
    assert "amax_grad_output" not in summary

    runs = {("angpt", "bf16"): summary, ("angpt", "fp8"): dict(summary, final_valid_loss=2.5 * 1.004)}
    table, markdown = fp8_training.report(runs)
    assert table["angpt-fp8"]["fp8_relative_gap"] == pytest.approx(0.004)
    assert "| angpt | fp8 | 3.0000 | 2.5100 | +0.40% | 250.0 |" in markdown
    assert "| angpt | input | 2 | 1-12 | 12.0x | 4.0x | 3.00x |" in markdown


@pytest.mark.slow
def test_bf16_runs_end_to_end_on_the_cpu(pydoc_corpus, tmp_path, capsys):
    argv = ["--corpus", str(pydoc_corpus), "--output-dir", str(tmp_path), "--transformer-impl", "local",
            "--precisions", "bf16", "--families", "gptplus", "--train-iters", "4", "--num-layers", "2",
            "--hidden-size", "64", "--num-attention-heads", "2", "--seq-length", "32", "--micro-batch-size", "4",
            "--log-interval", "2", "--eval-iters", "1"]
    fp8_training.main(argv)
    report = json.loads((tmp_path / "fp8_training.json").read_text())
    assert sorted(report["runs"]) == ["gptplus-bf16"]
    for summary in report["runs"].values():
        assert summary["iterations"] == [2, 4]
        assert 0 < summary["final_valid_loss"] < 10 and 0 < summary["final_train_loss"] < 10
    # A second invocation reuses the finished runs.
    capsys.readouterr()
    fp8_training.main(argv)
    assert capsys.readouterr().out.count("finished earlier, reused") == 1
    with pytest.raises(SystemExit):
        fp8_training.parse_args(["--output-dir", str(tmp_path), "--corpus", str(tmp_path)])
