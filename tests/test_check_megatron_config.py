"""tools/check_megatron_config.py: a Megatron-LM launch script and a functional test's model_config.yaml read to
the exact command line, each flag's line and the exit status for accepted and refused configurations, and
Megatron-LM's own GPT functional tests (tests/data/megatron_gpt_configs.json, derived by
benchmarks/megatron_configs.py) accepted exactly as the benchmark recorded."""

import os
import sys

import pytest

from angpt.config import megatron_lm, transformer_engine_support
from angpt.config.choices import MODEL_FAMILIES

from conftest import ROOT, load_benchmark

sys.path.insert(0, os.path.join(ROOT, "tools"))
import check_megatron_config as checker  # noqa: E402 (a tool, not a package)

SCRIPT = r"""#!/bin/bash
set -euo pipefail
GPUS=8
CHECKPOINT_PATH=${1:-checkpoints/gpt}
DATA_PATH=$2 # <prefix>_text_document
PRECISION="bf16"

DISTRIBUTED_ARGS=(
    --nproc_per_node $GPUS   # per node
    --nnodes 1
)
MODEL_ARGS=(
    --num-layers 4
    --hidden-size 64 --num-attention-heads 4
    --seq-length 128  # not the end of the array: )
)
MODEL_ARGS+=(--swiglu)
if [[ "$PRECISION" == "fp16" ]]; then
    MODEL_ARGS+=(--fp16)
elif [[ "$PRECISION" == "bf16" ]]; then
    MODEL_ARGS+=("--bf16" "--use-distributed-optimizer")
else
    MODEL_ARGS+=(--fp32)
fi
OPTIONS="--lr 3e-4 --min-lr 3e-5"

torchrun ${DISTRIBUTED_ARGS[@]} pretrain_gpt.py \
    "${MODEL_ARGS[@]}" \
    --data-path $DATA_PATH --split '99,1,0' \
    --save "$CHECKPOINT_PATH" --tensorboard-dir "${TB_DIR:-tb/gpt}" \
    $OPTIONS 2>&1 | tee train.log
"""

# A functional test's shape: placeholders, a list in brackets, switches on and off, numbers YAML reads as floats.
MODEL_CONFIG = """\
ENV_VARS:
  CUDA_DEVICE_MAX_CONNECTIONS: 1
TEST_TYPE: regular
MODEL_ARGS:
  --num-layers: 2
  --hidden-size: 64
  --num-attention-heads: 4
  --seq-length: 32
  --max-position-embeddings: 32
  --micro-batch-size: 2
  --global-batch-size: 8
  --rampup-batch-size: "[2 2 32]"
  --train-samples: 64
  --lr: 3.0e-4
  --tokenizer-type: NullTokenizer
  --vocab-size: 256
  --data-path: ${DATA_PATH}/text/corpus_text_document
  --split: 99,1,0
  --save: ${CHECKPOINT_SAVE_PATH}
  --seed: ${REPEAT}
  --untie-embeddings-and-output-weights: true
  --no-mmap-bin-files: false
  --tensor-model-parallel-size: 1
  --expert-model-parallel-size: EXPERT
"""
EXPERT_PARALLEL_WHY = megatron_lm.decide("transformer configuration", "--expert-model-parallel-size").why


def write(tmp_path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def run(capsys, *argv: str) -> tuple[int, list[str]]:
    status = checker.main(list(argv))
    return status, capsys.readouterr().out.splitlines()


def test_launch_script_to_its_exact_command_line():
    argv, notes = checker.script_argv(SCRIPT)
    assert argv == ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "128",
                    "--swiglu", "--bf16", "--use-distributed-optimizer", "--data-path", "$DATA_PATH", "--split",
                    "99,1,0", "--save", "checkpoints/gpt", "--tensorboard-dir", "tb/gpt", "--lr", "3e-4", "--min-lr",
                    "3e-5"]
    assert notes == ["line 27: the command line of pretrain_gpt.py"]


def test_launch_script_conditions_and_entry_points():
    # A condition on what the script cannot know takes the first branch, and says so.
    argv, notes = checker.script_argv('if [ -f "$CONFIG" ]; then\n  X=(--swiglu)\nelse\n  X=(--fp16)\nfi\n'
                                      'python -u /opt/megatron/pretrain_gpt.py "${X[@]}" --num-workers ""\n')
    assert argv == ["--swiglu", "--num-workers", ""]
    assert notes[0] == 'line 1: `if [ -f "$CONFIG" ]; then` is not decided here: its first branch taken'
    argv, _ = checker.script_argv("torchrun --nproc-per-node 2 -m angpt.pretrain --model-family angpt --lr 1e-3 &\n")
    assert argv == ["--model-family", "angpt", "--lr", "1e-3"]


def test_unreadable_configuration_exits_with_status_2(tmp_path, capsys):
    assert checker.main([str(tmp_path / "missing.sh")]) == 2
    assert capsys.readouterr().err == \
        f"check_megatron_config.py: error: {tmp_path}/missing.sh: No such file or directory\n"
    bert = write(tmp_path, "bert.sh", "python pretrain_bert.py --num-layers 2\n")
    assert checker.main([bert]) == 2
    assert capsys.readouterr().err == f"check_megatron_config.py: error: {bert}: no command line of pretrain_gpt.py " \
        "(or python -m angpt.pretrain) found\n"


def test_model_config_yaml_to_its_exact_command_line(tmp_path):
    argv, notes = checker.read_config(write(tmp_path, "model_config.yaml", MODEL_CONFIG.replace("EXPERT", "1")))
    assert argv == ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
                    "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
                    "--rampup-batch-size", "2", "2", "32", "--train-samples", "64", "--lr", "0.0003",
                    "--tokenizer-type", "NullTokenizer", "--vocab-size", "256",
                    "--data-path", "${DATA_PATH}/text/corpus_text_document", "--split", "99,1,0",
                    "--save", "${CHECKPOINT_SAVE_PATH}", "--seed", "${REPEAT}", "--untie-embeddings-and-output-weights",
                    "--tensor-model-parallel-size", "1", "--expert-model-parallel-size", "1"]
    assert "--no-mmap-bin-files false: left off" in notes
    with pytest.raises(checker.ConfigError, match="no MODEL_ARGS mapping"):
        checker.read_config(write(tmp_path, "other.yaml", "ENV_VARS: {}\n"))


def test_accepted_with_stand_ins_and_megatron_defaults(tmp_path, capsys):
    status, out = run(capsys, write(tmp_path, "model_config.yaml", MODEL_CONFIG.replace("EXPERT", "1")))
    assert status == 0, out
    assert out[-1] == "would start"
    assert "--tensor-model-parallel-size 1: implemented" in out
    assert "--expert-model-parallel-size 1: Megatron-LM's default value: asks for nothing" in out
    assert "--untie-embeddings-and-output-weights: implemented" in out
    seed = checker.action_of("--seed").default
    assert "  --data-path ${DATA_PATH}/text/corpus_text_document (a placeholder): a dataset prefix with empty .bin " \
           "and .idx files" in out
    assert f"  --seed ${{REPEAT}}: {seed} (a placeholder; --seed's default)" in out
    assert "  --save ${CHECKPOINT_SAVE_PATH}: an empty directory (a placeholder)" in out
    assert out[-2].startswith(f"--model-family {checker.DEFAULT_FAMILY}, world size 1 (TP 1 x PP 1 x CP 1 x DP 1;")


def test_refused_flag_gives_the_tables_reason(tmp_path, capsys):
    status, out = run(capsys, write(tmp_path, "model_config.yaml", MODEL_CONFIG.replace("EXPERT", "8")),
                      "--model-family", "angpt")
    assert status == 1
    assert f"--expert-model-parallel-size 8: refused: {EXPERT_PARALLEL_WHY}" in out
    assert out[-1] == (f"would not start: angpt.pretrain: error: argument --expert-model-parallel-size: not supported: "
                       f"{EXPERT_PARALLEL_WHY} (see --help)")


def test_implied_flag_refused_for_a_value_that_asks_for_something_else():
    decision = megatron_lm.decide("", "--dataloader-type")
    report = checker.check(["--train-iters", "10", "--mock-data", "--vocab-size", "256", "--dataloader-type", "single"],
                           "ngpt")
    assert report.starts and report.flags[-1][2] == f"implied: {decision.why}"
    report = checker.check(["--train-iters", "10", "--mock-data", "--vocab-size", "256", "--dataloader-type", "cyclic"],
                           "ngpt")
    why = decision.check(None, "cyclic")
    assert report.flags[-1] == ("--dataloader-type", ["cyclic"], f"refused with --model-family ngpt: {why}")
    assert report.error == f"angpt.pretrain: error: --dataloader-type cyclic with --model-family ngpt: {why} " \
                           "(see --help)"


def test_data_flags_are_checked_with_stand_ins(tmp_path):
    base = ["--train-iters", "10", "--tokenizer-type", "NullTokenizer", "--vocab-size", "256"]
    report = checker.check([*base, "--data-path", str(tmp_path / "absent_text_document")])
    assert report.starts and report.stand_ins == [f"--data-path {tmp_path}/absent_text_document (not found here): a "
                                                  "dataset prefix with empty .bin and .idx files"]
    for ext in (".bin", ".idx"):  # a prefix found here is the one checked
        (tmp_path / f"corpus_text_document{ext}").write_bytes(b"")
    report = checker.check([*base, "--data-path", "0.5", str(tmp_path / "corpus_text_document"), "0.5", "$OTHER"])
    assert report.starts and report.stand_ins == ["--data-path $OTHER (a placeholder): a dataset prefix with empty "
                                                  ".bin and .idx files, one for what may be a blend"]
    report = checker.check([*base, "--data-path", "$DATA", "--mock-data"])
    assert report.error == ("angpt.pretrain: error: --data-path and --mock-data both name the training data: give "
                            "one (see --help)")


def test_unknown_flag_and_transformer_engine(capsys, tmp_path):
    base = ["--train-iters", "10", "--mock-data", "--vocab-size", "256"]
    report = checker.check([*base, "--not-a-megatron-flag", "1"])
    assert report.flags[-1][2].startswith("not a flag of Megatron-LM") and not report.starts
    te = [*base, "--transformer-impl", "transformer_engine"]
    assert checker.check(te).starts  # as on a GPU node
    if transformer_engine_support.transformer_engine_error() is None:
        pytest.skip("Transformer Engine is importable here")
    report = checker.check(te, assume_transformer_engine=False)
    assert report.error == f"angpt.pretrain: error: {transformer_engine_support.unavailable_message()} (see --help)"
    status, out = run(capsys, write(tmp_path, "run.sh", "python pretrain_gpt.py " + " ".join(te) + "\n"),
                      "--no-assume-transformer-engine")
    assert status == 1 and "Transformer Engine as this machine has it" in out[-2]


def test_world_size_from_the_layout():
    flags = checker.segments(["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size=2",
                              "--context-parallel-size", "2", "--expert-model-parallel-size", "4",
                              "--micro-batch-size", "2", "--global-batch-size", "16"])
    # CP x DP must hold the 4 expert-parallel ranks: DP 2, which divides the 8 micro-batches.
    assert checker.default_world_size(flags) == (16, "TP 2 x PP 2 x CP 2 x DP 2")
    assert checker.default_world_size(checker.segments(["--global-batch-size", "$GBS"])) == \
        (1, "TP 1 x PP 1 x CP 1 x DP 1")
    # CP x DP holds the distributed optimizer's instances: 4 instances at CP 2 need DP 2.
    assert checker.default_world_size(checker.segments(["--context-parallel-size", "2", "--global-batch-size", "8",
                                                        "--num-distributed-optimizer-instances", "4"])) == \
        (4, "TP 1 x PP 1 x CP 2 x DP 2")
    # The world over PP holds the expert tensor-parallel groups: ETP 4 at TP 2 needs DP 2.
    assert checker.default_world_size(checker.segments(["--tensor-model-parallel-size", "2", "--global-batch-size",
                                                        "8", "--expert-tensor-parallel-size", "4"])) == \
        (4, "TP 2 x PP 1 x CP 1 x DP 2")


@pytest.fixture
def recorded():  # per test (it reads in milliseconds), so that pytest-xdist spreads the families over workers
    return load_benchmark("megatron_configs").read_record(os.path.join(ROOT, "tests", "data",
                                                                       "megatron_gpt_configs.json"))


@pytest.mark.slow
@pytest.mark.parametrize("family", MODEL_FAMILIES)
def test_megatron_functional_tests_accepted_as_recorded(recorded, family):
    # ~120 checks of ~35 ms (parse_args builds its parser each time): ~4 s a family on one core.
    accepted = [name for name, model_args in recorded["configs"].items()
                if checker.check(checker.yaml_argv(model_args)[0], family).starts]
    assert family in recorded["accepted"], (f"no counts recorded for --model-family {family}: rerun "
                                            "benchmarks/megatron_configs.py to record them")
    expected = recorded["accepted"][family]
    assert len(accepted) == expected["count"] and accepted == expected["configs"], (
        f"{family}: {len(accepted)} of {len(recorded['configs'])} Megatron-LM configurations would start, "
        f"{expected['count']} recorded; newly accepted {sorted(set(accepted) - set(expected['configs']))}, no longer "
        f"{sorted(set(expected['configs']) - set(accepted))}: rerun benchmarks/megatron_configs.py (--recorded "
        "without a Megatron-LM checkout) to record the new counts")
