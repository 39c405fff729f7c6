"""benchmarks/gpu_throughput.py on a CPU in a tiny configuration: every code path that the GPU run takes
(micro-batch sizes, a global batch by gradient accumulation, kernels on and off, two variants, the profile's
busy fraction and operation count, JSON, Markdown and the kernel table), with ATen operators standing in for
GPU kernels. Not `gpu`: it runs everywhere."""

import importlib.util
import json
import os

import pytest

from conftest import ROOT

SCRIPT = os.path.join(ROOT, "benchmarks", "gpu_throughput.py")


def load_script():
    spec = importlib.util.spec_from_file_location("gpu_throughput", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow  # the benchmark end to end, 10 s on the CPU
def test_tiny_run_on_cpu_writes_every_measure(single_process, tmp_path):
    out = tmp_path / "throughput.json"
    rows = load_script().main([
        "--device", "cpu", "--shapes", "tiny", "--families", "gptplus", "angpt", "--precisions", "bf16",
        "--seq-length", "16", "--vocab-size", "128", "--micro-batch-size", "4", "2", "--global-batch-size", "8",
        "--global-micro-batch-size", "4",
        "--global-steps", "1", "--warmup", "1", "--steps", "1", "--profile-steps", "1", "--variant", "base=",
        "--variant", "clipped=--clip-grad 0.5", "--output", str(out), "--markdown", str(tmp_path / "table.md"),
        "--profile", str(tmp_path / "profile.txt")])

    # 2 variants x 2 families x (micro-batch 2, micro-batch 4, the global batch of 2 x 4) x kernels on/off.
    assert len(rows) == 24
    saved = json.loads(out.read_text())
    assert saved["rows"] == rows and saved["not_measured"] == [] and saved["variants"]["clipped"] == "--clip-grad 0.5"
    for row in rows:
        assert row["ms_per_step"] > 0 and row["tokens_per_s_per_gpu"] > 0
        assert row["mfu"] is None and row["peak_memory_gib"] is None  # no datasheet peak or CUDA memory on a CPU
        assert row["global_batch_size"] == row["micro_batch_size"] * row["num_microbatches"]
        assert row["num_microbatches"] == 1 or (row["global_batch_size"], row["micro_batch_size"]) == (8, 4)
        profiled = row["kernels"] == "on" and row["num_microbatches"] == 1
        assert ("device_busy_fraction" in row) == profiled
        if profiled:
            assert row["device_busy_fraction"] > 0 and row["device_ops_per_step"] > 100
        assert row["vs_gptplus"] > 0
        if row["family"] == "gptplus":
            assert row["vs_gptplus"] == 1
    angpt_ops = {row["device_ops_per_step"] for row in rows if row["family"] == "angpt"
                 and "device_ops_per_step" in row}
    gptplus_ops = {row["device_ops_per_step"] for row in rows if row["family"] == "gptplus"
                   and "device_ops_per_step" in row}
    assert min(angpt_ops) > max(gptplus_ops)  # anGPT's scales and nu(alpha) launch more operations
    table = (tmp_path / "table.md").read_text()
    assert table.startswith("| shape | family |") and len(table.splitlines()) == 2 + len(rows)
    assert (tmp_path / "profile.txt").read_text().count("== tiny") == 8
