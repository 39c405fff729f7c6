"""The CUDA SwiGLU, forward and backward, inside a captured CUDA graph (issue 13): its backward takes its
workspace from torch's caching allocator (no cudaMallocAsync of its own), so a graph of a training step can
hold it. Replayed on new inputs, the graph gives exactly what the same kernels give eagerly. `gpu`."""

import pytest
import torch

from angpt import kernels

pytestmark = pytest.mark.gpu

FACTORS = (0.5, 3.7)  # nu_uz, nu_acf at f = 4d


def inputs(tokens, f, dtype, seed):
    generator = torch.Generator().manual_seed(seed)
    uz = torch.randn(tokens, 2 * f, generator=generator).to(dtype)
    s_u = torch.empty(f).uniform_(0.5, 2.0, generator=generator)
    s_v = torch.empty(f).uniform_(-4.0, 4.0, generator=generator)
    grad = torch.randn(tokens, f, generator=generator).to(dtype)
    return [t.cuda() for t in (uz, s_u, s_v, grad)]


def forward_backward(uz, s_u, s_v, grad):
    out = kernels.scaled_swiglu(uz, s_u, s_v, *FACTORS)
    return (out, *torch.autograd.grad(out, (uz, s_u, s_v), grad))


# 4096 wide in bf16 takes the 16-byte packs; 37 wide takes the scalar path.
@pytest.mark.parametrize("tokens,f,dtype", [(512, 4096, torch.bfloat16), (33, 37, torch.float32)])
def test_swiglu_replays_in_a_cuda_graph_exactly_as_eager(tokens, f, dtype):
    assert kernels.extension(torch.device("cuda")) is not None
    *static, static_grad = inputs(tokens, f, dtype, seed=0)
    static = [t.requires_grad_() for t in static]
    side = torch.cuda.Stream()  # warm up off the default stream before capture, as torch.cuda.graph asks
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            forward_backward(*static, static_grad)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = forward_backward(*static, static_grad)

    *fresh, fresh_grad = inputs(tokens, f, dtype, seed=1)
    with torch.no_grad():
        for target, source in zip([*static, static_grad], [*fresh, fresh_grad]):
            target.copy_(source)
    graph.replay()
    torch.cuda.synchronize()
    eager = forward_backward(*(t.requires_grad_() for t in fresh), fresh_grad)
    for name, replayed, expected in zip(("out", "grad uz", "grad s_u", "grad s_v"), captured, eager):
        assert torch.equal(replayed, expected), name
