"""--model-family gpt: megatron-core's GPT as Megatron-LM's pretrain_gpt.py builds it from the same flags
(docs/model.md, GPT). Megatron-LM's defaults (read off its parser: angpt.config.megatron_lm_flags, and megatron-core's
TransformerConfig), each architecture flag on the built model, the refusals, the other families' boundaries,
training and an exact resume; and, where a Megatron-LM checkout is at hand, the very model its own model_provider
builds (benchmarks/megatron_gpt_reference.py; skipped without one)."""

import dataclasses
import math
import os

import pytest
import torch
import torch.nn.functional as F
from megatron.core.activations import squared_relu
from megatron.core.fusions.fused_bias_geglu import quick_gelu
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.gpt.gpt_layer_specs import LNImpl
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.identity_op import IdentityOp
from test_trainer import losses

from angpt.config import megatron_lm
from angpt.config.arguments import parse_args
from angpt.config.megatron_lm_flags import GROUPS
from angpt.config.sections import ArchitectureSection, option_of
from angpt.hf.checkpoint_reader import read_checkpoint
from angpt.hf.errors import ExportError
from angpt.models import build_model
from angpt.models.attention import clear_attention_backend_environment
from angpt.training import checkpointing, distributed, megatron_configs
from angpt.training.dry_run import describe
from angpt.training.megatron_configs import transformer_config
from angpt.training.optimizer import build_optimizer, norm_backend, optimizer_config
from angpt.training.step import build_model_chunks

from conftest import in_process_trainer, load_benchmark

MOCK = ["--mock-data", "--vocab-size", "256", "--train-iters", "10"]
H, HEADS, LAYERS, SEQ, V = 64, 4, 2, 32, 256
SHAPE = ["--num-layers", str(LAYERS), "--hidden-size", str(H), "--num-attention-heads", str(HEADS), "--seq-length",
         str(SEQ)]
# Megatron-LM's default of each flag of its parser (core_v0.16.1), as read from its arguments.py.
MEGATRON_DEFAULTS = {row[0]: row[4] for rows in GROUPS.values() for row in rows}
TC_DEFAULTS = {field.name: field.default for field in dataclasses.fields(TransformerConfig)}
LLAMA = ["--position-embedding-type", "rope", "--swiglu", "--normalization", "RMSNorm", "--group-query-attention",
         "--num-query-groups", "2", "--untie-embeddings-and-output-weights", "--disable-bias-linear"]


def gpt(*argv, world_size=1):
    return parse_args([*MOCK, *SHAPE, "--model-family", "gpt", *argv], world_size=world_size)


def parse_error(argv, capsys, world_size=1) -> str:
    with pytest.raises(SystemExit):
        parse_args([*MOCK, *argv], world_size=world_size)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_gpt_takes_megatron_lms_defaults(seeded):
    config = gpt()
    for field in dataclasses.fields(ArchitectureSection):
        expected = MEGATRON_DEFAULTS[option_of(field.name)]
        if field.name == "add_qkv_bias":  # Megatron-LM's validate_args: a QKV bias wherever the linear layers have one
            expected = MEGATRON_DEFAULTS["--disable-bias-linear"]
        assert getattr(config.architecture, field.name) == expected, field.name
    model = transformer_config(config)
    assert (model.activation_func, model.gated_linear_unit, model.layernorm_epsilon, model.init_method_std,
            model.rotary_base) == (TC_DEFAULTS["activation_func"], TC_DEFAULTS["gated_linear_unit"],
                                   MEGATRON_DEFAULTS["--norm-epsilon"], MEGATRON_DEFAULTS["--init-method-std"],
                                   MEGATRON_DEFAULTS["--rotary-base"])
    assert model.hidden_dropout == model.attention_dropout == 0.0  # angpt's default (Megatron-LM's is 0.1)
    # Tied unless --untie-embeddings-and-output-weights; the MLP 4 x hidden (validate_args); the learned positions'
    # table --seq-length rows where Megatron-LM requires --max-position-embeddings.
    assert model.share_embeddings_and_output_weights == (not MEGATRON_DEFAULTS["--untie-embeddings-and-output-weights"])
    assert (model.ffn_hidden_size, model.max_position_embeddings) == (4 * H, SEQ)
    # The optimizer's recipe: Megatron-LM's weight decay, min lr and warm-up.
    recipe = optimizer_config(config)
    assert (recipe.weight_decay, recipe.min_lr) == (MEGATRON_DEFAULTS["--weight-decay"], MEGATRON_DEFAULTS["--min-lr"])
    _, scheduler = build_optimizer(build_model_chunks(model, V, SEQ), config)
    assert scheduler.lr_warmup_steps == MEGATRON_DEFAULTS["--lr-warmup-iters"]
    assert gpt("--use-rotary-position-embeddings").architecture.position_embedding_type == "rope"  # its old spelling


def linear_layers(layer):
    attention, mlp = layer.self_attention, layer.mlp
    return dict(qkv=attention.linear_qkv, proj=attention.linear_proj, fc1=mlp.linear_fc1, fc2=mlp.linear_fc2)


# Each variant's flags and what the model must hold: the norms' class, the queries' norm, the rows of the learned
# position embeddings (None: none), the rotary channels (None: no RoPE), the QKV projection's rows, the linear
# layers that have a bias, the MLP's first projection's rows, the activation, whether the output layer is the
# embedding. Widths from Megatron-LM's rules: a head is 64 / 4 = 16 channels; --swiglu's MLP is
# int(4 x 64 x 2/3 / 64) x 64 = 128 wide, each other MLP 4 x 64 = 256; grouped-query attention has 2 + 2 x 2 key
# and value heads fewer.
VARIANTS = {
    "megatron_lms_defaults": (["--max-position-embeddings", "48"], dict(
        norm=torch.nn.LayerNorm, qk_norm=IdentityOp, positions=48, rotary=None, qkv=3 * H,
        biases={"qkv", "proj", "fc1", "fc2"}, fc1=4 * H, activation=F.gelu, tied=True)),
    "llama": (LLAMA, dict(
        norm=torch.nn.RMSNorm, qk_norm=IdentityOp, positions=None, rotary=16, qkv=(4 + 2 * 2) * 16, biases=set(),
        fc1=2 * 128, activation=F.silu, tied=False)),
    "squared_relu": (["--squared-relu", "--qk-layernorm", "--position-embedding-type", "rope", "--rotary-percent",
                      "0.5", "--rotary-interleaved", "--use-rope-scaling", "--apply-query-key-layer-scaling"], dict(
        norm=torch.nn.LayerNorm, qk_norm=torch.nn.LayerNorm, positions=None, rotary=8, qkv=3 * H,
        biases={"qkv", "proj", "fc1", "fc2"}, fc1=4 * H, activation=squared_relu, tied=True)),
    "quick_geglu": (["--position-embedding-type", "none", "--quick-geglu", "--normalization", "RMSNorm",
                     "--qk-layernorm", "--disable-bias-linear", "--add-qkv-bias"], dict(
        norm=torch.nn.RMSNorm, qk_norm=torch.nn.RMSNorm, positions=None, rotary=None, qkv=3 * H, biases={"qkv"},
        fc1=2 * 4 * H, activation=quick_gelu, tied=True)),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_each_architecture_flag_reaches_the_built_model(variant, seeded):
    argv, expected = VARIANTS[variant]
    clear_attention_backend_environment()
    model = build_model(transformer_config(gpt(*argv)), V, SEQ)
    for layer in model.decoder.layers:
        assert type(layer.input_layernorm) is type(layer.pre_mlp_layernorm) is expected["norm"]
        assert type(layer.self_attention.q_layernorm) is type(layer.self_attention.k_layernorm) is expected["qk_norm"]
        linears = linear_layers(layer)
        assert {name for name, linear in linears.items() if linear.bias is not None} == expected["biases"]
        assert (linears["qkv"].weight.shape[0], linears["fc1"].weight.shape[0]) == (expected["qkv"], expected["fc1"])
    assert type(model.decoder.final_layernorm) is expected["norm"]
    assert model.config.activation_func is expected["activation"]
    positions = getattr(model.embedding, "position_embeddings", None)
    assert (None if positions is None else positions.weight.shape) == (
        None if expected["positions"] is None else (expected["positions"], H))
    rotary = getattr(model, "rotary_pos_emb", None)
    assert (None if rotary is None else 2 * rotary.inv_freq.numel()) == expected["rotary"]
    # Tied: the output layer has no weight of its own and computes with the embedding's.
    output = model.output_layer.weight
    assert (None if output is None else output.shape) == (None if expected["tied"] else (V, H))


def test_rope_scaling_and_query_key_layer_scaling_reach_megatron_core(seeded):
    model = build_model(transformer_config(gpt(*VARIANTS["squared_relu"][0])), V, SEQ)
    # megatron-core's own Llama 3 scaling of RoPE over 8 of a head's 16 channels, which changes the lowest frequency.
    scaled = RotaryEmbedding(16, rotary_percent=0.5, rope_scaling=True, use_cpu_initialization=True).inv_freq
    plain = RotaryEmbedding(16, rotary_percent=0.5, use_cpu_initialization=True).inv_freq
    assert torch.equal(model.rotary_pos_emb.inv_freq, scaled) and not torch.equal(scaled, plain)
    config = model.config
    # TransformerConfig: query-key layer scaling puts the softmax in fp32 (off by default in Megatron-LM).
    assert (config.rotary_interleaved, config.apply_query_key_layer_scaling, config.attention_softmax_in_fp32) == (
        True, True, True)
    assert transformer_config(gpt()).attention_softmax_in_fp32 is MEGATRON_DEFAULTS["--attention-softmax-in-fp32"]


def test_embedding_init_method_std_initializes_the_embeddings_alone(seeded):
    """--embedding-init-method-std (megatron-core's TransformerConfig field, as Megatron-LM passes it): the word and
    position embeddings drawn from N(0, 0.5^2), the other weights still from --init-method-std's N(0, 0.02^2). The
    sample standard deviation of n normal draws is within 5 / sqrt(2 n) of the true one (5 sigma)."""
    model = build_model(transformer_config(gpt("--embedding-init-method-std", "0.5")), V, SEQ)
    embedding = model.embedding
    for weight, std in ((embedding.word_embeddings.weight, 0.5), (embedding.position_embeddings.weight, 0.5),
                        (model.decoder.layers[0].mlp.linear_fc1.weight, 0.02)):
        assert abs(weight.std().item() - std) <= 5 * std / math.sqrt(2 * weight.numel()), (weight.shape, std)


def test_glu_linear_offset_and_clamp_reach_megatron_cores_gated_mlp(seeded):
    """--glu-linear-offset and --activation-func-clamp-value (megatron-core's TransformerConfig fields, as Megatron-LM
    passes them): the SwiGLU MLP's output computed here from its weights, the gate's input clamped to at most 1, the
    linear half to [-1, 1] and offset by 0.5, on inputs large enough for the clamp to bite."""
    model = build_model(transformer_config(gpt("--swiglu", "--glu-linear-offset", "0.5",
                                               "--activation-func-clamp-value", "1.0")), V, SEQ)
    mlp = model.decoder.layers[0].mlp
    x = torch.randn(SEQ, 2, H) * 10
    gate, linear = F.linear(x, mlp.linear_fc1.weight, mlp.linear_fc1.bias).chunk(2, dim=-1)
    assert gate.max() > 1 and linear.abs().max() > 1
    expected = F.linear(F.silu(gate.clamp(max=1.0)) * (linear.clamp(-1.0, 1.0) + 0.5), mlp.linear_fc2.weight)
    with torch.no_grad():
        output, bias = mlp(x)
    assert torch.allclose(output, expected, atol=1e-5) and torch.equal(bias, mlp.linear_fc2.bias)


def test_an_offset_or_clamp_turns_the_default_activation_fusion_off(monkeypatch):
    """megatron-core's fused SwiGLU takes neither (it refuses an offset, skips a clamp): with a GPU the default
    fusion is on without them and off with either; given explicitly with a clamp, the run says the clamp is skipped;
    a non-gated MLP reads neither, as in Megatron-LM, and the run says so."""
    monkeypatch.setattr(megatron_configs.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(megatron_configs, "model_config", lambda family, **fields: fields)
    for argv, fused in (([], True), (["--glu-linear-offset", "0.5"], False),
                        (["--activation-func-clamp-value", "7"], False)):
        assert transformer_config(gpt("--swiglu", *argv))["bias_activation_fusion"] is fused, argv
    clamped = gpt("--swiglu", "--bias-swiglu-fusion", "--activation-func-clamp-value", "7")
    assert megatron_lm.notes(clamped, cuda=True) == [
        "--activation-func-clamp-value: megatron-core's fused activation does not clamp (as in Megatron-LM, nothing "
        "changes)"]
    assert megatron_lm.notes(gpt("--glu-linear-offset", "0.5", "--activation-func-clamp-value", "0"), cuda=True) == [
        "--glu-linear-offset and --activation-func-clamp-value: megatron-core applies them in a gated MLP (--swiglu, "
        "--quick-geglu) only (as in Megatron-LM, nothing changes)"]


def test_no_rope_freq_skips_rope_on_its_layers(seeded):
    """--no-rope-freq (megatron-core's TransformerConfig field, read as Megatron-LM reads it): 2 on 2 layers is the
    pattern [0, 1], a list expression is evaluated; RoPE skipped on every layer gives the model without position
    embeddings (the same weights), skipped on the second alone does not."""
    rope = ["--position-embedding-type", "rope"]
    assert transformer_config(gpt(*rope, "--no-rope-freq", "2")).no_rope_freq == [0, 1]
    assert transformer_config(gpt(*rope, "--no-rope-freq", "([1]*1+[0])")).no_rope_freq == [1, 0]
    tokens, positions = torch.randint(0, V, (2, SEQ)), torch.arange(SEQ).expand(2, SEQ)

    def logits(*argv):
        model = build_model(transformer_config(gpt(*argv)), V, SEQ)
        model.load_state_dict(weights, strict=False)
        with torch.no_grad():
            return model(tokens, positions, None)

    weights = build_model(transformer_config(gpt("--position-embedding-type", "none")), V, SEQ).state_dict()
    none = logits("--position-embedding-type", "none")
    assert torch.equal(logits(*rope, "--no-rope-freq", "1"), none)
    assert not torch.allclose(logits(*rope, "--no-rope-freq", "2"), none, atol=1e-3)


def test_fp32_residual_connection_casts_gpt_pluss_embeddings_to_fp32(seeded):
    """megatron-core 0.16.1's meaning (as Megatron-LM passes the field): the embeddings' output in fp32, the bf16
    one's values exactly; the first bias-dropout-add casts the residual to the attention output's dtype, so that the
    logits are the run's without the flag, bit for bit."""
    tokens, positions = torch.randint(0, V, (2, SEQ)), torch.arange(SEQ).expand(2, SEQ)
    out = {}
    for argv in ([], ["--fp32-residual-connection"]):
        torch.manual_seed(0)
        config = transformer_config(parse_args([*MOCK, *SHAPE, "--model-family", "gptplus", "--bf16", *argv],
                                               world_size=1))
        assert config.fp32_residual_connection is bool(argv)
        model = build_model(config, V, SEQ)
        with torch.no_grad():
            out[bool(argv)] = model.embedding(tokens, positions), model(tokens, positions, None)
    assert out[True][0].dtype == torch.float32 and torch.equal(out[True][0], out[False][0].float())
    assert out[True][1].dtype == torch.bfloat16 and torch.equal(out[True][1], out[False][1])


def test_the_dry_run_counts_the_parameters_of_megatron_lms_gpt(single_process):
    """Counted here from the shapes: the embedding (tied: once), the positions, per layer two LayerNorms and the
    four biased linear layers, the final LayerNorm."""
    per_layer = 2 * 2 * H + (3 * H * H + 3 * H) + (H * H + H) + (4 * H * H + 4 * H) + (4 * H * H + H)
    expected = V * H + SEQ * H + LAYERS * per_layer + 2 * H
    distributed.destroy_model_parallel()  # the dry run sets up its own one-process groups
    try:
        report = describe(gpt(world_size=2))
    finally:
        distributed.destroy_model_parallel()
        distributed.initialize()
    assert f"({expected:,}): embedding" in report and "(tied to the output layer)" in report


@pytest.mark.parametrize("argv,message", [
    (["--num-query-groups", "2"], "--num-query-groups 2 with --model-family gpt needs --group-query-attention"),
    (["--qk-l2-norm"], "--qk-l2-norm with --model-family gpt: Megatron-LM's pretrain_gpt.py hands it to the "
                       "Transformer Engine spec only"),
    (["--rotary-percent", "0.5"], "--rotary-percent 0.5 with --model-family gpt: it applies to "
                                  "--position-embedding-type rope"),
    (["--position-embedding-type", "mrope"], "--position-embedding-type mrope with --model-family gpt: "
                                             "megatron-core's GPTModel builds learned_absolute, rope and none"),
    (["--apply-layernorm-1p"], "--apply-layernorm-1p with --model-family gpt: megatron-core's torch LayerNorm"),
    (["--squared-relu", "--bias-gelu-fusion"], "--bias-gelu-fusion with --model-family gpt: megatron-core fuses GELU"),
    (["--bias-swiglu-fusion"], "--bias-swiglu-fusion with --model-family gpt: it fuses --swiglu's activation"),
    (["--swiglu", "--squared-relu"], "argument --squared-relu: not allowed with argument --swiglu"),
    (["--swiglu", "--hidden-size", "16"], "--swiglu with --hidden-size 16: Megatron-LM's MLP width"),
    (["--recompute-granularity", "selective", "--recompute-modules", "qk_norm"],
     "GPT's QK-norm is megatron-core's own norm module"),
    (["--recompute-granularity", "selective", "--recompute-modules", "residual_update"],
     "GPT's residual is a plain add"),
    (["--rope-scaling-factor", "4"], "Megatron-LM's pretrain_gpt.py does not hand it to GPTModel"),
    (["--angpt-post-norm", "none"], "--angpt-post-norm does not apply to --model-family gpt"),
    (["--swiglu", "--bias-swiglu-fusion", "--glu-linear-offset", "0.5"], "--glu-linear-offset 0.5 with --model-family "
     "gpt: megatron-core's fused activation takes an offset with --quick-geglu only (its check)"),
    (["--activation-func-clamp-value", "-1"], "--activation-func-clamp-value -1.0 cannot be negative"),
    (["--no-rope-freq", "2"], "--no-rope-freq 2 with --model-family gpt: it applies to --position-embedding-type rope"),
    (["--position-embedding-type", "rope", "--no-rope-freq", "3"], "--no-rope-freq 3 must divide --num-layers 2 "
     "(megatron-core's check)"),
    (["--position-embedding-type", "rope", "--no-rope-freq", "-1"], "--no-rope-freq -1 cannot be negative"),
    (["--position-embedding-type", "rope", "--no-rope-freq", "[0,1,1]"], "--no-rope-freq: the pattern has 3 entries, "
     "one per layer of --num-layers 2"),
    (["--position-embedding-type", "rope", "--no-rope-freq", "[0]+x"], "argument --no-rope-freq: invalid "
     "no_rope_freq_type value: '[0]+x'"),
    (["--fp32-residual-connection"], "--fp32-residual-connection needs --bf16 or --fp16 (Megatron-LM's check)"),
    (["--bf16", "--fp32-residual-connection"], "--fp32-residual-connection with --model-family gpt --normalization "
     "LayerNorm on --transformer-impl local: megatron-core's torch norms take no fp32 input"),
])
def test_what_megatron_lm_would_not_build_or_would_ignore_is_refused(argv, message, capsys):
    assert message in parse_error([*SHAPE, "--model-family", "gpt", *argv], capsys)


def test_sequence_parallelism_over_megatron_cores_torch_norms_is_refused(capsys):
    assert "megatron-core's torch norms refuse sequence parallelism" in parse_error(
        ["--model-family", "gpt", "--tensor-model-parallel-size", "2", "--sequence-parallel"], capsys, world_size=2)


def test_what_the_families_of_megatron_core_layers_take(seeded):
    # GPT's hidden dropout and layernorm recompute are megatron-core's layer's (GPT+ has them too).
    config = gpt("--hidden-dropout", "0.1", "--recompute-granularity", "selective", "--recompute-modules", "layernorm")
    assert (transformer_config(config).hidden_dropout, config.model.recompute_modules) == (0.1, ("layernorm",))


# The families of the paper, at each architecture flag's boundary: their own value (or Megatron-LM's default,
# which asks for nothing) accepted, another refused in one line saying what the family does.
@pytest.mark.parametrize("family,accepted,refused,message", [
    ("gptplus", ["--normalization", "RMSNorm"], ["--normalization", "LayerNorm"], "GPT+ normalizes with RMSNorm"),
    ("angpt", ["--position-embedding-type", "rope"], ["--position-embedding-type", "learned_absolute"],
     "every family uses RoPE"),
    ("ngpt", ["--rotary-percent", "1.0"], ["--rotary-percent", "0.5"], "RoPE rotates every channel of a head"),
    ("gptplus", ["--disable-bias-linear"], ["--add-qkv-bias"], "no family has biases in its linear layers"),
    ("gptplus", ["--swiglu"], ["--squared-relu"], "the families use SwiGLU"),
    ("angpt", ["--swiglu"], ["--quick-geglu"], "the families use SwiGLU"),
    ("gptplus", ["--qk-layernorm"], ["--qk-l2-norm"], "GPT+ normalizes q and k with RMSNorm, not an L2 norm"),
    ("gptplus", ["--use-rotary-position-embeddings"], ["--rotary-interleaved"], "the families rotate halves"),
    ("angpt", ["--group-query-attention"], ["--use-rope-scaling"], "the families' RoPE is not scaled"),
    ("gptplus", ["--attention-softmax-in-fp32"], ["--apply-query-key-layer-scaling"],
     "the families' softmax scale is fixed"),
    ("ngpt", ["--no-bias-gelu-fusion"], ["--bias-gelu-fusion"], "nGPT has no GELU"),
    ("angpt", ["--init-method-std", "0.02"], ["--embedding-init-method-std", "0.5"],
     "the families initialize the embedding as docs/model.md says"),
    ("gptplus", ["--glu-linear-offset", "0"], ["--glu-linear-offset", "0.5"],
     "the families' SwiGLU multiplies by its linear half, without an offset"),
    ("ngpt", ["--swiglu"], ["--activation-func-clamp-value", "7"], "the families' SwiGLU does not clamp"),
    ("gptplus", ["--position-embedding-type", "rope"], ["--no-rope-freq", "2"],
     "every layer of the families applies RoPE"),
    ("angpt", ["--bf16"], ["--fp32-residual-connection", "--bf16"], "its residual stream feeds the linear layers "
     "without a norm in between and is updated by its own normalized LERP"),
])
def test_the_other_families_take_their_own_architecture_and_refuse_another(family, accepted, refused, message,
                                                                           capsys):
    parse_args([*MOCK, "--model-family", family, *accepted], world_size=1)
    line = parse_error(["--model-family", family, *refused], capsys)
    assert line.startswith(f"angpt.pretrain: error: {refused[0]}") and f"--model-family {family}: {message}" in line


def test_megatron_lms_flags_leave_the_other_families_models_as_they_were():
    megatron = ["--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear", "--qk-layernorm",
                "--position-embedding-type", "rope", "--rotary-percent", "1.0", "--group-query-attention",
                "--attention-softmax-in-fp32", "--apply-layernorm-1p", "--max-position-embeddings", "256"]
    def fields(config):  # every field but the initializations, functions made anew for each config
        return {field.name: getattr(config, field.name) for field in dataclasses.fields(config)
                if not callable(getattr(config, field.name))}

    for family in ("gptplus", "angpt", "ngpt"):
        plain = transformer_config(parse_args([*MOCK, "--model-family", family], world_size=1))
        given = transformer_config(parse_args([*MOCK, "--model-family", family, *megatron], world_size=1))
        assert fields(given) == fields(plain), family
    # anGPT and nGPT replace the norm flags by their own normalization, and say so; an L2 QK-norm too.
    angpt = parse_args([*MOCK, "--model-family", "angpt", "--qk-l2-norm"], world_size=1)
    assert megatron_lm.notes(angpt) == ["--qk-l2-norm: replaced by anGPT's own normalization (docs/model.md)"]


@pytest.mark.slow  # two short in-process runs
@pytest.mark.parametrize("argv", [[], LLAMA], ids=["megatron_lms_defaults", "llama"])
def test_gpt_trains(argv, tmp_path, single_process):
    run = ["--mock-data", "--vocab-size", "64", "--model-family", "gpt", "--num-layers", "2", "--hidden-size", "32",
           "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "4",
           "--eval-iters", "0", "--lr", "1e-2", "--log-interval", "1", "--train-iters", "10", "--save", str(tmp_path),
           *argv]
    assert in_process_trainer(run).run() == 0
    curve = losses(tmp_path)
    assert sorted(curve) == list(range(1, 11)) and all(math.isfinite(loss) for loss in curve.values())
    # From about ln 128 = 4.85 nats (the padded vocabulary) on megatron-core's mock sequences: 1 nat and more
    # lower after 10 steps in both variants.
    assert sum(curve[i] for i in (8, 9, 10)) / 3 < curve[1] - 0.5


@pytest.mark.slow  # three in-process runs
def test_gpt_resumes_exactly_and_refuses_another_architecture_or_an_export(tmp_path, single_process):
    flags = [*MOCK[:-2], "--model-family", "gpt", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads",
             "4", "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "2", "--eval-iters", "0",
             "--lr", "1e-3", "--train-iters", "4", "--log-interval", "1"]
    uninterrupted, resumed = tmp_path / "uninterrupted", tmp_path / "resumed"
    assert in_process_trainer([*flags, "--save", str(uninterrupted), "--save-interval", "2"]).run() == 0
    assert in_process_trainer([*flags, "--save", str(resumed), "--exit-interval", "2"]).run() == 0
    assert in_process_trainer([*flags, "--save", str(resumed), "--load", str(resumed)]).run() == 0
    assert losses(resumed) == losses(uninterrupted) and sorted(losses(resumed)) == [1, 2, 3, 4]
    with pytest.raises(checkpointing.CheckpointError, match=(
            "--normalization LayerNorm \\(this run: RMSNorm\\), --disable-bias-linear off \\(this run: on\\), "
            "--add-qkv-bias on \\(this run: off\\); give the flags")):
        in_process_trainer([*flags, "--normalization", "RMSNorm", "--disable-bias-linear", "--load", str(resumed)])
    with pytest.raises(ExportError, match="the export of --model-family gpt is not built"):
        read_checkpoint(str(resumed))


CHECKOUT = os.environ.get("MEGATRON_LM_CHECKOUT", "/work/.mirror/NVIDIA+Megatron-LM/repo")


@pytest.mark.slow  # Megatron-LM's and angpt's model, each built in a process of its own
@pytest.mark.skipif(not os.path.exists(CHECKOUT), reason=f"no Megatron-LM checkout at {CHECKOUT} "
                    "($MEGATRON_LM_CHECKOUT)")
def test_megatron_lms_model_provider_builds_the_same_model(tmp_path):
    reference = load_benchmark("megatron_gpt_reference")
    tree, _ = reference.work_tree(CHECKOUT, reference.TAG, str(tmp_path / "megatron-lm"))
    _, flags = reference.VARIANTS["gpt3"]
    megatron = reference.build("megatron", tree, [*reference.SHARED, *reference.CPU_FLAGS, *flags], str(tmp_path))
    angpt = reference.build("angpt", tree, [*reference.SHARED, *flags], str(tmp_path))
    assert "error" not in megatron and "error" not in angpt, (megatron.get("error"), angpt.get("error"))
    row = reference.compare(megatron, angpt)
    assert row["names_match"] and row["shapes_match"]
    assert (row["weights_max_abs_diff"], row["logits_max_abs_diff"], row["grads_max_abs_diff"]) == (0.0, 0.0, 0.0)


@pytest.mark.parametrize("argv, normalization", [([], "LayerNorm"), (["--normalization", "RMSNorm"], "RMSNorm")])
def test_the_norms_log_line_names_gpts_normalization_and_megatron_cores_class(argv, normalization):
    line = norm_backend(transformer_config(gpt(*argv)))
    assert line == f"{normalization} by megatron-core's {LNImpl.__name__}"
