"""The main job: `python -m angpt.pretrain` under torchrun, and its refusal of impossible layouts."""

import json
import math
import os
import re
import shutil
import subprocess
import sys

import pytest
from megatron.core.datasets.indexed_dataset import IndexedDataset

from angpt.config import megatron_lm, transformer_engine_support
from angpt.config.arguments import parse_args
from angpt.config.parser import build_parser
from angpt.config.validation import NUMERIC_RANGES, derive
from angpt.training import megatron_configs
from angpt.training import trainer as trainer_module
from angpt.training.megatron_configs import transformer_config

from conftest import PYDOC_VOCAB_SIZE, ROOT, TRAINED_ITERS, TRAINED_RUNS
from launch import launch

FLAGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
         "--micro-batch-size", "4", "--global-batch-size", "8", "--lr", "1e-2", "--log-interval", "1",
         "--eval-iters", "0"]
MOCK = ["--mock-data", "--vocab-size", "256"]


def train_losses(metrics_file) -> list[float]:
    with open(metrics_file) as file:
        return [r["lm_loss"] for r in map(json.loads, file) if r["kind"] == "train"]


def pretrain(*args, nproc=2, timeout=600):
    env = {**os.environ, "PYTHONPATH": ROOT, "PYTHONWARNINGS": "ignore"}
    return launch(["-m", "angpt.pretrain", *args], nproc=nproc, env=env, timeout=timeout)


@pytest.mark.multiprocess
@pytest.mark.parametrize("family", list(TRAINED_RUNS))
def test_training_lowers_the_loss(family, trained_runs):
    """anGPT at tensor parallelism 2 on a preprocessed dataset, nGPT and GPT+ at pipeline parallelism 2 on
    mock data (conftest's trained_runs)."""
    losses = train_losses(trained_runs[family] / "metrics.jsonl")
    # The vocabulary as padded for tensor parallelism (GPT+'s 200 ids to 256): the padding's logits count too.
    padded_vocab_size = {"angpt": PYDOC_VOCAB_SIZE, "ngpt": 256, "gptplus": 256}[family]
    print(family, f"loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    assert len(losses) == TRAINED_ITERS
    if family == "angpt":
        output = (trained_runs[family] / "output.txt").read_text()
        assert f"vocabulary {PYDOC_VOCAB_SIZE} (padded {PYDOC_VOCAB_SIZE})" in output
    # About uniform over the vocabulary at the start: every family's logits start small.
    assert losses[0] == pytest.approx(math.log(padded_vocab_size), abs=0.15)
    assert losses[-1] < losses[0] - 1.0


@pytest.mark.parametrize(
    "flags, message",
    [
        ([*MOCK, "--tensor-model-parallel-size", "3"],
         "world size 2 is not divisible by --tensor-model-parallel-size 3"),
        ([*MOCK, "--tensor-model-parallel-size", "2", "--num-attention-heads", "3"],
         "--num-attention-heads 3 is not divisible"),
        ([*MOCK, "--pipeline-model-parallel-size", "2", "--num-layers", "3"], "--num-layers 3 is not divisible"),
        ([*MOCK, "--global-batch-size", "6"], "--global-batch-size 6 is not divisible by --micro-batch-size 4"),
        (["--data-path", "/nonexistent/corpus_text_document"],
         "--data-path /nonexistent/corpus_text_document: no /nonexistent/corpus_text_document.bin"),
        (["--data-path", "0.5", "/nonexistent/a"], "--data-path /nonexistent/a: no"),
        (["--mock-data"], "--mock-data needs --vocab-size or --tokenizer-type"),
        ([], "no training data: give --data-path, --train-data-path or --mock-data"),
        ([*MOCK, "--save-interval", "10"], "--save-interval needs --save"),
        ([*MOCK, "--lr-decay-style", "WSD"], "--lr-decay-style WSD needs --lr-wsd-decay-iters"),
        ([*MOCK, "--exit-interval", "5"], "need --save"),
        ([*MOCK, "--train-samples", "7"], "--train-samples 7 is less than one --global-batch-size 8"),
        ([*MOCK, "--hidden-dropout", "0.1"], "--hidden-dropout is not supported for --model-family angpt"),
        ([*MOCK, "--model-family", "ngpt", "--hidden-dropout", "0.1"],
         "--hidden-dropout is not supported for --model-family ngpt"),
        ([*MOCK, "--attention-dropout", "1"], "--attention-dropout 1.0 must be in [0, 1)"),
        # Numeric ranges (validation.NUMERIC_RANGES), checked before anything divides by them.
        ([*MOCK, "--micro-batch-size", "0"], "--micro-batch-size 0 must be at least 1"),
        ([*MOCK, "--tensor-model-parallel-size", "0"], "--tensor-model-parallel-size 0 must be at least 1"),
        ([*MOCK, "--global-batch-size", "-8"], "--global-batch-size -8 must be at least 1"),
        ([*MOCK, "--seq-length", "0"], "--seq-length 0 must be at least 1"),
        ([*MOCK, "--train-iters", "0"], "--train-iters 0 must be at least 1"),
        ([*MOCK, "--log-interval", "0"], "--log-interval 0 must be at least 1"),
        (["--mock-data", "--vocab-size", "0"], "--vocab-size 0 must be at least 1"),
        ([*MOCK, "--eval-iters", "-1"], "--eval-iters -1 cannot be negative"),
        ([*MOCK, "--lr", "0"], "--lr 0.0 must be positive"),
        ([*MOCK, "--lr", "nan"], "--lr nan must be a finite number"),
        ([*MOCK, "--weight-decay", "-0.1"], "--weight-decay -0.1 cannot be negative"),
        ([*MOCK, "--adam-beta2", "1"], "--adam-beta2 1.0 must be in [0, 1)"),
        ([*MOCK, "--exit-duration-in-mins", "inf", "--save", "/tmp/x"], "--exit-duration-in-mins inf must be a finite"),
        ([*MOCK, "--sample-rate", "0"], "--sample-rate 0.0 must be in (0, 1]"),
        ([*MOCK, "--glu-linear-offset", "inf"], "--glu-linear-offset inf must be a finite number"),
        ([*MOCK, "--tensorboard-queue-size", "-1"], "--tensorboard-queue-size -1 cannot be negative"),
        ([*MOCK, "--replication-factor", "0"], "--replication-factor 0 must be at least 1"),
    ],
)
def test_impossible_settings_fail_before_starting(flags, message, monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit):
        parse_args([*FLAGS, *([] if "--train-samples" in flags else ["--train-iters", "10"]), *flags])
    last_line = capsys.readouterr().err.splitlines()[-1]  # after argparse's usage
    assert last_line.startswith("angpt.pretrain: error: ") and message in last_line


def test_a_wrong_flag_is_one_line_from_rank_0_only(monkeypatch, capsys):
    for rank, expected in (("0", "angpt.pretrain: error: unrecognized arguments: --num-layerz 3 (see --help)\n"),
                           ("1", "")):
        monkeypatch.setenv("RANK", rank)
        with pytest.raises(SystemExit) as exit_:
            parse_args([*MOCK, "--train-iters", "10", "--num-layerz", "3"])
        assert exit_.value.code == 2
        assert capsys.readouterr().err == expected


def test_a_flag_cut_short_is_unknown_as_in_megatron_lm(capsys):
    """argparse would read --train-iter as --train-iters; Megatron-LM's parser (allow_abbrev=False) refuses it."""
    with pytest.raises(SystemExit):
        parse_args([*MOCK, "--train-iter", "10"])
    assert "unrecognized arguments: --train-iter 10" in capsys.readouterr().err
    assert parse_args([*MOCK, "--train-iters", "10"]).training.train_iters == 10


def test_help_shows_defaults_and_what_is_required_before_torch_is_imported():
    """`--help` and flag errors come before any heavy import (torch, megatron-core): they are instant."""
    probe = ("import contextlib, io, sys\n"
             "from angpt.pretrain import main\n"
             "out = io.StringIO()\n"
             "with contextlib.suppress(SystemExit), contextlib.redirect_stdout(out):\n"
             "    main(['--help'])\n"
             "print(out.getvalue())\n"
             "print(sorted(name for name in ('torch', 'megatron', 'numpy') if name in sys.modules))\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.rstrip().endswith("[]")  # none of them imported
    help_text = " ".join(done.stdout.split())
    for flag, shown in (("--num-layers NUM_LAYERS", "default: 4"), ("--model-family {angpt,gptplus,ngpt,gpt}",
                        "default: angpt"), ("--lr LR", "default: 0.003"),
                        ("--train-iters TRAIN_ITERS", "required, or --train-samples")):
        assert f"{flag} {shown}" in help_text, flag


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--data-path", "{prefix}", "--train-data-path", "{prefix}"],
         "--data-path and --train-data-path both name the training data: give one"),
        (["--data-path", "{prefix}", "--mock-data", "--vocab-size", "256"],
         "--data-path and --mock-data both name the training data: give one"),
        (["--data-path", "{prefix}", "--valid-data-path", "{prefix}"],
         "--valid-data-path and --test-data-path go with --train-data-path"),
    ],
)
def test_data_flags_that_contradict_each_other_are_refused(flags, message, tmp_path, monkeypatch, capsys):
    prefix = tmp_path / "corpus_text_document"
    for ext in (".bin", ".idx"):
        (tmp_path / f"corpus_text_document{ext}").touch()
    with pytest.raises(SystemExit):
        parse_args([*FLAGS, "--train-iters", "10", *(flag.format(prefix=prefix) for flag in flags)])
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("suffix", [".bin", ".idx", ""])
def test_a_data_path_given_as_one_of_its_files_means_its_prefix(suffix, tmp_path):
    prefix = tmp_path / "corpus_text_document"
    for ext in (".bin", ".idx"):
        (tmp_path / f"corpus_text_document{ext}").touch()
    args = parse_args([*FLAGS, "--train-iters", "10", "--data-path", "0.5", f"{prefix}{suffix}", "0.5", str(prefix)],
                      world_size=1)
    assert args.data.data_path == ("0.5", str(prefix), "0.5", str(prefix))


@pytest.mark.parametrize("flags", [["--sample-rate", "1"], ["--tensorboard-queue-size", "0"],
                                   ["--replication-factor", "1"],
                                   ["--model-family", "gpt", "--mtp-loss-scaling-factor", "0"]])
def test_the_ranges_take_their_limits(flags, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    parse_args([*FLAGS, "--train-iters", "10", *MOCK, *flags])


def test_every_numeric_flag_has_a_range():
    numeric = {action.dest for action in build_parser()._actions if action.type in (int, float)}
    ranged = [flag for _, _, flags in NUMERIC_RANGES for flag in flags]
    assert sorted(ranged) == sorted(numeric)  # each numeric flag once, and nothing else


@pytest.fixture(scope="module")
def preprocessed(pydoc_corpus):
    """An indexed dataset of Python's own help texts (the pydoc_corpus fixture of conftest.py: the
    training split), its tokenizer in tokenizer/ beside it."""
    return pydoc_corpus / "train_text_document"


@pytest.mark.multiprocess
def test_a_truncated_dataset_is_refused_when_training_opens_it(preprocessed, tmp_path):
    broken = tmp_path / "broken_text_document"
    for ext in (".bin", ".idx", ".json"):
        shutil.copy(str(preprocessed) + ext, str(broken) + ext)
    with open(str(broken) + ".bin", "r+b") as handle:
        handle.truncate(100)
    done = pretrain("--train-iters", "1", *FLAGS, "--data-path", str(broken), nproc=1)
    assert done.returncode != 0
    assert f"angpt.pretrain: {broken}.bin: 100 bytes" in done.stderr


def test_a_yaml_config_sets_flags_and_the_command_line_overrides_it(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    config = tmp_path / "run.yaml"
    config.write_text("model-family: ngpt\nnum_layers: 6\ntensor-model-parallel-size: 2\nlr: 0.002\n"
                      "use-distributed-optimizer: true\nmock-data: true\nvocab-size: 256\ntrain-iters: 10\n")
    run = parse_args(["--config", str(config), "--lr", "0.01"])
    assert (run.model.model_family, run.model.num_layers, run.parallel.tensor_model_parallel_size) == ("ngpt", 6, 2)
    assert run.parallel.use_distributed_optimizer and run.data.mock_data and run.optimizer.lr == 0.01
    off = parse_args(["--config", str(config), "--no-use-distributed-optimizer"])
    assert not off.parallel.use_distributed_optimizer


@pytest.mark.parametrize(
    "text, message",
    [
        ("num-layer: 4\n", "unknown key 'num-layer' (not a flag of angpt.pretrain)"),
        ("model-family: bert\n",
         "model-family: 'bert' is not one of ['angpt', 'gptplus', 'ngpt', 'gpt'] (--model-family)"),
        ("num-layers: four\n", "num-layers: 'four' is not a valid int (--num-layers)"),
        ("sequence-parallel: 1\n", "sequence-parallel: expected true or false (--sequence-parallel)"),
        ("- just a list\n", "expected a mapping of flag names to values"),
        ("num-layers: [\n", "not valid YAML"),
    ],
)
def test_a_bad_config_file_is_refused_by_name(text, message, tmp_path, monkeypatch, capsys):
    config = tmp_path / "bad.yaml"
    config.write_text(text)
    with pytest.raises(SystemExit):
        parse_args(["--config", str(config), *MOCK, "--train-iters", "10"])
    error = capsys.readouterr().err
    assert f"--config {config}" in error and message in error


def test_dry_run_checks_the_world_size(monkeypatch, capsys):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    flags = [*FLAGS, *MOCK, "--train-iters", "10", "--global-batch-size", "12", "--micro-batch-size", "2"]
    assert parse_args([*flags, "--dry-run", "6"]).parallel.world_size == 6
    assert parse_args([*flags, "--dry-run"]).parallel.world_size == 1
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert parse_args([*flags, "--dry-run"]).parallel.world_size == 3
    for bad, message in (("4", "--global-batch-size 12 is not divisible by --micro-batch-size 2 x data-parallel "
                                "size 4"), ("-2", "--dry-run -2 cannot be negative")):
        with pytest.raises(SystemExit):
            parse_args([*flags, "--dry-run", bad])
        assert message in capsys.readouterr().err


def dry_run(*flags, world_size=None):
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    env.pop("WORLD_SIZE", None)
    dry = ["--dry-run", *([str(world_size)] if world_size else [])]
    return launch(["-m", "angpt.pretrain", *flags, *dry], env=env, timeout=300)


@pytest.mark.slow  # a dry run is a process of its own
def test_dry_run_of_the_1b_config_on_64_processes_resolves_its_layout_and_counts_its_parameters(tmp_path):
    done = dry_run("--config", "examples/configs/angpt_1b.yaml", "--model-family", "gptplus", "--mock-data",
                   "--vocab-size", "50277", "--save", str(tmp_path / "run"), "--pipeline-model-parallel-size", "4",
                   "--num-layers-per-virtual-pipeline-stage", "3", "--context-parallel-size", "2",
                   "--cp-comm-type", "all_gather", "--suggest-layout", world_size=64)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    # GPT+ from its definition: d 1280, f 5120, 36 layers, heads of 64, the vocabulary padded to a multiple of
    # 128 x TP 2; per layer q/k/v/output and SwiGLU's three matrices (split over TP), two RMSNorm gains and
    # the QK-norm gains (replicated); a final RMSNorm; untied embedding and head (split over TP).
    d, f, layers, head_dim, vocab = 1280, 5120, 36, 64, -(-50277 // 256) * 256
    split, replicated = 4 * d * d + 3 * f * d, 2 * d + 2 * head_dim
    total = 2 * vocab * d + layers * (split + replicated) + d
    assert f"({total:,})" in out
    # Context parallelism splits sequences, not batches: the data-parallel size is 64 / (2 x 4 x 2).
    assert "tensor parallel 2 x pipeline parallel 4 x context parallel 2 x data parallel 4 = 64 processes" in out
    assert "each sequence in 4 chunks of 512 tokens, 2 per context-parallel rank (--cp-comm-type all_gather)" in out
    assert "36 layers: 9 per pipeline stage, 3 per virtual stage" in out
    assert "micro-batch 2 x 128 micro-batches x data parallel 4" in out
    assert f"{1024 * 2048:,} tokens per step" in out and "pipeline bubble (p - 1) / (m x v) = 0.8%" in out
    first = vocab * d / 2 + 9 * (split / 2 + replicated)
    assert f"stage 0 {first / 1e6:.2f}M" in out and f"stage 3 {(first + d) / 1e6:.2f}M" in out
    # Memory: Megatron-LM's interleaved schedule holds 1 + (p - 1) / (p v) of the layers' micro-batches on the
    # first stage (p 4, v 3: 5 micro-batches of its layers; the last stage 3); an estimate that fits 80 GiB.
    table = out[out.index("memory per GPU"):]
    assert table.startswith("memory per GPU, estimated (BF16 activations of the GPU's code path, TP 2 x PP 4 x CP 2 x "
                            "DP 4")  # the config's --bf16
    for stage, held in ((0, 5), (3, 3)):
        assert re.search(rf"\n\s+{stage}\s+\S+ GiB\s+\S+ GiB\s+{held}\s", table), (stage, table)
    assert "the fullest GPU (stage 0) needs" in table and "80 GiB assumed" in table and ": fits," in table
    # --suggest-layout: every layout of 64 GPUs listed fits, fastest first.
    ranked = [line.split() for line in out[out.index("the fastest by the estimate"):].splitlines()[2:12]]
    assert len(ranked) == 10 and all(float(row[-3]) <= 80 for row in ranked)
    assert [float(row[-2]) for row in ranked] == sorted(float(row[-2]) for row in ranked)
    assert out.rstrip().endswith("nothing was started (--dry-run)") and not done.stderr.strip()
    assert not (tmp_path / "run").exists()


@pytest.mark.slow  # the preprocessed corpus and dry runs are processes of their own
def test_dry_run_reads_the_data_and_refuses_missing_data(preprocessed, tmp_path):
    done = dry_run(*FLAGS, "--train-iters", "10", "--data-path", str(preprocessed))
    assert done.returncode == 0, done.stderr
    dataset = IndexedDataset(str(preprocessed))  # megatron-core's own reader (its arrays live as long as it)
    tokens = int(dataset.sequence_lengths.sum())
    assert f"{preprocessed}: {tokens:,} tokens" in done.stdout
    assert f"vocabulary {PYDOC_VOCAB_SIZE} (tokenizer HuggingFaceTokenizer)" in done.stdout
    missing = dry_run(*FLAGS, "--train-iters", "10", "--data-path", str(tmp_path / "nothing"))
    assert missing.returncode == 2 and f"{tmp_path / 'nothing'}" in missing.stderr
    assert len(missing.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("family, flags", [
    ("gptplus", ["--angpt-post-norm", "none"]), ("gptplus", ["--angpt-alpha-init", "0.02"]),
    ("ngpt", ["--angpt-constant-factors", "exact"]), ("ngpt", ["--angpt-constant-factor-multiplier", "2"]),
    ("ngpt", ["--angpt-nu-alpha-multiplier", "0.5"]), ("ngpt", ["--angpt-no-nu-alpha-grad"]),
])
def test_a_switch_the_family_ignores_is_refused(family, flags, capsys):
    with pytest.raises(SystemExit):
        parse_args([*FLAGS, *MOCK, "--train-iters", "10", "--model-family", family, *flags])
    assert f"{flags[0]} does not apply to --model-family {family}" in capsys.readouterr().err


@pytest.mark.parametrize("flag, field, value", [("--angpt-post-norm", "post_norm", "none"),
                                               ("--angpt-alpha-init", "alpha_init", 0.02),
                                               ("--angpt-residual", "residual", "plain")])
def test_the_switches_ngpt_reads_reach_its_config(flag, field, value):
    args = parse_args([*FLAGS, *MOCK, "--train-iters", "10", "--model-family", "ngpt", flag, str(value)])
    assert getattr(transformer_config(args), field) == value


@pytest.mark.parametrize("world_size, flags, message", [
    (6, ["--context-parallel-size", "4", "--cp-comm-type", "all_gather"],
     "the world size 6 is not divisible by --tensor-model-parallel-size 1 x --pipeline-model-parallel-size 1 x "
     "--context-parallel-size 4"),
    (2, ["--context-parallel-size", "2", "--cp-comm-type", "p2p"], "--cp-comm-type p2p: context parallelism on "
     "--transformer-impl local is all_gather only: pass --cp-comm-type all_gather"),
    (2, ["--context-parallel-size", "2", "--cp-comm-type", "a2a"], "--cp-comm-type a2a: context parallelism"),
    (6, ["--context-parallel-size", "3", "--cp-comm-type", "all_gather"],
     "--seq-length 64 is not divisible by 2 x --context-parallel-size 3"),
    (4, ["--context-parallel-size", "2", "--cp-comm-type", "all_gather", "all_gather"],
     "--cp-comm-type takes one value here (got 2): megatron-core 0.16.1 misreads a list of one per layer"),
    (2, ["--context-parallel-size", "2", "--cp-comm-type", "all_gather", "--global-batch-size", "3",
         "--micro-batch-size", "2"], "--global-batch-size 3 is not divisible by --micro-batch-size 2 x data-parallel "
     "size 1"),
    (4, ["--context-parallel-size", "2", "--hierarchical-context-parallel-sizes", "2", "2"],
     "--hierarchical-context-parallel-sizes 2 2 must multiply to --context-parallel-size 2"),
    (1, ["--hierarchical-context-parallel-sizes", "2"],
     "--hierarchical-context-parallel-sizes 2 must multiply to --context-parallel-size 1"),
    (4, ["--context-parallel-size", "4", "--transformer-impl", "transformer_engine", "--cp-comm-type", "a2a+p2p"],
     "--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes (Megatron-LM's check)"),
    (4, ["--context-parallel-size", "4", "--cp-comm-type", "a2a+p2p", "--hierarchical-context-parallel-sizes", "2",
         "2"], "--cp-comm-type a2a+p2p: context parallelism on --transformer-impl local is all_gather only"),
])
def test_context_parallel_layouts_are_checked_by_flag(world_size, flags, message, capsys):
    with pytest.raises(SystemExit):
        parse_args([*FLAGS, *MOCK, "--train-iters", "10", *flags], world_size=world_size)
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert message in error


def test_context_parallelism_alone_on_the_local_spec_is_all_gather_and_said():
    args = parse_args([*FLAGS, *MOCK, "--train-iters", "10", "--context-parallel-size", "2"], world_size=2)
    assert (args.parallel.cp_comm_type, transformer_config(args).cp_comm_type) == (("all_gather",), "all_gather")
    assert megatron_lm.notes(args) == ["--cp-comm-type: all_gather, the only one built on --transformer-impl local "
                                       "(Megatron-LM's default p2p needs Transformer Engine)"]
    # Without context parallelism, or on Transformer Engine, it is Megatron-LM's p2p, and nothing is said.
    alone = parse_args([*FLAGS, *MOCK, "--train-iters", "10"])
    assert (alone.parallel.cp_comm_type, megatron_lm.notes(alone)) == (("p2p",), [])
    engine = {**alone.flags(), "cp_comm_type": None, "context_parallel_size": 2,
              "transformer_impl": "transformer_engine"}
    assert derive(engine, 2)["cp_comm_type"] == ("p2p",)
    assert derive({**engine, "transformer_impl": "local"}, 2)["cp_comm_type"] == ("all_gather",)


def test_hierarchical_context_parallelism_reaches_megatron_cores_groups_and_config(monkeypatch):
    """Megatron-LM's a2a+p2p reaches megatron-core's groups and config; the exchange itself is Transformer Engine's
    attention, on a GPU (never run here)."""
    monkeypatch.setattr(transformer_engine_support, "transformer_engine_error", lambda: None)
    args = parse_args([*FLAGS, *MOCK, "--train-iters", "10", "--context-parallel-size", "4", "--transformer-impl",
                       "transformer_engine", "--cp-comm-type", "a2a+p2p", "--hierarchical-context-parallel-sizes", "2",
                       "2", "--global-batch-size", "4", "--micro-batch-size", "4"], world_size=4)
    assert args.parallel.hierarchical_context_parallel_sizes == (2, 2)
    monkeypatch.setattr(megatron_configs, "model_config", lambda family, **fields: fields)
    fields = transformer_config(args)
    assert (fields["cp_comm_type"], fields["hierarchical_context_parallel_sizes"]) == ("a2a+p2p", [2, 2])

    class Initialized(Exception):
        pass

    def initialize(*args, **kwargs):
        raise Initialized(kwargs["hierarchical_context_parallel_sizes"])

    monkeypatch.setattr(trainer_module.distributed, "initialize", initialize)
    with pytest.raises(Initialized) as initialized:
        trainer_module.Trainer(args)
    assert initialized.value.args == ([2, 2],)


def test_context_parallelism_reaches_the_model_config():
    """World 8 = TP 2 x CP 2 x DP 2: the data-parallel size, and the config megatron-core's layers read."""
    args = parse_args([*FLAGS, *MOCK, "--train-iters", "10", "--tensor-model-parallel-size", "2",
                       "--context-parallel-size", "2", "--cp-comm-type", "all_gather", "--global-batch-size", "4",
                       "--micro-batch-size", "2"], world_size=8)
    config = transformer_config(args)
    assert (config.context_parallel_size, config.cp_comm_type) == (2, "all_gather")
