"""The pretraining loop: megatron-core's schedules and optimizer, evaluation, checkpoints, graceful exits
and what users watch. `angpt.pretrain` parses the flags and calls `pretrain(config)` with the run's
configuration (angpt.config.sections.RunConfig).
"""

from __future__ import annotations

import gc
import logging
import math
import os
import signal
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from functools import partial
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
from megatron.core.optimizer_param_scheduler import get_canonical_lr_for_logging
from megatron.core.timers import Timers
from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper
from megatron.core.utils import get_model_config

from angpt.config.batch_schedule import BatchSchedule
from angpt.config.sections import RunConfig
from angpt.data.gpt_datasets import (
    MicroBatchIndices,
    TrainingBatches,
    build_datasets,
    dataset_vocabulary,
    describe_samples,
    micro_batches,
)
from angpt.data.indexed import IndexedDatasetError
from angpt.megatron_compat import parent_watch
from angpt.telemetry import memory_history
from angpt.telemetry.hang_watchdog import HangWatchdog
from angpt.telemetry.monitoring import TrainingMonitor
from angpt.telemetry.profiling import StepProfiler
from angpt.telemetry.progress_log import ProgressLog
from angpt.telemetry.timers import timer
from angpt.training import checkpointing, distributed, faults, rerun, save_lock
from angpt.training.checkpointing import TrainState
from angpt.training.exits import ExitRequests
from angpt.training.grad_dumps import GradDumps
from angpt.training.megatron_configs import ddp_config, transformer_config
from angpt.training.optimizer import build_optimizer
from angpt.training.replica_check import ReplicasDifferError, check_weight_hashes
from angpt.training.step import (
    build_model_chunks,
    eval_step,
    gather_whole_weights,
    mtp_losses,
    param_gather_finished,
    pre_hooks_on,
    set_pre_hooks,
    train_step,
    wait_for_the_device,
)

logger = logging.getLogger("angpt.trainer")


class SkippedStepsError(RuntimeError):
    """More than --max-skipped-steps consecutive steps had a NaN or Inf loss or gradient norm."""


@dataclass
class Data:
    train: object
    valid: Optional[object]
    test: Optional[object]


class Trainer:
    """One pretraining job on this rank: built from the run's configuration, run by `run()`."""

    def __init__(self, config: RunConfig):
        self.run_config = config
        model, parallel, training, checkpoint = config.model, config.parallel, config.training, config.checkpoint
        self.hooks = faults.from_environment()  # production's do nothing
        self.vocabulary = dataset_vocabulary(config.data)
        self.tokenizer = self.vocabulary.unique_identifiers.get("tokenizer")
        if training.deterministic_mode:  # before the process groups (NCCL reads NCCL_ALGO)
            distributed.use_deterministic_algorithms(config.precision.transformer_impl == "transformer_engine")
        if training.batch_invariant_mode:  # before the process groups, as Megatron-LM's initialize_megatron
            distributed.enable_batch_invariant_mode()
        self.config = transformer_config(config)
        distributed.initialize(parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size,
                               parallel.virtual_pipeline_stages, training.seed, parallel.distributed_timeout_minutes,
                               cuda_graphs=config.fusion.cuda_graph_impl == "local",
                               context_parallel_size=parallel.context_parallel_size,
                               flight_recorder_dump_path=parallel.flight_recorder_dump_path,
                               flight_recorder_trace_buffer_size=parallel.flight_recorder_trace_buffer_size,
                               use_tp_pp_dp_mapping=parallel.use_tp_pp_dp_mapping,
                               create_gloo_process_groups=parallel.enable_gloo_process_groups,
                               hierarchical_context_parallel_sizes=(list(parallel.hierarchical_context_parallel_sizes)
                                                                    if parallel.hierarchical_context_parallel_sizes
                                                                    else None),
                               expert_tensor_parallel_size=parallel.expert_tensor_parallel_size,
                               num_distributed_optimizer_instances=parallel.num_distributed_optimizer_instances,
                               create_all_gather_group=parallel.create_all_gather_group,
                               fake_process_group=parallel.fake_process_group,
                               get_embedding_ranks=partial(distributed.embedding_ranks, config=self.config))
        self.rank = dist.get_rank()
        # Where --non-persistent-ckpt-type global's checkpoints are saved (None: none are).
        self.non_persistent_save = (checkpointing.non_persistent_dir(checkpoint.save,
                                                                     checkpoint.non_persistent_global_ckpt_dir)
                                    if checkpoint.save and checkpoint.non_persistent_ckpt_type == "global" else None)
        # One run writes into a --save directory: locked before anything is written there (a non-persistent directory
        # elsewhere too).
        for directory in dict.fromkeys(filter(None, (checkpoint.save, checkpoint.non_persistent_global_ckpt_dir
                                                     if self.non_persistent_save else None))):
            save_lock.take(directory)
        self.progress_log = None  # --log-progress's (Megatron-LM's: its first line once the processes are up)
        if config.logging.log_progress and checkpoint.save:
            self.progress_log = ProgressLog(checkpoint.save, dist.get_world_size(), enabled=self.rank == 0)
        if self.config.cuda_graph_impl == "local" and self.rank == 0:
            logger.warning("--cuda-graph-impl local is not verified yet: on an H200 the steps replayed from CUDA "
                           "graphs had wrong gradients, and the fix (angpt.megatron_compat.patches) has not run on "
                           "a GPU since (docs/gpu.md, CUDA graphs); use it to measure speed, not to train")
        self.vocab_size = config.padded_vocab_size(self.vocabulary.vocab_size)
        if config.memory.record_memory_history:  # before the model is built, as Megatron-LM's model_provider does
            memory_history.start(config.memory.memory_snapshot_path)
        MTPLossLoggingHelper.tracker.clear()  # megatron-core's, a class attribute: an earlier run's in this process
        self.chunks = build_model_chunks(self.config, self.vocab_size, model.seq_length, ddp_config(config),
                                         one_bucket_group=parallel.overlap_param_gather_with_optimizer_step,
                                         num_buckets=parallel.ddp_num_buckets,
                                         align_grad_reduce=parallel.align_grad_reduce)
        self.hooks.model_built(self.chunks)
        if checkpoint.save or checkpoint.load:
            checkpointing.check_savable(self.chunks)
        self.optimizer, self.scheduler = build_optimizer(self.chunks, config)
        if config.precision.fp16:
            # The schedules scale each micro-batch's loss before its backward (Megatron-LM's setup_model_and_optimizer).
            get_model_config(self.chunks[0]).grad_scale_func = self.optimizer.scale_loss
        # megatron-core times its schedules and optimizer with the Timers its configs hold (as Megatron-LM sets them).
        logging_section = config.logging
        self.timers = Timers(logging_section.timing_log_level, logging_section.timing_log_option)
        for inner_config in [get_model_config(self.chunks[0]),
                             *(inner.config for inner in getattr(self.optimizer, "chained_optimizers",
                                                                 [self.optimizer]))]:
            inner_config.timers, inner_config.barrier_with_L1_time = self.timers, logging_section.barrier_with_l1_time
        self.state = TrainState()
        self.loaded_from: Optional[str] = None  # the checkpoint directory this run starts from
        if checkpoint.save and self.rank == 0:
            checkpointing.remove_incomplete(checkpoint.save)
            if self.non_persistent_save:
                checkpointing.remove_incomplete(self.non_persistent_save)
        if checkpoint.load:
            self.loaded_from = checkpointing.checkpoint_to_resume(
                checkpoint.load, fallback=checkpoint.load_fallback_to_intact, step=checkpoint.ckpt_step,
                non_persistent=(checkpointing.non_persistent_dir(checkpoint.load,
                                                                 checkpoint.non_persistent_global_ckpt_dir)
                                if checkpoint.non_persistent_ckpt_type == "global" else None),
                exit_on_missing=checkpoint.exit_on_missing_checkpoint)
            if self.loaded_from is None and not config.model.perform_initialization:
                raise ValueError(f"--no-initialization: no checkpoint in {checkpoint.load} to give the weights, "
                                 "which would stay uninitialized memory: leave the flag out to start from scratch")
        if self.loaded_from is not None:
            timer(self.timers, "load-checkpoint").start()
            self.state = checkpointing.load_checkpoint(
                self.loaded_from, self.chunks, self.optimizer, self.scheduler, config,
                load_optimizer=not checkpoint.no_load_optim, load_rng=not checkpoint.no_load_rng,
                finetune=checkpoint.finetune, strictness=checkpoint.dist_ckpt_strictness,
                fully_parallel=checkpoint.ckpt_fully_parallel_load, ckpt_format=checkpoint.ckpt_format,
                auto_detect=checkpoint.auto_detect_ckpt_format, vocab_size=self.vocabulary.vocab_size,
                mem_efficient=checkpoint.distrib_optim_fully_reshardable_mem_efficient,
                main_params_from_checkpoint=checkpoint.load_main_params_from_ckpt,
            )
            timer(self.timers, "load-checkpoint").stop()
        # Nothing to save before the first step of this run (a resumed state is in its checkpoint).
        self.saved_iteration = self.state.iteration
        self.async_queue = None
        self.checkpointing_context: dict = {}  # Megatron-LM's: what one save leaves for the next
        if checkpoint.async_save:
            self.async_queue = AsyncCallsQueue(persistent=checkpoint.use_persistent_ckpt_worker)
        self.checks = rerun.checks(config.rerun)
        rerun.initialize(config.rerun, self.state.iteration)

        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.dp_size = parallel_state.get_data_parallel_world_size()
        self.batches = BatchSchedule(training.global_batch_size, training.micro_batch_size, self.dp_size,
                                     training.rampup_batch_size, self.rank, training.decrease_batch_size_if_needed)
        # An evaluation step reads a global batch, decreased as a training step's would be (Megatron-LM's evaluate).
        group = training.micro_batch_size * self.dp_size
        self.eval_batch_size = training.global_batch_size // group * group
        evaluation = config.evaluation
        evaluation_samples = evaluation.eval_iters * training.global_batch_size
        # As Megatron-LM: the samples a run by samples asks for, else its iterations' global batches; a phase of
        # --phase-transition-iterations builds its own share of them and reads it from its start.
        train_samples = training.train_samples or training.train_iters * training.global_batch_size
        self.train_data_offset = 0  # the samples consumed before the training dataset's first
        if training.phase_transitions:
            train_samples, self.train_data_offset = self._phase(training.train_samples)
        self.data = Data(*build_datasets(config.data, self.vocabulary, model.seq_length, training.seed,
                                         [train_samples, None if evaluation.full_validation else evaluation_samples,
                                          evaluation_samples], full_validation=evaluation.full_validation,
                                         multiple_validation_sets=evaluation.multiple_validation_sets))
        # [(name, dataset)] evaluated as the validation split: megatron-core's builder gives a list of the datasets of
        # a --valid-data-path blend with --multiple-validation-sets, each reported by its index (Megatron-LM's names).
        valid = self.data.valid
        if evaluation.multiple_validation_sets:
            valid = valid if isinstance(valid, list) else [valid]
            self.validation_sets = [(f"validation-{index}", dataset) for index, dataset in enumerate(valid)]
        else:
            self.validation_sets = [("validation", valid)]
        self.iterations_to_skip = frozenset(training.iterations_to_skip or ()) | frozenset(
            rerun.iterations_to_skip(config.rerun.result_rejected_tracker_filename))
        # Forked after the exit-signal handlers are installed (below): the workers inherit them.
        self.train_batches = None
        self.profiler = None  # --profile's (below)
        self.hang_watchdog: Optional[HangWatchdog] = None  # --hang-timeout-minutes', while run() runs
        # The schedule counts samples in a run by samples (Megatron-LM's), else iterations (angpt.training.optimizer).
        self.by_samples = training.train_samples is not None
        self.exits = ExitRequests([getattr(signal, name) for name in config.exits.save_and_exit_signals],
                                  config.exits.exit_duration_in_mins)
        overlapped_gather = parallel.use_distributed_optimizer and parallel.overlap_param_gather
        self.monitor = TrainingMonitor(config, self.config, self.chunks, self.vocab_size, self.rank,
                                       self.state.iteration, self.loaded_from, self.timers, self.optimizer,
                                       weights_ready=partial(self._weights_whole, overlapped_gather))
        if self.progress_log is not None:
            self.progress_log.flops_at_start = self._flops_so_far()
        if logging_section.profile and self.rank in logging_section.profile_ranks:
            self.profiler = StepProfiler(logging_section.profile_step_start, logging_section.profile_step_end,
                                         logging_section.use_pytorch_profiler, self.monitor.tensorboard_dir)
        if self.rank == 0:
            # Megatron-FSDP's DTensors span the tensor-parallel group; the weights they stand for (orig_param) do not.
            parameters = sum(getattr(p, "orig_param", p).numel() for c in self.chunks for p in c.parameters())
            logger.info("%s: %d layers, d=%d, vocabulary %d (padded %d), %d parameters on rank 0; world %d "
                        "(TP %d, PP %d, CP %d, DP %d); starting at iteration %d of %d",
                        model.model_family, model.num_layers, model.hidden_size, self.vocabulary.vocab_size,
                        self.vocab_size, parameters, dist.get_world_size(), parallel.tensor_model_parallel_size,
                        parallel.pipeline_model_parallel_size, parallel.context_parallel_size, self.dp_size,
                        self.state.iteration, training.train_iters)

    def _phase(self, train_samples: int) -> tuple[int, int]:
        """(the samples of this run's phase, the samples consumed before it), as Megatron-LM's
        get_train_valid_test_num_samples and build_train_valid_test_data_loaders count them: in global batches of
        the iterations, a phase from one transition (or 0) to the next (or --train-samples)."""
        global_batch_size, iteration = self.run_config.training.global_batch_size, self.state.iteration
        bounds = [0, *(t * global_batch_size for t in self.run_config.training.phase_transitions), train_samples]
        current = iteration * global_batch_size
        first = max(bound for bound in bounds if bound <= current)
        return min((bound for bound in bounds if bound > current), default=current) - first, \
            self.state.consumed_samples - (current - first)

    def _flops_so_far(self) -> float:
        """Megatron-LM's num_floating_point_operations_so_far: the model FLOPs of every sample trained."""
        return self.monitor.flops_per_token * self.run_config.model.seq_length * self.state.consumed_samples

    # -- data ---------------------------------------------------------------------------------------
    def _iterators(self, batches: list[dict]):
        iterators = [iter(batches) for _ in self.chunks] if len(self.chunks) > 1 else iter(batches)
        return iterators, len(batches)

    # -- steps --------------------------------------------------------------------------------------
    def train_one_step(self) -> dict:
        training, state = self.run_config.training, self.state
        iteration = state.iteration + 1
        global_batch_size = self.batches.running_batch_size(state.consumed_samples)
        timer(self.timers, "batch-generator").start()
        batches = self._take(global_batch_size)
        timer(self.timers, "batch-generator").stop()
        iterators, num_micro_batches = self._iterators(self.hooks.batches(iteration, batches))
        lr = get_canonical_lr_for_logging(self.optimizer.param_groups)  # --lr's group (megatron-core's choice)
        try:
            with self.monitor.step(iteration):
                loss, grad_norm, updated = train_step(iterators, self.chunks, self.optimizer, self.scheduler,
                                                      num_micro_batches, training.micro_batch_size,
                                                      self.run_config.model.seq_length,
                                                      global_batch_size if self.by_samples else 1,
                                                      self.run_config.memory.empty_unused_memory_level, self.timers,
                                                      self.run_config.logging.barrier_with_l1_time, self.checks,
                                                      self._grad_dumps(iteration))
        finally:
            self._report_failed_checks(iteration, global_batch_size)
        mtp = mtp_losses(self.config.mtp_num_layers, num_micro_batches)
        memory, fp16 = self.run_config.memory, self.run_config.precision.fp16
        if memory.manual_gc and memory.manual_gc_interval and iteration % memory.manual_gc_interval == 0:
            gc.collect()
        wait_for_the_device(iteration, training.train_sync_interval)
        state.iteration = iteration
        state.consumed_samples += global_batch_size
        # A step skipped because fp16 gradients overflowed while the scale can still come down is the loss
        # scaler finding its scale (2^32 at first), as in Megatron-LM: it does not count towards --max-skipped-steps.
        calibrating = (fp16 and grad_norm is None and math.isfinite(loss)
                       and self.optimizer.get_loss_scale().item() > self.run_config.precision.min_loss_scale)
        state.skipped_steps = 0 if updated else state.skipped_steps + (not calibrating)
        record = dict(iteration=iteration, loss=loss, grad_norm=grad_norm, lr=lr, skipped=not updated,
                      consumed_samples=state.consumed_samples, global_batch_size=global_batch_size, **mtp)
        if fp16:
            record.update(loss_scale=self.optimizer.get_loss_scale().item(), calibrating=calibrating)
        return record

    def _take(self, global_batch_size: int) -> list[dict]:
        """This rank's micro-batches of the next global batch of the training split."""
        training = self.run_config.training
        if self.train_batches is None:
            self.train_batches = TrainingBatches(self.data.train, self.state.consumed_samples - self.train_data_offset,
                                                 training.micro_batch_size, self.dp_rank, self.dp_size,
                                                 self.run_config.data.num_workers, self.vocabulary.vocab_size)
        return self.train_batches.take(global_batch_size // (training.micro_batch_size * self.dp_size))

    def skip_one_step(self) -> None:
        """--iterations-to-skip (Megatron-LM's dummy_train_step): the step's global batch read and left out, no
        forward, backward or optimizer step; the iteration and the consumed samples move on."""
        global_batch_size = self.batches.running_batch_size(self.state.consumed_samples)
        self._take(global_batch_size)
        self.state.iteration += 1
        self.state.consumed_samples += global_batch_size
        if self.rank == 0:
            logger.info("iteration %d: skipped (--iterations-to-skip %d): its %d samples read and left out",
                        self.state.iteration, self.state.iteration - 1, global_batch_size)

    def _grad_dumps(self, iteration: int) -> Optional[GradDumps]:
        """What --save-wgrads-interval and --save-dgrads-interval save at this iteration, or None."""
        checkpoint = self.run_config.checkpoint
        wgrads, dgrads = (interval is not None and iteration % interval == 0
                          for interval in (checkpoint.save_wgrads_interval, checkpoint.save_dgrads_interval))
        return GradDumps(checkpoint.save, iteration, wgrads, dgrads) if wgrads or dgrads else None

    def _report_failed_checks(self, iteration: int, global_batch_size: int) -> None:
        """One line for each check that failed on this rank in the step, naming the rank and the data: a loss
        check names its micro-batch's samples, a grad check this rank's share of the global batch."""
        for finding in rerun.findings():
            # The step's first sample of the training split: the step is not counted yet.
            first = self.state.consumed_samples - self.train_data_offset
            micro_batches_here = list(MicroBatchIndices(first, first + global_batch_size,
                                                        self.run_config.training.micro_batch_size, self.dp_rank,
                                                        self.dp_size))
            if finding.micro_batch is not None:
                where = f"micro-batch {finding.micro_batch} of {len(micro_batches_here)}"
                micro_batches_here = [micro_batches_here[finding.micro_batch - 1]]
            else:
                where = "its local grads"
            samples = [index for indices in micro_batches_here for index in indices]
            logger.warning("iteration %d, %s, %s: '%s' (%g) %s; training samples %s", iteration, rerun.where(),
                           where, finding.message, finding.result, finding.outcome,
                           describe_samples(self.data.train, samples))

    def validate(self) -> None:
        """Evaluate each validation set (the split, or with --multiple-validation-sets each of its datasets)."""
        for name, dataset in self.validation_sets:
            self.evaluate(dataset, name, whole=self.run_config.evaluation.full_validation)

    def evaluate(self, dataset, name: str, whole: bool = False) -> Optional[float]:
        """Mean loss over the first --eval-iters global batches of a split: the same samples at every
        evaluation, so that evaluations are comparable along the run; `whole` (--full-validation): over every
        whole global batch of it (Megatron-LM's evaluation steps are global batches: fewer samples are left out)."""
        eval_iters, training, memory = (self.run_config.evaluation.eval_iters, self.run_config.training,
                                        self.run_config.memory)
        batch_size = self.eval_batch_size
        if dataset is None:
            return None
        if whole:
            eval_iters = len(dataset) // batch_size
            if eval_iters == 0:
                raise ValueError(f"--full-validation: the {name} split has {len(dataset)} samples, fewer than one "
                                 f"global batch of {batch_size}")
        if eval_iters == 0:
            return None
        if len(dataset) < eval_iters * batch_size:
            raise ValueError(f"the {name} split has {len(dataset)} samples, fewer than --eval-iters "
                             f"{eval_iters} x --global-batch-size {batch_size}")
        manual_gc = memory.manual_gc and memory.manual_gc_eval
        if manual_gc:
            gc.collect()
        losses = []
        timer(self.timers, "evaluate").start()
        with self.monitor.paused():
            for batch_index in range(eval_iters):
                batches = micro_batches(dataset, batch_index * batch_size, batch_size, training.micro_batch_size,
                                        self.dp_rank, self.dp_size, vocab_size=self.vocabulary.vocab_size)
                iterators, num_micro_batches = self._iterators(batches)
                losses.append(eval_step(iterators, self.chunks, num_micro_batches, training.micro_batch_size,
                                        self.run_config.model.seq_length))
                if memory.empty_unused_memory_level >= 1:
                    torch.cuda.empty_cache()
        timer(self.timers, "evaluate").stop()
        if manual_gc:
            gc.collect(generation=0)  # what the evaluation made
        loss = sum(losses) / len(losses)
        self.monitor.log_evaluation(self.state.iteration, name, loss)
        return loss

    @contextmanager
    def _weights_whole(self, overlapped_gather: bool):
        """The model's weights whole, as the last step left them, for what the log line reads between steps."""
        with param_gather_finished(self.chunks, overlapped_gather):
            gather_whole_weights(self.chunks)
            yield

    def save(self, non_persistent: bool = False) -> None:
        """Save a checkpoint into --save, or with `non_persistent` into the non-persistent directory, where it
        replaces the one before (Megatron-LM's global non-persistent checkpoints)."""
        checkpoint = self.run_config.checkpoint
        if not checkpoint.save or (not non_persistent and self.saved_iteration == self.state.iteration):
            return
        if not non_persistent:
            self.saved_iteration = self.state.iteration
        name = "save-checkpoint-non-persistent" if non_persistent else "save-checkpoint"
        timer(self.timers, name).start(barrier=True)  # as Megatron-LM: the ranks' time together
        parallel = self.run_config.parallel
        # The weights of the last step, not those before its (overlapped) all-gather.
        with param_gather_finished(self.chunks, parallel.use_distributed_optimizer and parallel.overlap_param_gather), \
                self.monitor.paused():
            checkpointing.save_checkpoint(
                self.non_persistent_save if non_persistent else checkpoint.save, self.state, self.chunks,
                self.optimizer, self.scheduler, self.run_config.flags(), self.tokenizer,
                keep_last=1 if non_persistent else checkpoint.keep_last_n_checkpoints,
                retain_interval=None if non_persistent else checkpoint.save_retain_interval,
                async_queue=self.async_queue, hooks=self.hooks, fully_parallel=checkpoint.ckpt_fully_parallel_save,
                assume_constant_structure=checkpoint.ckpt_assume_constant_structure,
                context=self.checkpointing_context, ckpt_format=checkpoint.ckpt_format,
                save_optimizer=not checkpoint.no_save_optim, save_rng=not checkpoint.no_save_rng,
                mem_efficient=checkpoint.distrib_optim_fully_reshardable_mem_efficient,
            )
        timer(self.timers, name).stop(barrier=True)
        if self.progress_log is not None and not non_persistent:  # Megatron-LM's: the persistent saves
            tokens = self.state.consumed_samples * self.run_config.model.seq_length
            self.progress_log.saved(self.state.iteration, self._flops_so_far(), tokens, checkpoint.async_save)

    # -- the loop -----------------------------------------------------------------------------------
    def run(self) -> int:
        """Train to --train-iters (or a graceful exit). Returns the process exit code."""
        parent_watch.on_launcher_death(self.exits.launcher_gone)
        hang_timeout = self.run_config.parallel.hang_timeout_minutes
        if hang_timeout:
            self.hang_watchdog = HangWatchdog(hang_timeout * 60, f"rank {self.rank}")
        try:
            return self._run()
        finally:
            parent_watch.on_launcher_death(None)
            if self.hang_watchdog is not None:
                self.hang_watchdog.close()

    def _run(self) -> int:
        training, evaluation, exits = self.run_config.training, self.run_config.evaluation, self.run_config.exits
        save_dir, save_interval = self.run_config.checkpoint.save, self.run_config.checkpoint.save_interval
        non_persistent_interval = self.run_config.checkpoint.non_persistent_save_interval
        if self.run_config.memory.manual_gc:
            # Collections at the same steps on every rank, not when each rank's allocations trigger one.
            gc.disable()
            gc.collect()
        parallel = self.run_config.parallel
        # Megatron-LM's: the first step without the overlapped param gather's pre-hooks (angpt.training.step).
        hooks_later = parallel.use_distributed_optimizer and parallel.overlap_param_gather and pre_hooks_on(self.chunks)
        if hooks_later:
            set_pre_hooks(self.chunks, False)
        if evaluation.skip_train:
            if self.rank == 0:
                logger.info("--skip-train: no training; evaluating the model of iteration %d", self.state.iteration)
            self.validate()
            self.evaluate(self.data.test, "test")
            self._finish()
            return 0
        start_iteration = self.state.iteration
        try:
            while self.state.iteration < training.train_iters:
                if self.state.iteration == start_iteration + 1 and parallel.distributed_timeout_seconds_after_init:
                    # Megatron-LM's: once the first iteration, which takes longer than the others, is done.
                    parallel_state.update_pg_timeout(timedelta(seconds=parallel.distributed_timeout_seconds_after_init))
                if self.state.iteration in self.iterations_to_skip:  # Megatron-LM's count of the steps done
                    self.skip_one_step()
                    continue
                if self.hang_watchdog is not None:  # each iteration's clock; stopped when the run ends
                    self.hang_watchdog.arm(self.state.iteration + 1)
                if self.profiler is not None:
                    self.profiler.before_step(self.state.iteration)
                with self.hooks.step(self.state.iteration + 1, lambda: self.exits.received is not None):
                    record = self.train_one_step()
                if hooks_later and not record["skipped"]:
                    set_pre_hooks(self.chunks, True)
                    hooks_later = False
                iteration = record["iteration"]
                if self.profiler is not None:
                    self.profiler.after_step(iteration)
                self.monitor.log_step(record)
                if record.get("calibrating") and self.rank == 0:
                    logger.info("iteration %d: fp16 gradients overflowed: step skipped, loss scale now %g", iteration,
                                record["loss_scale"])
                elif record["skipped"] and self.rank == 0:
                    logger.warning("iteration %d: loss %s, grad norm %s: step skipped (%d in a row)", iteration,
                                   record["loss"], record["grad_norm"], self.state.skipped_steps)
                if self.state.skipped_steps > exits.max_skipped_steps:
                    self.save()
                    raise SkippedStepsError(
                        f"{self.state.skipped_steps} steps in a row had a NaN or Inf loss or grad norm "
                        f"(--max-skipped-steps {exits.max_skipped_steps}); stopped at iteration {iteration}"
                        + (f", the last good state saved in {save_dir}" if save_dir else ""))
                if self.async_queue is not None:
                    self.async_queue.maybe_finalize_async_calls(blocking=False)
                hash_interval = self.run_config.rerun.check_weight_hash_across_dp_replicas_interval
                if hash_interval and iteration % hash_interval == 0:
                    parallel = self.run_config.parallel
                    check_weight_hashes(self.chunks, iteration,
                                        parallel.use_distributed_optimizer and parallel.overlap_param_gather)
                    if self.rank == 0:
                        logger.info("iteration %d: the weights are the same on every data-parallel replica",
                                    iteration)
                if evaluation.eval_interval and iteration % evaluation.eval_interval == 0:
                    self.validate()
                if save_interval and iteration % save_interval == 0:
                    self.save()
                elif self.non_persistent_save and non_persistent_interval and iteration % non_persistent_interval == 0:
                    self.save(non_persistent=True)
                reason = self.exits.check()
                if reason is None and exits.exit_interval and iteration % exits.exit_interval == 0:
                    reason = f"iteration {iteration} is a multiple of --exit-interval {exits.exit_interval}"
                if reason is None and iteration in training.phase_transitions:
                    reason = f"iteration {iteration} ends a phase of --phase-transition-iterations"
                if reason is not None:
                    self.save()
                    self._finish()
                    if self.rank == 0:
                        logger.info("exiting at iteration %d: %s", iteration, reason)
                    return 0
            if (evaluation.eval_iters or evaluation.full_validation) and (
                    not evaluation.eval_interval or self.state.iteration % evaluation.eval_interval):
                self.validate()
            self.evaluate(self.data.test, "test")
            self.save()
            self._finish()
            return 0
        except (SkippedStepsError, ReplicasDifferError) as error:
            self._finish()
            if self.rank == 0:
                logger.error("%s", error)
            return 1
        except rerun.ResultValidationExit as stop:  # before the step's update, as in Megatron-LM
            if stop.save:
                self.save()
            self._finish()
            if self.rank == 0:
                saved = (f"; the state before it (iteration {self.state.iteration}) is saved in {save_dir}"
                         if stop.save and save_dir else "")
                logger.error("iteration %d failed its result validation (the lines above name the ranks and "
                             "data): exiting with %s%s", self.state.iteration + 1, stop, saved)
            return stop.exit_code

    def _finish(self) -> None:
        if self.profiler is not None:
            self.profiler.close()
        if self.train_batches is not None:
            self.train_batches.close()
        if self.run_config.memory.manual_gc:
            gc.enable()
        if self.async_queue is not None:
            self.async_queue.maybe_finalize_async_calls(blocking=True, no_dist=False)
            self.async_queue.close()
            # Dropped while the process groups live: the persistent writer's __del__ asks for this rank.
            self.async_queue = None
        self.monitor.close()
        if self.run_config.memory.record_memory_history:
            memory_history.stop()
        if self.run_config.checkpoint.save and self.rank == 0:
            save_lock.release(self.run_config.checkpoint.save)
            if self.non_persistent_save and self.run_config.checkpoint.non_persistent_global_ckpt_dir:
                save_lock.release(self.run_config.checkpoint.non_persistent_global_ckpt_dir)


def pretrain(config: RunConfig) -> int:
    """Run the job the configuration describes; returns the exit code (0 also after a graceful exit)."""
    try:
        trainer = Trainer(config)
    except checkpointing.NoCheckpointToLoad as stop:
        if int(os.environ.get("RANK", "0")) == 0:
            logger.info("%s", stop)
        return 0
    except (ValueError, OSError, checkpointing.CheckpointError) as error:
        # Every rank checks the same flags, data and checkpoint the same way: one line from each node (whose
        # files may differ from another's), not one per rank; every rank exits non-zero.
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:
            print(f"angpt.pretrain: {error}", file=sys.stderr)
        return 2
    try:
        code = trainer.run()
    except IndexedDatasetError as error:  # a token id out of range, found in a batch (micro_batches)
        print(f"angpt.pretrain: {error}", file=sys.stderr)
        return 2
    except checkpointing.CheckpointError as error:  # a save that found no space: the previous checkpoint stands
        if not error.every_rank or int(os.environ.get("RANK", "0")) == 0:
            print(f"angpt.pretrain: {error}", file=sys.stderr)
        return 1
    dist.barrier()
    dist.destroy_process_group()
    return code
