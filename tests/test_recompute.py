"""Selective activation recompute (`recompute_granularity="selective"`, `recompute_modules`): the same gradients
as without recompute for every choice in every family, dropout masks replayed, and the recomputed parts no
longer kept for the backward pass (saved-tensor hooks). In-process, tiny fp32 models on the CPU path."""

import itertools

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from angpt.config.arguments import parse_args
from angpt.config.choices import RECOMPUTE_MODULES, recompute_module_refusal
from angpt.models import build_model, model_config
from angpt.models.config import RECOMPUTE_MODULES as MODEL_RECOMPUTE_MODULES
from angpt.training import distributed
from angpt.training.megatron_configs import transformer_config

from conftest import load_benchmark

FAMILIES = ("gptplus", "angpt", "ngpt")
HIDDEN, HEADS, VOCAB, SEQ, BATCH = 32, 4, 64, 16, 2
FFN = 4 * HIDDEN
TOKENS = SEQ * BATCH
FP32 = 4
MOCK = ["--mock-data", "--vocab-size", "64", "--train-iters", "4", "--num-layers", "2", "--hidden-size", "32",
        "--num-attention-heads", "4"]


def applicable(family: str) -> list[str]:
    return [module for module in RECOMPUTE_MODULES if recompute_module_refusal(module, family) is None]


def settings(family: str) -> list[tuple]:
    """None, each choice alone, core_attn with mlp, all of the family's choices together, and full."""
    own = applicable(family)
    return [(), *((module,) for module in own), ("core_attn", "mlp"), tuple(own), "full"]


def build(family: str, recompute=(), num_layers: int = 2, **overrides):
    distributed.set_random_seed(0)
    if recompute == "full":
        overrides.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    elif recompute:
        overrides.update(recompute_granularity="selective", recompute_modules=list(recompute))
    config = model_config(family, num_layers=num_layers, hidden_size=HIDDEN, num_attention_heads=HEADS, **overrides)
    return build_model(config, VOCAB, SEQ)


def batch():
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(0))
    return tokens, torch.arange(SEQ).unsqueeze(0).expand(BATCH, -1)


def loss(model):
    tokens, positions = batch()
    return model(tokens[:, :-1], positions, None, labels=tokens[:, 1:]).mean()


def gradients(family: str, recompute=(), seed: int = 0, **overrides) -> dict:
    model = build(family, recompute, **overrides)
    distributed.set_random_seed(seed)  # the dropout masks
    loss(model).backward()
    return {name: param.grad.clone() for name, param in model.named_parameters()}


def test_the_choices_are_megatron_lms_names_and_ours():
    assert MODEL_RECOMPUTE_MODULES is RECOMPUTE_MODULES
    assert RECOMPUTE_MODULES == ("core_attn", "mlp", "layernorm", "qk_norm", "residual_update")
    assert applicable("gptplus") == ["core_attn", "mlp", "layernorm", "qk_norm"]
    assert applicable("angpt") == applicable("ngpt") == ["core_attn", "mlp", "qk_norm", "residual_update"]


@pytest.mark.parametrize("family, module", [("angpt", "layernorm"), ("ngpt", "layernorm"),
                                            ("gptplus", "residual_update"), ("angpt", "moe_act")])
def test_a_choice_the_family_lacks_is_refused(single_process, family, module):
    with pytest.raises(ValueError, match=f"recompute_modules: .*{'not one of' if module == 'moe_act' else ''}"):
        build(family, (module,))


@pytest.mark.parametrize("argv, modules", [
    (["--recompute-granularity", "selective"], ["core_attn"]),  # Megatron-LM's default
    (["--recompute-activations"], ["core_attn"]),  # Megatron-LM's alias
    (["--recompute-activations", "--recompute-modules", "qk_norm", "mlp", "residual_update"],
     ["qk_norm", "mlp", "residual_update"]),
])
def test_the_flags_reach_the_model_config(single_process, argv, modules):
    config = transformer_config(parse_args([*MOCK, *argv], world_size=1))
    assert config.recompute_granularity == "selective"
    assert config.recompute_modules == modules
    assert all(config.recomputes(module) == (module in modules) for module in RECOMPUTE_MODULES)


@pytest.mark.parametrize("argv, message", [
    (["--recompute-modules", "mlp"], "--recompute-modules needs --recompute-granularity selective"),
    (["--recompute-granularity", "full", "--recompute-modules", "mlp"], "--recompute-modules needs"),
    (["--recompute-granularity", "selective", "--recompute-method", "block"],
     "--recompute-method needs --recompute-granularity full"),
    (["--recompute-activations", "--recompute-num-layers", "2"], "--recompute-num-layers needs"),
    (["--recompute-activations", "--recompute-granularity", "full"], "give one of them"),
    (["--recompute-activations", "--recompute-modules", "layernorm"],
     "--recompute-modules layernorm with --model-family angpt: anGPT has no pre-norms"),
    (["--model-family", "gptplus", "--recompute-activations", "--recompute-modules", "residual_update"],
     "GPT+'s residual is a plain add"),
    (["--recompute-activations", "--recompute-modules", "moe_act"], "invalid choice: 'moe_act'"),
    (["--recompute-activations", "--cuda-graph-impl", "local"], "--cuda-graph-impl local with "
                                                                "--recompute-granularity selective"),
])
def test_flags_the_granularity_or_family_lacks_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit):
        parse_args([*MOCK, *argv], world_size=1)
    assert message in capsys.readouterr().err


# Megatron-LM's checks of --distribute-saved-activations, and megatron-core's (with sequence parallelism), at TP 1
# and 2; it trains as without it (tests/distributed/equivalence_worker.py, tp2_distribute_saved_activations).
@pytest.mark.parametrize("argv,message", [
    (["--tensor-model-parallel-size", "1", "--recompute-granularity", "full"],
     "--distribute-saved-activations splits the saved inputs over the tensor-parallel ranks: it needs "
     "--tensor-model-parallel-size > 1 (Megatron-LM's check)"),
    (["--recompute-activations"], "--distribute-saved-activations needs --recompute-granularity full (Megatron-LM's "
                                  "check)"),
    (["--recompute-granularity", "full", "--sequence-parallel"], "--distribute-saved-activations with "
     "--sequence-parallel: the saved inputs are split over the tensor-parallel ranks already (megatron-core's check)"),
])
def test_distribute_saved_activations_needs_tensor_parallel_full_recompute(argv, message, capsys):
    flags = [*MOCK, "--tensor-model-parallel-size", "2", "--distribute-saved-activations"]
    config = parse_args([*flags, "--recompute-granularity", "full"], world_size=2)
    assert transformer_config(config).distribute_saved_activations is True
    with pytest.raises(SystemExit):
        parse_args([*flags, *argv], world_size=2)
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("family", FAMILIES)
def test_gradients_equal_without_and_with_each_recompute(seeded, family):
    # The recomputation runs the same ops on the same inputs in the same order, so the CPU's fp32 results are
    # bit-identical, except with GPT+'s layernorm: megatron-core's CheckpointWithoutOutput returns the norm's
    # input gradient from a backward pass of its own, which the residual stream's gradient is then summed with
    # (measured: 2.9 fp32 eps of the largest gradient of a weight); held to 16 eps.
    reference = gradients(family)
    for recompute in settings(family)[1:]:
        assert_equal(gradients(family, recompute), reference, recompute)


def assert_equal(got: dict, reference: dict, recompute) -> None:
    assert got.keys() == reference.keys()
    for name, grad in reference.items():
        if recompute != "full" and "layernorm" in recompute:
            tolerance = 16 * torch.finfo(torch.float32).eps * grad.abs().max().item()
            torch.testing.assert_close(got[name], grad, rtol=0, atol=tolerance, msg=f"{recompute} {name}")
        else:
            assert torch.equal(got[name], grad), (recompute, name, (got[name] - grad).abs().max())


@pytest.mark.parametrize("family", ["gptplus", "angpt"])
def test_the_recomputation_replays_the_dropout_masks(seeded, family):
    # core_attn and full recompute attention's dropout, full also GPT+'s hidden dropout (in its bias-dropout-add):
    # the masks of the first forward pass must be drawn again, from megatron-core's RNG tracker as it was then.
    dropout = dict(attention_dropout=0.3, hidden_dropout=0.3 if family == "gptplus" else 0.0)
    reference = gradients(family, **dropout)
    other_masks = gradients(family, seed=1, **dropout)
    assert any(not torch.equal(reference[name], grad) for name, grad in other_masks.items())
    for recompute in (("core_attn",), ("core_attn", "mlp"), tuple(applicable(family)), "full"):
        assert_equal(gradients(family, recompute, **dropout), reference, recompute)


def saved(model, inside=()) -> tuple[int, int]:
    """(bytes of the distinct storages autograd keeps for the backward pass after one forward pass, and of
    those among them saved while one of the modules `inside` ran that are not one of its inputs). Sizes are
    read after the forward pass: megatron-core's CheckpointWithoutOutput frees an output it recomputes."""
    storages, own = {}, set()
    depth, inputs = [0], set()

    def enter(module, args):
        depth[0] += 1
        inputs.update(arg.untyped_storage().data_ptr() for arg in args if isinstance(arg, torch.Tensor))

    def leave(module, args, output):
        depth[0] -= 1

    def pack(tensor):
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage
        if depth[0] and storage.data_ptr() not in inputs and not isinstance(tensor, torch.nn.Parameter):
            own.add(storage.data_ptr())
        return tensor

    handles = [hook for module in inside for hook in (module.register_forward_pre_hook(enter),
                                                      module.register_forward_hook(leave))]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        result = loss(model)
    for handle in handles:
        handle.remove()
    total = sum(storage.nbytes() for storage in storages.values())
    inside_bytes = sum(storages[ptr].nbytes() for ptr in own)
    result.backward()  # the recomputation restores what was freed
    return total, inside_bytes


def recomputed_modules(model, module: str) -> list:
    layer = model.decoder.layers[0]
    attention = layer.self_attention
    return {
        "core_attn": [attention.core_attention],
        "mlp": [layer.mlp],
        "layernorm": [layer.input_layernorm, layer.pre_mlp_layernorm],
        "qk_norm": [attention.q_layernorm, attention.k_layernorm] if model.config.model_family == "gptplus" else [],
        "residual_update": [getattr(layer, "attention_residual", None), getattr(layer, "mlp_residual", None)],
    }[module]


# The least that each choice stops keeping in one layer, in bytes, from the shapes (fp32, unfused attention on
# the CPU path): core attention keeps its softmax probabilities [b, heads, s, s]; the MLP its fc1 output
# [tokens, 2 ffn] and the SwiGLU output [tokens, ffn]; GPT+'s pre-norms their outputs (the QKV and fc1 inputs);
# anGPT's QK normalization the normalized q and k that attention keeps; each residual update at least one
# [tokens, hidden] tensor beyond its inputs (eagerly: Norm(x) and h + alpha (x - h)). GPT+'s QK-RMSNorm keeps its
# input, a view of the QKV output that attention keeps for v, and its per-row rstd: only that is dropped.
LEAST_DROP = {
    "core_attn": BATCH * HEADS * SEQ * SEQ * FP32,
    "mlp": TOKENS * 3 * FFN * FP32,
    "layernorm": 2 * TOKENS * HIDDEN * FP32,
    "qk_norm": 2 * TOKENS * HIDDEN * FP32,
    "residual_update": 2 * TOKENS * HIDDEN * FP32,
}


@pytest.mark.parametrize("family", FAMILIES)
def test_a_recomputed_part_keeps_nothing_of_its_own(seeded, family):
    for module in applicable(family):
        plain, recomputed = build(family, num_layers=1), build(family, (module,), num_layers=1)
        total_plain, inside_plain = saved(plain, recomputed_modules(plain, module))
        total, inside = saved(recomputed, recomputed_modules(recomputed, module))
        least = 2 * TOKENS * HEADS * FP32 if (family, module) == ("gptplus", "qk_norm") else LEAST_DROP[module]
        assert total_plain - total >= least, (module, total_plain, total)
        if recomputed_modules(plain, module):
            assert inside_plain > 0 and inside == 0, (module, inside_plain, inside)


def test_each_combination_keeps_less_than_its_parts(seeded):
    totals = {}
    for recompute in itertools.chain([()], ((m,) for m in applicable("angpt")), [("core_attn", "mlp")]):
        totals[recompute] = saved(build("angpt", recompute, num_layers=1))[0]
    assert totals[("core_attn", "mlp")] < min(totals[("core_attn",)], totals[("mlp",)])
    assert all(total < totals[()] for recompute, total in totals.items() if recompute)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_benchmarks_recompute_flops_hold_the_layers_matmuls(seeded, family):
    # torch's own count of one layer's forward matmuls (2-layer model minus 1-layer model) against the
    # benchmark's formula for full recompute, which adds the elementwise work (a few FLOPs per element) on top.
    counts = []
    for layers in (2, 1):
        model = build(family, num_layers=layers)
        with FlopCounterMode(display=False) as counter:
            with torch.no_grad():
                loss(model)
        counts.append(counter.get_total_flops())
    matmuls = counts[0] - counts[1]
    assert matmuls == 2 * TOKENS * HIDDEN * 4 * HIDDEN + 4 * TOKENS * SEQ * HIDDEN + 6 * TOKENS * HIDDEN * FFN
    formula = load_benchmark("activation_memory").recompute_flops(family, "full", TOKENS, SEQ, HIDDEN, HEADS)
    elementwise = formula - matmuls
    assert 0 < elementwise < 0.1 * matmuls


@pytest.mark.slow  # eager, every family and setting at a tiny shape: about 15 s
def test_the_benchmark_reports_each_setting(single_process, capsys):
    benchmark = load_benchmark("activation_memory")
    results = benchmark.main(["--recompute", "--modes", "eager", "--hidden-size", "32", "--seq-length", "16",
                              "--micro-batch-size", "2", "--vocab-size", "64"])
    for family in FAMILIES:
        kept = {key[2]: value[0] for key, value in results.items() if key[:2] == (family, "eager") and len(key) == 3}
        assert results[(family, "eager")] == kept["none"]  # the first table's figure
        assert kept["full"] == pytest.approx(1.0)  # the layer's input
        assert all(units < kept["none"] for label, units in kept.items() if label != "none")
    assert "| angpt | core_attn,mlp |" in capsys.readouterr().out
