"""Megatron-LM's activation offloading flags (--cpu-offloading-num-layers, --fine-grained-activation-offloading,
--offload-modules, --min-offloaded-tensor-size) and its optimizer offloading flags: on the CPU their parsing,
Megatron-LM's and megatron-core's checks at their boundaries, the fields megatron-core's TransformerConfig receives by
name, and the refusals of what needs CUDA; the `gpu` tests (tests/test_gpu_activation_offloading.py) what only a GPU
shows."""

import dataclasses

import pytest
import torch
from megatron.core import utils as megatron_utils
from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

from angpt.config import megatron_lm, transformer_engine_support
from angpt.config.arguments import parse_args
from angpt.training import megatron_configs
from angpt.training.megatron_configs import transformer_config

MOCK = ["--mock-data", "--vocab-size", "64", "--train-iters", "4", "--num-layers", "4"]
FINE = ["--model-family", "gpt", "--transformer-impl", "transformer_engine", "--fine-grained-activation-offloading"]


@pytest.fixture
def with_te(monkeypatch):
    """Transformer Engine taken as importable (it is not here), Transformer Engine < 2.10 (no NVTE_CPU_OFFLOAD_V1)."""
    monkeypatch.setattr(transformer_engine_support, "transformer_engine_error", lambda: None)
    monkeypatch.setattr(megatron_utils, "is_te_min_version", lambda version, *args, **kwargs: False)


def refusal(argv, capsys) -> str:
    with pytest.raises(SystemExit):
        parse_args([*MOCK, *argv], world_size=2 if "--pipeline-model-parallel-size" in argv else 1)
    return capsys.readouterr().err


@pytest.mark.parametrize("argv,message", [
    (["--cpu-offloading-num-layers", "-1"], "--cpu-offloading-num-layers -1 cannot be negative"),
    # megatron-core's TransformerConfig: fewer layers than --num-layers (4), no pipeline parallelism nor recompute.
    (["--cpu-offloading-num-layers", "4"], "--cpu-offloading-num-layers 4: CPU offloading can be done only for layers "
                                           "less than --num-layers 4 (megatron-core's check)"),
    (["--cpu-offloading-num-layers", "1", "--pipeline-model-parallel-size", "2"],
     "--cpu-offloading-num-layers with --pipeline-model-parallel-size 2: megatron-core has no CPU offloading"),
    (["--cpu-offloading-num-layers", "1", "--recompute-activations"],
     "--cpu-offloading-num-layers with activation recompute: CPU offloading does not work when activation "
     "recomputation is enabled (megatron-core's check)"),
    (["--cpu-offloading-num-layers", "1", "--recompute-granularity", "full"], "with activation recompute"),
    # Megatron-LM's validate_args and megatron-core's TransformerConfig.
    (["--model-family", "gpt", "--fine-grained-activation-offloading", "--offload-modules", "core_attn"],
     "--fine-grained-activation-offloading needs --transformer-impl transformer_engine (Megatron-LM's check"),
    ([*FINE], "--fine-grained-activation-offloading needs --offload-modules (megatron-core asserts some)"),
    ([*FINE, "--offload-modules", "attn_proj"], "--offload-modules attn_proj needs core_attn too"),
    ([*FINE, "--offload-modules", "core_attn", "expert_fc1"], "--offload-modules expert_fc1: a module of MoE layers, "
                                                               "and this model is dense"),
    ([*FINE, "--offload-modules", "core_attn", "--cpu-offloading-num-layers", "1"],
     "--fine-grained-activation-offloading cannot be enabled with --cpu-offloading-num-layers (megatron-core's check)"),
    ([*FINE, "--offload-modules", "mlp"], "invalid choice: 'mlp'"),
    (["--min-offloaded-tensor-size", "-1"], "--min-offloaded-tensor-size -1 cannot be negative"),
])
def test_megatron_lms_and_megatron_cores_checks_are_one_line_refusals(argv, message, with_te, capsys):
    assert message in refusal(argv, capsys)


@pytest.mark.parametrize("family", ["angpt", "ngpt"])
def test_fine_grained_offloading_is_refused_for_the_normalized_layers(family, with_te, capsys):
    """NormalizedTransformerLayer.forward has none of TransformerLayer's offload points (_forward_attention,
    _forward_mlp), which the offloading's group commits follow."""
    error = refusal(["--model-family", family, "--transformer-impl", "transformer_engine",
                     "--fine-grained-activation-offloading", "--offload-modules", "core_attn"], capsys)
    assert f"--fine-grained-activation-offloading with --model-family {family}: " in error
    assert "runs its own forward" in error


def test_without_transformer_engine_layer_offloading_is_refused(capsys):
    """megatron-core's TransformerBlock asserts Transformer Engine (its get_cpu_offload_context), not installed here."""
    assert transformer_engine_support.transformer_engine_error() is not None
    assert "--cpu-offloading-num-layers needs NVIDIA Transformer Engine" in refusal(
        ["--cpu-offloading-num-layers", "1"], capsys)


def test_transformer_engine_2_10_needs_the_v1_offloading(with_te, monkeypatch, capsys):
    """Megatron-LM's check: with Transformer Engine >= 2.10, NVTE_CPU_OFFLOAD_V1=1; 2.9 does not need it."""
    monkeypatch.delenv("NVTE_CPU_OFFLOAD_V1", raising=False)
    argv = [*FINE, "--offload-modules", "core_attn"]
    parse_args([*MOCK, *argv], world_size=1)  # Transformer Engine 2.9 (with_te)
    monkeypatch.setattr(megatron_utils, "is_te_min_version", lambda version, *args, **kwargs: version <= "2.10.0")
    assert "needs the environment variable NVTE_CPU_OFFLOAD_V1=1" in refusal(argv, capsys)
    monkeypatch.setenv("NVTE_CPU_OFFLOAD_V1", "1")
    parse_args([*MOCK, *argv], world_size=1)


def test_the_boundaries_are_taken(with_te, monkeypatch):
    """--cpu-offloading-num-layers 3 of 4 layers (the most), 0 (off), --min-offloaded-tensor-size 0, attn_proj with
    core_attn: each reaches megatron-core's config by name; cpu_offloading follows the layers, as Megatron-LM sets
    it."""
    monkeypatch.setattr(megatron_configs.torch.cuda, "is_available", lambda: True)

    def transformer_config(config):  # with CUDA taken as there, less the fusions that need Transformer Engine
        return megatron_configs.transformer_config(dataclasses.replace(
            config, fusion=dataclasses.replace(config.fusion, apply_rope_fusion=False)))

    config = transformer_config(parse_args([*MOCK, "--cpu-offloading-num-layers", "3"], world_size=1))
    assert (config.cpu_offloading, config.cpu_offloading_num_layers, config.fine_grained_activation_offloading) == (
        True, 3, False)
    assert (config.cpu_offloading_activations, config.cpu_offloading_weights) == (True, False)  # megatron-core's
    config = transformer_config(parse_args([*MOCK, "--cpu-offloading-num-layers", "0"], world_size=1))
    assert (config.cpu_offloading, config.cpu_offloading_num_layers, config.offload_modules) == (False, 0, [])
    config = transformer_config(parse_args([*MOCK, *FINE, "--offload-modules", "core_attn", "attn_proj",
                                            "--min-offloaded-tensor-size", "0"], world_size=1))
    assert (config.fine_grained_activation_offloading, config.offload_modules, config.min_offloaded_tensor_size,
            config.cpu_offloading) == (True, ["core_attn", "attn_proj"], 0, False)


@pytest.mark.parametrize("argv,flag", [
    (["--cpu-offloading-num-layers", "1"], "--cpu-offloading-num-layers"),
    ([*FINE, "--offload-modules", "attn_norm", "qkv_linear", "mlp_norm"], "--fine-grained-activation-offloading"),
])
def test_without_cuda_offloading_is_refused_in_one_line(argv, flag, with_te):
    config = parse_args([*MOCK, *argv], world_size=1)
    assert not torch.cuda.is_available()
    with pytest.raises(ValueError, match=f"^{flag} offloads activations to the host on CUDA streams: it needs a CUDA "
                                         "device; there is none here$"):
        transformer_config(config)


def test_the_fine_grained_details_alone_change_nothing_and_say_so():
    """Megatron-LM accepts --offload-modules and --min-offloaded-tensor-size without the offloading, and ignores them;
    Megatron-LM's default size says nothing."""
    config = parse_args([*MOCK, "--offload-modules", "core_attn", "--min-offloaded-tensor-size", "1"], world_size=1)
    assert [line for line in megatron_lm.notes(config, cuda=False) if "offload" in line] == [
        "--offload-modules: without --fine-grained-activation-offloading nothing is offloaded (as in Megatron-LM, "
        "nothing changes)",
        "--min-offloaded-tensor-size: without --fine-grained-activation-offloading nothing is offloaded (as in "
        "Megatron-LM, nothing changes)"]
    config = parse_args([*MOCK, "--min-offloaded-tensor-size", "1048576"], world_size=1)
    assert not [line for line in megatron_lm.notes(config, cuda=False) if "offload" in line]


@pytest.mark.parametrize("argv", [["--optimizer-cpu-offload"], ["--optimizer-offload-fraction", "0.5"],
                                  ["--use-torch-optimizer-for-cpu-offload"], ["--overlap-cpu-optimizer-d2h-h2d"],
                                  ["--no-pin-cpu-grads"], ["--no-pin-cpu-params"]])
def test_optimizer_offloading_is_refused_with_its_reason(argv, capsys):
    error = refusal(argv, capsys)
    assert "megatron-core's HybridDeviceOptimizer, which runs Adam on the host, needs CUDA" in error
    assert "--use-precision-aware-optimizer" in error


def test_megatron_lms_default_offload_fraction_asks_for_nothing():
    parse_args([*MOCK, "--optimizer-offload-fraction", "1.0"], world_size=1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the claim is about a machine without CUDA")
def test_megatron_cores_hybrid_device_optimizer_cannot_be_built_without_cuda():
    """The refusal's reason: the optimizer takes CUDA streams when built, even for weights already on the CPU."""
    weight = torch.nn.Parameter(torch.ones(4))
    with pytest.raises((AssertionError, RuntimeError), match="CUDA"):
        HybridDeviceOptimizer([{"params": [weight]}], offload_fraction=1.0, cpu_optimizer_cls=torch.optim.AdamW,
                              gpu_optimizer_cls=torch.optim.AdamW, param_update_in_fp32=True,
                              overlap_cpu_optimizer_d2h_h2d=False, lr=1e-3)
