"""megatron-core's rerun state machine, wired as Megatron-LM wires it (--rerun-mode, the loss checks of
pretrain_gpt.py's loss_func, the grad checks of megatron-core's DDP, --error-injection-* to test them).

A step whose micro-batch loss (NaN, Inf, spike) or local grads (NaN, Inf, large) fail a check on some rank is
run again on the same micro-batches from the same RNG state (`RerunDataIterator` replays them):
- the rerun differs: a transient fault of that rank's GPU. A fatal check (NaN, Inf) saves a checkpoint and the
  job exits with EXIT_CODE_FAILED_ON_RESULT_VALIDATION (17); a spike or large grads are only reported.
- the rerun reproduces it: the data, or a persistent fault of that GPU. A fatal check saves a checkpoint and the
  job exits with EXIT_CODE_RESUME_TO_DISAMBIGUATE (16), to be resumed on other GPUs; a spike or large grads
  are reported (naming the samples) and the step is applied.

The rule with angpt's skip of NaN/Inf steps (`angpt.training.step.step_unless_not_finite`, --max-skipped-steps):
the skip is what happens to a NaN or Inf that no check stops first. With --rerun-mode validate_results (Megatron-LM's
default) and the NaN check on, that is only the first step of a process (megatron-core checks from the second
on: a checkpoint of the state before must exist) and a NaN that appears after the local grads (the optimizer's
grad norm); with --rerun-mode disabled, --no-check-for-nan-in-loss-and-grad, or --fp16's dynamic loss scale
(whose overflows are expected; Megatron-LM turns the check off there too), every NaN/Inf step is skipped, as
before the machine existed. A job resumed after exit code 16 starts at the suspect step, which is then the first
of the process: a NaN again is skipped, a finite loss clears the data (the first GPU was at fault). The machine's
own state is not saved in the checkpoint, so its second rerun ("on another GPU") is this resume.
"""

from __future__ import annotations

import logging
import os
from functools import partial
from typing import NamedTuple, Optional

import torch
import torch.distributed as dist
from megatron.core import rerun_state_machine, tensor_parallel
from megatron.core.rerun_state_machine import (
    EXIT_CODE_FAILED_ON_RESULT_VALIDATION,
    EXIT_CODE_RESUME_TO_DISAMBIGUATE,
    RerunDataIterator,
    RerunDiagnostic,
    RerunErrorInjector,
    RerunMode,
    RerunState,
    RerunStateMachine,
    RerunValidationStatus,
    get_rerun_state_machine,
)

from angpt.config.sections import RerunSection

logger = logging.getLogger("angpt.rerun")

# Megatron-LM passes --rerun-mode to RerunMode(), whose value for report_stats is report_determinism_stats.
MODES = {"disabled": RerunMode.DISABLED, "validate_results": RerunMode.VALIDATE_RESULTS,
         "report_stats": RerunMode.REPORT_DETERMINISM_STATS}
SPIKY_LOSS_FACTOR = 10  # pretrain_gpt.py's: a spike is 10x the largest micro-batch loss seen
# pretrain_gpt.py's messages of its loss checks (one call each per micro-batch)
NAN_LOSS = "found NaN in local forward loss calculation"
INF_LOSS = "found Inf in local forward loss calculation"
SPIKY_LOSS = "Spiky loss"
LOSS_CHECKS = (NAN_LOSS, INF_LOSS, SPIKY_LOSS)
EXIT_CODE_NAMES = {EXIT_CODE_RESUME_TO_DISAMBIGUATE: "EXIT_CODE_RESUME_TO_DISAMBIGUATE",
                   EXIT_CODE_FAILED_ON_RESULT_VALIDATION: "EXIT_CODE_FAILED_ON_RESULT_VALIDATION"}


class Checks(NamedTuple):
    """What is checked: each micro-batch's loss for NaN/Inf (and the local grads, by megatron-core's DDP), for
    a spike, and the local grads for large values."""

    nan: bool
    spiky: bool
    large_grads: bool


def checks(rerun: RerunSection) -> Checks:
    return Checks(rerun.nan_checks, rerun.check_for_spiky_loss, rerun.check_for_large_grads)


class ResultValidationExit(Exception):
    """The machine asks the job to exit with `exit_code`, after a checkpoint if `save`."""

    def __init__(self, exit_code: int, save: bool):
        super().__init__(f"exit code {exit_code} ({EXIT_CODE_NAMES.get(exit_code, 'result validation')})")
        self.exit_code, self.save = exit_code, save


class Finding(NamedTuple):
    """A failed check on this rank, with what its reruns found (the machine's tracker statuses, in order)."""

    message: str
    result: float
    statuses: tuple
    call: Optional[int]  # the check's call number in the step: the micro-batch (1-based) for a loss check

    @property
    def micro_batch(self) -> Optional[int]:
        return self.call if self.message in LOSS_CHECKS else None

    @property
    def outcome(self) -> str:
        last = self.statuses[-1]
        if last == RerunValidationStatus.FIRST_RERUN_NOT_REPRODUCIBLE:
            return "not reproduced by a rerun on the same micro-batches: a transient fault of this GPU"
        if last == RerunValidationStatus.FIRST_RERUN_REPRODUCIBLE:
            return "reproduced by a rerun on the same micro-batches: the data (or a persistent fault of this GPU)"
        if last == RerunValidationStatus.RERUN_DISABLED:
            return "not rerun (--rerun-mode disabled)"
        return "awaiting its rerun"


class _Machine(RerunStateMachine):
    """megatron-core's machine, which also keeps this step's failed checks and their outcomes on this rank (what
    it writes to --result-rejected-tracker-filename), for the trainer to name the rank and the data."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.findings: list[Finding] = []

    def should_run_forward_backward(self, data_iterator) -> bool:
        if self.state == RerunState.NOT_RUNNING_YET:
            self.findings = []
        return super().should_run_forward_backward(data_iterator)

    def _log_validation_error_to_file(self, status, result, message) -> None:
        super()._log_validation_error_to_file(status, result, message)
        value = float(result.item()) if isinstance(result, torch.Tensor) else float(result)
        if status in (RerunValidationStatus.INITIAL_RUN, RerunValidationStatus.RERUN_DISABLED):
            call = self.failed_validation_call.sequence if status == RerunValidationStatus.INITIAL_RUN else None
            self.findings.append(Finding(message, value, (status,), call))
        elif self.findings:
            last = self.findings[-1]
            self.findings[-1] = last._replace(statuses=(*last.statuses, status))

    def _maybe_report_stats(self) -> None:
        """megatron-core 0.16.1's names each check by `Caller.filename` and `lineno`, which Caller lacks
        (AttributeError at the second step of --rerun-mode report_stats): the same report, by message."""
        if self.current_iteration % self.REPORTING_INTERVAL_ITERATIONS:
            return
        gathered = [None] * dist.get_world_size()
        dist.gather_object(dict(self.stats), gathered if dist.get_rank() == 0 else None)
        if dist.get_rank() != 0:
            for stats in self.stats.values():
                stats.reset()
            return
        for caller in {caller for stats in gathered for caller in stats}:
            self.stats[caller].combine([stats[caller] for stats in gathered[1:] if caller in stats])
            logger.info("iteration %d: rerun variability of '%s': %s", self.current_iteration, caller.message,
                        self.stats[caller].print_stats())


def initialize(rerun: RerunSection, iteration: int) -> None:
    """The process's machine (a new one, as Megatron-LM's initialize_megatron builds it), at `iteration`, the
    number of steps already done (Megatron-LM's train sets it so: the machine numbers steps from 1)."""
    def save_rng_tracker():
        return {"rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states()}

    def restore_rng_tracker(state):
        if state["rng_tracker_states"]:
            tensor_parallel.get_cuda_rng_tracker().set_states(state["rng_tracker_states"])

    rerun_state_machine.destroy_rerun_state_machine()
    try:
        machine = _Machine(
            state_save_func=save_rng_tracker, state_restore_func=restore_rng_tracker, mode=MODES[rerun.rerun_mode],
            error_injector=RerunErrorInjector(rerun.error_injection_rate, RerunDiagnostic(rerun.error_injection_type)),
            result_rejected_tracker_filename=rerun.result_rejected_tracker_filename)
    except RuntimeError as error:  # the tracker file cannot be appended to
        raise ValueError(f"--result-rejected-tracker-filename {rerun.result_rejected_tracker_filename}: {error}") \
            from None
    rerun_state_machine._set_rerun_state_machine(machine)
    machine.current_iteration = iteration
    if (rerun.check_for_nan_in_loss_and_grad and rerun.rerun_mode != "disabled" and not rerun.nan_checks
            and dist.get_rank() == 0):
        logger.info("--check-for-nan-in-loss-and-grad: off with --fp16's dynamic loss scale, as in Megatron-LM (its "
                    "overflows are expected): a NaN/Inf step is skipped")


def iterations_to_skip(tracker_filename: Optional[str]) -> list[int]:
    """The iterations --result-rejected-tracker-filename records as failing twice on a rank (megatron-core's reading of
    it), which Megatron-LM adds to --iterations-to-skip; none before the file exists (a first run)."""
    if tracker_filename is None or not os.path.exists(tracker_filename):
        return []
    return RerunStateMachine.get_skipped_iterations_from_tracker_file(tracker_filename)


def findings() -> list[Finding]:
    """This step's failed checks on this rank (none with a machine angpt did not build)."""
    return getattr(get_rerun_state_machine(), "findings", [])


def replayable(data_iterators):
    """The step's iterators, each wrapped to replay its micro-batches in a rerun (Megatron-LM wraps its own)."""
    def wrap(iterator):
        return iterator if iterator is None or isinstance(iterator, RerunDataIterator) else RerunDataIterator(iterator)

    return [wrap(i) for i in data_iterators] if isinstance(data_iterators, list) else wrap(data_iterators)


def validate_loss(loss: torch.Tensor, loss_checks: Checks) -> None:
    """pretrain_gpt.py's loss_func checks of one micro-batch's loss (the sum over its tokens)."""
    machine = get_rerun_state_machine()
    if loss_checks.nan:
        machine.validate_result(result=loss, rejection_func=torch.isnan, message=NAN_LOSS, tolerance=0.0,
                                fatal=True)
        machine.validate_result(result=loss, rejection_func=torch.isinf, message=INF_LOSS, tolerance=0.0,
                                fatal=True)
    if loss_checks.spiky:
        machine.validate_result(
            result=loss, rejection_func=partial(machine.is_unexpectedly_large, threshold=SPIKY_LOSS_FACTOR,
                                                context="loss"),
            message=SPIKY_LOSS, tolerance=0.0, fatal=False)


def exit_if_asked() -> None:
    """After the step's forward-backward passes (and before its optimizer step): raise ResultValidationExit
    if the machine asks the job to exit."""
    save, stop, exit_code = get_rerun_state_machine().should_checkpoint_and_exit()
    if stop:
        raise ResultValidationExit(exit_code, save)


def where() -> str:
    """This rank, host and device, as the machine names them."""
    return f"rank {dist.get_rank()} on {os.uname()[1]} (device {torch.cuda.current_device()})"
