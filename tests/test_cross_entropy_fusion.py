"""megatron-core's fused cross-entropy (--cross-entropy-loss-fusion) behind each family's output layer and logit
scale: the loss and gradients of the unfused path, and the flags that choose it."""

import time

import pytest
import torch
from megatron.core.models.common.language_module import language_module

from angpt.config import transformer_engine_support
from angpt.config.arguments import parse_args
from angpt.models import build_model, model_config
from angpt.training import distributed
from angpt.training.megatron_configs import transformer_config

V, S, MB = 128, 16, 2
FLAGS = ["--train-iters", "1", "--mock-data", "--vocab-size", str(V)]


def loss_and_grads(family: str, fused: bool):
    """The per-token losses of one bf16 batch and the gradients of their sum, the model seeded the same."""
    distributed.set_random_seed(1234)
    config = model_config(family, num_layers=2, hidden_size=64, num_attention_heads=4, bf16=True,
                          params_dtype=torch.bfloat16, cross_entropy_loss_fusion=fused)
    model = build_model(config, V, S)
    tokens = torch.randint(0, V, (MB, S + 1), generator=torch.Generator().manual_seed(0))
    loss = model(tokens[:, :-1], torch.arange(S).expand(MB, -1), None, labels=tokens[:, 1:])
    loss.sum().backward()
    return loss.detach(), {name: param.grad.float() for name, param in model.named_parameters()}


@pytest.mark.slow
@pytest.mark.parametrize("family", ["angpt", "ngpt", "gptplus"])
def test_the_fused_cross_entropy_gives_the_unfused_loss_and_gradients(family, seeded, monkeypatch):
    """Both paths compute the loss in fp32 from the same bf16 logits (times s_Z) and hand back the logits'
    gradient in bf16. The first call compiles megatron's kernels with Inductor (seconds when its cache is warm,
    ~30 s cold on 2 cores); the three families share them (same shapes)."""
    calls = []
    fused = language_module.fused_vocab_parallel_cross_entropy
    monkeypatch.setattr(language_module, "fused_vocab_parallel_cross_entropy",
                        lambda *args: calls.append(1) or fused(*args))
    unfused_loss, unfused_grads = loss_and_grads(family, fused=False)
    assert not calls
    start = time.perf_counter()
    fused_loss, fused_grads = loss_and_grads(family, fused=True)
    print(f"{family}: fused forward and backward in {time.perf_counter() - start:.1f} s")
    assert calls
    assert fused_loss.dtype == unfused_loss.dtype == torch.float32
    # fp32 log-sum-exp over V terms summed in another order: a few ulps of the loss (~5).
    torch.testing.assert_close(fused_loss, unfused_loss, rtol=2**-20, atol=0)
    assert unfused_grads.keys() == fused_grads.keys()
    for name, grad in unfused_grads.items():
        # An fp32 difference in the logits' gradient may round to the other neighbouring bf16 value: one bf16
        # ulp (2**-8 relative) in a few entries, carried linearly into every gradient.
        difference = torch.linalg.vector_norm(fused_grads[name] - grad)
        assert difference <= 2**-8 * torch.linalg.vector_norm(grad), name


def test_the_fusion_defaults_to_on_only_with_bf16_on_a_gpu():
    on_gpu = torch.cuda.is_available()
    fp32 = transformer_config(parse_args(FLAGS, world_size=1))
    bf16 = transformer_config(parse_args([*FLAGS, "--bf16", "--use-distributed-optimizer"], world_size=1))
    assert not fp32.cross_entropy_loss_fusion
    assert bf16.cross_entropy_loss_fusion == on_gpu
    chosen = transformer_config(parse_args([*FLAGS, "--bf16", "--use-distributed-optimizer",
                                            "--cross-entropy-loss-fusion"], world_size=1))
    assert chosen.cross_entropy_loss_fusion and chosen.cross_entropy_fusion_impl == "native"
    off = transformer_config(parse_args([*FLAGS, "--bf16", "--use-distributed-optimizer",
                                         "--no-cross-entropy-loss-fusion"], world_size=1))
    assert not off.cross_entropy_loss_fusion


def test_the_fusion_in_fp32_is_refused(capsys):
    with pytest.raises(SystemExit):
        parse_args([*FLAGS, "--cross-entropy-loss-fusion"], world_size=1)
    assert "--cross-entropy-loss-fusion needs --bf16" in capsys.readouterr().err


def test_transformer_engines_fusion_is_refused_without_it(capsys):
    if transformer_engine_support.transformer_engine_error() is None:
        pytest.skip("Transformer Engine is installed here")
    with pytest.raises(SystemExit):
        parse_args([*FLAGS, "--bf16", "--use-distributed-optimizer", "--cross-entropy-fusion-impl", "te"],
                   world_size=1)
    error = capsys.readouterr().err
    assert "--cross-entropy-fusion-impl te needs NVIDIA Transformer Engine" in error and error.count("\n") == 1
