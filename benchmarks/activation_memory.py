#!/usr/bin/env python
"""What one transformer layer keeps for its backward pass, per token, for each family: measured on the CPU with
the GPU's code path (issue 13: anGPT's peak memory should not exceed GPT+'s).

    python benchmarks/activation_memory.py [--hidden-size 256 --seq-length 256 --micro-batch-size 4]

Peak training memory is the weights, the optimizer state and, above all at long contexts, the activations
each layer saves for its backward pass. This script runs a forward pass with torch's saved-tensor hooks and
adds up the distinct storages saved (a tensor saved twice, say the residual stream that both the next linear
layer and the residual update keep, counts once), for a model of 2 layers minus one of 1 layer, so that the
embedding, the head and the loss drop out. "compiled" runs the fused chains the way a GPU does: every
`fused_on_gpu` function compiled (angpt.kernels.compiled_everywhere; torch.compile's partitioner decides what
they save), with megatron-core's SwiGLU and RoPE fusions on, as on a GPU by default. "eager" is the CPU path.
The figures are in units of one [tokens, hidden] tensor of the activations' dtype (fp32 here; the ratios
carry over to BF16), with the attention's own buffers included.
"""

import argparse
import contextlib
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from angpt import kernels  # noqa: E402
from angpt.megatron_compat import patches  # noqa: E402
from angpt.models import build_model, model_config  # noqa: E402
from angpt.training import distributed  # noqa: E402

FAMILIES = ("gptplus", "angpt", "ngpt")


def saved_bytes(model: torch.nn.Module, tokens: torch.Tensor) -> int:
    """Bytes of the distinct storages autograd saves during one forward pass of `model` (then a backward
    pass, so that compiled functions are exercised the way training runs them)."""
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    positions = torch.arange(tokens.shape[1] - 1).unsqueeze(0).expand(tokens.shape[0], -1)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = model(tokens[:, :-1], positions, None, labels=tokens[:, 1:]).mean()
    loss.backward()
    return sum(storages.values())


def per_layer(family: str, mode: str, args) -> float:
    """Saved [tokens, hidden] tensors per layer: the 2-layer model's bytes minus the 1-layer model's."""
    fusions = dict(apply_rope_fusion=True, bias_activation_fusion=True) if mode == "compiled" else {}
    counts = []
    for layers in (2, 1):
        distributed.set_random_seed(0)
        config = model_config(family, num_layers=layers, hidden_size=args.hidden_size,
                              num_attention_heads=args.num_attention_heads, **fusions)
        model = build_model(config, args.vocab_size, args.seq_length)
        tokens = torch.randint(0, args.vocab_size, (args.micro_batch_size, args.seq_length + 1),
                               generator=torch.Generator().manual_seed(0))
        with kernels.compiled_everywhere() if mode == "compiled" else contextlib.nullcontext():
            counts.append(saved_bytes(model, tokens))
    unit = args.micro_batch_size * args.seq_length * args.hidden_size * 4
    return (counts[0] - counts[1]) / unit


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--num-attention-heads", type=int, default=4)
    parser.add_argument("--seq-length", type=int, default=256)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--vocab-size", type=int, default=256)
    parser.add_argument("--families", nargs="+", choices=FAMILIES, default=list(FAMILIES))
    parser.add_argument("--modes", nargs="+", choices=("eager", "compiled"), default=["eager", "compiled"])
    args = parser.parse_args(argv)
    distributed.initialize()
    patches.install()
    results = {}
    print(f"saved for backward per layer, in [tokens, hidden] tensors (d={args.hidden_size}, "
          f"{args.micro_batch_size} x {args.seq_length} tokens, fp32):")
    for mode in args.modes:
        for family in args.families:
            results[(family, mode)] = per_layer(family, mode, args)
        ratios = ", ".join(f"{family} {results[(family, mode)]:.2f}" for family in args.families)
        print(f"  {mode:8}: {ratios}")
        if "gptplus" in args.families:
            print(f"  {'':8}  vs GPT+: " + ", ".join(
                f"{family} {results[(family, mode)] / results[('gptplus', mode)]:.3f}"
                for family in args.families if family != "gptplus"))
    return results


if __name__ == "__main__":
    main()
