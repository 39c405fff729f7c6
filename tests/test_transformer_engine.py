"""The Transformer Engine path: `--transformer-impl transformer_engine`, the FP8 flags, apex / fused-kernel
selection, and the order of the bounded-weight projection and the cast of the main weights.

On CPU (Transformer Engine absent): the one clear error, the TE spec's structure built on stand-in bases
that behave like TE's (not megatron-core subclasses), every invalid FP8 combination refused by flag, the
backend log lines, and that the projection runs on the fp32 main weights before they are cast to the model.

Marked `gpu` (skipped without CUDA, and without Transformer Engine): the TE spec's logits against the local
spec's on the same weights, an FP8 run against a BF16 run, and bounding of the fp32 main weights under FP8.
These run in a torchrun subprocess of this file (NCCL, one GPU), so that they never share a process group
with the CPU tests.
"""

import json
import logging
import os
import re
import subprocess
import sys
import types

import pytest
import torch
from megatron.core import optimizer as megatron_optimizer
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.enums import ModelType
from megatron.core.fp8_utils import is_first_last_bf16_layer
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.transformer.dot_product_attention import DotProductAttention

from angpt.config import transformer_engine_support
from angpt.config.arguments import parse_args
from angpt.config.sections import RunConfig
from angpt.models import bounding, model_config, te_specs
from angpt.models.attention import FusedDotProductAttention
from angpt.models.bounding import _optimizer_pieces, constrained_parameters
from angpt.models.gpt import build_model_with_impl
from angpt.models.layers import FactorScaledColumn, FactorScaledRow, QKNormalization
from angpt.models.specs import normalized_layer_spec
from angpt.training import distributed
from angpt.training.distributed import set_random_seed
from angpt.training.megatron_configs import transformer_config
from angpt.training.optimizer import build_optimizer
from angpt.training.step import build_model_chunks, train_step

from conftest import ROOT

SMALL = dict(num_layers=2, hidden_size=64, num_attention_heads=4)
ARGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
        "--micro-batch-size", "4", "--global-batch-size", "4", "--mock-data", "--vocab-size", "256",
        "--train-iters", "10"]
FP8 = ["--transformer-impl", "transformer_engine", "--bf16", "--use-distributed-optimizer", "--fp8-format", "hybrid"]
HAVE_TE = transformer_engine_support.transformer_engine_error() is None


# -- one clear error without Transformer Engine --------------------------------------------------------

@pytest.mark.skipif(HAVE_TE, reason="Transformer Engine is installed")
@pytest.mark.parametrize("family", ["angpt", "gptplus", "ngpt", "gpt"])
def test_without_transformer_engine_building_the_te_spec_fails_with_one_clear_message(family, single_process):
    config = model_config(family, **SMALL)
    with pytest.raises(transformer_engine_support.TransformerEngineUnavailable) as error:
        build_model_with_impl(config, 128, 16, transformer_impl="transformer_engine")
    message = str(error.value)
    assert "--transformer-impl transformer_engine" in message and "transformer-engine[pytorch]" in message
    assert "--transformer-impl local" in message


@pytest.mark.skipif(HAVE_TE, reason="Transformer Engine is installed")
def test_without_transformer_engine_the_flag_is_refused_at_validation(capsys):
    with pytest.raises(SystemExit):
        parse_args([*ARGS, "--transformer-impl", "transformer_engine"], world_size=1)
    err = capsys.readouterr().err
    assert "--transformer-impl transformer_engine needs NVIDIA Transformer Engine" in err
    assert "docker/Dockerfile" in err


def test_local_stays_the_default():
    assert parse_args(ARGS, world_size=1).precision.transformer_impl == "local"
    assert model_config("angpt", **SMALL).transformer_impl == "local"  # megatron-core's default is TE


# -- the TE spec's structure, on stand-in bases --------------------------------------------------------

class StandInLinear(torch.nn.Module):
    """Behaves like megatron-core's TE linear wrappers at TP = 1: keyword arguments, a `weight`
    parameter owned directly, `parallel_mode`, forward(x) -> (output, None); not a megatron-core class."""

    parallel_mode = None

    def __init__(self, input_size, output_size, *, config, init_method, bias, skip_bias_add, is_expert,
                 tp_comm_buffer_name=None, tp_group=None, **kwargs):
        super().__init__()
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        self.weight = torch.nn.Parameter(torch.empty(output_size, input_size, dtype=config.params_dtype,
                                                     device=device))
        init_method(self.weight)

    def forward(self, x):
        return torch.nn.functional.linear(x, self.weight), None


class StandInColumn(StandInLinear):
    parallel_mode = "column"


class StandInRow(StandInLinear):
    parallel_mode = "row"


@pytest.fixture
def stand_in_te(monkeypatch):
    """Transformer Engine 'installed', its layers replaced by the stand-ins (the local core attention stands
    in for TEDotProductAttention)."""
    modules = te_specs.compose_normalized_modules(StandInColumn, StandInRow, FusedDotProductAttention)
    monkeypatch.setattr(transformer_engine_support, "transformer_engine_error", lambda: None)
    monkeypatch.setattr(te_specs, "te_normalized_modules", lambda: modules)
    return modules


def test_te_normalized_spec_puts_the_anGPT_mixins_on_te_modules():
    modules = te_specs.compose_normalized_modules(StandInColumn, StandInRow, DotProductAttention)
    spec = normalized_layer_spec(modules)
    attention, mlp = spec.submodules.self_attention.submodules, spec.submodules.mlp.submodules
    for place, mixin, base, factor in (
        (attention.linear_qkv, FactorScaledColumn, StandInColumn, "nu_qkv"),
        (attention.linear_proj, FactorScaledRow, StandInRow, "nu_p"),
        (mlp.linear_fc1, FactorScaledColumn, StandInColumn, "nu_uz"),
        (mlp.linear_fc2, FactorScaledRow, StandInRow, "nu_d"),
    ):
        assert place.module.__mro__[1:3] == (mixin, base) and place.params == {"factor": factor}
    assert attention.core_attention.__mro__[1:3] == (QKNormalization, DotProductAttention)


@pytest.mark.parametrize("family", ["angpt", "ngpt"])
def test_te_spec_on_stand_ins_builds_and_equals_the_local_spec(family, seeded, stand_in_te):
    """The TE spec's model (block spec dispatch, mixins on foreign bases, nGPT's dim-0 vectors of the
    row-parallel weights) gives the local model's logits on the same weights."""
    config = model_config(family, **SMALL)
    local = build_model_with_impl(config, 128, 16, transformer_impl="local")
    te = build_model_with_impl(config, 128, 16, transformer_impl="transformer_engine")
    layer = te.decoder.layers[0]
    assert isinstance(layer.self_attention.linear_qkv, StandInColumn)
    assert isinstance(layer.mlp.linear_fc2, StandInRow)
    for module in (layer.self_attention.linear_proj, layer.mlp.linear_fc2):
        dim = 0 if family == "ngpt" else 1
        assert module.weight.unit_norm_dim == dim
        norms = module.weight.data.norm(dim=dim)
        torch.testing.assert_close(norms, torch.ones_like(norms))
    assert len(constrained_parameters([te])) == len(constrained_parameters([local]))
    missing, unexpected = te.load_state_dict(local.state_dict(), strict=False)
    assert missing == [] and all(key.endswith("._extra_state") for key in unexpected)  # local layers' extra state
    device = local.embedding.word_embeddings.weight.device
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0)).to(device)
    positions = torch.arange(16, device=device).unsqueeze(0).expand(2, -1)
    with torch.no_grad():
        torch.testing.assert_close(te(tokens, positions, None), local(tokens, positions, None),
                                   rtol=1e-5, atol=1e-5)


def test_trainer_path_tags_ngpt_te_row_weights_before_the_optimizer(seeded, stand_in_te):
    """build_model_chunks + build_optimizer (what the trainer runs): nGPT's TE row-parallel weights end up
    normalized along dim 0 before the optimizer takes its main copies."""
    config = model_config("ngpt", transformer_impl="transformer_engine", **SMALL)
    chunks = build_model_chunks(config, 128, 16)
    build_optimizer(chunks, RunConfig.from_flags(dict(model_family="ngpt", lr=1e-3, train_iters=10)))
    for layer in chunks[0].module.decoder.layers:
        for module in (layer.self_attention.linear_proj, layer.mlp.linear_fc2):
            assert module.weight.unit_norm_dim == 0
            norms = module.weight.data.norm(dim=0)
            torch.testing.assert_close(norms, torch.ones_like(norms))


# -- FP8 flags ---------------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "flags,message",
    [
        (["--fp8-format", "e4m3"], "--fp8-format e4m3 needs --transformer-impl transformer_engine"),
        (["--transformer-impl", "transformer_engine", "--fp8-format", "e4m3"], "--fp8-format e4m3 needs --bf16"),
        (["--fp8-recipe", "mxfp8"], "--fp8-recipe needs --fp8-format"),
        (["--fp8-margin", "1"], "--fp8-margin needs --fp8-format"),
        (["--fp8-amax-history-len", "16"], "--fp8-amax-history-len needs --fp8-format"),
        (["--fp8-amax-compute-algo", "max"], "--fp8-amax-compute-algo needs --fp8-format"),
        (["--fp8-param-gather"], "--fp8-param-gather: not supported: FP8 parameters are not built"),
        ([*FP8, "--fp8-param-gather"], "--fp8-param-gather: not supported: FP8 parameters are not built"),
        ([*FP8, "--fp8-recipe", "tensorwise", "--fp8-amax-history-len", "16"],
         "--fp8-amax-history-len applies to --fp8-recipe delayed only"),
        ([*FP8, "--fp8-recipe", "mxfp8", "--fp8-margin", "1"], "--fp8-margin applies to --fp8-recipe delayed only"),
        ([*FP8, "--fp8-amax-history-len", "0"], "--fp8-amax-history-len 0 must be at least 1"),
        ([*FP8, "--fp8-margin", "-1"], "--fp8-margin -1 cannot be negative"),
        ([*FP8, "--hidden-size", "72", "--num-attention-heads", "2"], "--hidden-size 72"),
        ([*FP8, "--fp8-recipe", "mxfp8", "--hidden-size", "80", "--num-attention-heads", "5"], "multiples of 32"),
        ([*FP8, "--first-last-layers-bf16"], "--first-last-layers-bf16: Transformer Engine's delayed scaling cannot "
                                             "leave layers in BF16 (megatron-core's check)"),
        ([*FP8, "--fp8-recipe", "tensorwise", "--first-last-layers-bf16", "--num-layers-at-end-in-bf16", "3"],
         "--num-layers-at-end-in-bf16 3 must be at most the layers of a pipeline stage (2)"),
        ([*FP8, "--fp8-recipe", "tensorwise", "--first-last-layers-bf16", "--num-layers-at-start-in-bf16", "-1"],
         "--num-layers-at-start-in-bf16 -1 cannot be negative"),
        (["--fp8-format", "e5m2"], "--fp8-format: invalid choice"),
        (["--fp8-recipe", "blockwise"], "--fp8-recipe: invalid choice"),
        (["--transformer-impl", "te"], "--transformer-impl: invalid choice"),
    ],
)
def test_invalid_fp8_settings_are_refused_by_flag(flags, message, capsys, monkeypatch):
    monkeypatch.setattr(transformer_engine_support, "transformer_engine_error", lambda: None)  # reach the FP8 checks
    monkeypatch.setattr(transformer_engine_support, "fp8_recipe_problem", lambda recipe: None)
    with pytest.raises(SystemExit):
        parse_args([*ARGS, *flags], world_size=1)
    assert message in capsys.readouterr().err


@pytest.fixture
def fake_te_runtime(monkeypatch):
    """Transformer Engine 2.8 'installed' with MXFP8, on a GPU of the compute capability the test sets."""
    monkeypatch.setattr(transformer_engine_support, "transformer_engine_error", lambda: None)
    monkeypatch.setattr("megatron.core.utils.is_te_min_version", lambda version, check_equality=True: True)
    recipe = types.ModuleType("transformer_engine.common.recipe")
    recipe.MXFP8BlockScaling = object
    common = types.ModuleType("transformer_engine.common")
    common.recipe = recipe
    package = types.ModuleType("transformer_engine")
    package.common = common
    for name, module in (("transformer_engine", package), ("transformer_engine.common", common),
                         ("transformer_engine.common.recipe", recipe)):
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)

    def on(capability):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)

    return on


@pytest.mark.parametrize(
    "recipe,capability,message",
    [
        ("mxfp8", (9, 0), "--fp8-recipe mxfp8: MXFP8 needs Blackwell (compute capability >= 10.0); this GPU "
                          "has compute capability 9.0"),
        ("delayed", (8, 0), "--fp8-recipe delayed: FP8 needs Ada, Hopper or newer (compute capability >= 8.9)"),
        ("tensorwise", (8, 0), "this GPU has compute capability 8.0"),
    ],
)
def test_fp8_recipes_are_checked_against_the_gpu(recipe, capability, message, fake_te_runtime, capsys):
    fake_te_runtime(capability)
    with pytest.raises(SystemExit):
        parse_args([*ARGS, *FP8, "--fp8-recipe", recipe], world_size=1)
    assert message in capsys.readouterr().err


def test_mxfp8_needs_a_transformer_engine_that_has_it(fake_te_runtime, monkeypatch):
    fake_te_runtime((10, 0))
    assert transformer_engine_support.fp8_recipe_problem("mxfp8") is None
    monkeypatch.delattr(sys.modules["transformer_engine.common.recipe"], "MXFP8BlockScaling")
    assert "no MXFP8BlockScaling" in transformer_engine_support.fp8_recipe_problem("mxfp8")


def test_valid_fp8_flags_reach_the_transformer_config(fake_te_runtime):
    fake_te_runtime((9, 0))
    # The pretended GPU has no fused RoPE here: the fusions' GPU defaults are turned off (megatron-core refuses them).
    unfused = ["--no-rope-fusion", "--no-bias-swiglu-fusion"]
    run_config = parse_args([*ARGS, *FP8, *unfused, "--fp8-amax-history-len", "1024", "--fp8-amax-compute-algo",
                             "max"], world_size=1)
    config = transformer_config(run_config)
    assert (config.transformer_impl, config.fp8, config.fp8_recipe, config.fp8_margin) == (
        "transformer_engine", "hybrid", "delayed", 0)
    assert (config.fp8_amax_history_len, config.fp8_amax_compute_algo, config.fp8_param) == (1024, "max", False)
    plain = transformer_config(parse_args([*ARGS, *unfused], world_size=1))
    assert plain.fp8 is None and plain.transformer_impl == "local"


def test_fp8_needs_the_te_implementation_in_the_config_too():
    with pytest.raises(ValueError, match="transformer_impl='transformer_engine'"):
        model_config("angpt", fp8="hybrid", **SMALL)


# -- apex / Transformer Engine selection, logged once ----------------------------------------------

def test_optimizer_and_norm_choice_logged_once(seeded, caplog, monkeypatch):
    monkeypatch.setattr("angpt.training.optimizer._logged_backends", False)
    chunks = build_model_chunks(model_config("gptplus", **SMALL), 128, 16)
    with caplog.at_level(logging.INFO, logger="angpt.optimizer"):
        build_optimizer(chunks, RunConfig.from_flags(dict(model_family="gptplus", lr=1e-3, train_iters=10)))
        build_optimizer(chunks, RunConfig.from_flags(dict(model_family="gptplus", lr=1e-3, train_iters=10)))
    lines = [r.getMessage() for r in caplog.records if r.name == "angpt.optimizer"]
    assert [line.split(":")[0] for line in lines] == ["optimizer", "norms"]
    adam = megatron_optimizer.Adam
    if adam.__module__.startswith("torch"):  # what megatron-core selected, named as such
        assert lines[0] == "optimizer: torch.optim.AdamW (neither Transformer Engine nor apex installed)"
    else:
        assert adam.__name__ in lines[0] and adam.__module__.split(".")[0] in lines[0]
    assert lines[1].startswith("norms: torch.nn.RMSNorm")


# -- the projection runs on the fp32 main weights before they are cast ------------------------------

def test_projection_runs_on_main_weights_before_the_cast_to_the_model(seeded, monkeypatch):
    """bf16 with the distributed optimizer (the FP8 setting): the post-step projection of the fp32 main
    shards happens inside the optimizer step, before megatron-core copies (casts) them into the model's
    bf16 weights, from which Transformer Engine makes its FP8 copies in the next forward."""
    config = model_config("angpt", bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16, **SMALL)
    chunks = build_model_chunks(config, 128, 16, DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=True))
    optimizer, scheduler = build_optimizer(chunks, RunConfig.from_flags(dict(
        model_family="angpt", lr=0.05, train_iters=10, use_distributed_optimizer=True, bf16=True)))
    events = []
    project = bounding._project

    def recording_project(params, pieces, mode, group=None):
        assert all(piece.data.dtype == torch.float32 for piece in pieces)  # main weights, not the model's
        events.append("project")
        return project(params, pieces, mode, group)

    monkeypatch.setattr(bounding, "_project", recording_project)
    inners = getattr(optimizer, "chained_optimizers", [optimizer])
    assert any(isinstance(inner, DistributedOptimizer) for inner in inners)
    for inner in inners:
        for name in ("_copy_main_params_to_model_params", "_copy_main_params_to_param_buffer"):
            original = getattr(inner, name, None)
            if original is not None:
                def recording_copy(*a, original=original, name=name, **k):
                    events.append("cast")
                    return original(*a, **k)
                monkeypatch.setattr(inner, name, recording_copy)
    device = constrained_parameters(chunks)[0].device
    tokens = torch.randint(0, 128, (4, 17), generator=torch.Generator().manual_seed(1)).to(device)
    batch = dict(tokens=tokens[:, :-1], labels=tokens[:, 1:], loss_mask=torch.ones(4, 16, device=device),
                 position_ids=torch.arange(16, device=device).unsqueeze(0).expand(4, -1))
    _, _, updated = train_step(iter([batch]), chunks, optimizer, scheduler, 1, 4, 16)
    assert updated
    assert events and events[0] == "project" and "cast" in events[events.index("project"):]
    # The bf16 model weights are the cast of the bounded main weights.
    for param in constrained_parameters(chunks):
        assert param.dtype == torch.bfloat16
        assert param.data.float().norm(dim=param.unit_norm_dim).max().item() <= 1 + 2**-7


# -- the GPU image installs what CI installs ---------------------------------------------------------

def _dockerfile_runs(path: str) -> list[str]:
    """The shell commands of a Dockerfile's RUN instructions, continuation lines joined, split at &&."""
    with open(path) as file:
        text = file.read().replace("\\\n", " ")
    commands = []
    for line in text.splitlines():
        if line.startswith("RUN "):
            commands += [c.strip() for c in line[4:].split("&&")]
    return commands


def _makefile_recipe(target_prefix: str) -> list[str]:
    with open(os.path.join(ROOT, "Makefile")) as file:
        lines = file.read().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(target_prefix))
    recipe = []
    for line in lines[start + 1:]:
        if not line.startswith("\t"):
            break
        recipe.append(line.strip())
    return recipe


def _pip_install_arguments(command: str) -> list[str]:
    """The arguments of a `pip install` command, without --quiet, the interpreter spelling, and the parenthesis
    that closes the Makefile's `$(call timed,...)` around it."""
    if command.endswith(")") and command.count(")") > command.count("("):
        command = command[:-1]
    words = command.split()
    at = next(i for i in range(len(words) - 1) if words[i] == "pip" and words[i + 1] == "install")
    return [w for w in words[at + 2:] if w not in ("--quiet", "-q")]


def test_the_gpu_image_runs_the_install_steps_of_make_setup():
    runs = _dockerfile_runs(os.path.join(ROOT, "docker", "Dockerfile"))
    setup = _makefile_recipe("$(VENV)/.installed:")
    docker_pip = [_pip_install_arguments(c) for c in runs if "pip install" in c]
    make_pip = [_pip_install_arguments(c) for c in setup if "pip install" in c]
    # The package itself: the same editable install without build isolation (kernels built against torch).
    editable = [args for args in make_pip if "-e" in args]
    assert len(editable) == 1 and editable[0] in docker_pip, (editable, docker_pip)
    assert "--no-build-isolation" in editable[0]
    # The requirements: the Makefile's file, minus only the CPU torch (the image's torch stays).
    assert ["-r", "requirements/cpu.txt"] in make_pip
    (filtering,) = [c for c in runs if "requirements/cpu.txt" in c]
    pattern = re.search(r"grep -vE '([^']+)' requirements/cpu.txt > (\S+)", filtering)
    assert pattern, filtering
    assert ["-r", pattern.group(2)] in docker_pip
    with open(os.path.join(ROOT, "requirements", "cpu.txt")) as file:
        requirements = [line.strip() for line in file if line.strip() and not line.startswith("#")]
    kept = [r for r in requirements if not re.search(pattern.group(1), r)]
    dropped = [r for r in requirements if r not in kept]
    assert [re.split(r"[=<>~!]", r)[0] for r in dropped] == ["torch"], dropped
    # megatron-core pinned alike in setup.py, requirements/cpu.txt and so in the image.
    with open(os.path.join(ROOT, "setup.py")) as file:
        pins = set(re.findall(r'"(megatron-core==[^"]+)"', file.read()))
    assert pins and pins <= set(kept), (pins, kept)
    # No install names torch, Transformer Engine or apex: the image's own are used.
    for args in docker_pip:
        assert not any(re.match(r"(torch|transformer[-_]engine|apex)\b", a) for a in args), args
    # The image's GPU stack is pinned while pip runs.
    with open(os.path.join(ROOT, "docker", "Dockerfile")) as file:
        dockerfile = file.read()
    assert re.search(r"^ENV PIP_CONSTRAINT=", dockerfile, re.M)
    assert re.search(r"^FROM \$\{BASE_IMAGE\}", dockerfile, re.M)
    assert re.search(r"^ARG BASE_IMAGE=nvcr\.io/nvidia/pytorch:[0-9.]+-py3$", dockerfile, re.M)
    # Kernels for the architectures `make cuda-check` compiles.
    with open(os.path.join(ROOT, "Makefile")) as file:
        make_archs = re.search(r"^CUDA_ARCHS \?= (.+)$", file.read(), re.M).group(1).split()
    make_archs = sorted(tuple(arch) for arch in make_archs)
    arch_list = re.search(r'TORCH_CUDA_ARCH_LIST="([^"]+)"', dockerfile).group(1).split()
    assert sorted(tuple(a.split(".")) for a in arch_list) == make_archs


# -- on a GPU with Transformer Engine ----------------------------------------------------------------

needs_te = pytest.mark.skipif(not HAVE_TE, reason="needs Transformer Engine")
# Tolerances of the GPU tests, stated once:
# (a) TE spec vs local spec, BF16 weights and activations, same weights: max |logit difference| at most
#     LOGIT_TOLERANCE x max |logit| (a few BF16 ulps after 2 layers with different GEMM and attention kernels).
LOGIT_TOLERANCE = 3e-2
# (b) FP8 (hybrid, delayed scaling) vs BF16, both on TE layers, 200 steps of a small anGPT (4 layers, d=256)
#     on a learnable synthetic language: the 20-step moving averages of the losses differ by at most
#     CURVE_ABS + CURVE_REL x the BF16 average at every step from 20 on, and both runs learn (final
#     average below 60% of the first).
FP8_STEPS, CURVE_WINDOW, CURVE_ABS, CURVE_REL = 200, 20, 0.1, 0.05
# (c) Every vector of every fp32 main weight within 1 + MAIN_EPS of the unit ball after the FP8 run; the
#     bf16 model copy within 1 + 2^-7 (one bf16 rounding).
MAIN_EPS = 1e-6


def run_gpu_worker(task: str, nproc: int = 1) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "tests")]),
           "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", __file__, task],
        capture_output=True, text=True, timeout=900, env=env, cwd=ROOT,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"GPU worker {task} failed:\n{output[-6000:]}"
    results = [line[len("RESULT "):] for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert results, output[-6000:]
    return json.loads(results[-1])


@pytest.mark.gpu
@needs_te
def test_te_spec_logits_equal_the_local_spec_on_the_same_weights():
    result = run_gpu_worker("logits")
    for family in ("angpt", "gptplus", "ngpt"):
        figures = result[family]
        # Only the layers' (empty or FP8-metadata) extra states differ between the implementations.
        assert all(k.endswith("_extra_state") for k in figures["missing"] + figures["unexpected"]), figures
        assert figures["max_diff"] <= LOGIT_TOLERANCE * figures["max_logit"], (family, figures)


@pytest.fixture(scope="module")
def fp8_and_bf16_runs():
    return run_gpu_worker("fp8")


@pytest.mark.gpu
@needs_te
def test_fp8_training_tracks_the_bf16_loss_curve(fp8_and_bf16_runs):
    def moving_average(values):
        return [sum(values[i - CURVE_WINDOW:i]) / CURVE_WINDOW for i in range(CURVE_WINDOW, len(values) + 1)]

    fp8, bf16 = (moving_average(fp8_and_bf16_runs[k]["losses"]) for k in ("fp8", "bf16"))
    assert len(fp8) == len(bf16) == FP8_STEPS - CURVE_WINDOW + 1
    for step, (a, b) in enumerate(zip(fp8, bf16), start=CURVE_WINDOW):
        assert abs(a - b) <= CURVE_ABS + CURVE_REL * b, f"step {step}: FP8 {a:.4f}, BF16 {b:.4f}"
    for curve in (fp8, bf16):
        assert curve[-1] < 0.6 * curve[0]


@pytest.mark.gpu
@needs_te
def test_bounding_holds_on_the_fp32_main_weights_under_fp8(fp8_and_bf16_runs):
    run = fp8_and_bf16_runs["fp8"]
    assert run["main_weights"] > 0 and run["main_dtypes"] == ["torch.float32"]
    assert run["max_main_norm"] <= 1 + MAIN_EPS
    assert run["max_model_norm"] <= 1 + 2**-7
    assert run["fp8_layers"] > 0  # the GEMMs did run in FP8


@pytest.mark.gpu
@needs_te
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="context parallelism over NCCL needs two GPUs")
def test_te_context_parallelism_gives_the_logits_and_loss_of_cp1():
    """Transformer Engine's own context parallelism (megatron-core's TEDotProductAttention with the CP group and
    --cp-comm-type), fed this rank's chunks and RoPE angles: CP 2 against CP 1 on the same weights, BF16."""
    result = run_gpu_worker("context_parallel", nproc=2)
    for family in ("angpt", "gptplus", "ngpt"):
        for kind in ("p2p", "all_gather"):
            figures = result[family][kind]
            assert figures["max_diff"] <= LOGIT_TOLERANCE * figures["max_logit"], (family, kind, figures)
            assert abs(figures["loss"] - figures["loss_cp1"]) <= LOGIT_TOLERANCE * figures["loss_cp1"], figures


# -- the GPU worker (torchrun, one process; two for context parallelism) -----------------------------

def _cuda_model(config, impl, vocab, seq):
    model = build_model_with_impl(config, vocab, seq, transformer_impl=impl)
    return model.cuda()


def _worker_logits() -> dict:
    vocab, seq, out = 256, 64, {}
    tokens = torch.randint(0, vocab, (2, seq), generator=torch.Generator().manual_seed(0)).cuda()
    positions = torch.arange(seq, device="cuda").unsqueeze(0).expand(2, -1)
    for family in ("angpt", "gptplus", "ngpt"):
        config = model_config(family, num_layers=2, hidden_size=128, num_attention_heads=2, bf16=True,
                              params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16)
        set_random_seed(1234)
        local = _cuda_model(config, "local", vocab, seq)
        te = _cuda_model(config, "transformer_engine", vocab, seq)
        state = {}
        for key, value in local.state_dict().items():
            # GPT+: the pre-norms live in TE's fused LayerNorm+linear modules (megatron-core's own key map).
            key = key.replace("input_layernorm.", "self_attention.linear_qkv.layer_norm_")
            key = key.replace("pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_")
            state[key] = value
        missing, unexpected = te.load_state_dict(state, strict=False)
        local.eval(), te.eval()
        with torch.no_grad():
            a = local(tokens, positions, None).float()
            b = te(tokens, positions, None).float()
        out[family] = dict(max_diff=(a - b).abs().max().item(), max_logit=a.abs().max().item(),
                           missing=list(missing), unexpected=list(unexpected))
    return out


def _worker_context_parallel() -> dict:
    """Logits (gathered in sequence order) and mean loss of one batch at CP 2 and at CP 1 (two data-parallel
    ranks computing the same batch), the CP 2 model's weights loaded into the CP 1 model."""
    from megatron.core import parallel_state  # noqa: PLC0415 (the worker's only use)
    from megatron.core.utils import get_batch_on_this_cp_rank  # noqa: PLC0415

    vocab, seq, out = 256, 64, {}
    tokens = torch.randint(0, vocab, (2, seq + 1), generator=torch.Generator().manual_seed(0)).cuda()
    batch = dict(tokens=tokens[:, :-1], labels=tokens[:, 1:],
                 position_ids=torch.arange(seq, device="cuda").unsqueeze(0).expand(2, -1))
    for family in ("angpt", "gptplus", "ngpt"):
        out[family] = {}
        for kind in ("p2p", "all_gather"):
            figures, state = {}, None
            for cp in (2, 1):
                distributed.destroy_model_parallel()
                distributed.initialize(context_parallel_size=cp)
                config = model_config(family, num_layers=2, hidden_size=128, num_attention_heads=2, bf16=True,
                                      params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16,
                                      transformer_impl="transformer_engine", context_parallel_size=cp,
                                      cp_comm_type=kind)
                model = _cuda_model(config, "transformer_engine", vocab, seq)
                if state is None:
                    state = model.state_dict()
                else:
                    model.load_state_dict(state)
                model.eval()
                mine = get_batch_on_this_cp_rank(dict(batch))
                with torch.no_grad():
                    logits = model(mine["tokens"], mine["position_ids"], None).float()
                    losses = model(mine["tokens"], mine["position_ids"], None, labels=mine["labels"]).float()
                group = parallel_state.get_context_parallel_group()
                parts = [torch.empty_like(logits) for _ in range(cp)]
                torch.distributed.all_gather(parts, logits.contiguous(), group=group)
                chunks = [None] * (2 * cp)
                for rank, part in enumerate(parts):
                    chunks[rank], chunks[2 * cp - 1 - rank] = part.chunk(2, dim=1)
                total = losses.sum()
                torch.distributed.all_reduce(total, group=group)
                figures[cp] = (torch.cat(chunks, dim=1), (total / (2 * seq)).item())
            (a, loss), (b, loss_cp1) = figures[2], figures[1]
            out[family][kind] = dict(max_diff=(a - b).abs().max().item(), max_logit=b.abs().max().item(),
                                     loss=loss, loss_cp1=loss_cp1)
    return out


def _bigram_batch(step: int, vocab: int, seq: int, batch: int) -> dict:
    """A learnable synthetic language, the same for every run: each token follows from the previous one by a
    fixed permutation with probability 0.9, else is uniform (best loss about 0.87 nats, from ln 256 = 5.5)."""
    permutation = torch.randperm(vocab, generator=torch.Generator().manual_seed(7))
    generator = torch.Generator().manual_seed(10_000 + step)
    tokens = torch.empty(batch, seq + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, vocab, (batch,), generator=generator)
    for t in range(1, seq + 1):
        follow = torch.rand(batch, generator=generator) < 0.9
        tokens[:, t] = torch.where(follow, permutation[tokens[:, t - 1]],
                                   torch.randint(0, vocab, (batch,), generator=generator))
    tokens = tokens.cuda()
    return dict(tokens=tokens[:, :-1], labels=tokens[:, 1:], loss_mask=torch.ones(batch, seq, device="cuda"),
                position_ids=torch.arange(seq, device="cuda").unsqueeze(0).expand(batch, -1))


def _worker_train(fp8: bool) -> dict:
    vocab, seq, batch = 256, 128, 8
    fp8_settings = dict(fp8="hybrid", fp8_recipe="delayed", fp8_amax_history_len=16, fp8_amax_compute_algo="max")
    config = model_config("angpt", num_layers=4, hidden_size=256, num_attention_heads=4, bf16=True,
                          params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16,
                          transformer_impl="transformer_engine", **(fp8_settings if fp8 else {}))
    set_random_seed(1234)
    model = _cuda_model(config, "transformer_engine", vocab, seq)
    model.model_type = ModelType.encoder_or_decoder
    chunk = DistributedDataParallel(config=config, module=model, ddp_config=DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=True))
    config.finalize_model_grads_func = finalize_model_grads
    optimizer, scheduler = build_optimizer([chunk], RunConfig.from_flags(dict(
        model_family="angpt", lr=2e-3, train_iters=FP8_STEPS, use_distributed_optimizer=True, bf16=True)))
    losses = []
    for step in range(FP8_STEPS):
        loss, _, updated = train_step(iter([_bigram_batch(step, vocab, seq, batch)]), [chunk], optimizer,
                                      scheduler, 1, batch, seq)
        assert updated, f"step {step} skipped"
        losses.append(loss)
    main_norms, dtypes, count = [], set(), 0
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        _, pieces, _ = _optimizer_pieces(inner)
        for piece in pieces:
            assert piece.whole  # one data-parallel rank holds every weight whole
            weight = piece.data.view(piece.param.shape)
            dtypes.add(str(weight.dtype))
            main_norms.append(weight.norm(dim=piece.param.unit_norm_dim).max().item())
            count += 1
    model_norms = [p.data.float().norm(dim=p.unit_norm_dim).max().item() for p in constrained_parameters([model])]
    # Transformer Engine sets `module.fp8` in each forward to whether fp8_autocast was on.
    fp8_layers = sum(1 for m in model.modules() if getattr(m, "fp8", False) is True)
    return dict(losses=losses, max_main_norm=max(main_norms), main_weights=count, main_dtypes=sorted(dtypes),
                max_model_norm=max(model_norms), fp8_layers=fp8_layers)


def _worker(task: str) -> None:
    distributed.initialize()
    if task == "logits":
        result = _worker_logits()
    elif task == "fp8":
        result = dict(fp8=_worker_train(fp8=True), bf16=_worker_train(fp8=False))
    elif task == "context_parallel":
        result = _worker_context_parallel()
    else:
        raise SystemExit(f"unknown task {task}")
    if torch.distributed.get_rank() == 0:
        print("RESULT " + json.dumps(result), flush=True)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    _worker(sys.argv[1])


def test_first_last_layers_bf16_leaves_those_layers_to_bf16_in_megatron_cores_per_layer_choice(fake_te_runtime):
    """megatron-core's TransformerBlock asks is_first_last_bf16_layer for each layer's FP8 context: with 2 layers,
    the start's and the end's counts at their limits (2) and at 0."""
    fake_te_runtime((9, 0))
    unfused = ["--no-rope-fusion", "--no-bias-swiglu-fusion"]  # as above
    for start, end, bf16 in (("1", "1", [True, True]), ("0", "1", [False, True]), ("2", "0", [True, True]),
                             ("0", "0", [False, False])):
        config = transformer_config(parse_args([
            *ARGS, *FP8, *unfused, "--fp8-recipe", "tensorwise", "--first-last-layers-bf16",
            "--num-layers-at-start-in-bf16", start, "--num-layers-at-end-in-bf16", end], world_size=1))
        assert [is_first_last_bf16_layer(config, layer) for layer in range(config.num_layers)] == bf16
    config = transformer_config(parse_args([*ARGS, *FP8, *unfused, "--fp8-recipe", "tensorwise"], world_size=1))
    assert [is_first_last_bf16_layer(config, layer) for layer in range(config.num_layers)] == [False, False]
