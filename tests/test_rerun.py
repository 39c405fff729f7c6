"""megatron-core's rerun state machine in the step and the trainer (angpt/training/rerun.py): each injected fault
is detected, rerun and named (the rank and host for a transient fault, the samples and the dataset for one that
reproduces), with Megatron-LM's exit codes; in this process, on the CPU."""

import logging
import re
import socket
from functools import partial
from types import SimpleNamespace

import pytest
import torch
from megatron.core import tensor_parallel
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.rerun_state_machine import (
    EXIT_CODE_FAILED_ON_RESULT_VALIDATION,
    EXIT_CODE_RESUME_TO_DISAMBIGUATE,
    RerunDataIterator,
    RerunDiagnostic,
    RerunMode,
    RerunStateMachine,
    RerunValidationStatus,
    destroy_rerun_state_machine,
    get_rerun_state_machine,
)
from megatron.core.utils import get_model_config
from test_gpt_datasets import write_dataset
from test_trainer import MODEL, checkpoint_tensors, latest, records

from angpt.config.arguments import parse_args
from angpt.config.sections import RunConfig
from angpt.models import model_config
from angpt.training import faults, rerun
from angpt.training.optimizer import build_optimizer
from angpt.training.step import build_model_chunks, train_step

from conftest import in_process_trainer

V, S, MB = 128, 16, 2
FLAGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", str(S),
         "--micro-batch-size", str(MB), "--global-batch-size", str(MB), "--mock-data", "--vocab-size", str(V),
         "--train-iters", "1"]


@pytest.fixture(autouse=True)
def fresh_machine():
    """Each test builds its own machine; none is left to tests that build none (an implicit, disabled one)."""
    destroy_rerun_state_machine()
    yield
    destroy_rerun_state_machine()


def machine_checks(*flags: str) -> rerun.Checks:
    config = parse_args([*FLAGS, *flags], world_size=1)
    rerun.initialize(config.rerun, 0)
    return rerun.checks(config.rerun)


def tiny(checks: rerun.Checks, bucket_size=None):
    # megatron-core's DDP makes buckets of bucket_size only when it overlaps the grad reduce with the backward.
    ddp = DistributedDataParallelConfig(grad_reduce_in_fp32=True, check_for_nan_in_grad=checks.nan,
                                        check_for_large_grads=checks.large_grads, bucket_size=bucket_size,
                                        overlap_grad_reduce=bucket_size is not None)
    chunks = build_model_chunks(model_config("gptplus", num_layers=2, hidden_size=64, num_attention_heads=4), V, S,
                                ddp)
    optimizer, scheduler = build_optimizer(chunks, RunConfig.from_flags(dict(model_family="gptplus", lr=1e-3,
                                                                              train_iters=1000, lr_warmup_iters=0)))
    return chunks, optimizer, scheduler


def batch(seed: int, scale: float = 1.0) -> dict:
    tokens = torch.randint(0, V, (MB, S + 1), generator=torch.Generator().manual_seed(seed))
    return dict(tokens=tokens[:, :-1], labels=tokens[:, 1:], loss_mask=torch.full((MB, S), scale),
                position_ids=torch.arange(S).unsqueeze(0).expand(MB, -1))


class Counted:
    """An iterator over `batches` that counts the micro-batches read (a rerun reads them from its replay)."""

    def __init__(self, batches):
        self.batches, self.read = iter(batches), 0

    def __iter__(self):
        return self

    def __next__(self):
        self.read += 1
        return next(self.batches)


def step(model, batches, checks):
    chunks, optimizer, scheduler = model
    return train_step(iter(batches), chunks, optimizer, scheduler, len(batches), MB, S, checks=checks)


@pytest.mark.slow
def test_a_spiky_loss_is_rerun_found_reproducible_and_named_by_its_micro_batch(seeded, monkeypatch):
    """pretrain_gpt.py's check: a micro-batch loss (its sum over tokens) of 10x the largest of the first 100 that
    were checked (megatron-core checks from the second step on). Its rerun reproduces it: not fatal, the step
    is applied. The spike: micro-batch 2 of 3 has its loss mask times 100."""
    checks = machine_checks("--check-for-spiky-loss")
    assert checks == rerun.Checks(nan=True, spiky=True, large_grads=False)
    model = tiny(checks)
    step(model, [batch(0)], checks)
    step(model, [batch(i) for i in range(1, 101)], checks)  # the 100 samples of the largest loss
    assert rerun.findings() == []
    spiky = [batch(200), batch(201, scale=100.0), batch(202)]
    data = Counted(spiky)
    chunks, optimizer, scheduler = model
    loss, _, updated = train_step(data, chunks, optimizer, scheduler, 3, MB, S, checks=checks)
    assert updated and data.read == 3  # the rerun replayed the micro-batches it had read
    [finding] = rerun.findings()
    assert (finding.message, finding.micro_batch) == (rerun.SPIKY_LOSS, 2)
    assert finding.statuses == (RerunValidationStatus.INITIAL_RUN, RerunValidationStatus.FIRST_RERUN_REPRODUCIBLE)
    assert "reproduced by a rerun" in finding.outcome
    step(model, [batch(300)], checks)
    assert rerun.findings() == []  # a new step starts clean


def test_large_grads_are_rerun_and_found_reproducible(seeded):
    """megatron-core's DDP check (--check-for-large-grads): a bucket's local grad norm 10x the largest of the first
    100 bucket norms checked. Small buckets give 100 norms in few steps; then the loss is scaled 1000x."""
    checks = machine_checks("--check-for-large-grads")
    model = tiny(checks, bucket_size=2000)
    buckets = sum(len(group.buckets) for group in model[0][0].bucket_groups)
    assert buckets >= 10
    for seed in range(1 + -(-100 // buckets)):
        step(model, [batch(seed)], checks)
    assert rerun.findings() == []
    # The schedule's hook for fp16 loss scaling multiplies the loss before its backward (a mask would not: the
    # loss is the mean over the mask).
    get_model_config(model[0][0]).grad_scale_func = lambda loss: loss * 1000.0
    _, _, updated = step(model, [batch(99)], checks)
    [finding] = rerun.findings()
    assert finding.message.startswith("found unexpected large grads in bucket #") and finding.micro_batch is None
    assert finding.statuses[-1] == RerunValidationStatus.FIRST_RERUN_REPRODUCIBLE and updated


def test_disabled_costs_nothing_and_skips_a_nan_step(seeded, monkeypatch):
    """--rerun-mode disabled: no all-reduce of the machine, no saved RNG state, no rerun, no micro-batch kept;
    a NaN step is skipped as before the machine (the NaN check is angpt's skip). validate_results (the default)
    pays one all-reduce and one RNG state per step."""
    calls = {"_reduce_any": 0, "_save_state": 0}
    for name in calls:
        original = getattr(RerunStateMachine, name)

        def counted(self, *args, _original=original, _name=name):
            calls[_name] += 1
            return _original(self, *args)

        monkeypatch.setattr(RerunStateMachine, name, counted)
    checks = machine_checks("--rerun-mode", "disabled")
    assert not checks.nan
    model = tiny(checks)
    for seed in range(3):
        data = Counted([batch(seed), batch(seed + 10)])
        chunks, optimizer, scheduler = model
        train_step(data, chunks, optimizer, scheduler, 2, MB, S, checks=checks)
        assert data.read == 2
    nan = batch(7)
    nan["loss_mask"] = nan["loss_mask"] * float("nan")
    _, _, updated = step(model, [nan], checks)
    assert not updated and calls == {"_reduce_any": 0, "_save_state": 0}
    checks = machine_checks()
    for seed in range(3):
        step(model, [batch(seed)], checks)
    assert calls == {"_reduce_any": 3, "_save_state": 3}


def test_report_stats_reruns_every_step_and_reports_the_variability(seeded, caplog):
    """--rerun-mode report_stats: each step runs twice; every second step rank 0 logs, for each check, how much the
    rerun's result differed (megatron-core's QuickStats; the CPU here is deterministic: all identical). Nothing is
    validated: a NaN step is skipped."""
    checks = machine_checks("--rerun-mode", "report_stats")
    model = tiny(checks)
    with caplog.at_level(logging.INFO, logger="angpt.rerun"):
        for seed in range(2):
            data = Counted([batch(seed)])
            chunks, optimizer, scheduler = model
            train_step(data, chunks, optimizer, scheduler, 1, MB, S, checks=checks)
            assert data.read == 1
    assert f"iteration 2: rerun variability of '{rerun.NAN_LOSS}': 2 samples, all identical" in caplog.messages
    nan = batch(7)
    nan["loss_mask"] = nan["loss_mask"] * float("nan")
    assert not step(model, [nan], checks)[2]  # reported, not validated: angpt's skip


@pytest.mark.slow  # a trainer built and run in this process
def test_an_injected_transient_error_is_a_fault_of_the_rank_and_exits_with_megatron_lms_code(tmp_path,
                                                                                             single_process, caplog):
    """--error-injection-type transient_error at rate 1: the first check of the second step fails and its rerun
    differs: the rank and host are named, a checkpoint of the step before is saved, exit code 17; the tracker
    file has megatron-core's two lines."""
    tracker = tmp_path / "rejected.txt"
    with caplog.at_level(logging.INFO, logger="angpt"):
        code = in_process_trainer([*MODEL, "--train-iters", "4", "--save", str(tmp_path / "run"),
                                   "--error-injection-rate", "1", "--result-rejected-tracker-filename",
                                   str(tracker)]).run()
    assert code == EXIT_CODE_FAILED_ON_RESULT_VALIDATION == 17
    assert latest(tmp_path / "run") == 1
    assert re.search(r"iteration 2, rank 0 on \S+ \(device cpu\), micro-batch 1 of 4: 'found NaN in local forward "
                     r"loss calculation' \([\d.]+\) not reproduced by a rerun on the same micro-batches: a transient "
                     r"fault of this GPU; training samples 8 \(mock data sample 8, documents \d+\); 9 ", caplog.text)
    assert ("iteration 2 failed its result validation (the lines above name the ranks and data): exiting with exit "
            "code 17 (EXIT_CODE_FAILED_ON_RESULT_VALIDATION); the state before it (iteration 1) is saved in") \
        in caplog.text
    statuses = re.findall(r"rank=0 iteration=2 status=(\S+) ", tracker.read_text())
    assert statuses == ["RerunValidationStatus.INITIAL_RUN", "RerunValidationStatus.FIRST_RERUN_NOT_REPRODUCIBLE"]


@pytest.mark.slow  # a trainer built and run in this process
def test_a_nan_that_reproduces_names_the_samples_and_the_blended_dataset(tmp_path, single_process, monkeypatch,
                                                                         caplog):
    """A NaN in micro-batch 2 of step 3 on every run of it (the data): the rerun reproduces it, the log names the
    micro-batch, its two samples and for each the blend's dataset and sample within it, a checkpoint of step 2
    is saved, exit code 16 (rerun it elsewhere). The samples named are the ones read: their tokens are those
    of the named dataset's sample."""
    a, b = str(tmp_path / "a_text_document"), str(tmp_path / "b_text_document")
    write_dataset(a, 400, 1)
    write_dataset(b, 300, 2)
    monkeypatch.setenv(faults.NAN_AT_ITERATIONS, "3")
    monkeypatch.setenv(faults.NAN_IN_MICRO_BATCH, "2")
    with caplog.at_level(logging.INFO, logger="angpt"):
        trainer = in_process_trainer([*[f for f in MODEL if f not in ("--mock-data", "--vocab-size", "256")],
                                      "--train-iters", "4", "--save", str(tmp_path / "run"), "--data-path", "1", a,
                                      "1", b, "--split", "100,0,0", "--data-cache-path", str(tmp_path / "cache")])
        assert trainer.run() == EXIT_CODE_RESUME_TO_DISAMBIGUATE == 16
    assert latest(tmp_path / "run") == 2 and checkpoint_tensors(tmp_path / "run", 2)
    # Step 3 starts at sample 16; micro-batch 2 (of 2 samples) holds samples 18 and 19.
    named = re.search(r"iteration 3, rank 0 on \S+ \(device cpu\), micro-batch 2 of 4: 'found NaN in local forward "
                      r"loss calculation' \(nan\) reproduced by a rerun on the same micro-batches: the data \(or a "
                      r"persistent fault of this GPU\); training samples 18 \((\S+) sample (\d+), documents [\d, ]+\); "
                      r"19 \((\S+) sample (\d+), documents [\d, ]+\)", caplog.text)
    assert named, caplog.text[-3000:]
    train = trainer.data.train
    for index, prefix, sample in ((18, named[1], named[2]), (19, named[3], named[4])):
        assert prefix in (a, b)
        component = next(d for d in train.datasets if d.dataset.path_prefix == prefix)
        assert torch.equal(torch.as_tensor(component[int(sample)]["tokens"]), torch.as_tensor(train[index]["tokens"]))
    assert "exiting with exit code 16 (EXIT_CODE_RESUME_TO_DISAMBIGUATE)" in caplog.text
    # Resumed (elsewhere, as the exit code asks), step 3 is the first of the process, which megatron-core does not
    # check: the NaN, again, is skipped (angpt's rule), and the run goes on.
    resumed = in_process_trainer([*[f for f in MODEL if f not in ("--mock-data", "--vocab-size", "256")],
                                  "--train-iters", "4", "--save", str(tmp_path / "run"), "--load",
                                  str(tmp_path / "run"), "--data-path", "1", a, "1", b, "--split", "100,0,0",
                                  "--data-cache-path", str(tmp_path / "cache")])
    assert resumed.run() == 0
    steps = {r["iteration"]: r["skipped"] for r in records(tmp_path / "run")}
    assert steps[3] == 1 and steps[4] == 0


@pytest.mark.parametrize("flags, nan", [
    ([], True),
    (["--no-check-for-nan-in-loss-and-grad"], False),
    (["--rerun-mode", "disabled"], False),  # angpt's skip instead (megatron-core would raise)
    (["--rerun-mode", "report_stats"], True),  # the checks are what report_stats compares
    # Megatron-LM's validate_args: overflows are the dynamic loss scale's signal; a constant scale keeps the check.
    (["--fp16", "--use-distributed-optimizer"], False),
    (["--fp16", "--use-distributed-optimizer", "--loss-scale", "1024"], True),
])
def test_which_nan_checks_run(flags, nan, single_process, caplog):
    config = parse_args([*FLAGS, *flags], world_size=1)
    assert rerun.checks(config.rerun).nan is nan
    with caplog.at_level(logging.INFO, logger="angpt.rerun"):
        rerun.initialize(config.rerun, 0)
    said = ("--check-for-nan-in-loss-and-grad: off with --fp16's dynamic loss scale, as in Megatron-LM (its overflows "
            "are expected): a NaN/Inf step is skipped") in caplog.messages
    assert said is ("--fp16" in flags and not nan)


def test_a_tracker_file_that_cannot_be_written_is_refused_naming_the_flag(tmp_path):
    config = parse_args([*FLAGS, "--result-rejected-tracker-filename", str(tmp_path / "missing" / "rejected.txt")],
                        world_size=1)
    with pytest.raises(ValueError, match=r"^--result-rejected-tracker-filename .*missing/rejected\.txt: "
                                         "RerunStateMachine result validation log cannot be appended to"):
        rerun.initialize(config.rerun, 0)


@pytest.mark.parametrize("flags, message", [
    (["--error-injection-type", "persistent_error"], "--error-injection-type needs --error-injection-rate"),
    (["--error-injection-rate", "5", "--rerun-mode", "disabled"], "--error-injection-rate makes checks of --rerun-mode "
                                                                 "validate_results fail, and this run has none"),
    (["--error-injection-rate", "5", "--rerun-mode", "report_stats"], "--error-injection-rate makes checks"),
    (["--error-injection-rate", "5", "--no-check-for-nan-in-loss-and-grad"], "--error-injection-rate makes checks"),
    (["--error-injection-rate", "5", "--fp16", "--use-distributed-optimizer"], "--error-injection-rate makes checks"),
    (["--error-injection-rate", "-1"], "--error-injection-rate -1 cannot be negative"),
])
def test_an_injection_that_would_inject_nothing_is_refused(flags, message, capsys):
    """megatron-core injects only into the checks of validate_results: elsewhere the flags would be ignored."""
    with pytest.raises(SystemExit):
        parse_args([*FLAGS, *flags], world_size=1)
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("flags, checks", [
    ([], (True, False, False)),
    (["--check-for-spiky-loss"], (True, True, False)),
    (["--check-for-large-grads", "--no-check-for-nan-in-loss-and-grad"], (False, False, True)),
])
def test_the_checks_are_the_flags_megatron_lm_names_them_by(flags, checks, single_process):
    assert machine_checks(*flags) == rerun.Checks(nan=checks[0], spiky=checks[1], large_grads=checks[2])


@pytest.mark.parametrize("mode, megatron", [("disabled", RerunMode.DISABLED),
                                            ("validate_results", RerunMode.VALIDATE_RESULTS),
                                            ("report_stats", RerunMode.REPORT_DETERMINISM_STATS)])
def test_the_machine_runs_in_megatron_cores_mode_from_the_steps_already_done(mode, megatron, single_process):
    """Megatron-LM passes --rerun-mode to RerunMode(); its train() sets the machine's iteration to the steps done."""
    config = parse_args([*FLAGS, "--rerun-mode", mode], world_size=1)
    rerun.initialize(config.rerun, 7)
    machine = get_rerun_state_machine()
    assert machine.mode == megatron and machine.current_iteration == 7 and rerun.findings() == []


def test_the_machine_injects_the_errors_the_flags_ask_for(single_process):
    """--error-injection-rate and --error-injection-type, as Megatron-LM hands them to megatron-core's injector."""
    flags = ["--error-injection-rate", "5", "--error-injection-type", "persistent_error"]
    rerun.initialize(parse_args([*FLAGS, *flags], world_size=1).rerun, 0)
    injector = get_rerun_state_machine().error_injector
    assert (injector.error_injection_rate, injector.error_injection_type) == (5, RerunDiagnostic.PERSISTENT_ERROR)


def test_a_finding_names_its_micro_batch_and_what_its_reruns_found():
    """A loss check's call number is its micro-batch (a grad check's is not one); the outcome is the machine's last
    status: a rerun that differs is a fault of the GPU, one that reproduces is the data (docs in rerun.py)."""
    initial = (RerunValidationStatus.INITIAL_RUN,)
    for message in rerun.LOSS_CHECKS:
        assert rerun.Finding(message, 1.0, initial, 3).micro_batch == 3
    assert rerun.Finding("found unexpected large grads in bucket #0", 1.0, initial, 3).micro_batch is None
    outcomes = {status: rerun.Finding(rerun.NAN_LOSS, 1.0, (*initial, status), 1).outcome for status in (
        RerunValidationStatus.FIRST_RERUN_NOT_REPRODUCIBLE, RerunValidationStatus.FIRST_RERUN_REPRODUCIBLE)}
    assert outcomes == {
        RerunValidationStatus.FIRST_RERUN_NOT_REPRODUCIBLE:
            "not reproduced by a rerun on the same micro-batches: a transient fault of this GPU",
        RerunValidationStatus.FIRST_RERUN_REPRODUCIBLE:
            "reproduced by a rerun on the same micro-batches: the data (or a persistent fault of this GPU)"}
    disabled = (RerunValidationStatus.RERUN_DISABLED,)
    assert rerun.Finding(rerun.NAN_LOSS, 1.0, disabled, None).outcome == "not rerun (--rerun-mode disabled)"
    assert rerun.Finding(rerun.NAN_LOSS, 1.0, initial, 1).outcome == "awaiting its rerun"


def test_the_exit_names_megatron_lms_exit_code():
    """Megatron-LM's codes: 16 to resume elsewhere and disambiguate, 17 for a validation that failed."""
    resume = rerun.ResultValidationExit(16, True)
    assert (resume.exit_code, resume.save, str(resume)) == (16, True, "exit code 16 (EXIT_CODE_RESUME_TO_DISAMBIGUATE)")
    failed = rerun.ResultValidationExit(17, False)
    assert (failed.exit_code, failed.save) == (17, False)
    assert str(failed) == "exit code 17 (EXIT_CODE_FAILED_ON_RESULT_VALIDATION)"
    assert str(rerun.ResultValidationExit(3, False)) == "exit code 3 (result validation)"


def test_the_steps_iterators_are_wrapped_once_for_replay():
    plain, wrapped = iter([1]), RerunDataIterator(iter([2]))
    assert isinstance(rerun.replayable(plain), RerunDataIterator)
    assert rerun.replayable(wrapped) is wrapped and rerun.replayable(None) is None
    first, second, third = rerun.replayable([plain, wrapped, None])  # one per virtual pipeline stage
    assert isinstance(first, RerunDataIterator) and second is wrapped and third is None


def test_the_rank_is_named_with_its_host_and_device(single_process):
    assert rerun.where() == f"rank 0 on {socket.gethostname()} (device {torch.cuda.current_device()})"


def test_a_machine_angpt_did_not_build_has_no_findings():
    """megatron-core's own machine (get_rerun_state_machine builds one when none is set) keeps none."""
    assert rerun.findings() == []


def test_each_failed_check_is_kept_with_its_value_its_call_and_what_its_reruns_found(tmp_path, single_process):
    """And megatron-core's line for each in --result-rejected-tracker-filename, as its machine writes it."""
    tracker = tmp_path / "rejected.txt"
    rerun.initialize(parse_args([*FLAGS, "--result-rejected-tracker-filename", str(tracker)], world_size=1).rerun, 4)
    machine = get_rerun_state_machine()
    machine._log_validation_error_to_file(RerunValidationStatus.FIRST_RERUN_REPRODUCIBLE, 1.0, rerun.NAN_LOSS)
    assert rerun.findings() == []  # a rerun's status with no check failed before: nothing to add it to
    machine.failed_validation_call = SimpleNamespace(sequence=2)  # the check's second call in the step
    machine._log_validation_error_to_file(RerunValidationStatus.INITIAL_RUN, torch.tensor(12.5), rerun.SPIKY_LOSS)
    machine._log_validation_error_to_file(RerunValidationStatus.FIRST_RERUN_REPRODUCIBLE, 12.5, rerun.SPIKY_LOSS)
    machine._log_validation_error_to_file(RerunValidationStatus.RERUN_DISABLED, 7, rerun.NAN_LOSS)
    assert rerun.findings() == [
        rerun.Finding(rerun.SPIKY_LOSS, 12.5, (RerunValidationStatus.INITIAL_RUN,
                                               RerunValidationStatus.FIRST_RERUN_REPRODUCIBLE), 2),
        rerun.Finding(rerun.NAN_LOSS, 7.0, (RerunValidationStatus.RERUN_DISABLED,), None)]
    lines = tracker.read_text().splitlines()
    assert len(lines) == 4
    assert lines[1].endswith(f"iteration=4 status={RerunValidationStatus.INITIAL_RUN} result={torch.tensor(12.5)} "
                             f"message='{rerun.SPIKY_LOSS}'")


class RecordingMachine:
    """Stands for megatron-core's machine: records what is asked of it."""

    def __init__(self, exit_asked=(False, False, 0)):
        self.calls, self.exit_asked = [], exit_asked

    def validate_result(self, **kwargs):
        self.calls.append(kwargs)

    def is_unexpectedly_large(self, result, threshold, context):
        raise AssertionError("not called by validate_loss itself")

    def should_checkpoint_and_exit(self):
        return self.exit_asked


@pytest.mark.parametrize("checks", [rerun.Checks(True, True, False), rerun.Checks(False, False, False)])
def test_the_loss_checks_are_pretrain_gpts(checks, monkeypatch):
    """Megatron-LM's pretrain_gpt.py loss_func: NaN and Inf fatal, a spike (10x the largest loss seen) reported,
    all with tolerance 0 (the forward pass is deterministic)."""
    machine = RecordingMachine()
    monkeypatch.setattr(rerun, "get_rerun_state_machine", lambda: machine)
    loss = torch.tensor(2.5)
    rerun.validate_loss(loss, checks)
    if not checks.nan:
        assert machine.calls == []
        return
    nan, inf, spiky = machine.calls
    assert nan == dict(result=loss, rejection_func=torch.isnan, message="found NaN in local forward loss calculation",
                       tolerance=0.0, fatal=True)
    assert inf == dict(result=loss, rejection_func=torch.isinf, message="found Inf in local forward loss calculation",
                       tolerance=0.0, fatal=True)
    rejection = spiky.pop("rejection_func")
    assert spiky == dict(result=loss, message="Spiky loss", tolerance=0.0, fatal=False)
    assert isinstance(rejection, partial) and rejection.func == machine.is_unexpectedly_large
    assert (rejection.args, rejection.keywords) == ((), dict(threshold=10, context="loss"))


@pytest.mark.parametrize("asked", [(True, True, 16), (False, True, 17), (False, False, 0)])
def test_the_job_exits_when_the_machine_asks_with_its_code_and_whether_to_save(asked, monkeypatch):
    monkeypatch.setattr(rerun, "get_rerun_state_machine", lambda: RecordingMachine(asked))
    save, stop, code = asked
    if not stop:
        rerun.exit_if_asked()
        return
    with pytest.raises(rerun.ResultValidationExit) as asked_to_exit:
        rerun.exit_if_asked()
    assert (asked_to_exit.value.exit_code, asked_to_exit.value.save) == (code, save)


def test_a_rerun_saves_and_restores_megatron_cores_rng_tracker(seeded):
    """The machine replays a step from the same RNG state: that of megatron-core's CUDA RNG tracker."""
    rerun.initialize(parse_args(FLAGS, world_size=1).rerun, 0)
    machine = get_rerun_state_machine()
    tracker = tensor_parallel.get_cuda_rng_tracker()
    saved = machine.state_save_func()
    assert saved.keys() == {"rng_tracker_states"} and saved["rng_tracker_states"].keys() == tracker.get_states().keys()
    with tracker.fork():  # a step's dropout draws
        torch.rand(3)
    advanced = tracker.get_states()
    assert not all(torch.equal(advanced[name], state) for name, state in saved["rng_tracker_states"].items())
    machine.state_restore_func({"rng_tracker_states": {}})  # nothing saved: nothing to restore
    assert all(torch.equal(tracker.get_states()[name], state) for name, state in advanced.items())
    machine.state_restore_func(saved)
    assert all(torch.equal(tracker.get_states()[name], state) for name, state in saved["rng_tracker_states"].items())
