"""Megatron-LM's checkpoint flags with its meaning (megatron/training/checkpointing.py, core_v0.16.1):
--no-save-optim and --no-save-rng (and the load that refuses to take such a checkpoint for an exact resume),
--exit-on-missing-checkpoint,
--use-checkpoint-args with --use-mp-args-from-checkpoint-args and --no-use-tokenizer-model-from-checkpoint-args,
--load-main-params-from-ckpt, --distrib-optim-fully-reshardable-mem-efficient, and the global non-persistent
checkpoints (--non-persistent-save-interval, --non-persistent-ckpt-type global, --non-persistent-global-ckpt-dir);
local ones and replication are refused (nvidia_resiliency_ext is not installed). Runs in this process."""

import importlib.util
import logging
import os
import re
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp
from megatron.core import parallel_state
from megatron.core.utils import get_model_config, unwrap_model
from test_trainer import MODEL, records

from angpt.config import megatron_lm
from angpt.config.arguments import parse_args
from angpt.config.saved import checkpoint_args
from angpt.config.sections import RunConfig
from angpt.megatron_compat import checkpoint_unpickling
from angpt.training import checkpointing, distributed, torch_checkpoint
from angpt.training import trainer as trainer_module

from conftest import in_process_trainer

MOCK = ["--mock-data", "--vocab-size", "64", "--train-iters", "4"]


def run(*flags: str) -> int:
    return in_process_trainer([*MODEL, *flags]).run()


def saved_keys(path: str) -> set[str]:
    """The top-level keys a checkpoint's files hold (its common state and sharded tensors, or the torch format's
    rank file), read from the files themselves."""
    if checkpointing.checkpoint_format(path) == "torch":
        return set(checkpoint_unpickling.read_as_data(torch_checkpoint.model_file(path), map_location="cpu"))
    checkpoint_unpickling.check_metadata(path)
    # torch's distributed checkpoint's keys: sharded tensors by their names, sharded objects as "<key>/shard_...".
    stored = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    return set(checkpointing.read_common_state(path)) | {re.split(r"[./]", key)[0] for key in stored}


@pytest.mark.slow  # in-process runs
@pytest.mark.parametrize("ckpt_format", ["torch_dist", "torch", "fsdp_dtensor"])
def test_a_checkpoint_saved_without_optimizer_and_rng_states_resumes_only_without_them(ckpt_format, tmp_path,
                                                                                      single_process):
    """Megatron-LM leaves out the optimizer state and schedule (--no-save-optim) and the RNG states (--no-save-rng);
    a load that would take them is refused in one line naming the flags that continue it without them."""
    save, fmt = str(tmp_path), ["--ckpt-format", ckpt_format]
    if ckpt_format == "fsdp_dtensor":
        fmt += ["--use-megatron-fsdp", "--use-distributed-optimizer"]
    assert run("--train-iters", "2", "--save", save, "--no-save-optim", "--no-save-rng", *fmt) == 0
    path = checkpointing.checkpoint_dir(save, 2)
    held = saved_keys(path)
    assert not held & {"optimizer", "opt_param_scheduler", "rng_state"} and "train_state" in held, held
    for loads, message in (
            ([], "was saved with --no-save-optim and --no-save-rng: it holds no optimizer state nor learning-rate "
                 "schedule and no RNG states, so it cannot resume exactly; give --no-load-optim and --no-load-rng "
                 "to continue it without them, or --finetune"),
            (["--no-load-optim"], "was saved with --no-save-rng: it holds no RNG states, so it cannot resume "
                                  "exactly; give --no-load-rng"),
            (["--no-load-rng"], "was saved with --no-save-optim: it holds no optimizer state nor learning-rate "
                                "schedule, so it cannot resume exactly; give --no-load-optim")):
        with pytest.raises(checkpointing.CheckpointError, match=message):
            in_process_trainer([*MODEL, "--train-iters", "4", "--load", save, *loads])
    assert in_process_trainer([*MODEL, "--train-iters", "4", "--load", save, "--finetune"]).state.iteration == 0
    resumed = in_process_trainer([*MODEL, "--train-iters", "4", "--load", save, "--save", save, "--no-load-optim",
                                  "--no-load-rng", *fmt])
    assert resumed.state.iteration == 2 and resumed.run() == 0
    assert [r["iteration"] for r in records(save)] == [1, 2, 3, 4]


@pytest.mark.slow  # in-process runs
def test_a_full_checkpoint_loads_without_its_optimizer_and_rng_states_as_before(tmp_path, single_process):
    """The refusal is of what a checkpoint lacks: one saved whole resumes with or without them."""
    save = str(tmp_path)
    assert run("--train-iters", "2", "--save", save) == 0
    assert {"optimizer", "opt_param_scheduler", "rng_state"} <= saved_keys(checkpointing.checkpoint_dir(save, 2))
    for loads in ([], ["--no-load-optim", "--no-load-rng"]):
        assert in_process_trainer([*MODEL, "--train-iters", "4", "--load", save, *loads]).state.iteration == 2


def in_process_pretrain(argv: list[str]) -> int:
    """angpt.pretrain's pretrain() in this process, for the runs that end before training (it would destroy the
    process group after one)."""
    config = parse_args(argv, world_size=1, recorded_flags=checkpointing.recorded_flags)
    distributed.destroy_model_parallel()
    try:
        return trainer_module.pretrain(config)
    finally:
        if not parallel_state.model_parallel_is_initialized():
            distributed.initialize()


@pytest.mark.slow  # in-process runs
@pytest.mark.parametrize("load", ["empty", "missing"])
def test_exit_on_missing_checkpoint_exits_with_status_0_where_load_holds_none(load, tmp_path, single_process,
                                                                             caplog):
    """Megatron-LM's _load_base_checkpoint: sys.exit() (status 0) instead of starting from scratch, for an empty
    --load and one that does not exist; a --load holding a checkpoint is loaded."""
    directory = str(tmp_path / "empty") if load == "empty" else str(tmp_path / "nowhere")
    os.makedirs(tmp_path / "empty")
    with caplog.at_level(logging.INFO, logger="angpt"):
        code = in_process_pretrain([*MODEL, "--train-iters", "2", "--load", directory, "--exit-on-missing-checkpoint"])
    assert code == 0
    assert (f"--exit-on-missing-checkpoint: no checkpoint in {directory} (no latest_checkpointed_iteration.txt): "
            "exiting instead of starting from scratch") in caplog.text
    assert "starting from scratch" not in caplog.text.replace("instead of starting from scratch", "")
    assert run("--train-iters", "2", "--save", str(tmp_path / "saved")) == 0
    trainer = in_process_trainer([*MODEL, "--train-iters", "2", "--load", str(tmp_path / "saved"),
                                  "--exit-on-missing-checkpoint"])
    assert trainer.state.iteration == 2


@pytest.mark.slow  # in-process runs
def test_use_checkpoint_args_takes_the_recorded_model_flags_as_megatron_lm_does(tmp_path, single_process):
    """The model's flags the checkpoint recorded: those Megatron-LM takes only where not given (--hidden-size,
    --num-layers, ...) where neither the command line nor --config gives them, the others (--rotary-base, the
    family's) over what was given; a resume then needs no model flags."""
    save = str(tmp_path / "run")
    assert run("--train-iters", "2", "--save", save, "--rotary-base", "5000", "--num-layers", "3") == 0
    rest = ["--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "1e-2", "--mock-data", "--vocab-size",
            "256", "--log-interval", "1", "--eval-iters", "0", "--train-iters", "4", "--load", save,
            "--use-checkpoint-args"]
    config_file = tmp_path / "run.yaml"
    config_file.write_text("hidden-size: 64\n")
    config = parse_args([*rest, "--rotary-base", "10000", "--num-attention-heads", "8", "--config", str(config_file)],
                        world_size=1, recorded_flags=checkpointing.recorded_flags)
    model = config.model
    # Given: --num-attention-heads (command line), --hidden-size (--config); taken: the rest (defaults 4 and 128).
    assert (model.num_layers, model.hidden_size, model.num_attention_heads, model.seq_length, model.rotary_base) == \
        (3, 64, 8, 32, 5000)
    assert config.checkpoint.flags_from_checkpoint.startswith(f"took from {checkpointing.checkpoint_dir(save, 2)}: ")
    assert "--rotary-base 5000 (given: 10000)" in config.checkpoint.flags_from_checkpoint
    assert f"--use-checkpoint-args: {config.checkpoint.flags_from_checkpoint}" in megatron_lm.notes(config)
    trainer = in_process_trainer([*rest, "--save", save])
    assert trainer.state.iteration == 2 and trainer.run_config.model.num_layers == 3 and trainer.run() == 0
    assert [r["iteration"] for r in records(save)] == [1, 2, 3, 4]
    empty = parse_args([*rest[:-3], "--load", str(tmp_path / "empty"), "--use-checkpoint-args"], world_size=1,
                       recorded_flags=checkpointing.recorded_flags)
    assert empty.model.num_layers == RunConfig().model.num_layers
    assert empty.checkpoint.flags_from_checkpoint == (f"no checkpoint in {tmp_path / 'empty'}: the flags given stand "
                                                      "(as in Megatron-LM)")


def recorded(**flags) -> dict:
    """The flags a checkpoint of a run of `flags` (by destination) records."""
    return RunConfig.from_flags({**RunConfig().flags(), **flags}).flags()


@pytest.mark.parametrize("mp_args, tp, refused", [(False, 1, None), (True, 2, "the world size 1 is not divisible by "
                                                                               "--tensor-model-parallel-size 2")])
def test_the_parallel_sizes_are_taken_with_use_mp_args_from_checkpoint_args_and_validated(mp_args, tp, refused,
                                                                                          capsys):
    """A checkpoint saved at TP 2: its size is taken only with --use-mp-args-from-checkpoint-args, and then goes
    through validation as a given one (refused for one process)."""
    saved = ("/ckpt/iter_0000002", recorded(tensor_model_parallel_size=2, world_size=2))
    argv = [*MOCK, "--load", "/ckpt", "--use-checkpoint-args", *(["--use-mp-args-from-checkpoint-args"] * mp_args)]
    if refused:
        with pytest.raises(SystemExit):
            parse_args(argv, world_size=1, recorded_flags=lambda load, step, *_: saved)
        assert refused in capsys.readouterr().err
    config = parse_args(argv, world_size=2, recorded_flags=lambda load, step, *_: saved)
    assert config.parallel.tensor_model_parallel_size == tp


def test_the_tokenizer_is_the_checkpoints_unless_no_use_tokenizer_model_from_checkpoint_args():
    saved = recorded(tokenizer_type="HuggingFaceTokenizer", tokenizer_model="/saved/tokenizer.json")
    assert checkpoint_args(saved, set(), tokenizer=True, parallel=False)["tokenizer_model"] == "/saved/tokenizer.json"
    taken = checkpoint_args(saved, {"tokenizer_model"}, tokenizer=False, parallel=False)
    assert "tokenizer_model" not in taken and "tokenizer_type" not in taken
    # A value the checkpoint leaves unset is not taken (Megatron-LM's "Checkpoint did not provide arguments").
    assert "kv_channels" not in checkpoint_args(recorded(), set(), tokenizer=True, parallel=False)


@pytest.mark.slow  # in-process runs
@pytest.mark.parametrize("family", ["angpt", "ngpt", "gptplus", "gpt"])
def test_no_initialization_resumes_as_an_initialized_model_does(family, tmp_path, single_process):
    """--no-initialization builds the weights uninitialized (megatron-core's perform_initialization, and anGPT's and
    nGPT's unit-norm rows skipped) for the checkpoint to give them: the resumed run is bit for bit the one that
    initialized first. With --load holding no checkpoint the weights would stay garbage: refused in one line."""
    save = str(tmp_path / "run")
    flags = [*MODEL, "--model-family", family, "--train-iters", "4"]
    assert in_process_trainer([*flags[:-1], "2", "--save", save]).run() == 0
    losses = {}
    for given in ([], ["--no-initialization"]):
        out = str(tmp_path / f"resumed{len(given)}")
        shutil.copytree(save, out)
        trainer = in_process_trainer([*flags, "--load", out, "--save", out, *given])
        assert get_model_config(trainer.chunks[0]).perform_initialization is not given
        assert trainer.state.iteration == 2 and trainer.run() == 0
        losses[bool(given)] = [(r["iteration"], r["lm_loss"]) for r in records(out)][2:]
    assert len(losses[True]) == 2 and losses[True] == losses[False]
    with pytest.raises(ValueError, match=r"^--no-initialization: no checkpoint in .*empty to give the weights, which "
                                         r"would stay uninitialized memory"):
        in_process_trainer([*flags, "--load", str(tmp_path / "empty"), "--no-initialization"])


@pytest.mark.parametrize("argv, message", [
    (["--use-checkpoint-args"], "--use-checkpoint-args needs --load"),
    (["--no-initialization"], "--no-initialization needs --load"),
    (["--load", "x", "--load-main-params-from-ckpt"], "--load-main-params-from-ckpt needs --no-load-optim"),
    (["--load", "x", "--no-load-optim", "--load-main-params-from-ckpt", "--bf16"],
     "--load-main-params-from-ckpt with --bf16 or --fp16 needs --use-distributed-optimizer"),
    (["--use-distributed-optimizer", "--disable-gloo-process-groups",
      "--distrib-optim-fully-reshardable-mem-efficient"],
     "--distrib-optim-fully-reshardable-mem-efficient gathers the optimizer state over megatron-core's gloo process "
     "groups"),
    (["--save", "x", "--non-persistent-ckpt-type", "global", "--non-persistent-save-interval", "0"],
     "--non-persistent-save-interval 0 must be at least 1"),
    (["--save", "x", "--non-persistent-save-interval", "1"],
     "--non-persistent-save-interval needs --non-persistent-ckpt-type global"),
    (["--non-persistent-ckpt-type", "local", "--non-persistent-local-ckpt-dir", "/local"],
     "--non-persistent-ckpt-type local: its checkpoints are nvidia_resiliency_ext's"),
    (["--non-persistent-ckpt-type", "in_memory"], "--non-persistent-ckpt-type in_memory: Megatron-LM 0.16 refuses it"),
    (["--save", "x", "--non-persistent-ckpt-type", "global", "--non-persistent-global-ckpt-dir", "./x/"],
     "--non-persistent-global-ckpt-dir is --save: each non-persistent save would delete the persistent checkpoints"),
    (["--replication", "--replication-jump", "2"], "--replication: not supported: replication is of local "
                                                   "non-persistent checkpoints"),
])
def test_the_checkpoint_flags_refuse_what_megatron_lm_refuses(argv, message, capsys):
    with pytest.raises(SystemExit):
        parse_args([*MOCK, *argv], world_size=1, recorded_flags=checkpointing.recorded_flags)
    assert message in capsys.readouterr().err


def test_the_checkpoint_flags_at_their_boundary_and_where_megatron_lm_ignores_them():
    """Accepted where Megatron-LM runs them, each said in one line where it changes nothing."""
    assert importlib.util.find_spec("nvidia_resiliency_ext") is None  # what the refusals of local ones say
    config = parse_args([*MOCK, "--save", "x", "--non-persistent-ckpt-type", "global", "--non-persistent-save-interval",
                         "1", "--replication-jump", "2", "--replication-factor", "2", "--no-save-optim"], world_size=1)
    assert config.checkpoint.non_persistent_save_interval == 1
    notes = megatron_lm.notes(config)
    assert any(note.startswith("--replication-jump: ignored, as in Megatron-LM") for note in notes)
    assert any(note.startswith("--no-save-optim: the checkpoints hold no optimizer state") for note in notes)
    alone = megatron_lm.notes(parse_args([*MOCK, "--exit-on-missing-checkpoint", "--no-save-rng",
                                          "--load-main-params-from-ckpt", "--no-load-optim", "--load", "x",
                                          "--use-mp-args-from-checkpoint-args",
                                          "--distrib-optim-fully-reshardable-mem-efficient"], world_size=1))
    for line in ("--no-save-optim and --no-save-rng: without --save nothing is saved",
                 "--use-mp-args-from-checkpoint-args and --no-use-tokenizer-model-from-checkpoint-args: without "
                 "--use-checkpoint-args no flag is taken from a checkpoint",
                 "--load-main-params-from-ckpt: without --bf16 or --fp16 the model's weights are the main ones",
                 "--distrib-optim-fully-reshardable-mem-efficient: it applies to the distributed optimizer's state in "
                 "torch_dist checkpoints only"):
        assert f"{line} (as in Megatron-LM, nothing changes)" in alone
    assert "--exit-on-missing-checkpoint: without --load no checkpoint is looked for (as in Megatron-LM, nothing " \
           "changes)" in megatron_lm.notes(parse_args([*MOCK, "--exit-on-missing-checkpoint"], world_size=1))


@pytest.mark.slow  # in-process runs
@pytest.mark.parametrize("directory", [None, "elsewhere"])
def test_global_non_persistent_checkpoints_replace_each_other_and_resume_where_newer(directory, tmp_path,
                                                                                    single_process, caplog):
    """Megatron-LM's global non-persistent checkpoints: ordinary ones every --non-persistent-save-interval (but at
    --save-interval's), in non_persistent/ of --save or --non-persistent-global-ckpt-dir, each replacing the one
    before; a --load with --non-persistent-ckpt-type global resumes from there where it is at least as new."""
    save = str(tmp_path / "run")
    where = str(tmp_path / directory) if directory else os.path.join(save, "non_persistent")
    flags = ["--non-persistent-ckpt-type", "global",
             *(["--non-persistent-global-ckpt-dir", where] if directory else [])]
    assert run("--train-iters", "3", "--save", save, "--save-interval", "2", "--non-persistent-save-interval", "1",
               *flags) == 0
    assert checkpointing.complete_iterations(save) == [2, 3]  # 3: the end of training
    assert checkpointing.complete_iterations(where) == [3] and checkpointing.read_latest_iteration(where) == 3
    # As if the run had died after its non-persistent save at 3: --load's latest is 2.
    checkpointing.write_latest_iteration(save, 2)
    shutil.rmtree(checkpointing.checkpoint_dir(save, 3))
    assert in_process_trainer([*MODEL, "--train-iters", "4", "--load", save]).state.iteration == 2
    with caplog.at_level(logging.INFO, logger="angpt"):
        trainer = in_process_trainer([*MODEL, "--train-iters", "4", "--load", save, *flags])
    assert trainer.loaded_from == checkpointing.checkpoint_dir(where, 3) and trainer.state.iteration == 3
    assert "resuming from the non-persistent checkpoint" in caplog.text
    # --use-checkpoint-args reads the flags of the checkpoint the run resumes from (Megatron-LM's _load_base_checkpoint
    # gives load_args_from_checkpoint the non-persistent one where newer); --ckpt-step names --load's own.
    argv = [*MOCK, "--train-iters", "4", "--load", save, "--use-checkpoint-args"]
    for given, taken in ((flags, checkpointing.checkpoint_dir(where, 3)),
                         ([*flags, "--ckpt-step", "2"], checkpointing.checkpoint_dir(save, 2)),
                         ([], checkpointing.checkpoint_dir(save, 2))):
        config = parse_args([*argv, *given], world_size=1, recorded_flags=checkpointing.recorded_flags)
        assert config.checkpoint.flags_from_checkpoint.startswith(f"took from {taken}: "), given


def main_weights(trainer) -> dict[str, torch.Tensor]:
    """{name: the distributed optimizer's fp32 main weight} of a one-process run (its shard is the whole weight)."""
    (inner,) = trainer.optimizer.chained_optimizers
    names = {param: name for chunk in trainer.chunks for name, param in unwrap_model(chunk).named_parameters()}
    return {names[param]: main.detach().view(param.shape).clone()
            for model_group, main_group in zip(inner.model_float16_groups, inner.shard_fp32_from_float16_groups)
            for param, main in zip(model_group, main_group)}


@pytest.mark.slow  # in-process runs
def test_load_main_params_from_ckpt_takes_the_main_weights_from_an_fp32_checkpoint(tmp_path, single_process):
    """Megatron-LM's reload_model_params(state_dict): a torch-format checkpoint of an fp32 run gives a bf16 run's fp32
    main weights exactly, where without the flag they are the bf16 weights' (rounded)."""
    save = str(tmp_path)
    assert run("--train-iters", "1", "--save", save, "--ckpt-format", "torch") == 0
    path = torch_checkpoint.model_file(checkpointing.checkpoint_dir(save, 1))
    weights = {name: value for name, value in checkpoint_unpickling.read_as_data(path, map_location="cpu")["model"]
               .items() if isinstance(value, torch.Tensor) and value.is_floating_point() and "_extra_state" not in name}
    loads = [*MODEL, "--train-iters", "2", "--load", save, "--bf16", "--use-distributed-optimizer", "--no-load-optim"]
    exact = main_weights(in_process_trainer([*loads, "--load-main-params-from-ckpt"]))
    rounded = main_weights(in_process_trainer(loads))
    assert exact.keys() == rounded.keys() and exact.keys() <= weights.keys()
    assert all(torch.equal(exact[name], weights[name]) for name in exact)
    assert all(torch.equal(rounded[name], weights[name].bfloat16().float()) for name in rounded)
    assert sum(not torch.equal(exact[name], rounded[name]) for name in exact) >= len(exact) // 2


@pytest.mark.slow  # in-process runs
def test_a_mem_efficient_distributed_optimizer_checkpoint_holds_and_loads_the_same_state(tmp_path, single_process):
    """megatron-core's memory-efficient gather (over gloo, onto data-parallel rank 0) writes the optimizer state the
    default one writes, and a run given the flag loads it back."""
    saved = {}
    for efficient in (False, True):
        save = str(tmp_path / str(efficient))
        flags = ["--use-distributed-optimizer", *(["--distrib-optim-fully-reshardable-mem-efficient"] * efficient)]
        distributed.set_random_seed(1234)
        assert run("--train-iters", "2", "--save", save, *flags) == 0
        saved[efficient] = checkpointing.read_plain_tensors(checkpointing.checkpoint_dir(save, 2))
        resumed = in_process_trainer([*MODEL, "--train-iters", "3", "--load", save, "--save", save, *flags])
        assert resumed.state.iteration == 2 and resumed.run() == 0
    optimizer = [key for key in saved[False] if key.startswith("optimizer.")]
    assert optimizer and optimizer == [key for key in saved[True] if key.startswith("optimizer.")]
    assert all(torch.equal(saved[False][key], saved[True][key]) for key in optimizer)
