"""--cuda-graph-scope and --batch-invariant-mode, Megatron-LM's flags whose effect needs CUDA: on the CPU their
parsing, Megatron-LM's and megatron-core's checks (at their boundaries), the fields megatron-core's config receives by
name and the wiring of megatron-core's full-iteration graph; the `gpu` tests (benchmarks/gpu_checks.sh, stage
gpu-flags) what only a GPU shows: a captured iteration trains as eager steps, and a sample's logits do not depend
on its batch."""

import inspect
import itertools

import pytest
import torch
from megatron.core.transformer.enums import AttnBackend, CudaGraphScope
from megatron.core.transformer.transformer_layer import TransformerLayer
from test_gpu_training import SHAPE, assert_graphed_steps_are_eager, main_grads, train
from test_optimizer import MB, S, batch, run_config, tiny_chunks

from angpt.config import megatron_lm
from angpt.config.arguments import parse_args
from angpt.config.choices import CUDA_GRAPH_SCOPES
from angpt.megatron_compat import patches
from angpt.models import build_model, model_config
from angpt.models.attention import clear_attention_backend_environment
from angpt.training import distributed
from angpt.training import step as step_module
from angpt.training.distributed import set_random_seed
from angpt.training.megatron_configs import transformer_config
from angpt.training.optimizer import build_optimizer

from conftest import in_process_trainer

MOCK = ["--mock-data", "--vocab-size", "64", "--train-iters", "4"]
LOCAL = ["--cuda-graph-impl", "local"]
NO_NAN_CHECK = "--no-check-for-nan-in-loss-and-grad"
BATCH_INVARIANT = ["--model-family", "gpt", "--batch-invariant-mode", "--attention-backend", "flash"]


def scope_notes(argv):
    return [line for line in megatron_lm.notes(parse_args([*MOCK, *argv], world_size=1), cuda=False)
            if line.startswith("--cuda-graph-scope")]


def test_the_scopes_are_megatron_cores_and_megatron_lms_full():
    assert set(CUDA_GRAPH_SCOPES) == {scope.name for scope in CudaGraphScope} | {"full"}


def assert_refused_in_one_line(argv, message, capsys) -> None:
    with pytest.raises(SystemExit):
        parse_args([*MOCK, *argv], world_size=1)
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and message in error, error


@pytest.mark.parametrize("argv,scope", [
    ([], []),
    (["--cuda-graph-scope", "attn", "mlp"], [CudaGraphScope.attn, CudaGraphScope.mlp]),
    (["--cuda-graph-scope", "full"], []),  # megatron-core's reading of Megatron-LM's deprecated name
    (["--cuda-graph-scope", "full_iteration"], [CudaGraphScope.full_iteration]),
])
def test_cuda_graph_scope_reaches_megatron_cores_config_by_name(argv, scope):
    assert transformer_config(parse_args([*MOCK, *argv], world_size=1)).cuda_graph_scope == scope


@pytest.mark.parametrize("argv,message", [
    # Megatron-LM's validate_args, with or without --cuda-graph-impl.
    (["--cuda-graph-scope", "full", "attn"], "--cuda-graph-scope full attn: full (the whole layer, deprecated) cannot "
                                             "be used with other scopes (Megatron-LM's check)"),
    (["--cuda-graph-scope", "attn", "full"], "--cuda-graph-scope attn full: full"),
    # megatron-core's TransformerConfig: the moe scopes need MoE layers (moe_preprocess brings moe_router along).
    ([*LOCAL, "--cuda-graph-scope", "moe"], "--cuda-graph-scope moe: megatron-core graphs MoE layers with it, and this "
                                            "model is dense (megatron-core's check"),
    ([*LOCAL, "--cuda-graph-scope", "moe_router"], "--cuda-graph-scope moe_router: megatron-core graphs MoE layers"),
    ([*LOCAL, "--cuda-graph-scope", "attn", "moe_preprocess"], "--cuda-graph-scope moe_preprocess: megatron-core"),
    # Megatron-LM's: the NaN check reads the loss on the host (off with --fp16's dynamic scale, not with a fixed one).
    ([*LOCAL, "--cuda-graph-scope", "full_iteration"], "--cuda-graph-scope full_iteration needs "
                                                       "--no-check-for-nan-in-loss-and-grad (Megatron-LM's check"),
    ([*LOCAL, "--cuda-graph-scope", "full_iteration", "--fp16", "--loss-scale", "1024"],
     "--cuda-graph-scope full_iteration needs --no-check-for-nan-in-loss-and-grad"),
    # megatron-core's: full recompute with full_iteration alone.
    ([*LOCAL, "--recompute-granularity", "full"], "--cuda-graph-impl local with --recompute-granularity full needs "
                                                  "--cuda-graph-scope full_iteration alone (megatron-core's check"),
    ([*LOCAL, "--recompute-granularity", "full", "--cuda-graph-scope", "full_iteration", "attn", NO_NAN_CHECK],
     "--cuda-graph-impl local with --recompute-granularity full needs --cuda-graph-scope full_iteration alone"),
])
def test_megatron_lms_and_megatron_cores_scope_checks_are_one_line_refusals(argv, message, capsys):
    assert_refused_in_one_line(argv, message, capsys)


def test_the_refused_combinations_are_the_ones_megatron_core_refuses():
    """The refusals above where megatron-core's TransformerConfig asserts, and the accepted combinations where it
    does not (megatron-core's own checks, not ours)."""
    shape = dict(num_layers=2, hidden_size=64, num_attention_heads=4, cuda_graph_impl="local")
    full = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    for scope, message in ((["moe"], "only supported for MoE"), (["moe_preprocess"], "only supported for MoE"),
                           (["full", "attn"], "full scope cannot be used with other scopes")):
        with pytest.raises(AssertionError, match=message):
            model_config("gpt", **shape, cuda_graph_scope=scope)
    with pytest.raises(AssertionError, match="full recompute is only supported with full iteration"):
        model_config("gpt", **shape, **full, cuda_graph_scope=["full_iteration", "attn"])
    assert model_config("gpt", **shape, **full, cuda_graph_scope=["full_iteration"]).cuda_graph_scope == [
        CudaGraphScope.full_iteration]


@pytest.mark.parametrize("argv,scope", [
    (["--cuda-graph-scope", "full"], ("full",)),  # alone: Megatron-LM's deprecated name of no scope
    ([*LOCAL, "--cuda-graph-scope", "full_iteration", NO_NAN_CHECK], ("full_iteration",)),
    # The dynamic loss scale of --fp16 turns Megatron-LM's NaN check off; --rerun-mode disabled does not.
    ([*LOCAL, "--cuda-graph-scope", "full_iteration", "--fp16"], ("full_iteration",)),
    ([*LOCAL, "--cuda-graph-scope", "full_iteration", "--rerun-mode", "disabled", NO_NAN_CHECK], ("full_iteration",)),
    ([*LOCAL, "--cuda-graph-scope", "full_iteration", "--recompute-granularity", "full", NO_NAN_CHECK],
     ("full_iteration",)),
    ([*LOCAL, "--cuda-graph-scope", "attn", "mlp", "mamba"], ("attn", "mlp", "mamba")),
    # Without --cuda-graph-impl Megatron-LM checks no scope but full's.
    (["--cuda-graph-scope", "moe"], ("moe",)),
    (["--cuda-graph-scope", "full_iteration"], ("full_iteration",)),
    (["--recompute-granularity", "full", "--cuda-graph-scope", "attn"], ("attn",)),
])
def test_what_megatron_lm_runs_is_accepted(argv, scope):
    assert parse_args([*MOCK, *argv], world_size=1).fusion.cuda_graph_scope == scope


@pytest.mark.parametrize("argv,note", [
    ([], []),
    (["--cuda-graph-scope", "attn"], ["--cuda-graph-scope attn: without --cuda-graph-impl nothing is captured (as in "
                                      "Megatron-LM, nothing changes)"]),
    (["--cuda-graph-scope", "full_iteration"], ["--cuda-graph-scope full_iteration: without --cuda-graph-impl nothing "
                                                "is captured (as in Megatron-LM, nothing changes)"]),
    ([*LOCAL, "--cuda-graph-scope", "full"], ["--cuda-graph-scope full: Megatron-LM's deprecated name of no scope: "
                                              "each whole layer is captured"]),
    ([*LOCAL, "--cuda-graph-scope", "attn"], ["--cuda-graph-scope attn: megatron-core's local CUDA graphs capture each "
                                              "whole layer, as with no scope (they do not split a layer)"]),
    ([*LOCAL, "--cuda-graph-scope", "mlp", "mamba"], ["--cuda-graph-scope mlp mamba: megatron-core's local CUDA graphs "
                                                      "capture each whole layer, as with no scope (they do not split "
                                                      "a layer)"]),
    ([*LOCAL, "--cuda-graph-scope", "mamba"], ["--cuda-graph-scope mamba: megatron-core graphs Mamba layers only, and "
                                               "this model has none: nothing is captured"]),
    ([*LOCAL, "--cuda-graph-scope", "full_iteration", NO_NAN_CHECK], []),
    ([*LOCAL, "--cuda-graph-scope", "full_iteration", "attn", NO_NAN_CHECK],
     ["--cuda-graph-scope full_iteration attn: the whole iteration is captured; megatron-core then creates no graph of "
      "a layer (its schedules create them only without full_iteration)"]),
])
def test_what_a_scope_captures_is_said_in_one_line(argv, note):
    assert scope_notes(argv) == note


def test_without_full_iteration_the_layers_are_graphed_as_megatron_core_decides():
    """megatron-core's TransformerLayer.create_mcore_cudagraph_manager, which the log lines above describe: a layer
    gets a graph manager with no scope, attn or mlp, none with mamba or full_iteration alone (read from megatron-core's
    code, not run here: a manager needs CUDA)."""
    source = inspect.getsource(TransformerLayer.create_mcore_cudagraph_manager)
    assert "if not self.config.cuda_graph_scope:" in source
    assert "CudaGraphScope.attn in self.config.cuda_graph_scope" in source
    assert "CudaGraphScope.mlp in self.config.cuda_graph_scope" in source
    assert "mamba" not in source and "full_iteration" not in source


class RecordingWrapper:
    """A stand-in for megatron-core's FullCudaGraphWrapper that runs the wrapped function (no capture on a CPU)."""

    made, calls = [], []

    def __init__(self, forward_backward_func, cuda_graph_warmup_steps=1):
        self.forward_backward_func = forward_backward_func
        RecordingWrapper.made.append(cuda_graph_warmup_steps)

    def __call__(self, *args, **kwargs):
        RecordingWrapper.calls.append(kwargs["forward_only"])
        return self.forward_backward_func(*args, **kwargs)


def test_full_iteration_wraps_the_forward_and_backward_in_megatron_cores_full_cuda_graph(single_process, monkeypatch):
    """As Megatron-LM's train and evaluate: with --cuda-graph-impl local and the full_iteration scope, the schedule's
    function is wrapped in megatron-core's FullCudaGraphWrapper with cuda_graph_warmup_steps, for training steps and
    evaluation; without the scope it is not. The wrapper's capture needs CUDA (a `gpu` test below): on the CPU a
    stand-in runs the function, and the losses are the unwrapped ones. The model is built without CUDA graphs
    (megatron-core's graph managers need CUDA), its config told afterwards."""
    RecordingWrapper.made.clear(), RecordingWrapper.calls.clear()
    monkeypatch.setattr(step_module, "FullCudaGraphWrapper", RecordingWrapper)
    losses = {}
    for graphed in (False, True):
        set_random_seed(1234)
        chunks = tiny_chunks("gpt")
        config = chunks[0].config
        if graphed:
            config.cuda_graph_impl, config.cuda_graph_scope, config.cuda_graph_warmup_steps = (
                "local", [CudaGraphScope.full_iteration], 2)
        optimizer, scheduler = build_optimizer(chunks, run_config("gpt", lr=0.01, train_iters=3))
        data = itertools.repeat(batch())
        losses[graphed] = [step_module.train_step(data, chunks, optimizer, scheduler, 2, MB, S)[0] for _ in range(3)]
        losses[graphed].append(step_module.eval_step(data, chunks, 2, MB, S))
    assert RecordingWrapper.made == [2] * 4 and RecordingWrapper.calls == [False] * 3 + [True]
    assert losses[True] == losses[False]


def test_batch_invariant_mode_reaches_megatron_cores_config_by_name():
    assert transformer_config(parse_args([*MOCK, *BATCH_INVARIANT], world_size=1)).batch_invariant_mode is True
    assert transformer_config(parse_args([*MOCK, "--model-family", "gpt"], world_size=1)).batch_invariant_mode is False


REPLACED = ("none of the ops megatron-core's batch-invariant kernels replace (aten's mm, addmm, _log_softmax, "
            "mean.dim), so its results would still depend on the batch; --model-family gpt takes it as Megatron-LM "
            "does")


@pytest.mark.parametrize("argv,message", [
    # megatron-core's check, at each other backend.
    *[(["--model-family", "gpt", "--batch-invariant-mode", "--attention-backend", backend],
       f"--batch-invariant-mode needs --attention-backend flash, not {backend} (megatron-core's check)")
      for backend in ("auto", "fused", "unfused", "local")],
    # The families whose own reductions those kernels do not replace.
    (["--model-family", "angpt", "--batch-invariant-mode", "--attention-backend", "flash"],
     "--batch-invariant-mode with --model-family angpt: anGPT's L2 normalizations of the hidden states, q and k (sums "
     f"over the hidden dimension: compiled kernels on CUDA, aten::sum otherwise): {REPLACED}"),
    (["--model-family", "ngpt", "--batch-invariant-mode", "--attention-backend", "flash"],
     "--batch-invariant-mode with --model-family ngpt: nGPT's L2 normalizations of the hidden states, q and k"),
    (["--model-family", "gptplus", "--batch-invariant-mode", "--attention-backend", "flash"],
     "--batch-invariant-mode with --model-family gptplus: GPT+'s RMSNorm (angpt.models.norms: a compiled kernel on "
     f"CUDA, torch's fused rms_norm otherwise): {REPLACED}"),
])
def test_batch_invariant_mode_refusals(argv, message, capsys):
    assert_refused_in_one_line(argv, message, capsys)


def test_megatron_core_refuses_batch_invariant_mode_without_flash_attention():
    shape = dict(num_layers=2, hidden_size=64, num_attention_heads=4, batch_invariant_mode=True)
    with pytest.raises(AssertionError, match="Batch invariant mode only supports FlashAttention"):
        model_config("gpt", **shape, attention_backend=AttnBackend.auto)
    assert model_config("gpt", **shape, attention_backend=AttnBackend.flash).batch_invariant_mode


def test_batch_invariant_mode_needs_cuda(single_process):
    """megatron-core registers its Triton kernels for the current accelerator's dispatch key (the CPU's here), where
    Triton cannot run them: refused in one line before anything is built."""
    if torch.cuda.is_available():
        pytest.skip("CUDA is here")
    message = ("--batch-invariant-mode: megatron-core's batch-invariant kernels are Triton's and need CUDA; there is "
               "none here")
    with pytest.raises(ValueError, match=f"^{message}$"):
        distributed.enable_batch_invariant_mode()
    with pytest.raises(ValueError, match=f"^{message}$"):
        in_process_trainer([*MOCK, *BATCH_INVARIANT, "--num-layers", "1", "--hidden-size", "32", "--seq-length", "16",
                            "--micro-batch-size", "2", "--global-batch-size", "2"])


def gpt_logits(tokens, **overrides):
    """GPT's logits [b, s, vocab] of tokens [b, s], from the same weights each call."""
    clear_attention_backend_environment()
    set_random_seed(1234)
    config = model_config("gpt", **SHAPE, **overrides)
    model = build_model(config, 256, tokens.shape[1]).to(tokens.device)
    positions = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0).expand(tokens.shape[0], -1)
    with torch.no_grad():
        return model(tokens, positions, None)


def test_batch_invariant_mode_runs_megatron_cores_own_attention(single_process):
    """Under --batch-invariant-mode the flash backend runs megatron-core's attention, as Megatron-LM's local spec does
    (torch's fused kernels take no num_splits): the logits are those of the unfused backend, bit for bit."""
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    unfused = gpt_logits(tokens, attention_backend=AttnBackend.unfused)
    assert torch.equal(gpt_logits(tokens, attention_backend=AttnBackend.flash, batch_invariant_mode=True), unfused)
    assert not torch.equal(gpt_logits(tokens, attention_backend=AttnBackend.flash), unfused)  # torch's kernels


@pytest.mark.gpu
def test_a_samples_logits_do_not_depend_on_its_batch_in_batch_invariant_mode(single_process):
    """--batch-invariant-mode (megatron-core's Triton kernels, enabled as Megatron-LM does), GPT in BF16: the logits
    of a sample alone equal, bit for bit, its logits inside a batch of 4. Without the mode the same comparison is
    printed (cuBLAS picks its kernels by the GEMM's shape), as a control."""
    from megatron.core.transformer.custom_layers.batch_invariant_kernels import (  # noqa: PLC0415 (Triton's)
        disable_batch_invariant_mode,
    )

    tokens = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(0)).cuda()
    bf16 = dict(bf16=True, params_dtype=torch.bfloat16, attention_backend=AttnBackend.flash)
    differs = {}
    for mode in (False, True):
        if mode:
            distributed.enable_batch_invariant_mode()
        try:
            batched = gpt_logits(tokens, **bf16, batch_invariant_mode=mode)
            alone = gpt_logits(tokens[:1], **bf16, batch_invariant_mode=mode)
        finally:
            disable_batch_invariant_mode()
        assert torch.isfinite(batched).all()
        differs[mode] = (alone[0] - batched[0]).abs().max().item()
    print(f"largest difference of sample 0's logits alone and in a batch of 4: {differs[False]} without "
          f"--batch-invariant-mode, {differs[True]} with it")
    assert differs[True] == 0.0, differs


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["gpt", "angpt"])
def test_full_iteration_cuda_graph_trains_as_eager_steps(family, single_process):
    """--cuda-graph-scope full_iteration: megatron-core's FullCudaGraphWrapper runs 2 steps (2 micro-batches each)
    eagerly, captures the third's whole forward and backward and replays it from then on. fp32, from the same
    weights: the third step (the first replayed) has eager's loss and gradients to fp32 round-off (cuBLAS may pick
    other kernels under capture); later losses only fall (Adam turns round-off near zero into whole steps)."""
    eager_grads, graphed_grads, chunks = [], [], None
    eager, _, _ = train(family, steps=6, microbatches=2, after_step=main_grads(eager_grads))
    try:
        graphed, chunks, _ = train(family, steps=6, microbatches=2, cuda_graph_impl="local",
                                   cuda_graph_scope=["full_iteration"], cuda_graph_warmup_steps=2,
                                   after_step=main_grads(graphed_grads))
        assert step_module.FullCudaGraphWrapper.cuda_graph["training"] is not None
    finally:
        patches.delete_cuda_graphs(chunks or [])
    assert step_module.FullCudaGraphWrapper.cuda_graph["training"] is None
    assert_graphed_steps_are_eager(graphed, eager, graphed_grads, eager_grads, steps=3)
