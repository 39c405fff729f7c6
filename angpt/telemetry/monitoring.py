"""What the trainer reports every --log-interval and after each evaluation: TrainingMonitor puts the
measurements of angpt.telemetry.performance and angpt.telemetry.health into the records
angpt.telemetry.metrics writes and prints."""

from __future__ import annotations

import importlib.util
import math
import os
import time
from contextlib import contextmanager, nullcontext
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from angpt.config.sections import RunConfig
from angpt.telemetry import memory_history
from angpt.telemetry.health import HealthProbe, params_l2_norm
from angpt.telemetry.metrics import MTP_LOSS, MetricsLogger, ProgressBar, format_log_line
from angpt.telemetry.performance import (
    DeviceTelemetry,
    GpuEnergy,
    memory_report,
    memory_stats,
    model_flops_per_token,
    peak_flops_per_device,
)
from angpt.telemetry.stragglers import StragglerReport
from angpt.telemetry.timers import per_step_ms

# The figures of a step that TensorBoard and W&B get every --tensorboard-log-interval (Megatron-LM's: the step's
# loss, learning rate, batch size, grad norm, loss scale and world size), not with the --log-interval records.
STEP_FIGURES = ("lm_loss", "lr", "grad_norm", "global_batch_size", "consumed_samples", "consumed_tokens",
                "loss_scale", "world_size")  # and each MTP layer's loss (MTP_LOSS)


class TrainingMonitor:
    """Reads the logging section, and of the rest of the run's configuration the save directory (its default
    output directory), the length of training, the sequence length, the layout and the memory snapshot."""

    def __init__(self, run: RunConfig, config, chunks, vocab_size: int, rank: int, start_iteration: int,
                 loaded_from: Optional[str] = None, timers=None, optimizer=None, weights_ready=nullcontext):
        logging, save = run.logging, run.checkpoint.save
        self.logging, self.train_iters, self.seq_length = logging, run.training.train_iters, run.model.seq_length
        self.chunks, self.optimizer = chunks, optimizer  # for --log-params-norm and --log-num-zeros-in-grad
        # A context in which the weights are the last step's (the overlapped param gather finished); the health
        # probe calls modules, whose forward pre-hooks would otherwise finish it out of the schedule's order.
        self.weights_ready = weights_ready
        self.timers = timers  # megatron-core's Timers of the run (angpt.telemetry.timers), or None
        self.is_reporting_rank = rank == 0
        output_dir = save or logging.tensorboard_dir
        metrics_file = logging.metrics_file or (os.path.join(output_dir, "metrics.jsonl") if output_dir else None)
        tensorboard_dir = logging.tensorboard_dir or (os.path.join(save, "tensorboard") if save else None)
        if run.evaluation.skip_train:  # as Megatron-LM: an evaluation without training writes no curves
            tensorboard_dir = None
        self.tensorboard_dir = tensorboard_dir
        wandb_init = None
        if logging.wandb_project and not run.evaluation.skip_train:
            # As Megatron-LM: every launch is a run of its own, its settings as the run's config; a resumed
            # job's curves continue where its checkpoint left off, the steps being iterations.
            wandb_init = dict(project=logging.wandb_project, name=logging.wandb_exp_name, entity=logging.wandb_entity,
                              dir=logging.wandb_save_dir or os.path.join(save, "wandb"), config=run.flags())
        self.metrics = MetricsLogger(metrics_file, tensorboard_dir, enabled=self.is_reporting_rank,
                                     wandb_init=wandb_init, timers_to_tensorboard=logging.log_timers_to_tensorboard,
                                     queue_size=logging.tensorboard_queue_size)
        self.health = HealthProbe(chunks)
        self.telemetry = DeviceTelemetry()
        self.flops_per_token = model_flops_per_token(config, self.seq_length, vocab_size)
        self.peak_flops = peak_flops_per_device(config.params_dtype)
        self.world_size = dist.get_world_size()
        self.rank = rank
        # As Megatron-LM's report_memory: each data-parallel rank 0 prints its own.
        self.reports_memory = (logging.log_memory_interval is not None and torch.cuda.is_available()
                               and parallel_state.get_data_parallel_rank() == 0)
        self.energy = None
        if logging.log_energy and torch.cuda.is_available() and importlib.util.find_spec("pynvml") is not None:
            self.energy = GpuEnergy()
        self.progress = ProgressBar(self.train_iters, start_iteration, enabled=self.is_reporting_rank)
        self.start_iteration = start_iteration
        self.stragglers = None
        if logging.log_straggler:
            self.stragglers = StragglerReport(self.world_size, rank, parallel_state.get_pipeline_model_parallel_rank(),
                                              logging.straggler_minmax_count, logging.straggler_ctrlr_port,
                                              enabled=not logging.disable_straggler_on_startup)
        # As Megatron-LM: the last rank writes the snapshots.
        self.memory_snapshot = (run.memory.memory_snapshot_path if run.memory.record_memory_history
                                and rank == self.world_size - 1 else None)
        self._reset_window()
        # Marks where the steps logged after it start: a resumed run logs again the steps its checkpoint
        # did not hold, and readers (angpt.telemetry.metrics_reader.read_metrics) drop the first run's records of them.
        parallel = run.parallel
        tp, pp, cp = (parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size,
                      parallel.context_parallel_size)
        self.metrics.log({"kind": "start", "iteration": start_iteration, "train_iters": self.train_iters,
                          "resumed": start_iteration > 0, "checkpoint": loaded_from, "world_size": self.world_size,
                          "tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
                          "context_parallel_size": cp, "data_parallel_size": self.world_size // (tp * pp * cp)})

    def _reset_window(self) -> None:
        self.window_seconds, self.window_steps, self.window_losses, self.window_skipped = 0.0, 0, [], 0
        self.window_mtp_losses = {}  # {"mtp_1_loss": [each step's], ...} with --mtp-num-layers
        self.window_samples = 0

    def _reports(self, iteration: int) -> bool:
        return iteration % self.logging.log_interval == 0 or iteration == self.train_iters

    @contextmanager
    def step(self, iteration: int):
        """Times one training step; on logged iterations the health probe watches its forward passes."""
        start = time.perf_counter()
        with self.health.capture() if self._reports(iteration) else nullcontext():
            yield
        self.window_seconds += time.perf_counter() - start
        self.window_steps += 1

    def step_scalars(self, step: dict) -> dict:
        """The step's own figures for TensorBoard and W&B (STEP_FIGURES), as Megatron-LM writes them every
        --tensorboard-log-interval."""
        figures = {"lm_loss": step["loss"], "lr": step["lr"],
                   "grad_norm": step["grad_norm"] if step["grad_norm"] is not None else float("nan"),
                   "global_batch_size": step["global_batch_size"], "consumed_samples": step["consumed_samples"],
                   "consumed_tokens": step["consumed_samples"] * self.seq_length}
        if "loss_scale" in step and self.logging.log_loss_scale_to_tensorboard:
            figures["loss_scale"] = step["loss_scale"]
        if self.logging.log_world_size_to_tensorboard:
            figures["world_size"] = self.world_size
        figures.update({name: step[name] for name in filter(MTP_LOSS.fullmatch, step)})
        return {f"train/{name}": value for name, value in figures.items()}

    def paused(self):
        """A context for what is not a training step (evaluations, saves): the GPUs' energy is not counted."""
        return self.energy.paused() if self.energy is not None else nullcontext()

    def log_step(self, step: dict) -> None:
        """Collective on logged iterations (the health summary gathers over every rank)."""
        # A step skipped for its grad norm still computed a loss: it counts (and "skipped" says so).
        self.window_skipped += step["skipped"]
        self.window_samples += step["global_batch_size"]  # ramped up or constant
        if math.isfinite(step["loss"]):
            self.window_losses.append(step["loss"])
        for name in filter(MTP_LOSS.fullmatch, step):
            self.window_mtp_losses.setdefault(name, []).append(step[name])
        iteration = step["iteration"]
        self.progress.update(1, {"loss": f"{step['loss']:.4f}"})
        if self.memory_snapshot and (self._reports(iteration) or iteration == self.start_iteration + 1):
            memory_history.write_snapshot(self.memory_snapshot)
        interval = self.logging.tensorboard_log_interval
        scalars = self.step_scalars(step) if interval and iteration % interval == 0 else {}
        if not self._reports(iteration):
            if scalars and self.is_reporting_rank:
                self.metrics.add_scalars(scalars, iteration)
            return
        if self.reports_memory and iteration % self.logging.log_memory_interval == 0:
            print(memory_report(iteration, self.rank, self.logging.log_device_memory_used), flush=True)
        seconds_per_step = self.window_seconds / max(self.window_steps, 1)
        tokens_per_second_per_device = (self.window_samples * self.seq_length / max(self.window_seconds, 1e-9)
                                        / self.world_size)
        record = {
            "kind": "train",
            "iteration": iteration,
            "train_iters": self.train_iters,
            "consumed_samples": step["consumed_samples"],
            "consumed_tokens": step["consumed_samples"] * self.seq_length,
            "global_batch_size": step["global_batch_size"],
            **({"loss_scale": step["loss_scale"]} if "loss_scale" in step else {}),
            "lm_loss": (sum(self.window_losses) / len(self.window_losses)) if self.window_losses else float("nan"),
            # As Megatron-LM's log line: each MTP layer's loss averaged over the steps since the last line.
            **{name: sum(values) / len(values) for name, values in self.window_mtp_losses.items()},
            "lr": step["lr"],
            "grad_norm": step["grad_norm"] if step["grad_norm"] is not None else float("nan"),
            "ms_per_step": 1000 * seconds_per_step,
            "tokens_per_s_per_device": tokens_per_second_per_device,
            "skipped": self.window_skipped,
        }
        if self.peak_flops:
            record["mfu"] = self.flops_per_token * tokens_per_second_per_device / self.peak_flops
        if self.energy is not None:
            record.update(self.energy.figures(max(self.window_steps, 1), max(self.window_seconds, 1e-9),
                                              self.world_size))
        record.update(memory_stats())
        record.update(self.telemetry.read())
        with self.weights_ready():
            record.update(self.health.summary())
            if self.logging.log_params_norm:
                record["params_norm"] = params_l2_norm(self.chunks)
        if self.logging.log_num_zeros_in_grad and self.optimizer is not None:
            # The last step's gradients (clipped, as Megatron-LM counts them; clipping keeps zeros), over the model.
            record["num_zeros"] = int(self.optimizer.count_zeros())
        if self.timers is not None:
            timed = per_step_ms(self.timers, max(self.window_steps, 1))
            if timed:
                record["timers_ms"] = timed
        if self.stragglers is not None:
            record.update(self.stragglers.gather(max(self.window_steps, 1)) or {})
        self._reset_window()
        if self.is_reporting_rank:
            # The record's other figures every --log-interval; its step figures with the step's own, at their interval.
            scalars.update({tag: value for tag, value in self.metrics.scalars(record).items()
                            if tag.removeprefix("train/") not in STEP_FIGURES
                            and not MTP_LOSS.fullmatch(tag.removeprefix("train/"))})
            self.metrics.log(record, scalars)
            self.progress.write(format_log_line(record))

    def log_evaluation(self, iteration: int, split: str, loss: float) -> None:
        if not self.is_reporting_rank:
            return
        record = {"kind": "eval", "iteration": iteration, "split": split, "lm_loss": loss,
                  "lm_loss_ppl": math.exp(min(loss, 50.0))}
        self.metrics.log(record)
        self.progress.write(format_log_line(record))

    def close(self) -> None:
        """Collective with --log-energy (the total energy is summed over the ranks)."""
        if self.energy is not None:
            total = self.energy.close()
            self.energy = None
            if self.is_reporting_rank:
                self.progress.write(f"Total training energy (GPU): {total / 1e6:.3f} MJ")
        self.progress.close()
        self.metrics.close()
        if self.stragglers is not None:
            self.stragglers.close()
