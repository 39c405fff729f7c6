"""Multi-token prediction (--mtp-num-layers, --mtp-loss-scaling-factor, --mtp-standalone) in --model-family gpt, as
Megatron-LM's pretrain_gpt.py builds it on megatron-core (core_v0.16.1): the MTP parameters of megatron-core's own
GPTModel, the training objective computed here from the MTP layers' outputs, the logged MTP losses, an exact resume,
pipeline parallelism, the dry run's counts, and Megatron-LM's checks at their boundaries."""

import math
import os

import pytest
import torch
import torch.nn.functional as F
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_decoder_layer_specs,
    get_gpt_layer_local_spec,
    get_gpt_mtp_block_spec,
)
from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler, MTPLossLoggingHelper
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from test_trainer import checkpoint_tensors, copy_checkpoint, records

from angpt.config import megatron_lm
from angpt.config.arguments import parse_args
from angpt.models import build_model
from angpt.telemetry.performance import model_flops_per_token
from angpt.training import distributed
from angpt.training.dry_run import describe
from angpt.training.megatron_configs import transformer_config

from conftest import ROOT, in_process_trainer
from launch import launch

MOCK = ["--mock-data", "--vocab-size", "256", "--train-iters", "10"]
H, HEADS, LAYERS, SEQ, V = 64, 4, 2, 32, 256
SHAPE = ["--num-layers", str(LAYERS), "--hidden-size", str(H), "--num-attention-heads", str(HEADS), "--seq-length",
         str(SEQ)]
ROPE = ["--position-embedding-type", "rope"]


def gpt(*argv, world_size=1):
    return parse_args([*MOCK, *SHAPE, "--model-family", "gpt", *argv], world_size=world_size)


def parse_error(argv, capsys, world_size=1) -> str:
    with pytest.raises(SystemExit):
        parse_args([*MOCK, *SHAPE, *argv], world_size=world_size)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize("argv", [ROPE, ["--position-embedding-type", "none", "--normalization", "RMSNorm",
                                         "--swiglu", "--untie-embeddings-and-output-weights", "--qk-layernorm"]],
                         ids=["megatron_lms_defaults_with_rope", "llama_like"])
def test_the_mtp_layers_are_megatron_cores(argv, seeded):
    """The parameters' names and shapes of megatron-core's GPTModel built here from gpt_builders' calls (the local
    layer spec, get_gpt_mtp_block_spec around the decoder's last layer spec), from the same TransformerConfig."""
    config = transformer_config(gpt(*argv, "--mtp-num-layers", "2"))
    ours = build_model(config, V, SEQ)
    normalization = config.normalization
    megatron = GPTModel(
        config, get_gpt_layer_local_spec(qk_layernorm=config.qk_layernorm, normalization=normalization), V, SEQ,
        position_embedding_type=config.position_embedding_type,
        share_embeddings_and_output_weights=config.share_embeddings_and_output_weights,
        mtp_block_spec=get_gpt_mtp_block_spec(
            config, get_gpt_decoder_layer_specs(config, use_transformer_engine=False, normalization=normalization)[-1],
            use_transformer_engine=False))
    shapes = {name: tuple(param.shape) for name, param in ours.named_parameters()}
    assert shapes == {name: tuple(param.shape) for name, param in megatron.named_parameters()}
    assert sum(name.startswith("mtp.layers.1.") for name in shapes) > 0
    # megatron-core's modules, core attention through angpt's subclass (megatron-core's own path on CPU).
    theirs = dict(megatron.mtp.named_modules())
    assert all(isinstance(module, type(theirs[name])) for name, module in ours.mtp.named_modules())
    # Megatron-LM's default (None) and 0 build none.
    for extra in ([], ["--mtp-num-layers", "0"]):
        assert not hasattr(build_model(transformer_config(gpt(*argv, *extra)), V, SEQ), "mtp")


def test_the_objective_is_the_lm_loss_plus_the_scaled_mean_of_the_mtp_losses(seeded):
    """Two MTP layers, --mtp-loss-scaling-factor 0.3 and a loss mask with holes: the gradients of the LM loss alone,
    megatron-core's MTPLossAutoScaler adding the MTP losses' gradients, equal those of LM + 0.3 / 2 x (mtp_1 + mtp_2)
    on a copy of the model computed here: mtp_k the cross-entropy of the output layer's logits of the k-th MTP layer's
    output at position i against the token at i + 1 + k (the labels shifted k more), averaged over the positions whose
    shifted mask is 1. The losses megatron-core tracks for the log are those mtp_k."""
    config = transformer_config(gpt(*ROPE, "--mtp-num-layers", "2", "--mtp-loss-scaling-factor", "0.3"))
    model = build_model(config, V, SEQ)
    twin = build_model(config, V, SEQ)
    twin.load_state_dict(model.state_dict())
    tokens = torch.randint(0, V, (2, SEQ))
    labels = torch.roll(tokens, -1, dims=1)
    positions = torch.arange(SEQ).expand(2, SEQ)
    mask = torch.ones(2, SEQ)
    mask[0, 5:9] = 0
    mask[1, -3:] = 0

    def lm_loss(per_token):
        return (per_token * mask).sum() / mask.sum()

    MTPLossLoggingHelper.tracker.clear()
    MTPLossAutoScaler.set_loss_scale(torch.tensor(1.0))  # the schedule's with one micro-batch
    lm_loss(model(tokens, positions, None, labels=labels, loss_mask=mask)).backward()
    tracked = MTPLossLoggingHelper.tracker["values"].clone()

    outputs = []
    hooks = [layer.register_forward_hook(lambda module, args, output: outputs.append(output[0]))
             for layer in twin.mtp.layers]
    MTPLossAutoScaler.set_loss_scale(torch.tensor(0.0))  # megatron-core's MTP gradients off: the objective is ours
    try:
        lm = lm_loss(twin(tokens, positions, None, labels=labels, loss_mask=mask))
        head = twin.embedding.word_embeddings.weight  # tied, Megatron-LM's default
        mtp = []
        for k, hidden in enumerate(outputs, start=1):
            logits = F.linear(hidden, head).transpose(0, 1)[:, :SEQ - k]  # [b, s - k, V]
            ce = F.cross_entropy(logits.reshape(-1, V), labels[:, k:].reshape(-1), reduction="none").view(2, SEQ - k)
            shifted = mask[:, k:]
            mtp.append((ce * shifted).sum() / shifted.sum())
        (lm + 0.3 / 2 * (mtp[0] + mtp[1])).backward()
    finally:
        MTPLossAutoScaler.set_loss_scale(torch.tensor(1.0))
        for hook in hooks:
            hook.remove()

    assert torch.allclose(tracked, torch.stack(mtp).detach(), rtol=1e-5)
    grads = dict(model.named_parameters())
    for name, param in twin.named_parameters():
        assert torch.allclose(grads[name].grad, param.grad, rtol=1e-4, atol=1e-7), name
    assert twin.mtp.layers[1].eh_proj.weight.grad.abs().sum() > 0


def _event_steps(directory) -> dict[str, list[tuple[int, float]]]:
    events = EventAccumulator(str(directory), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [(event.step, event.value) for event in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


RUN = ["--mock-data", "--vocab-size", "64", "--model-family", "gpt", "--num-layers", "2", "--hidden-size", "32",
       "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "4",
       "--eval-iters", "0", "--lr", "1e-2", "--train-iters", "4", "--log-interval", "1", *ROPE, "--mtp-num-layers",
       "1"]


def figures(run_dir) -> dict[int, tuple[float, float]]:
    return {r["iteration"]: (r["lm_loss"], r["mtp_1_loss"]) for r in records(run_dir)}


@pytest.mark.slow  # three in-process runs
def test_mtp_trains_logs_its_loss_and_resumes_exactly(tmp_path, single_process, capsys):
    """Megatron-LM's "mtp_1 loss" in the log line, metrics.jsonl and TensorBoard at every step; resumed from its
    checkpoint (which holds the MTP layer), the run logs the same losses as the uninterrupted one, bit for bit."""
    uninterrupted, resumed = tmp_path / "uninterrupted", tmp_path / "resumed"
    assert in_process_trainer([*RUN, "--save", str(uninterrupted), "--save-interval", "2"]).run() == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith(" iteration")]
    assert len(lines) == 4 and all("| lm loss: " in line and "| mtp_1 loss: " in line for line in lines)
    curve = figures(uninterrupted)
    assert sorted(curve) == [1, 2, 3, 4] and all(math.isfinite(mtp) and mtp > 0 for _, mtp in curve.values())
    assert curve[4][1] < curve[1][1]  # the MTP layer learns
    tensorboard = _event_steps(uninterrupted / "tensorboard")
    assert [value for _, value in tensorboard["train/mtp_1_loss"]] == pytest.approx([curve[i][1] for i in range(1, 5)])
    assert in_process_trainer([*RUN, "--save", str(resumed), "--exit-interval", "2"]).run() == 0
    assert in_process_trainer([*RUN, "--save", str(resumed), "--load", str(resumed)]).run() == 0
    assert figures(resumed) == curve


# {case: (the one-process run's flags beyond RUN, the two-stage run's)}: the MTP layer on the last stage (Megatron-LM's
# default, with its copy of the tied embedding); on the first of two stages (a layout's m before the last:
# megatron-core's mtp_standalone, whose sends carry their shapes), untied, where only Megatron-LM's embedding group
# (get_embedding_ranks: the first stage alone, not the last stage's output layer; megatron-core's default pairs them,
# and iteration 3's grad norm was 2.656 for 2.465) keeps the weights right; and in the last of two virtual stages a rank
# of an uneven layout (rank 0: the embedding alone, then a layer; rank 1: a layer, then MTP and the loss).
PIPELINES = {
    "last_stage": ([], ["--pipeline-model-parallel-size", "2"]),
    "standalone_untied": (["--untie-embeddings-and-output-weights"],
                          ["--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout", "Ettm|L"]),
    "virtual_stages": ([], ["--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout", "E|t|t|mL"]),
}
_ONE_PROCESS_RUNS = {}  # {its flags: its run directory}: the tied cases continue the same one-process run


@pytest.mark.slow
@pytest.mark.multiprocess  # one torchrun launch of two ranks each, after an in-process run
@pytest.mark.parametrize("case", PIPELINES)
def test_mtp_on_two_pipeline_stages_continues_a_one_process_run(case, tmp_path_factory, single_process):
    """Pipeline parallelism 2, loading the one-process run's checkpoint of iteration 2 (MTP layer and all) and saving
    its own: the LM and MTP losses and the grad norms of iterations 3 and 4 are the one-process run's, and so are the
    weights saved after them."""
    flags, pipeline = PIPELINES[case]
    one = _ONE_PROCESS_RUNS.get(tuple(flags))
    if one is None:
        one = _ONE_PROCESS_RUNS[tuple(flags)] = tmp_path_factory.mktemp("pp1")
        assert in_process_trainer([*RUN, *flags, "--save", str(one), "--save-interval", "2"]).run() == 0
    two = tmp_path_factory.mktemp(case)
    copy_checkpoint(one, 2, two)
    done = launch(["-m", "angpt.pretrain", *RUN, *flags, *pipeline, "--save", str(two), "--load", str(two),
                   "--save-interval", "2"], nproc=2,
                  env={**os.environ, "PYTHONPATH": ROOT, "PYTHONWARNINGS": "ignore"}, timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    expected, got = figures(one), figures(two)
    assert sorted(got) == [3, 4]
    grad_norms = [{r["iteration"]: r["grad_norm"] for r in records(run)} for run in (one, two)]
    for iteration in (3, 4):
        assert got[iteration] == pytest.approx(expected[iteration], rel=1e-5), iteration
        assert grad_norms[1][iteration] == pytest.approx(grad_norms[0][iteration], rel=1e-5), iteration
    saved_one, saved_two = checkpoint_tensors(one, 4), checkpoint_tensors(two, 4)
    mtp_keys = [key for key in saved_one if "mtp.layers.0." in key]
    assert mtp_keys and set(saved_two) == set(saved_one)
    for key in saved_one:
        assert torch.allclose(saved_one[key], saved_two[key], rtol=1e-4, atol=1e-6), key


def test_the_dry_run_counts_the_mtp_layers(single_process):
    """Counted here from the shapes: per MTP layer the embedding's and hidden state's LayerNorms, the projection of
    their concatenation (2H -> H, no bias), a decoder layer and its final LayerNorm; with pipeline parallelism the last
    stage holds a copy of the word embedding (as it does for a head tied to it without MTP). The FLOPs count
    Megatron-LM's MTP terms: a layer, the projection and logits per MTP layer."""
    per_layer = 2 * 2 * H + (3 * H * H + 3 * H) + (H * H + H) + (4 * H * H + 4 * H) + (4 * H * H + H)
    per_mtp_layer = 3 * 2 * H + 2 * H * H + per_layer
    distributed.destroy_model_parallel()
    try:
        plain = describe(gpt(*ROPE, world_size=2))
        distributed.destroy_model_parallel()  # each dry run sets up its own one-process groups
        report = describe(gpt(*ROPE, "--mtp-num-layers", "2", "--pipeline-model-parallel-size", "2", world_size=2))
        distributed.destroy_model_parallel()
        tied = describe(gpt(*ROPE, "--pipeline-model-parallel-size", "2", world_size=2))
        distributed.destroy_model_parallel()
        untied = describe(gpt(*ROPE, "--untie-embeddings-and-output-weights", "--pipeline-model-parallel-size", "2",
                              world_size=2))
    finally:
        distributed.destroy_model_parallel()
        distributed.initialize()
    total = V * H + LAYERS * per_layer + 2 * H
    assert f"({total:,}): embedding" in plain
    assert f"({total + 2 * per_mtp_layer:,}): embedding" in report
    last_stage = per_layer + 2 * H + 2 * per_mtp_layer + V * H
    assert f"stage 1 {last_stage / 1e3:.2f}k" in report
    # Without MTP the last stage's head holds the copy where tied, its own weight where not: the same count.
    assert f"stage 1 {(per_layer + 2 * H + V * H) / 1e3:.2f}k" in tied
    assert f"stage 1 {(per_layer + 2 * H + V * H) / 1e3:.2f}k" in untied
    # A layout's m on the middle stage of 3: that stage holds its layer, the final norm (after the last layer), the MTP
    # layers and a copy of the word embedding; the last stage, the loss alone, its tied head's copy.
    distributed.destroy_model_parallel()
    try:
        standalone = describe(gpt(*ROPE, "--mtp-num-layers", "2", "--pipeline-model-parallel-size", "3",
                                  "--pipeline-model-parallel-layout", "Et|tmm|L", world_size=3))
    finally:
        distributed.destroy_model_parallel()
        distributed.initialize()
    assert f"stage 1 {last_stage / 1e3:.2f}k" in standalone
    assert f"stage 2 {V * H / 1e3:.2f}k" in standalone
    config, base = transformer_config(gpt(*ROPE, "--mtp-num-layers", "2")), transformer_config(gpt(*ROPE))
    layer = (model_flops_per_token(base, SEQ, V) - 3 * 2 * V * H) / 3 / 2 / LAYERS
    assert model_flops_per_token(config, SEQ, V) - model_flops_per_token(base, SEQ, V) == pytest.approx(
        3 * 2 * 2 * (layer + 2 * H * H + H * V))


@pytest.mark.parametrize("argv,expected", [
    # Megatron-LM's get_embedding_ranks over pipeline ranks 10, 11, 12, 13: the first; the last where tied; the MTP
    # stage's (m on rank 12); one stage: itself.
    (["--pipeline-model-parallel-size", "4"], [10, 13]),
    (["--pipeline-model-parallel-size", "4", "--untie-embeddings-and-output-weights"], [10]),
    (["--pipeline-model-parallel-size", "4", "--mtp-num-layers", "1", "--pipeline-model-parallel-layout", "Et|tt|tm|L"],
     [10, 12, 13]),
    (["--pipeline-model-parallel-size", "4", "--mtp-num-layers", "1", "--pipeline-model-parallel-layout", "Et|tt|tm|L",
      "--untie-embeddings-and-output-weights"], [10, 12]),
    (["--pipeline-model-parallel-size", "4", "--mtp-num-layers", "1", "--untie-embeddings-and-output-weights"],
     [10, 13]),
    ([], [10]),
])
def test_the_embedding_group_is_megatron_lms(argv, expected):
    stages = int(argv[1]) if argv else 1
    config = transformer_config(gpt(*ROPE, "--num-layers", "4", *argv, world_size=stages))
    assert distributed.embedding_ranks(list(range(10, 10 + stages)), config) == expected


@pytest.mark.parametrize("argv,message", [
    (["--mtp-num-layers", "-1", *ROPE], "--mtp-num-layers -1 cannot be negative"),
    (["--mtp-num-layers", "1"], "--mtp-num-layers 1 with --position-embedding-type learned_absolute: multi-token "
                                "prediction takes rope or none (Megatron-LM's check)"),
    (["--mtp-num-layers", "1", *ROPE, "--recompute-granularity", "full", "--recompute-num-layers", "2"],
     "--mtp-num-layers 1 with --recompute-granularity full --recompute-method uniform needs --recompute-num-layers 1, "
     "not 2 (megatron-core's MTP layer asserts it"),
    (["--mtp-num-layers", "1", *ROPE, "--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout",
      "Et|tL"], "Number of mtp layers in layout must match mtp_num_layers"),
    # megatron-core's own check: m in the last virtual stage of its rank.
    (["--mtp-num-layers", "1", *ROPE, "--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout",
      "Et|t||m||L"], "Currently we restrict that the MTP should be always in the last"),
    # Beside the first stage's embedding in a virtual stage of its own (rank 0's chunks: Et, then ttm).
    (["--mtp-num-layers", "1", *ROPE, "--num-layers", "4", "--pipeline-model-parallel-size", "2",
      "--pipeline-model-parallel-layout", "Et|t|ttm|L"], "puts the MTP layers (m) in the first pipeline rank's last "
     "virtual stage, beside its embedding: megatron-core 0.16.1 keeps one copy of the word embedding per rank"),
])
def test_what_megatron_lm_refuses_with_mtp_is_refused(argv, message, capsys):
    world_size = 3 if "3" in argv else 2
    assert message in parse_error(["--model-family", "gpt", *argv], capsys, world_size=world_size)


def test_megatron_lms_mtp_boundaries_are_accepted():
    # 0 asks for nothing (Megatron-LM checks the positions only for a positive count); rope and none take MTP; uniform
    # recompute of one layer at a time; m on the last stage of a layout.
    assert gpt("--mtp-num-layers", "0").architecture.mtp_num_layers == 0
    for positions in ("rope", "none"):
        config = gpt("--position-embedding-type", positions, "--mtp-num-layers", "1")
        assert transformer_config(config).mtp_num_layers == 1
    assert gpt(*ROPE, "--mtp-num-layers", "1", "--recompute-granularity", "full", "--recompute-num-layers", "1")
    layout = gpt(*ROPE, "--mtp-num-layers", "1", "--pipeline-model-parallel-size", "2",
                 "--pipeline-model-parallel-layout", "Et|tmL", world_size=2)
    assert transformer_config(layout).mtp_standalone is False
    # m on a stage before the last (megatron-core's mtp_standalone), with or without virtual stages (rank 1 of 3 holds
    # m in its second virtual stage: Et, t, t, t, tm, L over ranks 0, 1, 2, 0, 1, 2).
    for stages, layout, argv in ((2, "Ettm|L", []), (3, "Et|tm|L", []),
                                 (3, "Et|t|t|t|tm|L", ["--num-layers", "5"])):
        standalone = gpt(*ROPE, "--mtp-num-layers", "1", "--pipeline-model-parallel-size", str(stages),
                         "--pipeline-model-parallel-layout", layout, *argv, world_size=stages)
        assert transformer_config(standalone).mtp_standalone is True, layout
    assert transformer_config(gpt("--mtp-loss-scaling-factor", "0.5", "--mtp-num-layers", "1", *ROPE)
                              ).mtp_loss_scaling_factor == 0.5


def test_what_megatron_lm_ignores_is_said():
    assert megatron_lm.notes(gpt("--mtp-loss-scaling-factor", "0.5")) == [
        "--mtp-loss-scaling-factor: without --mtp-num-layers there is no MTP loss to weigh (as in Megatron-LM, nothing "
        "changes)"]
    assert megatron_lm.notes(gpt("--mtp-standalone")) == [
        "--mtp-standalone: without pipeline parallelism no stage sends to another (as in Megatron-LM, nothing "
        "changes)"]
    assert megatron_lm.notes(gpt(*ROPE, "--mtp-num-layers", "1", "--recompute-granularity", "full",
                                 "--recompute-method", "block")) == [
        "--recompute-method block: megatron-core does not recompute the MTP layers (its warning: not supported for "
        "MTP yet), as in Megatron-LM"]
    # Megatron-LM's values of the flags: nothing to say.
    assert megatron_lm.notes(gpt("--mtp-loss-scaling-factor", "0.1")) == []
    # With pipeline parallelism it reaches megatron-core's config (its p2p then exchanges shapes).
    config = gpt("--mtp-standalone", "--pipeline-model-parallel-size", "2", world_size=2)
    assert transformer_config(config).mtp_standalone is True


@pytest.mark.parametrize("family", ["angpt", "ngpt", "gptplus"])
def test_the_paper_families_train_next_token_prediction(family, capsys):
    """Megatron-LM's defaults (and 0 MTP layers) accepted; any MTP refused in one line naming what the family trains."""
    parse_args([*MOCK, "--model-family", family, "--mtp-num-layers", "0", "--mtp-loss-scaling-factor", "0.1"],
               world_size=1)
    for argv in (["--mtp-num-layers", "1"], ["--mtp-loss-scaling-factor", "0.2"], ["--mtp-standalone"]):
        line = parse_error(["--model-family", family, *argv], capsys)
        assert line.startswith(f"angpt.pretrain: error: {argv[0]}") and (
            f"--model-family {family}: the families train next-token prediction, without multi-token prediction "
            "layers (docs/model.md)") in line
