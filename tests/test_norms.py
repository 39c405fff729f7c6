"""GPT+'s RMSNorm (angpt.models.norms): the kernel compiled for GPUs and torch's RMSNorm used elsewhere both
compute RMSNorm as its definition states it."""

import pytest
import torch

from angpt.models import norms

EPS = 1e-5


def definition(x, weight):
    """weight * x / sqrt(mean(x^2) + eps) over the last dimension, in float64."""
    return weight * x / torch.sqrt((x * x).mean(-1, keepdim=True) + EPS)


def value_and_grads(function, x, weight):
    x, weight = x.detach().requires_grad_(), weight.detach().requires_grad_()
    out = function(x, weight)
    cotangent = torch.linspace(-1, 1, out.numel(), dtype=torch.float64).view_as(out)
    return (out.double(), *torch.autograd.grad((out.double() * cotangent).sum(), (x, weight)))


@pytest.mark.slow
@pytest.mark.parametrize("width", [64, 1024])  # QK-norm's head dimension, a hidden size
def test_rms_norm_compiled_and_eager_equal_the_definition(width):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(8, 3, width, generator=generator, dtype=torch.float64) * 3
    weight = 1 + 0.2 * torch.randn(width, generator=generator, dtype=torch.float64)
    expected = value_and_grads(definition, x, weight)
    for name, rms_norm in (("compiled", norms.rms_norm.compiled), ("eager", norms.rms_norm)):
        got = value_and_grads(lambda x, w: rms_norm(x, w, EPS), x.float(), weight.float())
        assert not norms.rms_norm.compile_failures
        for a, b, what in zip(got, expected, ("value", "x gradient", "weight gradient")):
            # fp32 arithmetic: a few units of round-off, relative to the largest entry.
            torch.testing.assert_close(a.double(), b, rtol=0, atol=1e-5 * b.abs().max().item(),
                                       msg=lambda message: f"{name} {what}: {message}")
