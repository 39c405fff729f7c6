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
Core attention runs as on a GPU (--attention-backend flash: torch's SDPA keeps its inputs, output and
log-sum-exp, not the [s, s] scores; unfused is megatron-core's local attention, the CPU's default). The
figures are in units of one [tokens, hidden] tensor of the activations' dtype (fp32 here; the ratios carry
over to BF16); the weights linear layers save are the parameters themselves and are not counted. Beside
the compiled figures stands the dry run's estimate (angpt.models.activation_memory), which
tests/test_memory_estimate.py holds within 10% of them.

    python benchmarks/activation_memory.py --recompute [--modes eager] [--markdown table.md]

adds, for each family, what a layer keeps with each activation recompute setting (docs/guide.md, Activation
recompute): none, each `--recompute-modules` choice the family has alone, core_attn+mlp, the cheap norms alone
(layernorm+qk_norm for GPT+, qk_norm+residual_update for anGPT and nGPT), all of the family's choices, and
`--recompute-granularity full` (uniform, 1 layer). Kept: measured as above, in units and in MiB for the given
sizes (a storage that CheckpointWithoutOutput frees after use counts as freed). Recomputed: FLOPs per layer
counted from the shapes (T = micro-batch x sequence tokens, s the sequence, d hidden, f ffn hidden = 4d; a
multiply-add is 2 FLOPs, an elementwise op 1 per element, and a whole attention matrix counted as the unfused
kernel computes it, causal half included):
    core_attn        4 T s d (q k^T and the context) + 5 T s h (scale, mask, softmax: max, exp, sum, divide)
                     + for anGPT and nGPT the QK normalization inside it (qk_norm below)
    mlp              6 T d f (fc1, 2f wide, and fc2) + 6 T f (SwiGLU: SiLU 4, product, scales)
    layernorm        2 x 4 T d (GPT+'s two pre-RMSNorms: square, sum, scale, weight)
    qk_norm          anGPT/nGPT: 2 x 8 T d (q and k: RoPE 3, L2 norm 4, s_qk 1); GPT+: 2 x 4 T d (RMSNorm)
    residual_update  2 x 8 T d (two updates: post-norm 4, LERP 4; anGPT's and nGPT's)
    full             the layer's whole forward pass: 2 T d (3d + d) for W_qkv and W_p + core_attn + mlp + the
                     norms and updates of the family (layernorm + qk_norm, or qk_norm + residual_update)
The last column puts that against a layer's forward and backward pass without recompute, 3 x (full).
"""

import argparse
import contextlib
import os
import sys

import torch
from megatron.core import parallel_state
from megatron.core.transformer.enums import AttnBackend

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from angpt import kernels  # noqa: E402
from angpt.config.choices import RECOMPUTE_MODULES, recompute_module_refusal  # noqa: E402
from angpt.megatron_compat import patches  # noqa: E402
from angpt.models import build_model, model_config  # noqa: E402
from angpt.models.activation_memory import layer_bytes  # noqa: E402
from angpt.models.attention import clear_attention_backend_environment  # noqa: E402
from angpt.training import distributed  # noqa: E402

FAMILIES = ("gptplus", "angpt", "ngpt")
FULL = "full"


def saved_bytes(model: torch.nn.Module, tokens: torch.Tensor) -> int:
    """Bytes of the distinct storages autograd saves during one forward pass of `model`, their sizes read
    after it (CheckpointWithoutOutput frees the outputs it recomputes); then a backward pass, so that compiled
    functions are exercised the way training runs them."""
    storages: dict[int, torch.UntypedStorage] = {}
    # The weights a linear layer saves are the parameters themselves (BF16 on a GPU), counted as the model's
    # weights, not as activations.
    weights = {param.untyped_storage().data_ptr() for param in model.parameters()}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in weights:
            storages[storage.data_ptr()] = storage
        return tensor

    positions = torch.arange(tokens.shape[1] - 1).unsqueeze(0).expand(tokens.shape[0], -1)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = model(tokens[:, :-1], positions, None, labels=tokens[:, 1:]).mean()
    kept = sum(storage.nbytes() for storage in storages.values())
    loss.backward()
    return kept


def recompute_settings(family: str) -> dict[str, object]:
    """label -> FULL, or the tuple of --recompute-modules (() for no recompute)."""
    own = tuple(module for module in RECOMPUTE_MODULES if recompute_module_refusal(module, family) is None)
    norms = ("layernorm", "qk_norm") if family == "gptplus" else ("qk_norm", "residual_update")
    settings = {"none": (), **{module: (module,) for module in own}}
    for modules in (("core_attn", "mlp"), norms, own):
        settings[",".join(modules)] = modules
    settings[FULL] = FULL
    return settings


def recompute_overrides(setting) -> dict:
    if setting == FULL:
        return dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    if setting:
        return dict(recompute_granularity="selective", recompute_modules=list(setting))
    return {}


def recompute_flops(family: str, setting, tokens: int, seq: int, hidden: int, heads: int) -> int:
    """FLOPs one layer recomputes in the backward pass (the formulas of the module docstring)."""
    ffn = 4 * hidden
    norm_per_element = 4 if family == "gptplus" else 8
    parts = {
        "core_attn": 4 * tokens * seq * hidden + 5 * tokens * seq * heads,
        "mlp": 6 * tokens * hidden * ffn + 6 * tokens * ffn,
        "layernorm": 2 * 4 * tokens * hidden,
        "qk_norm": 2 * norm_per_element * tokens * hidden,
        "residual_update": 2 * 8 * tokens * hidden,
    }
    if family != "gptplus":  # the QK normalization is inside core attention there
        parts["core_attn"] += parts["qk_norm"]
    if setting == FULL:
        norms = ("layernorm", "qk_norm") if family == "gptplus" else ("residual_update",)  # qk_norm: in core_attn
        return 2 * tokens * hidden * 4 * hidden + parts["core_attn"] + parts["mlp"] + sum(parts[n] for n in norms)
    modules = set(setting)
    if family != "gptplus" and "core_attn" in modules:
        modules.discard("qk_norm")  # recomputed once, with core attention
    return sum(parts[module] for module in modules)


@contextlib.contextmanager
def attention_environment():
    """megatron-core exports a config's attention backend as NVTE_* variables and checks them when it builds the
    model: cleared before each config and after, so that no other model built in this process (a test's) sees
    this script's backend."""
    clear_attention_backend_environment()
    try:
        yield
    finally:
        clear_attention_backend_environment()


def layer_config(family: str, args, **overrides):
    return model_config(family, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
                        num_query_groups=args.num_query_groups, attention_backend=AttnBackend[args.attention_backend],
                        **overrides)


def per_layer(family: str, mode: str, args, recompute=()) -> float:
    """Saved [tokens, hidden] tensors per layer: the 2-layer model's bytes minus the 1-layer model's."""
    fusions = dict(apply_rope_fusion=True, bias_activation_fusion=True) if mode == "compiled" else {}
    counts = []
    for layers in (2, 1):
        distributed.set_random_seed(0)
        with attention_environment():
            config = layer_config(family, args, num_layers=layers, **fusions, **recompute_overrides(recompute))
            model = build_model(config, args.vocab_size, args.seq_length)
        tokens = torch.randint(0, args.vocab_size, (args.micro_batch_size, args.seq_length + 1),
                               generator=torch.Generator().manual_seed(0))
        with kernels.compiled_everywhere() if mode == "compiled" else contextlib.nullcontext():
            counts.append(saved_bytes(model, tokens))
    unit = args.micro_batch_size * args.seq_length * args.hidden_size * 4
    return (counts[0] - counts[1]) / unit


def estimated(family: str, args, recompute=()) -> float:
    """The dry run's estimate of the same (angpt.models.activation_memory, the GPU's code path), in units."""
    if recompute == FULL:
        return 1.0  # the layer's input; the rest is recomputed
    tokens = args.micro_batch_size * args.seq_length
    with attention_environment():
        config = layer_config(family, args, num_layers=1)
    kept = layer_bytes(config, tokens, recompute_modules=tuple(recompute), bytes_per_element=4)
    return kept / (tokens * args.hidden_size * 4)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--num-attention-heads", type=int, default=4)
    parser.add_argument("--num-query-groups", type=int, help="key-value heads (default: as many as the heads)")
    parser.add_argument("--attention-backend", choices=("flash", "unfused"), default="flash",
                        help="flash: torch's SDPA, as a GPU runs core attention (no [s, s] scores kept); unfused: "
                        "megatron-core's local attention, the CPU's default")
    parser.add_argument("--seq-length", type=int, default=256)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--vocab-size", type=int, default=256)
    parser.add_argument("--families", nargs="+", choices=FAMILIES, default=list(FAMILIES))
    parser.add_argument("--modes", nargs="+", choices=("eager", "compiled"), default=["eager", "compiled"])
    parser.add_argument("--recompute", action="store_true", help="also each activation recompute setting of each "
                        "family: kept per layer and recompute FLOPs (module docstring)")
    parser.add_argument("--markdown", help="with --recompute: write its table here too")
    args = parser.parse_args(argv)
    if not parallel_state.model_parallel_is_initialized():  # a test may have built the groups
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
        if mode == "compiled" and args.attention_backend == "flash":
            print(f"  {'':8}  the dry run's estimate / measured: " + ", ".join(
                f"{family} {estimated(family, args) / results[(family, mode)]:.3f}" for family in args.families))
        if "gptplus" in args.families:
            print(f"  {'':8}  vs GPT+: " + ", ".join(
                f"{family} {results[(family, mode)] / results[('gptplus', mode)]:.3f}"
                for family in args.families if family != "gptplus"))
    if args.recompute:
        results.update(recompute_table(args))
    return results


def recompute_table(args) -> dict:
    """(family, mode, setting label) -> (kept units per layer, recompute FLOPs per layer), printed as a table."""
    tokens = args.micro_batch_size * args.seq_length
    unit_mib = tokens * args.hidden_size * 4 / 2**20
    shape = (tokens, args.seq_length, args.hidden_size, args.num_attention_heads)
    rows, results = [], {}
    for family in args.families:
        layer_flops = 3 * recompute_flops(family, FULL, *shape)
        for label, setting in recompute_settings(family).items():
            flops = recompute_flops(family, setting, *shape)
            kept = []
            for mode in args.modes:
                units = per_layer(family, mode, args, setting)
                results[(family, mode, label)] = (units, flops)
                kept.append(f"{units:.2f} ({units * unit_mib:.2f} MiB)")
            estimate = estimated(family, args, setting)
            results[(family, "estimate", label)] = (estimate, flops)
            rows.append(f"| {family} | {label} | " + " | ".join(kept)
                        + f" | {estimate:.2f} | {flops / 1e6:.1f} | {100 * flops / layer_flops:.1f}% |")
            print(rows[-1], flush=True)
    header = ("| family | recompute | " + " | ".join(f"kept per layer, {mode}: units (MiB)" for mode in args.modes)
              + " | the dry run's estimate (units) | recomputed MFLOP per layer | of a layer's forward+backward |"
              + "\n|---|---|" + "---:|" * (len(args.modes) + 3))
    table = "\n".join([f"one layer, d={args.hidden_size}, {args.num_attention_heads} heads, {args.attention_backend} "
                       "attention, "
                       f"{args.micro_batch_size} x {args.seq_length} tokens, fp32 (a unit: one [tokens, hidden] "
                       f"tensor, {unit_mib:.2f} MiB)", "", header, *rows])
    print(table)
    if args.markdown:
        with open(args.markdown, "w") as file:
            file.write(table + "\n")
    return results


if __name__ == "__main__":
    main()
