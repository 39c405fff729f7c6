#!/usr/bin/env python
"""The fused kernels against the eager PyTorch reference and torch.compile of it, measured side by side.

    python benchmarks/fused_kernels.py [--tokens 2048 --repeats 7 --layers 2]

- The nu-scaled SwiGLU at the MLP shapes of the 0.5B (d=1024, f=4096) and 1B (d=1280, f=5120) models
  (docs/model.md, Model shapes), for `--tokens` tokens: forward, backward (the gradients of [u; z], s_u and
  s_v), and both.
- The post-step projection of every weight of the 1B model (anGPT's bound, rows): `--layers` of its 36
  layers and the same share of its embedding and head rows, scaled up to the whole model.

Implementations alternate within each repeat so that machine noise hits all alike; each time is the median.
Effective bandwidth counts the bytes each fused kernel must read and write once, against a copy of a
buffer far larger than the caches (read + write) measured in the same run.
"""

import argparse
import statistics
import sys
import time

import torch

from angpt import kernels
from angpt.kernels import reference

MODELS = {"0.5B": dict(d=1024, f=4096, layers=24), "1B": dict(d=1280, f=5120, layers=36)}
VOCAB = 50304  # GPT-NeoX's ~50k, padded to a multiple of 128
FACTORS = (0.5, 3.73)  # nu_uz and nu_acf at f = 4d


def median_times(prepare: dict, repeats: int) -> dict:
    """{name: median seconds} of calls made alternately; prepare[name]() (untimed) returns the call."""
    times = {name: [] for name in prepare}
    for repeat in range(repeats + 1):  # the first round warms up (and compiles)
        for name, make_call in prepare.items():
            call = make_call()
            start = time.perf_counter()
            call()
            elapsed = time.perf_counter() - start
            if repeat:
                times[name].append(elapsed)
    return {name: statistics.median(values) for name, values in times.items()}


def copy_bandwidth(repeats: int) -> float:
    """Bytes per second of a 512 MB copy (read + write)."""
    source = torch.randn(128 * 2**20)
    target = torch.empty_like(source)
    seconds = median_times({"copy": lambda: lambda: target.copy_(source)}, repeats)["copy"]
    return 2 * source.numel() * source.element_size() / seconds


def benchmark_swiglu(tokens: int, repeats: int, stream: float, rows: list):
    generator = torch.Generator().manual_seed(0)
    for model, shape in MODELS.items():
        f = shape["f"]
        uz = torch.randn(tokens, 2 * f, generator=generator)
        s_u, s_v = torch.rand(f, generator=generator) + 0.5, 8 * torch.rand(f, generator=generator) - 4
        grad = torch.randn(tokens, f, generator=generator)
        functions = {
            "fused": kernels.scaled_swiglu,
            "eager": reference.scaled_swiglu,
            "compiled": torch.compile(reference.scaled_swiglu, dynamic=False),
        }

        def leaves():
            return [t.clone().requires_grad_() for t in (uz, s_u, s_v)]

        def forward(function):
            def call():
                with torch.no_grad():
                    function(uz, s_u, s_v, *FACTORS)
            return call

        def backward(function):
            out = function(*leaves(), *FACTORS)
            return lambda: out.backward(grad)

        def forward_backward(function):
            inputs = leaves()
            return lambda: function(*inputs, *FACTORS).backward(grad)

        times = {phase: median_times({name: (lambda fn=fn: prepare(fn)) for name, fn in functions.items()}, repeats)
                 for phase, prepare in (("forward", forward), ("backward", backward),
                                        ("forward+backward", forward_backward))}
        element = uz.element_size()
        traffic = {
            "forward": 3 * f * tokens * element,  # read [u; z], write a
            "backward": 5 * f * tokens * element,  # read [u; z] and grad, write grad [u; z]
        }
        traffic["forward+backward"] = traffic["forward"] + traffic["backward"]
        for phase, phase_times in times.items():
            rows.append((f"SwiGLU {model} {phase}", f"{tokens}x{2 * f}", phase_times,
                         traffic[phase] / phase_times["fused"] / stream))


def bounded_model_slice(layers: int) -> list[torch.Tensor]:
    """`layers` layers of the 1B model and the same share of its embedding and head rows (fp32 main
    parameters, vectors along rows), row norms from 0.9 to 1.1 as after an optimizer step: about half
    of the rows outside the unit ball."""
    d, f, total_layers = MODELS["1B"]["d"], MODELS["1B"]["f"], MODELS["1B"]["layers"]
    vocab_rows = VOCAB * layers // total_layers
    shapes = [(vocab_rows, d)] + [(3 * d, d), (d, d), (2 * f, d), (d, f)] * layers + [(vocab_rows, d)]
    generator = torch.Generator().manual_seed(1)
    weights = []
    for rows, cols in shapes:
        weight = torch.randn(rows, cols, generator=generator)
        norms = torch.empty(rows, 1).uniform_(0.9, 1.1, generator=generator)
        weights.append(weight / weight.norm(dim=1, keepdim=True) * norms)
    return weights


def bound_rows_(weight: torch.Tensor) -> None:
    """The reference projection of one whole weight, as a function torch.compile can fuse."""
    norms = weight.double().pow(2).sum(dim=1).sqrt()
    weight.mul_((1.0 / norms.clamp_min(1.0)).to(weight.dtype)[:, None])


def benchmark_projection(layers: int, repeats: int, stream: float, rows: list):
    initial = bounded_model_slice(layers)
    weights = [w.clone() for w in initial]
    pieces = [kernels.Piece(w.view(-1), 0, w.shape[1], True, 0) for w in weights]
    compiled = torch.compile(bound_rows_, dynamic=False)

    def from_initial(project):
        """Each call projects the same weights (restored untimed)."""
        def prepare():
            for weight, start in zip(weights, initial):
                weight.copy_(start)
            return project
        return prepare

    def compiled_all():
        for weight in weights:
            compiled(weight)

    times = median_times({
        "fused": from_initial(lambda: kernels.project_whole_(pieces, "bound")),
        "eager": from_initial(lambda: reference.project_whole_(pieces, "bound")),
        "compiled": from_initial(compiled_all),
    }, repeats)
    scale = MODELS["1B"]["layers"] / layers
    parameters = sum(w.numel() for w in weights) * scale
    # Every row is read; the rows outside the ball are written.
    outside = sum(int((w.norm(dim=1) > 1).sum()) * w.shape[1] for w in initial)
    traffic = (sum(w.numel() for w in weights) + outside) * weights[0].element_size()
    rows.append((f"projection 1B ({parameters / 1e9:.2f}B params)", f"{layers}/36 layers x{scale:g}",
                 {name: seconds * scale for name, seconds in times.items()}, traffic / times["fused"] / stream))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per SwiGLU call (micro-batch x sequence)")
    parser.add_argument("--layers", type=int, default=2, help="layers of the 1B model in the projection")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    if kernels.extension(torch.device("cpu")) is None:
        sys.exit("the fused kernels are not built: pip install --no-build-isolation -e .")

    stream = copy_bandwidth(args.repeats)
    rows = []
    benchmark_swiglu(args.tokens, args.repeats, stream, rows)
    benchmark_projection(args.layers, args.repeats, stream, rows)

    print(f"{torch.get_num_threads()} threads, copy bandwidth {stream / 1e9:.1f} GB/s (read + write), "
          f"median of {args.repeats}")
    header = (f"{'':<36} {'shape':<18} {'fused':>9} {'eager':>9} {'compiled':>9} "
              f"{'eager/fused':>11} {'compiled/fused':>14} {'fused GB/s of copy':>18}")
    print(header)
    for name, shape, times, bandwidth_share in rows:
        fused, eager, compiled = times["fused"], times["eager"], times["compiled"]
        print(f"{name:<36} {shape:<18} {fused * 1e3:>7.1f}ms {eager * 1e3:>7.1f}ms {compiled * 1e3:>7.1f}ms "
              f"{eager / fused:>10.2f}x {compiled / fused:>13.2f}x {bandwidth_share:>17.0%}")


if __name__ == "__main__":
    main()
