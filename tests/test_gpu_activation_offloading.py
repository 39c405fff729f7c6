"""Activation offloading on a GPU with Transformer Engine (benchmarks/gpu_checks.sh --te): a few training steps of
each family that takes it give the same losses with and without offloading, and the peak CUDA memory of each is
printed (the tiny model's activations are small beside its weights and optimizer state: the figures are a check that
it ran, not a measurement). Skipped without CUDA or Transformer Engine."""

import pytest
import torch
from test_gpu_training import train

from angpt.config.transformer_engine_support import transformer_engine_error

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(transformer_engine_error() is not None, reason="needs Transformer Engine")]

STEPS = 4


def losses_and_peak(family, **overrides):
    torch.cuda.reset_peak_memory_stats()
    losses, _, _ = train(family, STEPS, bf16=True, transformer_impl="transformer_engine", **overrides)
    return losses, torch.cuda.max_memory_allocated() / 2**20


@pytest.mark.parametrize("family", ["gpt", "gptplus", "angpt", "ngpt"])
def test_layer_offloading_trains_as_without_it(family):
    """--cpu-offloading-num-layers 1 of 2 (megatron-core's cpu_offloading on Transformer Engine's context): the
    offloaded tensors come back unchanged, so the steps are the same."""
    plain, plain_peak = losses_and_peak(family)
    offloaded, offloaded_peak = losses_and_peak(family, cpu_offloading=True, cpu_offloading_num_layers=1)
    print(f"{family} --cpu-offloading-num-layers 1: peak {offloaded_peak:.1f} MiB, without {plain_peak:.1f} MiB")
    torch.testing.assert_close(offloaded, plain, rtol=0, atol=0)


@pytest.mark.parametrize("family", ["gpt", "gptplus"])
def test_fine_grained_offloading_trains_as_without_it(family, monkeypatch):
    """--fine-grained-activation-offloading --offload-modules core_attn attn_proj mlp_norm (Megatron-LM's setting of
    NVTE_CPU_OFFLOAD_V1 with Transformer Engine >= 2.10)."""
    monkeypatch.setenv("NVTE_CPU_OFFLOAD_V1", "1")
    plain, plain_peak = losses_and_peak(family)
    offloaded, offloaded_peak = losses_and_peak(family, fine_grained_activation_offloading=True,
                                                offload_modules=["core_attn", "attn_proj", "mlp_norm"],
                                                min_offloaded_tensor_size=0)
    print(f"{family} --fine-grained-activation-offloading: peak {offloaded_peak:.1f} MiB, without "
          f"{plain_peak:.1f} MiB")
    torch.testing.assert_close(offloaded, plain, rtol=0, atol=0)
