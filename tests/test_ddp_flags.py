"""Megatron-LM's data-parallel and distributed flags with its meaning: --ddp-num-buckets,
--ddp-pad-buckets-for-high-nccl-busbw, --ddp-reduce-scatter-with-fp32-accumulation, --no-align-grad-reduce,
--no-align-param-gather, --create-all-gather-group, --distributed-timeout-seconds-after-init, --fake-process-group;
the ones Megatron-LM ignores (--no-scatter-gather-tensors-in-pipeline, --disable-symmetric-registration) said in one
line; the NCCL-only ones and the precision-aware optimizer (Transformer Engine's FusedAdam) refused with the reason.

Each flag that changes only how the gradients and weights are laid out or communicated trains as without it: one
torchrun job of 2 processes (tests/distributed/ddp_flags_worker.py) runs every variant three steps from the same
weights, and their losses, first gradients and final weights are compared with the variant's default."""

import json
import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from megatron.core import parallel_state

from angpt.config import megatron_lm
from angpt.config.arguments import parse_args
from angpt.training.megatron_configs import ddp_config, transformer_config
from angpt.training.step import build_model_chunks

from conftest import ROOT, in_process_trainer, run_workers
from launch import launch

MOCK = ["--mock-data", "--vocab-size", "64", "--train-iters", "4"]
DIST_OPT = ["--overlap-grad-reduce", "--use-distributed-optimizer"]
# PP 2 with 2 virtual stages of 1 layer each, the weights all-gathered overlapped (at DP 1: 2 processes).
INTERLEAVED = [*DIST_OPT, "--overlap-param-gather", "--pipeline-model-parallel-size", "2",
               "--num-layers-per-virtual-pipeline-stage", "1"]
MEGATRON_FSDP = ["--use-megatron-fsdp", "--use-distributed-optimizer", "--ckpt-format", "fsdp_dtensor",
                 "--data-parallel-sharding-strategy", "optim_grads_params"]
# {variant: (its default, its flags)}; a default is its own (None). DP 2 but for the interleaved ones.
VARIANTS = {
    "dp2": (None, ["--overlap-grad-reduce"]),
    "dp2_num_buckets": ("dp2", ["--overlap-grad-reduce", "--ddp-num-buckets", "4"]),
    "distributed_optimizer": (None, DIST_OPT),
    "padded_buckets": ("distributed_optimizer", [*DIST_OPT, "--ddp-pad-buckets-for-high-nccl-busbw",
                                                 "--ddp-num-buckets", "3"]),
    "fp32_accumulation": ("distributed_optimizer", [*DIST_OPT, "--ddp-reduce-scatter-with-fp32-accumulation"]),
    "interleaved": (None, INTERLEAVED),
    "no_align_grad_reduce": ("interleaved", [*INTERLEAVED, "--no-align-grad-reduce"]),
    "no_align_param_gather": ("interleaved", [*INTERLEAVED, "--no-align-param-gather"]),
    # The first chunk's all-gathers started by its own optimizer, the schedule's aligned ones skipped for it.
    "overlap_optimizer_step": ("interleaved", [*INTERLEAVED, "--overlap-param-gather-with-optimizer-step",
                                               "--ckpt-format", "torch"]),
    "megatron_fsdp": (None, MEGATRON_FSDP),
    "all_gather_group": ("megatron_fsdp", [*MEGATRON_FSDP, "--create-all-gather-group"]),
}


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict:
    """{variant: what the worker recorded}, all trained in one job."""
    root = tmp_path_factory.mktemp("ddp_flags")
    spec = root / "variants.json"
    spec.write_text(json.dumps([dict(name=name, family="angpt", flags=flags)
                                for name, (_, flags) in VARIANTS.items()]))
    run_workers("ddp_flags_worker.py", str(spec), str(root))
    return {name: torch.load(root / f"{name}.pt") for name in VARIANTS}


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", [name for name, (default, _) in VARIANTS.items() if default])
def test_a_layout_flag_trains_as_its_default(name, trained):
    """Three steps of anGPT (fp32, gloo): the same losses, first-step gradients (reduced over the data-parallel
    ranks) and weights after them as without the flag, to fp32's rounding."""
    default = VARIANTS[name][0]
    flagged, reference = trained[name], trained[default]
    assert flagged["losses"] == pytest.approx(reference["losses"], rel=1e-6)
    if reference["grads"] is not None:  # Megatron-FSDP's sharded gradients are not gathered: its weights are
        assert set(flagged["grads"]) == set(reference["grads"])
        assert max(relative(flagged["grads"][k], reference["grads"][k]) for k in reference["grads"]) < 1e-6
    assert set(flagged["params"]) == set(reference["params"])
    assert max(relative(flagged["params"][k], reference["params"][k]) for k in reference["params"]) < 1e-6
    assert flagged["losses"][2] < flagged["losses"][1] < flagged["losses"][0]  # the steps updated the weights


@pytest.mark.multiprocess
def test_the_flags_change_the_buckets_and_the_schedule_as_megatron_core_reads_them(trained):
    # --ddp-num-buckets 4: buckets of at least this rank's parameters // 4 (Megatron-LM's get_model), but the last.
    [[whole]] = trained["dp2"]["buckets"][0]
    [[*split]] = trained["dp2_num_buckets"]["buckets"][0]
    assert whole == sum(split) and len(split) > 1 and min(split[:-1]) >= sum(split) // 4
    # The distributed optimizer's buckets: 128-element multiples (and of DP), 2^16 ones with the padding.
    [[default]] = trained["distributed_optimizer"]["buckets"][0]
    [[*padded]] = trained["padded_buckets"]["buckets"][0]
    assert default % 128 == 0 and default % 2**16 != 0
    assert len(padded) > 1 and all(size % 2**16 == 0 for size in padded)
    # megatron-core's reduce-scatter with fp32 accumulation: once a step (one bucket), only with the flag.
    assert trained["fp32_accumulation"]["fp32_accumulation_calls"] == 3
    assert trained["distributed_optimizer"]["fp32_accumulation_calls"] == 0
    # The schedule starts the stages' reductions and all-gathers unless told not to (Megatron-LM's train).
    for name, grad_sync, param_sync in (("interleaved", True, True), ("no_align_grad_reduce", False, True),
                                        ("no_align_param_gather", True, False), ("overlap_optimizer_step", True, True)):
        assert (trained[name]["grad_sync_func"], trained[name]["param_sync_func"]) == (grad_sync, param_sync), name
        assert trained[name]["align_param_gather"] == param_sync
    # Megatron-FSDP all-gathers the weights over megatron-core's second data-parallel group when there is one.
    assert trained["megatron_fsdp"]["weight_groups"] == {"data-parallel"}
    assert trained["all_gather_group"]["weight_groups"] == {"all-gather"}


def test_the_flags_reach_megatron_cores_ddp_config_by_field_name():
    """As Megatron-LM's get_model fills DistributedDataParallelConfig; --no-align-param-gather's field is True only
    in the interleaved schedule (Megatron-LM's validate_args turns it off otherwise)."""
    default = ddp_config(parse_args(MOCK, world_size=1))
    assert (default.pad_buckets_for_high_nccl_busbw, default.reduce_scatter_with_fp32_accumulation,
            default.align_param_gather) == (False, False, False)
    given = ddp_config(parse_args([*MOCK, *DIST_OPT, "--ddp-pad-buckets-for-high-nccl-busbw",
                                   "--ddp-reduce-scatter-with-fp32-accumulation"], world_size=2))
    assert given.pad_buckets_for_high_nccl_busbw and given.reduce_scatter_with_fp32_accumulation
    interleaved = ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"]
    assert ddp_config(parse_args([*MOCK, *interleaved], world_size=2)).align_param_gather
    assert not ddp_config(parse_args([*MOCK, *interleaved, "--no-align-param-gather"], world_size=2)).align_param_gather
    assert not ddp_config(parse_args([*MOCK, "--pipeline-model-parallel-size", "2"], world_size=2)).align_param_gather
    assert parse_args(MOCK, world_size=1).parallel.align_grad_reduce
    assert not parse_args([*MOCK, "--no-align-grad-reduce"], world_size=1).parallel.align_grad_reduce


@pytest.mark.parametrize("argv,message", [
    (["--ddp-num-buckets", "0"], "--ddp-num-buckets 0 must be at least 1"),
    (["--ddp-num-buckets", "2", "--ddp-bucket-size", "1000"],
     "give one of --ddp-num-buckets and --ddp-bucket-size (Megatron-LM's check)"),
    ([*DIST_OPT, "--ddp-reduce-scatter-with-fp32-accumulation", "--num-distributed-optimizer-instances", "2"],
     "--ddp-reduce-scatter-with-fp32-accumulation with --num-distributed-optimizer-instances 2: megatron-core builds "
     "it for one instance only"),
    ([*DIST_OPT, "--ddp-reduce-scatter-with-fp32-accumulation", "--ddp-average-in-collective"],
     "--ddp-reduce-scatter-with-fp32-accumulation sums the gradients (megatron-core asserts ReduceOp.SUM): not with "
     "--ddp-average-in-collective"),
    (["--distributed-timeout-seconds-after-init", "0"], "--distributed-timeout-seconds-after-init 0 must be positive"),
    (["--hang-timeout-minutes", "1", "--distributed-timeout-seconds-after-init", "60"],
     "--hang-timeout-minutes 1.0 must be below --distributed-timeout-seconds-after-init 60 (in minutes, 1)"),
    (["--use-precision-aware-optimizer"], "Transformer Engine's FusedAdam"),
    (["--main-grads-dtype", "bf16"], "other than fp32 it needs --use-precision-aware-optimizer"),
    (["--main-params-dtype", "fp16"], "other than fp32 it needs --use-precision-aware-optimizer"),
    (["--exp-avg-dtype", "fp8"], "other than fp32 it needs --use-precision-aware-optimizer"),
    (["--exp-avg-sq-dtype", "bf16"], "other than fp32 it needs --use-precision-aware-optimizer"),
    (["--use-nccl-ub"], "NCCL user buffers for the gradient and weight buffers: NCCL's, on CUDA GPUs only"),
    (["--use-sharp"], "InfiniBand SHARP through NCCL's CollNet: NCCL's, on CUDA GPUs only"),
    (["--sharp-enabled-group", "dp"], "it needs --use-sharp (megatron-core asserts so)"),
    (["--nccl-communicator-config-path", "nccl.yaml"], "NCCL's per-group communicator settings: NCCL's, on CUDA"),
    (["--high-priority-stream-groups", "dp_cp"], "high-priority CUDA streams for NCCL's communicators"),
])
def test_megatron_lms_checks_and_what_needs_nccl_or_transformer_engine_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit):
        parse_args([*MOCK, *argv], world_size=2)
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv", [
    ["--ddp-num-buckets", "1"],
    [*DIST_OPT, "--ddp-reduce-scatter-with-fp32-accumulation", "--num-distributed-optimizer-instances", "1"],
    ["--ddp-reduce-scatter-with-fp32-accumulation", "--ddp-average-in-collective"],  # all-reduced: nothing to sum
    ["--distributed-timeout-seconds-after-init", "1"],
    ["--hang-timeout-minutes", "1", "--distributed-timeout-seconds-after-init", "61"],
    # Megatron-LM's defaults ask for nothing.
    ["--main-grads-dtype", "fp32", "--main-params-dtype", "fp32", "--exp-avg-dtype", "fp32", "--exp-avg-sq-dtype",
     "fp32"],
    ["--high-priority-stream-groups"],
])
def test_the_same_flags_at_their_boundaries_are_taken(argv):
    parse_args([*MOCK, *argv], world_size=2)


@pytest.mark.parametrize("argv,line", [
    (["--ddp-num-buckets", "2"], "--ddp-num-buckets: without --overlap-grad-reduce the gradients are reduced at "
                                 "once, in one bucket (as in Megatron-LM, nothing changes)"),
    (["--ddp-bucket-size", "1000"], "--ddp-bucket-size: without --overlap-grad-reduce"),
    (["--ddp-pad-buckets-for-high-nccl-busbw"], "--ddp-pad-buckets-for-high-nccl-busbw: only the distributed "
                                                "optimizer's buckets are padded"),
    (["--ddp-reduce-scatter-with-fp32-accumulation"], "--ddp-reduce-scatter-with-fp32-accumulation: only the "
                                                      "distributed optimizer's gradients are reduce-scattered"),
    (["--no-align-grad-reduce", "--overlap-grad-reduce"], "--no-align-grad-reduce: the stages' overlapped gradient "
                                                          "reductions are aligned only with --overlap-grad-reduce "
                                                          "and pipeline parallelism"),
    (["--no-align-param-gather", "--pipeline-model-parallel-size", "2", *DIST_OPT, "--overlap-param-gather"],
     "--no-align-param-gather: the stages' overlapped weight all-gathers are aligned only with "
     "--overlap-param-gather and the interleaved schedule"),
    (["--create-all-gather-group"], "--create-all-gather-group: only Megatron-FSDP's all-gathers use the group"),
    (["--no-scatter-gather-tensors-in-pipeline"], "--no-scatter-gather-tensors-in-pipeline: ignored, as in "
                                                  "Megatron-LM (nothing reads it in Megatron-LM core_v0.16.1 or "
                                                  "megatron-core 0.16.1)"),
    (["--disable-symmetric-registration"], "--disable-symmetric-registration: ignored, as in Megatron-LM"),
])
def test_a_flag_that_changes_nothing_here_is_said_in_one_line(argv, line):
    """Where Megatron-LM accepts a flag and it changes nothing, the run says so; where it acts, nothing is said."""
    given = megatron_lm.notes(parse_args([*MOCK, *argv], world_size=2), cuda=False)
    assert len([note for note in given if note.startswith(line)]) == 1, given


@pytest.mark.parametrize("argv", [
    ["--ddp-num-buckets", "2", "--overlap-grad-reduce"],
    [*DIST_OPT, "--ddp-pad-buckets-for-high-nccl-busbw", "--ddp-reduce-scatter-with-fp32-accumulation"],
    ["--no-align-grad-reduce", "--overlap-grad-reduce", "--pipeline-model-parallel-size", "2"],
    ["--no-align-param-gather", *INTERLEAVED],
    ["--create-all-gather-group", *MEGATRON_FSDP],
])
def test_where_the_flag_acts_nothing_is_said(argv):
    flags = [flag for flag in argv if flag.startswith("--ddp-") or flag in (
        "--no-align-grad-reduce", "--no-align-param-gather", "--create-all-gather-group")]
    assert [note for note in megatron_lm.notes(parse_args([*MOCK, *argv], world_size=2), cuda=False)
            if note.startswith(tuple(flags))] == []


def test_ddp_num_buckets_sizes_the_buckets_from_this_ranks_parameters(single_process):
    """Megatron-LM's get_model: bucket_size = the parameters of this rank's model chunks // --ddp-num-buckets."""
    config = parse_args([*MOCK, "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
                         "--overlap-grad-reduce", "--ddp-num-buckets", "3"], world_size=1)
    chunks = build_model_chunks(transformer_config(config), 64, config.model.seq_length, ddp_config(config),
                                num_buckets=config.parallel.ddp_num_buckets)
    parameters = sum(param.numel() for param in chunks[0].module.parameters())
    assert chunks[0].ddp_config.bucket_size == parameters // 3
    assert len(chunks[0].buffers[0].buckets) >= 3


@pytest.mark.slow  # an in-process trainer run
def test_the_timeout_after_init_applies_to_every_group_from_the_end_of_the_first_iteration(monkeypatch,
                                                                                           single_process):
    """megatron-core's update_pg_timeout, as Megatron-LM's train calls it: once, when the first iteration of the run
    is done; every process group megatron-core built (and the default one) waits that long from then on."""
    calls = []
    update = parallel_state.update_pg_timeout

    def recorded(timeout, pg=None):
        calls.append((trainer.state.iteration, timeout))
        update(timeout, pg)

    monkeypatch.setattr(parallel_state, "update_pg_timeout", recorded)
    trainer = in_process_trainer([*MOCK[:-2], "--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "4",
                                  "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "2",
                                  "--eval-iters", "0", "--train-iters", "3",
                                  "--distributed-timeout-seconds-after-init", "4321"])
    default = dist.distributed_c10d._get_default_group()
    before = default._get_backend(torch.device("cpu")).options._timeout
    try:
        assert trainer.run() == 0
        assert calls == [(1, timedelta(seconds=4321))]
        groups = [group or default for group in parallel_state._global_process_group_list]
        assert len(groups) > 5
        assert {group._get_backend(torch.device("cpu")).options._timeout for group in groups} == {
            timedelta(seconds=4321)}
    finally:  # the session's default group, which later tests use
        dist.distributed_c10d._set_pg_timeout(before, default)


def test_a_fake_process_group_turns_the_nan_checks_and_gloo_groups_off_and_refuses_save(capsys):
    """Megatron-LM's validate_args turns off the NaN checks and the gloo groups for --fake-process-group; a save
    fails (megatron-core's checkpoint checks the shards of every rank), refused here in one line."""
    config = parse_args([*MOCK, "--fake-process-group"], world_size=2)
    assert not (config.rerun.nan_checks or config.rerun.check_for_nan_in_loss_and_grad
                or config.parallel.enable_gloo_process_groups)
    assert "--fake-process-group: every collective is skipped, so the losses and norms are this rank's own; no NaN " \
           "checks and no gloo process groups (as Megatron-LM sets them)" in megatron_lm.notes(config, cuda=False)
    plain = parse_args(MOCK, world_size=2)
    assert plain.rerun.nan_checks and plain.parallel.enable_gloo_process_groups
    with pytest.raises(SystemExit):
        parse_args([*MOCK, "--fake-process-group", "--save", "x"], world_size=2)
    assert "--fake-process-group with --save: megatron-core's checkpoint save checks the shards of every rank" in \
        capsys.readouterr().err


@pytest.mark.slow  # one process of angpt.pretrain
def test_one_process_trains_as_one_rank_of_four_in_a_fake_process_group(tmp_path):
    """`WORLD_SIZE=4 python -m angpt.pretrain --fake-process-group` at TP 2: the one process builds rank 0's half of
    the layers (TP 2 x DP 2 of 4) and trains, no other process joining (torch's fake group skips the collectives)."""
    env = {**os.environ, "PYTHONPATH": ROOT, "PYTHONWARNINGS": "ignore", "WORLD_SIZE": "4"}
    env.pop("RANK", None)
    flags = [*MOCK[:-2], "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length",
             "16", "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "2", "--eval-iters", "0",
             "--log-interval", "1", "--tensor-model-parallel-size", "2", "--fake-process-group"]
    done = launch(["-m", "angpt.pretrain", *flags, "--metrics-file", str(tmp_path / "metrics.jsonl")], env=env,
                  timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "world 4 (TP 2, PP 1, CP 1, DP 2)" in done.stderr
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [record["iteration"] for record in records if record["kind"] == "train"] == [1, 2]
