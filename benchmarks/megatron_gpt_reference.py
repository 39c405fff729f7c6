#!/usr/bin/env python
"""Megatron-LM's own GPT against angpt's `--model-family gpt`, built from the same flags (issue 45, deliverable 2):
the same parameter names and shapes, and at the same seed the same initial weights, logits of a fixed batch and
gradients of its loss.

    python benchmarks/megatron_gpt_reference.py [--checkout MEGATRON_LM] [--tag core_v0.16.1]

--checkout is a Megatron-LM clone, bare or not (the tag is extracted with `git archive` into a temporary
directory), or a work tree at the tag. For each flag set of VARIANTS, two processes, one process group each
(gloo, world size 1, on the CPU):
- Megatron-LM: the checkout's `megatron.training.arguments.parse_args` and `validate_args` of `pretrain_gpt.py`'s
  command line, its seeding (`megatron.training.initialize._set_random_seed`, then megatron-core's
  `model_parallel_cuda_manual_seed`, which it calls where there is a GPU), and `pretrain_gpt.py`'s
  `model_provider(gpt_builder)`; megatron-core is the checkout's. Its command line adds what a CPU run of
  Megatron-LM needs (CPU_FLAGS). Two things this machine lacks are stood in for, each said in the output:
  the CUDA device (megatron-core's CUDA calls sent to the CPU by `angpt.megatron_compat.cpu`, as angpt's own CPU
  runs do), and triton, which the CPU build of torch does not have and `megatron.training.initialize` imports
  through megatron-core's batch-invariant kernels (used by --batch-invariant-mode only): that one module is
  replaced by one whose functions raise.
- angpt: the same flags with `--model-family gpt`, through `angpt.config.arguments.parse_args`, angpt's seeding
  (`angpt.training.distributed.initialize`) and `angpt.models.build_model` on the installed megatron-core.
Both build one model (TP = PP = 1) of a 256-token vocabulary and run the same batch: the logits without labels,
then the mean of the per-token losses with labels and its backward pass. Compared: the parameters' names in
order and shapes, each initial weight, the logits and each gradient (largest absolute difference; 0 is equal
bit for bit), and the classes of the modules where they differ. Prints a side-by-side summary and writes
docs/results/megatron_gpt_reference.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import socket
import subprocess
import sys
import tempfile
import time
import types

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHECKOUT = "/work/.mirror/NVIDIA+Megatron-LM/repo"
TAG = "core_v0.16.1"
RESULT = os.path.join(ROOT, "docs", "results", "megatron_gpt_reference.json")
VOCAB_SIZE = 256  # a multiple of --make-vocab-size-divisible-by 128: the padded vocabulary of both
BATCH, SEQUENCE = 2, 32
# Flags of both: the shape, a fixed seed, no dropout (Megatron-LM's default is 0.1), and the fused kernels off as
# they are on a CPU (angpt's defaults there; Megatron-LM's are on: most need apex, Transformer Engine or a GPU, and
# its fused bias-dropout-add, compiled by torch.compile, sums the biases' gradients in another order).
SHARED = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", str(SEQUENCE),
          "--max-position-embeddings", "64", "--micro-batch-size", str(BATCH), "--global-batch-size", str(BATCH),
          "--train-iters", "1", "--lr", "1e-3", "--seed", "1234", "--attention-dropout", "0", "--hidden-dropout", "0",
          "--transformer-impl", "local", "--no-persist-layer-norm", "--no-gradient-accumulation-fusion",
          "--no-masked-softmax-fusion", "--no-bias-gelu-fusion", "--no-bias-swiglu-fusion", "--no-rope-fusion",
          "--no-bias-dropout-fusion"]
# Megatron-LM's only: weights made on the CPU, and a tokenizer (its padded vocabulary is then set to VOCAB_SIZE).
CPU_FLAGS = ["--use-cpu-initialization", "--mock-data", "--tokenizer-type", "NullTokenizer",
             "--vocab-size", str(VOCAB_SIZE - 1)]
ANGPT_FLAGS = ["--model-family", "gpt", "--mock-data", "--vocab-size", str(VOCAB_SIZE)]
VARIANTS = {
    "gpt3": ("GPT-3: Megatron-LM's defaults (LayerNorm, learned positions, GELU, biases, tied embedding)", []),
    "llama": ("RoPE, SwiGLU, RMSNorm, grouped-query attention, untied embedding, no biases",
              ["--position-embedding-type", "rope", "--swiglu", "--normalization", "RMSNorm", "--group-query-attention",
               "--num-query-groups", "2", "--untie-embeddings-and-output-weights", "--disable-bias-linear"]),
    "squared_relu": ("squared ReLU, QK-LayerNorm, RoPE on half of each head interleaved with Llama 3 scaling, "
                     "query-key layer scaling",
                     ["--squared-relu", "--qk-layernorm", "--position-embedding-type", "rope", "--rotary-percent",
                      "0.5", "--rotary-interleaved", "--use-rope-scaling", "--apply-query-key-layer-scaling"]),
    "quick_geglu": ("no positions, quick GeGLU, RMSNorm with QK-norm, a QKV bias only",
                    ["--position-embedding-type", "none", "--quick-geglu", "--normalization", "RMSNorm",
                     "--qk-layernorm", "--disable-bias-linear", "--add-qkv-bias"]),
}
TRITON_STUB = "megatron.core.transformer.custom_layers.batch_invariant_kernels"


def git(checkout: str, *args: str) -> str:
    return subprocess.run(["git", "-C", checkout, *args], check=True, capture_output=True, text=True).stdout


def work_tree(checkout: str, tag: str, scratch: str) -> tuple[str, str]:
    """(a work tree of Megatron-LM at `tag`, what it is): the checkout itself, or the tag extracted from its git
    repository into `scratch`."""
    if os.path.isfile(os.path.join(checkout, "pretrain_gpt.py")):
        return checkout, f"the work tree {checkout}"
    commit = git(checkout, "rev-parse", f"{tag}^{{commit}}").strip()
    archive = subprocess.run(["git", "-C", checkout, "archive", commit], check=True, capture_output=True).stdout
    os.makedirs(scratch)
    subprocess.run(["tar", "-x", "-C", scratch], input=archive, check=True)
    return scratch, f"{tag} ({commit}) of {checkout}, extracted with git archive"


def free_port() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return str(sock.getsockname()[1])


def batch():
    """The fixed batch: tokens, position ids and labels (the next tokens) [BATCH, SEQUENCE]."""
    import torch  # noqa: PLC0415 (the parent process compares results and imports no model code)

    tokens = torch.randint(0, VOCAB_SIZE, (BATCH, SEQUENCE + 1), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(SEQUENCE).expand(BATCH, -1)
    return tokens[:, :-1], positions, tokens[:, 1:]


def run_model(model, output: str, **extra) -> None:
    """The model's parameters, module classes, logits, loss and gradients on the fixed batch, saved to `output`."""
    import torch  # noqa: PLC0415

    tokens, positions, labels = batch()
    weights = {name: param.detach().clone() for name, param in model.named_parameters()}
    with torch.no_grad():
        logits = model(tokens, positions, None)
    loss = model(tokens, positions, None, labels=labels).float().mean()
    loss.backward()
    torch.save(dict(extra, shapes=[(name, tuple(param.shape)) for name, param in model.named_parameters()],
                    weights=weights, logits=logits, loss=loss.item(),
                    grads={name: param.grad for name, param in model.named_parameters()},
                    classes={name: type(module).__name__ for name, module in model.named_modules()}), output)


def megatron_side(tree: str, flags: list[str], output: str) -> None:
    """Megatron-LM's model of `flags` (module docstring)."""
    sys.path.insert(0, tree)
    stub = types.ModuleType(TRITON_STUB)
    for name in ("set_batch_invariant_mode", "is_batch_invariant_mode_enabled", "disable_batch_invariant_mode",
                 "enable_batch_invariant_mode"):
        setattr(stub, name, _needs_triton)
    sys.modules[TRITON_STUB] = stub
    import torch.distributed as dist  # noqa: PLC0415

    from angpt.megatron_compat import cpu  # noqa: PLC0415 (after the checkout is first on the path)

    cpu.enable()
    import megatron.core  # noqa: PLC0415
    from megatron.core import parallel_state, tensor_parallel  # noqa: PLC0415
    from megatron.training import global_vars  # noqa: PLC0415
    from megatron.training.arguments import parse_args, validate_args  # noqa: PLC0415
    from megatron.training.initialize import _set_random_seed  # noqa: PLC0415

    sys.argv = ["pretrain_gpt.py", *flags]
    args = parse_args()
    validate_args(args)
    args.padded_vocab_size = VOCAB_SIZE
    global_vars.set_args(args)
    dist.init_process_group("gloo", rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    _set_random_seed(args.seed, args.data_parallel_random_init, args.te_rng_tracker, args.inference_rng_tracker)
    tensor_parallel.model_parallel_cuda_manual_seed(args.seed)  # what _set_random_seed does with a GPU
    import pretrain_gpt  # noqa: PLC0415,F401 (Megatron-LM's entry point: its imports, as a run has them)
    from gpt_builders import gpt_builder  # noqa: PLC0415
    from model_provider import model_provider  # noqa: PLC0415

    model = model_provider(gpt_builder, pre_process=True, post_process=True)
    run_model(model, output, megatron_core="the checkout's " + os.path.relpath(
        os.path.dirname(megatron.core.__file__), tree), ffn_hidden_size=args.ffn_hidden_size)


def _needs_triton(*args, **kwargs):
    raise RuntimeError("megatron-core's batch-invariant kernels need triton, which this machine lacks")


def angpt_side(flags: list[str], output: str) -> None:
    """angpt's `--model-family gpt` of `flags`."""
    from angpt.config.arguments import parse_args  # noqa: PLC0415
    from angpt.models import build_model  # noqa: PLC0415
    from angpt.training import distributed  # noqa: PLC0415
    from angpt.training.megatron_configs import transformer_config  # noqa: PLC0415

    config = parse_args([*ANGPT_FLAGS, *flags], world_size=1)
    distributed.initialize(seed=config.training.seed)
    model = build_model(transformer_config(config), VOCAB_SIZE, config.model.seq_length)
    import megatron.core  # noqa: PLC0415

    run_model(model, output, megatron_core=f"megatron-core {megatron.core.__version__}, installed",
              ffn_hidden_size=config.model.ffn_hidden_size)


def build(side: str, tree: str, flags: list[str], scratch: str) -> dict:
    """One side's results, or {"error": its output's end} when it fails."""
    import torch  # noqa: PLC0415

    output = os.path.join(scratch, f"{side}.pt")
    env = {**os.environ, "PYTHONPATH": ROOT, "PYTHONWARNINGS": "ignore", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": free_port(), "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}
    done = subprocess.run([sys.executable, os.path.abspath(__file__), "--side", side, "--tree", tree, "--output",
                           output, "--", *flags], capture_output=True, text=True, env=env, cwd=scratch)
    if done.returncode:
        lines = (done.stdout + done.stderr).strip().splitlines()
        return {"error": "\n".join(lines[-12:])}
    return torch.load(output, weights_only=False)


def largest_difference(ours: dict, theirs: dict) -> float:
    return max(((ours[name].double() - theirs[name].double()).abs().max().item() for name in ours), default=0.0)


def compare(megatron: dict, angpt: dict) -> dict:
    """What matched (module docstring)."""
    names = [name for name, _ in megatron["shapes"]] == [name for name, _ in angpt["shapes"]]
    shapes = megatron["shapes"] == angpt["shapes"]
    same = names and shapes
    return dict(
        parameters=sum(math.prod(shape) for _, shape in angpt["shapes"]),
        names_match=names, shapes_match=shapes,
        only_megatron_lm=sorted({n for n, _ in megatron["shapes"]} - {n for n, _ in angpt["shapes"]}),
        only_angpt=sorted({n for n, _ in angpt["shapes"]} - {n for n, _ in megatron["shapes"]}),
        ffn_hidden_size={"megatron_lm": megatron["ffn_hidden_size"], "angpt": angpt["ffn_hidden_size"]},
        weights_max_abs_diff=largest_difference(angpt["weights"], megatron["weights"]) if same else None,
        logits_max_abs_diff=(angpt["logits"].double() - megatron["logits"].double()).abs().max().item()
        if angpt["logits"].shape == megatron["logits"].shape else None,
        loss={"megatron_lm": megatron["loss"], "angpt": angpt["loss"]},
        grads_max_abs_diff=largest_difference(angpt["grads"], megatron["grads"]) if same else None,
        grads_differ=[name for name in angpt["grads"] if not angpt["grads"][name].equal(megatron["grads"][name])]
        if same else None,
        module_classes_differ={name: {"megatron_lm": cls, "angpt": angpt["classes"].get(name)}
                               for name, cls in megatron["classes"].items() if angpt["classes"].get(name) != cls},
    )


def verdict(row: dict) -> str:
    if "error" in row:
        return "not run"
    exact = all(row[key] == 0.0 for key in ("weights_max_abs_diff", "logits_max_abs_diff", "grads_max_abs_diff"))
    if row["names_match"] and row["shapes_match"] and exact:
        return "same"
    return "DIFFERENT"


def summary(report: dict) -> list[str]:
    lines = [f"Megatron-LM: {report['megatron_lm']['source']}", f"  {report['megatron_lm']['how']}", ""]
    header = f"{'variant':<14}{'parameters':>11}  {'names':<6}{'shapes':<7}{'weights':>9}{'logits':>9}{'grads':>9}" \
             f"  {'loss (Megatron-LM / angpt)':<28}verdict"
    lines += [header, "-" * len(header)]
    for name, row in report["variants"].items():
        if "error" in row:
            lines.append(f"{name:<14}  not run: {row['error'].splitlines()[-1]}")
            continue
        diff = {key: "-" if row[key] is None else f"{row[key]:.1e}" if row[key] else "0"
                for key in ("weights_max_abs_diff", "logits_max_abs_diff", "grads_max_abs_diff")}
        loss = f"{row['loss']['megatron_lm']:.6f} / {row['loss']['angpt']:.6f}"
        lines.append(f"{name:<14}{row['parameters']:>11}  {str(row['names_match']):<6}{str(row['shapes_match']):<7}"
                     f"{diff['weights_max_abs_diff']:>9}{diff['logits_max_abs_diff']:>9}"
                     f"{diff['grads_max_abs_diff']:>9}  {loss:<28}{verdict(row)}")
    lines += ["", "weights, logits, grads: the largest absolute difference (0: equal bit for bit)"]
    classes = {(name, pair["megatron_lm"], pair["angpt"]) for row in report["variants"].values()
               for name, pair in row.get("module_classes_differ", {}).items()}
    for name, theirs, ours in sorted(classes):
        lines.append(f"module classes that differ: {name or '(the model)'}: {theirs} (Megatron-LM), {ours} (angpt)")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkout", default=CHECKOUT, help="a Megatron-LM clone (bare or not) or work tree")
    parser.add_argument("--tag", default=TAG)
    parser.add_argument("--variants", nargs="+", choices=sorted(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--output", default=RESULT)
    parser.add_argument("--side", choices=("megatron", "angpt"), help=argparse.SUPPRESS)
    parser.add_argument("--tree", help=argparse.SUPPRESS)
    parser.add_argument("flags", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side == "megatron":
        return megatron_side(args.tree, args.flags, args.output)
    if args.side == "angpt":
        return angpt_side(args.flags, args.output)
    start = time.time()
    with tempfile.TemporaryDirectory() as scratch:
        tree, source = work_tree(args.checkout, args.tag, os.path.join(scratch, "megatron-lm")) \
            if os.path.exists(args.checkout) else (None, f"no checkout at {args.checkout}")
        report = {"megatron_lm": {"source": source, "how": (
            "megatron.training.arguments.parse_args and validate_args, megatron.training.initialize._set_random_seed "
            "and model_parallel_cuda_manual_seed, pretrain_gpt.py's model_provider(gpt_builder), the checkout's "
            f"megatron-core; extra flags {' '.join(CPU_FLAGS)}; stood in for: the CUDA device "
            f"(angpt.megatron_compat.cpu) and triton ({TRITON_STUB} replaced, its functions raise)")},
            "shared_flags": SHARED, "batch": {"micro_batch": BATCH, "sequence": SEQUENCE, "vocabulary": VOCAB_SIZE},
            "variants": {}}
        for name in args.variants:
            description, flags = VARIANTS[name]
            if tree is None:
                row = {"error": source}
            else:
                os.makedirs(os.path.join(scratch, name))
                work = os.path.join(scratch, name)
                megatron = build("megatron", tree, [*SHARED, *CPU_FLAGS, *flags], work)
                angpt = build("angpt", tree, [*SHARED, *flags], work)
                failed = {side: result["error"] for side, result in (("megatron_lm", megatron), ("angpt", angpt))
                          if "error" in result}
                row = {"error": "\n".join(f"{side}: {error}" for side, error in failed.items())} if failed else \
                    compare(megatron, angpt)
                with contextlib.suppress(KeyError):
                    row["megatron_core"] = {"megatron_lm": megatron["megatron_core"], "angpt": angpt["megatron_core"]}
            report["variants"][name] = {"description": description, "flags": flags, **row}
            report["variants"][name]["verdict"] = verdict(row)
            print(f"{name}: {verdict(row)} ({time.time() - start:.0f} s)", flush=True)
    lines = summary(report)
    print("\n".join(lines))
    with open(args.output, "w") as file:
        json.dump(report, file, indent=1)
        file.write("\n")
    print(f"written: {os.path.relpath(args.output, ROOT)}")


if __name__ == "__main__":
    main()
