"""Megatron-LM's flags (angpt.config.megatron_lm): every flag of its pretraining parser is implemented, implied
or refused with a reason, never unrecognized; docs/megatron.md is what the table says."""

import collections
import json
import os
import pathlib
import subprocess
import sys

import megatron.core
import pytest
import torch
import torch.nn.functional as F
from megatron.core import jit, tensor_parallel
from megatron.core.transformer import TransformerConfig

from angpt.config import megatron_lm
from angpt.config.arguments import parse_args
from angpt.config.megatron_lm_flags import GROUPS
from angpt.config.parser import build_parser
from angpt.data.gpt_datasets import flag_vocabulary
from angpt.training.megatron_configs import transformer_config

from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "tools"))
import megatron_flags_doc  # noqa: E402 (a tool, not a package)

BASE = ["--train-iters", "10", "--mock-data", "--vocab-size", "256"]


def parse_error(argv, capsys) -> str:
    with pytest.raises(SystemExit) as exit_:
        parse_args([*BASE, *argv], world_size=1)
    assert exit_.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_every_flag_of_megatron_lms_parser_is_a_flag_here_with_a_status():
    """None unrecognized: every spelling of every flag of Megatron-LM's parser is an option of angpt.pretrain,
    and each has a status (a flag left undecided stops build_parser)."""
    options = {name for action in build_parser()._actions for name in action.option_strings}
    spellings = [name for rows in GROUPS.values() for row in rows for name in (row[0], *row[1])]
    assert len(spellings) > 650
    assert [name for name in spellings if name not in options] == []
    statuses = collections.Counter(status for *_, status, _ in megatron_flags_doc.flag_rows(build_parser()))
    assert sum(statuses.values()) == sum(map(len, GROUPS.values()))
    assert set(statuses) == {megatron_lm.IMPLEMENTED, megatron_lm.IMPLIED, megatron_lm.IGNORED, megatron_lm.REFUSED}


def test_docs_megatron_md_is_what_the_parser_and_the_table_say():
    with open(os.path.join(ROOT, "docs", "megatron.md")) as file:
        assert file.read() == megatron_flags_doc.document(build_parser()), \
            "docs/megatron.md is out of date: run python tools/megatron_flags_doc.py"


@pytest.mark.parametrize("argv,message", [
    (["--use-legacy-models"], "argument --use-legacy-models: not supported: Megatron-LM's legacy models"),
    (["--moe-router-topk", "4"], "argument --moe-router-topk: not supported: mixture of experts"),
    (["--num-experts", "8"], "argument --num-experts: not supported: mixture of experts"),
    (["--hybrid-context-parallel"], "argument --hybrid-context-parallel: not supported: needs CUDA and Transformer "
     "Engine"),
    (["--rl-use-sequence-packing"], "not supported: reinforcement learning"),
    (["--fsdp-double-buffer"], "argument --fsdp-double-buffer: not supported: not built with Megatron-FSDP"),
    (["--init-method-xavier-uniform"], "argument --init-method-xavier-uniform: not supported: Megatron-LM 0.16.1 "
     "fails with it"),
    (["--qk-clip"], "argument --qk-clip: not supported: QK-clip scales W_q and W_k after each step by each head's "
     "largest attention logit, which Transformer Engine's attention (>= 2.9) alone records"),
    (["--qk-clip-threshold", "50"], "argument --qk-clip-threshold: not supported: QK-clip"),
    (["--log-max-attention-logit"], "argument --log-max-attention-logit: not supported: it logs each head's largest "
     "attention logit"),
    (["--init-model-with-meta-device"], "its weights are left uninitialized"),
])
def test_a_refused_flag_stops_the_parse_in_one_line_saying_why(argv, message, capsys):
    line = parse_error(argv, capsys)
    assert message in line and line.startswith("angpt.pretrain: error: ")


def test_a_refused_flag_given_megatron_lms_default_asks_for_nothing(capsys):
    """At the boundary: Megatron-LM's default is accepted, the next value is not."""
    parse_args([*BASE, "--expert-model-parallel-size", "1", "--distributed-backend", "nccl"], world_size=1)
    assert "--expert-model-parallel-size" in parse_error(["--expert-model-parallel-size", "2"], capsys)
    assert "--distributed-backend" in parse_error(["--distributed-backend", "gloo"], capsys)


@pytest.mark.parametrize("family,argv,message", [
    ("gptplus", ["--normalization", "LayerNorm"], "--normalization LayerNorm with --model-family gptplus: GPT+ "
                                                  "normalizes with RMSNorm"),
    ("gptplus", ["--qk-l2-norm"], "--qk-l2-norm with --model-family gptplus: GPT+ normalizes q and k with RMSNorm"),
    ("angpt", ["--position-embedding-type", "learned_absolute"],
     "--position-embedding-type learned_absolute with --model-family angpt: every family uses RoPE"),
    ("angpt", ["--rotary-percent", "0.5"], "--rotary-percent 0.5 with --model-family angpt"),
    ("ngpt", ["--optimizer", "sgd"], "--optimizer sgd with --model-family ngpt"),
])
def test_an_implied_flag_asking_for_something_else_is_refused_naming_the_family(family, argv, message, capsys):
    assert message in parse_error(["--model-family", family, *argv], capsys)


def test_implied_flags_are_accepted_and_the_replaced_norm_flags_are_said_once():
    megatron = ["--normalization", "RMSNorm", "--qk-layernorm", "--swiglu", "--disable-bias-linear",
                "--position-embedding-type", "rope", "--rotary-percent", "1.0", "--group-query-attention",
                "--use-mcore-models"]
    gptplus = parse_args([*BASE, "--model-family", "gptplus", *megatron], world_size=1)
    assert megatron_lm.notes(gptplus) == []
    angpt = parse_args([*BASE, "--model-family", "angpt", *megatron, "--apply-layernorm-1p",
                        "--norm-epsilon", "1e-6"], world_size=1)
    assert megatron_lm.notes(angpt) == ["--normalization RMSNorm, --apply-layernorm-1p, --qk-layernorm, "
                                        "--norm-epsilon 1e-06: replaced by anGPT's own normalization (docs/model.md)"]
    assert megatron_lm.notes(parse_args([*BASE, "--norm-epsilon", "1e-5"], world_size=1)) == []
    # As Megatron-LM: sequence parallelism without tensor parallelism is turned off, and said.
    alone = parse_args([*BASE, "--model-family", "gptplus", "--sequence-parallel"], world_size=1)
    assert not alone.parallel.sequence_parallel
    assert megatron_lm.notes(alone) == ["--sequence-parallel: off, as in Megatron-LM, with "
                                        "--tensor-model-parallel-size 1"]


@pytest.mark.parametrize("argv,line", [
    (["--no-async-tensor-model-parallel-allreduce"], "--no-async-tensor-model-parallel-allreduce: ignored, as in "
     "Megatron-LM (deprecated in megatron-core 0.16 and ignored there)"),
    (["--disable-async-tensor-model-parallel-allreduce"], "--no-async-tensor-model-parallel-allreduce: ignored"),
    (["--fp8-interval", "4"], "--fp8-interval: ignored, as in Megatron-LM (deprecated since Transformer Engine 1.8"),
    (["--use-dist-ckpt"], "--use-dist-ckpt: ignored, as in Megatron-LM (deprecated in Megatron-LM and without "
     "effect there: --ckpt-format decides)"),
    (["--dist-ckpt-format", "zarr"], "--dist-ckpt-format: ignored"),
    (["--ckpt-fully-parallel-save"], "--ckpt-fully-parallel-save: ignored"),
    (["--apply-residual-connection-post-layernorm"], "--apply-residual-connection-post-layernorm: ignored, as in "
     "Megatron-LM (megatron-core 0.16's TransformerConfig has the field and its layers never read it"),
    (["--disable-jit-fuser"], "--disable-jit-fuser: ignored, as in Megatron-LM (Megatron-LM 0.16.1 swaps "
     "megatron.core.jit.jit_fuser after megatron-core's fusions took it at import"),
    (["--fp16", "--fp16-lm-cross-entropy"], "--fp16-lm-cross-entropy: ignored, as in Megatron-LM (megatron-core "
     "0.16's GPTModel keeps it and never reads it"),
])
def test_what_megatron_lm_accepts_and_ignores_is_accepted_and_said_in_one_line(argv, line):
    notes = megatron_lm.notes(parse_args([*BASE, *argv], world_size=1))
    assert len(notes) == 1 and notes[0].startswith(line), notes
    assert megatron_lm.notes(parse_args(BASE, world_size=1)) == []


def test_megatron_lms_fp16_lm_cross_entropy_needs_fp16(capsys):
    assert "--fp16-lm-cross-entropy needs --fp16 (Megatron-LM's check)" in parse_error(
        ["--bf16", "--fp16-lm-cross-entropy"], capsys)


def test_megatron_cores_gpt_never_reads_fp16_lm_cross_entropy_and_computes_the_loss_in_fp32(single_process):
    """The reasons the ignored flags above give, held to megatron-core 0.16.1: GPTModel keeps fp16_lm_cross_entropy
    and its loss (vocab_parallel_cross_entropy) casts fp16 logits to fp32: the loss is fp32 and equals torch's
    cross-entropy of the logits in fp32; no module of megatron-core's GPT reads the attribute or
    apply_residual_connection_post_layernorm."""
    logits = (torch.randn(4, 2, 50) * 4).half()
    labels = torch.randint(0, 50, (4, 2))
    loss = tensor_parallel.vocab_parallel_cross_entropy(logits, labels)
    expected = F.cross_entropy(logits.float().view(-1, 50), labels.view(-1), reduction="none").view(4, 2)
    assert loss.dtype == torch.float32 and torch.allclose(loss, expected, rtol=1e-6, atol=1e-6)
    sources = {path: path.read_text() for path in pathlib.Path(megatron.core.__file__).parent.rglob("*.py")}
    assert [path.name for path, text in sources.items() if "apply_residual_connection_post_layernorm" in text] == [
        "transformer_config.py"]
    uses = {line.strip() for text in sources.values() for line in text.splitlines()
            if "self.fp16_lm_cross_entropy" in line}
    assert uses == {"self.fp16_lm_cross_entropy = fp16_lm_cross_entropy"}  # kept by each model, read by none


def test_disable_jit_fuser_after_megatron_cores_imports_changes_no_fusion():
    """Megatron-LM calls megatron.core.jit.disable_jit_fuser() in set_global_variables, after pretrain_gpt.py has
    imported megatron-core's models, whose fusions took jit_fuser (torch.compile) by name at import."""
    from megatron.core.fusions import fused_bias_swiglu  # noqa: PLC0415 (as pretrain_gpt.py's imports)

    compiled = fused_bias_swiglu.swiglu
    assert hasattr(compiled, "_torchdynamo_orig_callable")  # torch.compile's
    jit.disable_jit_fuser()
    try:
        assert jit.jit_fuser is jit.noop_decorator and fused_bias_swiglu.swiglu is compiled
    finally:
        jit.enable_jit_fuser()


def test_a_refused_flag_in_a_config_file_is_refused_and_megatron_lms_default_accepted(tmp_path, capsys):
    config = tmp_path / "run.yaml"
    config.write_text("expert-model-parallel-size: 1\nuse-distributed-optimizer: true\n")
    assert parse_args([*BASE, "--config", str(config)], world_size=1).parallel.use_distributed_optimizer
    config.write_text("expert_model_parallel_size: 4\n")
    assert "expert_model_parallel_size: not supported: expert parallelism" in parse_error(["--config", str(config)],
                                                                                    capsys)


def test_norm_epsilon_reaches_gpt_pluss_rms_norms():
    config = parse_args([*BASE, "--model-family", "gptplus", "--norm-epsilon", "1e-6"], world_size=1)
    assert transformer_config(config).layernorm_epsilon == 1e-6
    default = parse_args(BASE, world_size=1)
    assert default.model.norm_epsilon == 1e-5 == megatron_lm.NORM_EPSILON


def test_the_refusal_is_printed_by_rank_0_only():
    code = "from angpt.config.arguments import parse_args; parse_args(['--train-iters', '1', '--mock-data', " \
           "'--vocab-size', '8', '--num-experts', '4'])"
    outputs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                              env={**os.environ, "RANK": str(rank), "PYTHONPATH": ROOT}) for rank in (0, 1)]
    assert [output.returncode for output in outputs] == [2, 2]
    assert "--num-experts: not supported" in outputs[0].stderr and outputs[1].stderr == ""


def test_the_table_reads_megatron_lms_own_parser_output():
    """Spot checks of the vendored flag list against Megatron-LM core_v0.16.1's arguments.py, as read there."""
    rows = {row[0]: (group, row) for group, rows in GROUPS.items() for row in rows}
    assert rows["--context-parallel-size"][1][2:] == (None, "int", 1)
    assert rows["--swiglu"][1][2:] == (0, None, False)
    assert rows["--rampup-batch-size"][1][2] == 3
    assert rows["--save-interval"][1][1] == ("--persistent-save-interval",)
    assert rows["--num-experts"][0] == "moe"


def test_first_last_layers_bf16_without_fp8_is_accepted_and_said_to_change_nothing():
    notes = megatron_lm.notes(parse_args([*BASE, "--first-last-layers-bf16"], world_size=1))
    assert notes == ["--first-last-layers-bf16: without --fp8-format every layer is in BF16 already (as in "
                     "Megatron-LM, nothing changes)"]


def test_legacy_tokenizer_gives_the_vocabulary_of_megatron_lms_legacy_gpt2_tokenizer(tmp_path, capsys):
    """Megatron-LM's legacy _GPT2BPETokenizer: vocab_size = len(vocab.json), eod = vocab.json's <|endoftext|>
    (megatron/training/tokenizer/tokenizer.py), here with <|endoftext|> not last. A type whose legacy tokenizer
    differs is refused with the difference (tests/test_legacy_tokenizer.py), and no type at all as the legacy
    build_tokenizer refuses it."""
    symbols = [chr(c) for c in range(ord("!"), ord("~") + 1)]
    vocab = {symbol: i for i, symbol in enumerate(symbols)}
    vocab["<|endoftext|>"] = 7
    vocab[symbols[7]] = len(symbols)
    (tmp_path / "vocab.json").write_text(json.dumps(vocab))
    (tmp_path / "merges.txt").write_text(f"#version: 0.2\n{symbols[0]} {symbols[1]}\n")
    vocab[symbols[0] + symbols[1]] = len(vocab)
    (tmp_path / "vocab.json").write_text(json.dumps(vocab))
    files = ["--vocab-file", str(tmp_path / "vocab.json"), "--merge-file", str(tmp_path / "merges.txt")]
    base = ["--train-iters", "10", "--mock-data", "--model-family", "gpt"]
    config = parse_args([*base, "--vocab-size", "256", "--tokenizer-type", "GPT2BPETokenizer", *files,
                         "--legacy-tokenizer"], world_size=1)
    legacy = json.loads((tmp_path / "vocab.json").read_text())
    vocabulary = flag_vocabulary(config.data)
    assert (vocabulary.vocab_size, vocabulary.eod) == (len(legacy), legacy["<|endoftext|>"]) == (96, 7)
    assert "builds no tokenizer without --tokenizer-type" in parse_error([*base, "--vocab-size", "256", *files,
                                                                         "--legacy-tokenizer"], capsys)
    assert "Megatron-LM's legacy TikTokenizer has no pad id" in parse_error(
        [*base, "--vocab-size", "256", "--tokenizer-type", "TikTokenizer", "--tokenizer-model", "x.tiktoken",
         "--legacy-tokenizer"], capsys)


def test_no_fp8_wgrad_without_fp8s_delayed_recipe_is_accepted_and_said_to_change_nothing():
    """megatron-core reads fp8_wgrad in Transformer Engine's delayed recipe alone (its fp8_utils.get_fp8_recipe);
    Megatron-LM's other spelling is the same flag."""
    for flag in ("--no-fp8-wgrad", "--disable-fp8-wgrad"):
        config = parse_args([*BASE, flag], world_size=1)
        assert config.precision.fp8_wgrad is False
        assert megatron_lm.notes(config) == ["--no-fp8-wgrad: megatron-core overrides the weight gradients' precision "
                                             "in --fp8-format's delayed recipe only (as in Megatron-LM, nothing "
                                             "changes)"]


def test_megatron_lms_xavier_uniform_initialization_fails_in_megatron_core():
    """The refusal's reason: Megatron-LM's core_transformer_config_from_args hands TransformerConfig these two."""
    with pytest.raises(TypeError, match="unexpected keyword argument 'scaled_init_method'"):
        TransformerConfig(num_layers=2, hidden_size=8, num_attention_heads=2, init_method=torch.nn.init.xavier_uniform_,
                          scaled_init_method=torch.nn.init.xavier_uniform_)
