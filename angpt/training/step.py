"""One training step on megatron-core: model chunks under DDP, its pipeline schedules, the optimizer."""

from __future__ import annotations

import math
from contextlib import contextmanager, nullcontext
from functools import partial
from typing import Iterator

import torch
from megatron.core import parallel_state
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    TorchFullyShardedDataParallel,
    TorchFullyShardedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel
from megatron.core.enums import ModelType
from megatron.core.full_cuda_graph import FullCudaGraphWrapper
from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.rerun_state_machine import get_rerun_state_machine
from megatron.core.transformer.enums import CudaGraphScope
from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper
from megatron.core.utils import get_batch_on_this_cp_rank, get_model_config

from angpt.megatron_compat import megatron_fsdp
from angpt.models import AnGPTConfig, build_model
from angpt.telemetry.stragglers import FORWARD_TIMER
from angpt.telemetry.timers import timer
from angpt.training import rerun
from angpt.training.grad_dumps import GradDumps


def wait_for_the_device(iteration: int, interval: int | None) -> None:
    """--train-sync-interval (Megatron-LM's): every `interval` steps the CPU waits for the GPU's queued work."""
    if interval and iteration % interval == 0 and torch.cuda.is_available():
        torch.cuda.synchronize()


def build_model_chunks(
    config: AnGPTConfig,
    vocab_size: int,
    seq_length: int,
    ddp_config: DistributedDataParallelConfig | None = None,
    one_bucket_group: bool = False,
    num_buckets: int | None = None,
    align_grad_reduce: bool = True,
) -> list[DistributedDataParallel]:
    """This rank's model chunks (one per virtual pipeline stage), each wrapped in megatron-core's DDP, or in its
    FSDP2 wrapper for a TorchFullyShardedDataParallelConfig, or in Megatron-FSDP for a config with
    use_megatron_fsdp (Megatron-LM's get_model). The chunks after the first reduce their gradients in one
    bucket group each (their communication overlaps computation anyway), and the first too with `one_bucket_group`
    (--overlap-param-gather-with-optimizer-step, as Megatron-LM's get_model). With `num_buckets`
    (--ddp-num-buckets), buckets of this rank's parameters / `num_buckets` elements. With `align_grad_reduce`
    (unless --no-align-grad-reduce), the pipeline schedule starts every stage's overlapped gradient reduction
    (Megatron-LM's train: config.grad_sync_func); the weights' all-gathers it starts with set_pre_hooks."""
    ddp_config = ddp_config or DistributedDataParallelConfig(grad_reduce_in_fp32=True)
    if isinstance(ddp_config, TorchFullyShardedDataParallelConfig):
        wrapper = TorchFullyShardedDataParallel
    elif ddp_config.use_megatron_fsdp:
        megatron_fsdp.install()
        wrapper = FullyShardedDataParallel
    else:
        wrapper = DistributedDataParallel
    virtual_stages = config.virtual_pipeline_model_parallel_size
    models = []
    for vp_stage in range(virtual_stages) if virtual_stages else [None]:
        model = build_model(
            config,
            vocab_size,
            seq_length,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
            vp_stage=vp_stage,
        )
        model.model_type = ModelType.encoder_or_decoder
        models.append(model)
    if num_buckets is not None:  # Megatron-LM's get_model: of the parameters of this rank's chunks
        ddp_config.bucket_size = sum(param.numel() for model in models for param in model.parameters()) // num_buckets
    chunks = [wrapper(config=config, ddp_config=ddp_config, module=model,
                      disable_bucketing=index > 0 or one_bucket_group) for index, model in enumerate(models)]
    config.finalize_model_grads_func = finalize_model_grads
    if ddp_config.overlap_grad_reduce:
        config.no_sync_func = [chunk.no_sync for chunk in chunks]
        config.grad_sync_func = [chunk.start_grad_sync for chunk in chunks] if align_grad_reduce else None
        if len(chunks) == 1:
            config.no_sync_func = config.no_sync_func[0]
            config.grad_sync_func = config.grad_sync_func and config.grad_sync_func[0]
    return chunks


def whole_weights_between_steps(model_chunks) -> None:
    """Megatron-FSDP leaves its model's parameters the optimizer's shards (DTensors) once built (its optimizer is built
    from them) and after the gradients' sync, until the next forward; what reads the model between steps
    (angpt.telemetry.health's alphas, through the scales' modules, whose Megatron-FSDP hooks then fail with a
    KeyError) reads its own parameters, whole, where the strategy keeps them whole (optim, optim_grads): the ones
    the next forward takes anyway. optim_grads_params gathers them only inside its layers' forward and backward: its
    shards stay."""
    for chunk in model_chunks:
        if isinstance(chunk, FullyShardedDataParallel) and \
                chunk.ddp_config.data_parallel_sharding_strategy != "optim_grads_params":
            chunk.module._replace_param_with_raw_if_needed()


def gather_whole_weights(model_chunks) -> None:
    """Megatron-FSDP's optim_grads_params holds its model's weights whole only from the all-gather its optimizer step
    starts (overlapped: Megatron-FSDP turns --overlap-param-gather on for it) until each layer's forward is done; what
    reads them between steps (the health probe, the params norm) waits for that gather, and starts it where no step
    has (before the first), leaving the model as its next forward's pre-hook would: its buckets gathered, its own
    parameters in place of the optimizer's shards. Other wrappers' models are whole already."""
    for chunk in model_chunks:
        if isinstance(chunk, FullyShardedDataParallel) and \
                chunk.ddp_config.data_parallel_sharding_strategy == "optim_grads_params":
            gather = chunk.module.all_gather_pipeline
            for bucket in range(gather.num_buckets):
                gather.async_bucket_gather(bucket, bwd=False)  # none where the step's gather is under way or done
                gather.wait_bucket_ready(bucket, bwd=False)
            chunk.module._replace_param_with_raw_if_needed()


def pre_hooks_on(model_chunks) -> bool:
    """Whether the chunks' forward pre-hooks (the overlapped param gather's) are registered (Megatron-LM's check)."""
    return len(model_chunks[0].remove_forward_pre_hook_handles) > 0


def set_pre_hooks(model_chunks, on: bool) -> None:
    """Megatron-LM's train loop: the first step runs without the overlapped param gather's forward pre-hooks, so that
    a checkpoint's or the initialization's weights are not all-gathered over themselves, and they are turned on once
    a step has run (the first that was not skipped). With them, where the stages align their all-gathers (the
    interleaved schedule, unless --no-align-param-gather), the schedule starts each chunk's (config.param_sync_func,
    as Megatron-LM's train sets it)."""
    for chunk in model_chunks:
        if on:
            chunk.enable_forward_pre_hook()
        else:
            chunk.disable_forward_pre_hook(param_sync=False)
    config = get_model_config(model_chunks[0])
    aligned = on and model_chunks[0].ddp_config.align_param_gather
    config.param_sync_func = [chunk.start_param_sync for chunk in model_chunks] if aligned else None
    if config.param_sync_func and len(model_chunks) == 1:
        config.param_sync_func = config.param_sync_func[0]


@contextmanager
def param_gather_finished(model_chunks, overlapped: bool):
    """With the distributed optimizer's overlapped param gather, the all-gather of a step's updated weights finishes
    in the next forward's pre-hook; what reads the weights between steps (a save, the weight-hash check, the health
    probe) finishes it first, as Megatron-LM does by turning the pre-hook off (which syncs the params) and on again,
    or by syncing them where the hooks are off (before the first step's hooks are on)."""
    hooked = overlapped and pre_hooks_on(model_chunks)
    if hooked:
        for chunk in model_chunks:
            chunk.disable_forward_pre_hook()
    elif overlapped:
        for chunk in model_chunks:
            chunk.start_param_sync(force_sync=True)
    try:
        yield
    finally:
        if hooked:
            for chunk in model_chunks:
                chunk.enable_forward_pre_hook()


def language_model_loss(loss_mask: torch.Tensor, per_token_loss: torch.Tensor, *,
                        checks: rerun.Checks | None = None):
    """The next-token cross-entropy summed over the unmasked tokens of one micro-batch, and their count, as
    Megatron-LM's pretrain_gpt.py returns them: megatron-core's schedule divides the sum by the count (the
    micro-batch's mean, averaged over the micro-batches), or with calculate_per_token_loss keeps the sum and
    divides the gradients by the count of the whole global batch. With `checks`, the sum is validated by the
    rerun state machine, as pretrain_gpt.py's loss_func does."""
    loss_mask = loss_mask.float()
    total = (per_token_loss.float() * loss_mask).sum()
    count = loss_mask.sum()
    if checks is not None:  # on a copy: the machine keeps it to compare with the rerun's, and the schedule
        rerun.validate_loss(total.detach().clone(), checks)  # divides `total` in place
    # The schedule divides the returned sum in place; report a copy.
    return total, count.to(torch.int), {"lm loss": torch.stack([total.detach().clone(), count])}


def on_device(batch: dict) -> dict:
    """The batch on this rank's GPU, where there is one (Megatron-LM's get_batch): the datasets' batches
    are built on the CPU (pinned with CUDA), and the loss mask meets the loss on the model's device."""
    if not torch.cuda.is_available():
        return batch
    return {key: value.cuda(non_blocking=True) for key, value in batch.items()}


def forward_step(data_iterator: Iterator[dict], model, *, checks: rerun.Checks | None = None):
    """Batches are dicts with tokens, labels, loss_mask and position_ids, each [batch, sequence], and with
    --reset-attention-mask the attention_mask [batch, 1, sequence, sequence] (True: masked out). Under
    context parallelism this rank takes its two of the 2 x CP chunks of each (Megatron-LM's split; the
    attention mask's rows), from a copy: virtual pipeline stages iterate over the same batches."""
    batch = get_batch_on_this_cp_rank(on_device(dict(next(data_iterator))))
    with FORWARD_TIMER if model.training else nullcontext():  # --log-straggler's: training's forward passes
        per_token_loss = model(batch["tokens"], batch["position_ids"], batch.get("attention_mask"),
                               labels=batch["labels"], loss_mask=batch["loss_mask"])  # the MTP loss's mask too
    return per_token_loss, partial(language_model_loss, batch["loss_mask"], checks=checks)


def train_step(
    data_iterators,
    model_chunks,
    optimizer,
    scheduler,
    num_microbatches: int,
    micro_batch_size: int,
    seq_length: int,
    schedule_increment: int = 1,
    empty_unused_memory_level: int = 0,
    timers=None,
    barrier_with_l1_time: bool = True,
    checks: rerun.Checks | None = None,
    grad_dumps: GradDumps | None = None,
):
    """Forward and backward over the global batch, then one optimizer step unless the loss or the
    gradient norm is not finite, and the lr schedule advanced by `schedule_increment` (1 for a schedule in
    iterations, the global batch for one in samples). `empty_unused_memory_level` (Megatron-LM's): release the
    CUDA caching allocator's unused memory after the forward-backward (1) and also after the step (2). `timers`
    (megatron-core's Timers, or None): the optimizer's step, started after a barrier unless not
    `barrier_with_l1_time` (Megatron-LM's --no-barrier-with-level-1-timing); megatron-core's schedule times the
    forward-backward pass itself, with the Timers of the model's config. The forward-backward passes run as
    megatron-core's rerun state machine asks (Megatron-LM's train_step), with the loss `checks`
    (angpt.training.rerun); raises rerun.ResultValidationExit, before the optimizer step, when it asks to exit.
    `grad_dumps`: the gradients this iteration saves (--save-wgrads-interval, --save-dgrads-interval), or None.

    Returns (loss averaged over the global batch, available on every rank; grad norm; whether the
    optimizer applied the update)."""
    machine = get_rerun_state_machine()
    data_iterators = rerun.replayable(data_iterators)
    while machine.should_run_forward_backward(data_iterators):
        for chunk in model_chunks:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        with grad_dumps.forward_backward(model_chunks) if grad_dumps is not None else nullcontext():
            loss = _mean_loss_over_global_batch(data_iterators, model_chunks, num_microbatches, micro_batch_size,
                                                seq_length, forward_only=False, checks=checks,
                                                force_all_reduce=grad_dumps is not None and grad_dumps.wgrads)
    if grad_dumps is not None:
        grad_dumps.save_wgrads(model_chunks)
    rerun.exit_if_asked()
    if empty_unused_memory_level >= 1:
        torch.cuda.empty_cache()
    timer(timers, "optimizer").start(barrier=barrier_with_l1_time)
    updated, grad_norm = step_unless_not_finite(optimizer, loss)
    timer(timers, "optimizer").stop()
    whole_weights_between_steps(model_chunks)
    if empty_unused_memory_level >= 2:
        torch.cuda.empty_cache()
    if updated:
        scheduler.step(increment=schedule_increment)
    return loss, grad_norm, updated


@torch.no_grad()
def step_unless_not_finite(optimizer, loss: float) -> tuple[bool, float | None]:
    """megatron-core's optimizer step (clip to the total grad norm, then update), skipped when the loss
    or the grad norm is NaN or Inf; every rank sees the same global loss and norm, so all skip together.
    Returns (whether the update was applied, grad norm). A megatron-core workaround (angpt/megatron_compat)."""
    if optimizer.prepare_grads():  # an fp16 loss scaler found an overflow (and lowered its scale)
        return False, None
    grad_norm = optimizer.get_grad_norm()
    if not (math.isfinite(loss) and math.isfinite(grad_norm)):
        return False, grad_norm
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        parameters = inner.get_parameters()
        if inner.config.clip_grad > 0.0 and parameters:
            clip_grad_by_total_norm_fp32(parameters, inner.config.clip_grad, grad_norm,
                                         inner.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8)
    return optimizer.step_with_ready_grads(), grad_norm


@torch.no_grad()
def mtp_losses(mtp_num_layers: int | None, num_microbatches: int) -> dict[str, float]:
    """The step's loss of each MTP layer ({"mtp_1_loss": ...}; none without --mtp-num-layers), as Megatron-LM's
    training_log takes it from megatron-core's MTPLossLoggingHelper: each micro-batch's mean over its tokens, averaged
    over the micro-batches and data-parallel ranks; kept by the last pipeline stage, shared with every rank here. The
    helper's tracker starts afresh for the next step."""
    if not mtp_num_layers:
        return {}
    tracked = {}
    MTPLossLoggingHelper.track_mtp_metrics(1 / num_microbatches, None, None, total_loss_dict=tracked)
    values = torch.zeros(mtp_num_layers, device=torch.cuda.current_device())
    for layer in range(mtp_num_layers):
        values[layer] = tracked.get(f"mtp_{layer + 1} loss", 0.0)
    pipeline = parallel_state.get_pipeline_model_parallel_group()
    if pipeline.size() > 1:  # zeros but on the last stage
        torch.distributed.all_reduce(values, group=pipeline)
    return {f"mtp_{layer + 1}_loss": value for layer, value in enumerate(values.tolist())}


@torch.no_grad()
def eval_step(data_iterators, model_chunks, num_microbatches: int, micro_batch_size: int, seq_length: int) -> float:
    """The mean loss of one global batch, forward only, available on every rank."""
    for chunk in model_chunks:
        chunk.eval()
    loss = _mean_loss_over_global_batch(data_iterators, model_chunks, num_microbatches, micro_batch_size,
                                        seq_length, forward_only=True)
    for chunk in model_chunks:
        chunk.train()
    return loss


def _mean_loss_over_global_batch(data_iterators, model_chunks, num_microbatches: int, micro_batch_size: int,
                                 seq_length: int, forward_only: bool, checks: rerun.Checks | None = None,
                                 force_all_reduce: bool = False) -> float:
    """megatron-core's schedule over the micro-batches (and backward unless `forward_only`); the gradients
    all-reduced, not reduce-scattered, with `force_all_reduce`."""
    forward_backward = get_forward_backward_func()
    config = get_model_config(model_chunks[0])
    if config.cuda_graph_impl == "local" and CudaGraphScope.full_iteration in config.cuda_graph_scope:
        # --cuda-graph-scope full_iteration, as Megatron-LM's train and evaluate wrap it: the forward and backward
        # over all micro-batches as one CUDA graph, captured after cuda_graph_warmup_steps eager calls. The wrapper
        # keeps its graphs, counts and input buffers in class attributes: one per call acts as one per run.
        forward_backward = FullCudaGraphWrapper(forward_backward,
                                                cuda_graph_warmup_steps=config.cuda_graph_warmup_steps)
    losses = forward_backward(
        forward_step_func=partial(forward_step, checks=checks),
        data_iterator=data_iterators,
        model=model_chunks,
        num_microbatches=num_microbatches,
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        forward_only=forward_only,
        force_all_reduce=force_all_reduce,
    )
    return _global_mean_loss(losses, config.calculate_per_token_loss)


def _global_mean_loss(losses: list[dict], per_token: bool) -> float:
    """The last pipeline stage holds the micro-batch losses ([sum, tokens] each, of this rank's part of the
    sequence under context parallelism, summed over the CP group first): the mean over the global batch's
    tokens (per_token), else the mean of the micro-batches' means, over data-parallel ranks; shared with
    every rank."""
    if parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        stacked = torch.stack([entry["lm loss"] for entry in losses])
        if parallel_state.get_context_parallel_world_size() > 1:
            torch.distributed.all_reduce(stacked, group=parallel_state.get_context_parallel_group())
        sums, counts = stacked.unbind(-1)
        group = parallel_state.get_data_parallel_group()
        if per_token:
            totals = torch.stack([sums.sum(), counts.sum()])
            torch.distributed.all_reduce(totals, group=group)
            local = totals[0] / totals[1]
        else:
            local = (sums / counts).mean()
            torch.distributed.all_reduce(local, group=group)
            local /= parallel_state.get_data_parallel_world_size()
    else:
        local = torch.zeros((), device=torch.cuda.current_device())
    world = parallel_state.get_pipeline_model_parallel_group()
    if world.size() > 1:
        torch.distributed.all_reduce(local, group=world)
    return local.item()
