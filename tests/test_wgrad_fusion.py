"""Gradient-accumulation fusion (megatron-core's `gradient_accumulation_fusion`, which
--defer-embedding-wgrad-compute turns on): angpt.megatron_compat.wgrad_fusion's stand-in for apex's kernel, and every
family's weight gradients through it, anGPT's logit scale s_Z included (angpt.models.layers.ScaledOutputLayer).
The deferral itself, in the pipeline's flush, trains in tests/test_megatron_configs_train.py."""

import importlib

import pytest
import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel import layers
from megatron.core.utils import drain_embedding_wgrad_compute

from angpt.megatron_compat import wgrad_fusion
from angpt.models import model_config
from angpt.training import distributed
from angpt.training.step import build_model_chunks

V, S, MB = 128, 16, 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_stand_in_adds_the_weight_gradient_to_main_grad_as_a_float64_product_does(dtype):
    """apex's wgrad_gemm_accum: main_grad [out, in] += grad_output [tokens, out]^T input [tokens, in], 16-bit operands
    accumulated in main_grad's fp32 (their products are exact in fp32; only the sums round)."""
    generator = torch.Generator().manual_seed(0)
    input = torch.randn(24, 8, generator=generator).to(dtype)
    grad_output = torch.randn(24, 5, generator=generator).to(dtype)
    main_grad = torch.randn(5, 8, generator=generator)
    expected = main_grad.double() + grad_output.double().t() @ input.double()
    wgrad_fusion.wgrad_gemm_accum(input, grad_output, main_grad)
    assert main_grad.dtype == torch.float32
    torch.testing.assert_close(main_grad.double(), expected, rtol=0, atol=24 * 2 * 2**-24 * expected.abs().max())


def test_megatron_cores_linear_layers_take_the_stand_in_without_apex():
    """megatron-core refuses to build a linear layer with gradient_accumulation_fusion unless its import of apex's
    extension succeeded; the flush imports it again by name."""
    wgrad_fusion.install()
    assert layers._grad_accum_fusion_available
    imported = importlib.import_module("fused_weight_gradient_mlp_cuda")
    assert imported.wgrad_gemm_accum_fp32 is wgrad_fusion.wgrad_gemm_accum
    assert imported.wgrad_gemm_accum_fp16 is wgrad_fusion.wgrad_gemm_accum


def main_grads(family: str, fusion: bool) -> dict[str, torch.Tensor]:
    """Each parameter's main_grad after one forward and backward of a seeded model, through megatron-core's DDP."""
    distributed.set_random_seed(1234)
    config = model_config(family, num_layers=2, hidden_size=64, num_attention_heads=4,
                          gradient_accumulation_fusion=fusion)
    (chunk,) = build_model_chunks(config, V, S)
    tokens = torch.randint(0, V, (MB, S + 1), generator=torch.Generator().manual_seed(1))
    loss = chunk(tokens[:, :-1], torch.arange(S).expand(MB, -1), None, labels=tokens[:, 1:]).sum()
    loss.backward()
    chunk.finish_grad_sync()
    return {name: param.main_grad.clone() for name, param in chunk.module.named_parameters()}


@pytest.mark.parametrize("family", ["gpt", "gptplus", "angpt", "ngpt"])
def test_every_weight_gradient_through_the_fusion_is_autograds(family, single_process):
    """The same seeded model and batch with and without the fusion: every main_grad (the linear layers' from the
    fused accumulation, the output layer's with s_Z applied to the logits rather than to W_head, s_Z's own) equals the
    unfused one to fp32 rounding of sums over the batch's 32 tokens."""
    wgrad_fusion.install()
    fused, unfused = main_grads(family, True), main_grads(family, False)
    assert fused.keys() == unfused.keys()
    assert any("output_layer.weight" in name for name in fused) or family == "gpt"  # gpt ties its output layer
    for name, grad in unfused.items():
        assert grad.abs().max() > 0, name
        torch.testing.assert_close(fused[name], grad, rtol=1e-5, atol=1e-6 * grad.abs().max().item(), msg=name)


def deferred_main_grads(family: str, defer: bool) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """main_grads after two micro-batches of a one-stage model configured for two pipeline stages (one layer; the
    deferral needs PP > 1 in the config), the output layer's weight gradients drained as megatron-core's schedule
    does at the flush; and that weight's main_grad before the drain."""
    distributed.set_random_seed(1234)
    config = model_config(family, num_layers=2, hidden_size=64, num_attention_heads=4, pipeline_model_parallel_size=2,
                          pipeline_dtype=torch.float32, share_embeddings_and_output_weights=False,
                          gradient_accumulation_fusion=True, defer_embedding_wgrad_compute=defer)
    (chunk,) = build_model_chunks(config, V, S)
    for seed in (1, 2):
        tokens = torch.randint(0, V, (MB, S + 1), generator=torch.Generator().manual_seed(seed))
        chunk(tokens[:, :-1], torch.arange(S).expand(MB, -1), None, labels=tokens[:, 1:]).sum().backward()
    output_layer = chunk.module.output_layer
    before = output_layer.weight.main_grad.clone()
    # The schedule's drain (finish_embedding_wgrad_compute) at a last stage, which with PP > 1 is never the first: its
    # shared_embedding_or_output_weight() would be the input embedding's here, where the one stage is both.
    if defer:
        drain_embedding_wgrad_compute(config, chunk.module.embedding_activation_buffer, output_layer.grad_output_buffer,
                                      output_layer.weight, parallel_state.get_tensor_model_parallel_group())
    chunk.finish_grad_sync()
    return {name: param.main_grad.clone() for name, param in chunk.module.named_parameters()}, before


@pytest.mark.parametrize("family", ["gpt", "angpt"])
def test_the_output_layers_deferred_weight_gradient_is_drained_into_main_grad(family, single_process):
    """Under --defer-embedding-wgrad-compute only the output layer defers (megatron-core's local linear layers would
    all try to: angpt.models.gpt): its main_grad stays zero through both backward passes, and after the flush's drain
    every main_grad equals the undeferred run's."""
    wgrad_fusion.install()
    deferred, before = deferred_main_grads(family, True)
    undeferred, _ = deferred_main_grads(family, False)
    assert torch.count_nonzero(before) == 0 and torch.count_nonzero(undeferred["output_layer.weight"]) > 0
    for name, grad in undeferred.items():
        assert grad.abs().max() > 0, name
        torch.testing.assert_close(deferred[name], grad, rtol=1e-5, atol=1e-6 * grad.abs().max().item(), msg=name)
