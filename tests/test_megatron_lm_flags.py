"""Megatron-LM's flags (angpt.config.megatron_lm): every flag of its pretraining parser is implemented, implied
or refused with a reason, never unrecognized; docs/megatron.md is what the table says."""

import collections
import json
import os
import subprocess
import sys

import pytest

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
    (["--hybrid-context-parallel"], "argument --hybrid-context-parallel: not supported: hybrid (per-sample) context "
     "parallelism"),
    (["--rl-use-sequence-packing"], "not supported: reinforcement learning"),
    (["--fsdp-double-buffer"], "argument --fsdp-double-buffer: not supported: not built with Megatron-FSDP"),
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
])
def test_what_megatron_lm_accepts_and_ignores_is_accepted_and_said_in_one_line(argv, line):
    notes = megatron_lm.notes(parse_args([*BASE, *argv], world_size=1))
    assert len(notes) == 1 and notes[0].startswith(line), notes
    assert megatron_lm.notes(parse_args(BASE, world_size=1)) == []


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
    (megatron/training/tokenizer/tokenizer.py), here with <|endoftext|> not last. Other types are refused, and
    no type at all as the legacy build_tokenizer refuses it."""
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
    assert "give --tokenizer-type GPT2BPETokenizer" in parse_error([*base, "--vocab-size", "256", *files,
                                                                    "--legacy-tokenizer"], capsys)
    assert "not built yet for --tokenizer-type TikTokenizer" in parse_error(
        [*base, "--vocab-size", "256", "--tokenizer-type", "TikTokenizer", "--tokenizer-model", "x.tiktoken",
         "--legacy-tokenizer"], capsys)
