"""megatron-core 0.16.1's Megatron-FSDP (`megatron.core.distributed.fsdp.mcore_fsdp_adapter.FullyShardedDataParallel`,
Megatron-LM's --use-megatron-fsdp), made to train angpt's models, on a machine without CUDA (gloo) too; each
workaround says what breaks without it. `install()` is called by angpt.training.step before it wraps a model in it.

- Its device: the adapter and `MegatronFSDP.__init__` build `torch.device(f"cuda:{torch.cuda.current_device()}")`,
  which the CPU adapter's `current_device()` (torch.device("cpu")) makes "cuda:cpu": RuntimeError "Invalid device
  string" while wrapping. Without CUDA the adapter's device is the CPU, and `current_device()` answers 0 while
  `MegatronFSDP` is built (its device is only compared with it, for a warning, dropped: on the CPU it is no news).
- Its streams: the gradients' reduce-scatter and the weights' all-gather take `torch.cuda.current_stream()` and
  record events on streams ("Torch not compiled with CUDA enabled" at the first backward). The CPU adapter's streams
  lack both; on the CPU every op runs in program order on the calling thread, so there is nothing to wait for.
- Its root hooks (on every device; fixed upstream after 0.16.1, NVIDIA/Megatron-LM#5808): `MegatronFSDP.forward`
  calls the model's `forward`, not the model, so the hook that starts each backward pass (it lists the parameters
  whose gradients are still to be reduced) is never set on the model's output, only on the model's last submodule
  (a loop variable left over). In anGPT and nGPT that is the output layer's logit scale s_Z, whose gradient comes
  after W_head's: W_head's gradient is reduced, listed again, and its bucket reduce-scattered a second time at the
  end of the backward pass, which adds the bucket's pre-divided gradients once more. Every gradient but W_head's
  was 1.5 times the true one at DP 2 (optim_grads and optim_grads_params). `_forward_through_hooks` calls the
  model, as upstream now does.
- megatron-core's `unwrap_model` stops at `MegatronFSDP` (the adapter's module), not at the model inside it, so
  what reads the model's layers (angpt.telemetry.health) found none ("'MegatronFSDP' object has no attribute
  'decoder'" at the start of every run): its default classes take `MegatronFSDP` too.
- The optimizer's state in an fsdp_dtensor checkpoint (on every device; upstream NVIDIA/Megatron-LM#4910): torch's
  Adam creates a parameter's state at its first gradient, and Megatron-FSDP gives a parameter whose shard on this
  rank is empty no gradient (`update_main_grads`), so ranks hold state for different parameters, and
  `preprocess_state_dict_for_uneven_dtensor`, one collective per DTensor, pairs them wrongly: the first save hangs.
  `_every_parameters_state` gives each parameter Adam's initial state (zero moments, the step of the others) before
  the state dict is built, in the order of the parameter groups on every rank.
- Tensor parallelism without Transformer Engine (on every device): the adapter marks TP-duplicated weights with
  `isinstance(module, (TELinear,))`, and `TELinear` is megatron-core's MagicMock where Transformer Engine is not
  installed ("isinstance() arg 2 must be a type" while wrapping). Without it the adapter's `TELinear` is a class
  of which no module is an instance, as none is a Transformer Engine layer.
- A gradient buffer that is not distributed (on every device; fixed upstream after 0.16.1): optim's with
  --overlap-grad-reduce, and optim_grads' and optim_grads_params' at data-parallel size 1. The bucket that
  `_bucket_group_gradient_reduce` reduce-scatters is then the gradient buffer itself, and the reduced shard is added
  into that buffer's shard, which still holds this rank's unreduced gradient (at DP 1 every gradient accumulated so
  far counted again at each micro-batch's reduction: the grad norm 2-3 times DDP's; optim with overlap at DP 2: 0.147
  against DDP's 0.215 where that addition was dropped). `_reduced_once` installs the reduced shard in place of the
  unreduced one there, as upstream's reduce-scatter writes it in place.
- no_shard (Megatron-LM's default strategy; on every device): its gradients are all-reduced, every rank holding
  them whole, yet the distributed optimizer sums their statistics over the data-parallel ranks as it does shards':
  the grad norm sqrt(DP) times the true one (2.157 against DDP's 1.525 at DP 2), clipping too hard, and the zeros
  counted DP times: `_replicas_counted_once` reduces them over the model-parallel group, as megatron-core's optimizer
  does for DDP's replicated gradients.
  Without --overlap-grad-reduce its gradients are never reduced (`all_reduce_gradients` skips every buffer that
  exists: `if gbuf is not None: continue`), each rank stepping with its own: `_all_reduced` reduces them.
  And its `start_param_sync`, without --overlap-param-gather, all-gathers weight buckets no_shard does not have
  ("'NoneType' object has no attribute 'fetch_bucket'" at the first step): the weights are whole already, and
  `_nothing_to_gather` returns, as upstream does since. At fp32 its optimizer's parameters (the model's own, no
  buffer behind them) lack the `megatron_fsdp_slice` that the fsdp_dtensor checkpoint's split of a gated fc1 reads
  (an AttributeError at every save and load of anGPT, nGPT and GPT+): `_whole_slices` gives them their whole run.
  That split then makes fc1's halves sharded DTensors, each rank claiming its own rows of what all hold whole ("DTensor
  chunk metadata is invalid. Offsets: (192, 0)" at the save): `handle_swiglu_in_state_dict` (which angpt's
  checkpoints call in megatron-core's stead) makes them replicated, as fc1 is.
- Hybrid sharding (--num-distributed-optimizer-instances above 1: sharded within an instance, replicated over
  the instances; on every device, upstream's main too): its gradients are reduced over the instances (the outer
  group) only by the backward hook, when `no_sync` has marked the last micro-batch, which Megatron-LM's training
  loop (and angpt's) sets up only with --overlap-grad-reduce (optim_grads and optim_grads_params turn it on). optim
  and no_shard without it reduce within the instance only (`start_grad_sync`): each instance steps with its half of
  the batch's gradient (grad norm 0.093 against DDP's 0.152 at iteration 1 under optim, 4 ranks, 2 instances).
  `_over_the_instances_too` all-reduces what the optimizer reads of them over the outer group after that reduction,
  as the hook does. And no_shard's weights and gradients become DTensors over the 2-D (instance, rank) mesh with one
  placement (`_get_fsdp_tensor_spec`: `[Replicate()]` for a replicated parameter whatever the mesh): Adam's first
  `lerp_` fails ("in-place operations that require placement changes are not supported"). `_replicated_everywhere`
  gives them Replicate on every dimension of their mesh.
- Its weights' all-gathers without CUDA: megatron-core starts them asynchronously and frees or reuses a bucket by
  CUDA stream order, which on the CPU orders nothing, so gloo's thread could still be writing into a bucket freed
  (a prefetch left in flight at the end of a run): "malloc(): unaligned tcache chunk detected" and a dead rank, now
  and then, under optim_grads_params. Without CUDA `_gathered_at_once` waits for each all-gather it starts.
- --fp16's loss scaler (on every device): before each step it unscales every main gradient of the optimizer's
  groups, reading `param.grad.data`, and a parameter whose shard on this rank is empty has no gradient under
  Megatron-FSDP (`update_main_grads`): "'NoneType' object has no attribute 'data'" at the first step wherever a
  rank's shard misses a parameter (optim, optim_grads, optim_grads_params at DP 2). `_present_grads_unscaled`
  unscales the gradients there are (their local shards), as Adam steps only those; the overflow flag is reduced
  over the ranks as before.
- The fused gradient division (`--gradient-reduce-div-fusion`, Megatron-LM's default) reduces with NCCL's
  PREMUL_SUM, which gloo lacks ("_make_nccl_premul_sum" fails at the first reduction). Without CUDA the gradients are
  multiplied by the factor and summed, as megatron-core does without the fusion: the same products, the same sum.
"""

from __future__ import annotations

import functools
import logging
from collections import defaultdict

import megatron.core.distributed.fsdp.mcore_fsdp_adapter as adapter
import torch
import torch.distributed as dist
from megatron.core import parallel_state, utils
from megatron.core.distributed import DistributedDataParallel, TorchFullyShardedDataParallel
from megatron.core.distributed.fsdp.src.megatron_fsdp import megatron_fsdp, param_and_grad_buffer
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.transformer import fsdp_dtensor_checkpoint
from megatron.core.transformer.module import Float16Module
from torch.distributed import distributed_c10d
from torch.distributed.tensor import DTensor, Replicate

from angpt.megatron_compat import cpu

_installed = False


class _Event:
    """A recorded CUDA event where there is none: what it marks has run."""

    def wait(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class _Stream(cpu._Stream):
    """The CPU adapter's stream, with the events Megatron-FSDP records on it."""

    def record_event(self, event=None):
        return event or _Event()

    def wait_event(self, event) -> None:
        pass

    def synchronize(self) -> None:
        pass


class _NotTheCudaDevice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "instead of the current device" not in record.getMessage()


def _adapter_on_the_cpu(init):
    @functools.wraps(init)
    def __init__(self, *args, device=None, **kwargs):
        return init(self, *args, device=device or torch.device("cpu"), **kwargs)

    return __init__


def _cuda_index_while_built(init):
    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        current_device = torch.cuda.current_device
        torch.cuda.current_device = lambda: 0
        try:
            return init(self, *args, **kwargs)
        finally:
            torch.cuda.current_device = current_device

    return __init__


def _forward_through_hooks(self, *inputs, **kwargs):
    """megatron-core's `MegatronFSDP.forward`, calling the model (its forward hooks run)."""
    self._replace_param_with_raw_if_needed()
    with torch.autograd.profiler.record_function("CustomFSDP.forward"):
        return self.module(*inputs, **kwargs)


_sharded_param_state_fsdp_dtensor = DistributedOptimizer.sharded_param_state_fsdp_dtensor


def _every_parameters_state(self, is_loading: bool = False):
    """megatron-core's, with Adam's state for every parameter, in the order of the parameter groups."""
    if is_loading:
        self._init_optimizer_states_with_dummy_values()
    adam = self.optimizer
    steps = [float(state["step"]) for state in adam.state.values() if "step" in state]
    step = torch.tensor([max(steps, default=0.0)], device="cuda" if torch.cuda.is_available() else "cpu")
    dist.all_reduce(step, op=dist.ReduceOp.MAX)  # a rank may hold no state at all
    step = step.cpu()  # torch's Adam keeps its step counts on the CPU
    ordered = defaultdict(dict)
    for group in adam.param_groups:
        for param in group["params"]:
            state = adam.state[param]
            if "exp_avg" not in state:
                state.update(step=step[0].clone(), exp_avg=torch.zeros_like(param),
                             exp_avg_sq=torch.zeros_like(param))
            ordered[param] = state
    adam.state = ordered
    return _sharded_param_state_fsdp_dtensor(self, is_loading=False)


class _Installed:
    """A not-distributed gradient buffer's shard, into which `+=` installs the reduced shard (in the reduction's
    stream, where megatron-core adds it)."""

    def __init__(self, shard: torch.Tensor):
        self.shard = shard

    def __iadd__(self, reduced: torch.Tensor):
        self.shard.copy_(reduced)
        return self


def _reduced_once(reduce):
    """megatron-core's `GradReducePipeline._bucket_group_gradient_reduce`, whose reduced shard replaces the
    gradient buffer's where the buffer is the bucket reduced (not distributed), rather than being added to it."""

    @functools.wraps(reduce)
    def _bucket_group_gradient_reduce(self, bucket_group, *args, **kwargs):
        if self.buffer.ddp_config.data_parallel_sharding_strategy == "no_shard":
            return reduce(self, bucket_group, *args, **kwargs)
        whole = [buffer for buffer in map(self.get_fsdp_buffer, bucket_group) if not buffer.is_data_distributed]
        for buffer in whole:
            buffer.get_shard_from_local_buffer = functools.partial(_Installed, buffer.get_shard_from_local_buffer())
        try:
            return reduce(self, bucket_group, *args, **kwargs)
        finally:
            for buffer in whole:
                del buffer.get_shard_from_local_buffer  # the class's method again

    return _bucket_group_gradient_reduce


_gradient_reduce_preprocessing = param_and_grad_buffer.gradient_reduce_preprocessing


def _present_grads_unscaled(collect):
    @functools.wraps(collect)
    def _collect_main_grad_data_for_unscaling(self):
        if not self.ddp_config.use_megatron_fsdp:
            return collect(self)
        grads = (param.grad for group in self.optimizer.param_groups for param in group["params"])
        return [grad.to_local() if isinstance(grad, DTensor) else grad for grad in grads if grad is not None]

    return _collect_main_grad_data_for_unscaling


def _premultiplied(grad_data, scaling_factor, ddp_config):
    """megatron-core's `gradient_reduce_preprocessing`, with the fused division's PREMUL_SUM done as its
    multiplication and a SUM (gloo)."""
    if scaling_factor is None or ddp_config.average_in_collective:
        return _gradient_reduce_preprocessing(grad_data, scaling_factor, ddp_config)
    grad_data.mul_(scaling_factor)
    return dist.ReduceOp.SUM



def _unsharded(ddp_config) -> bool:
    return ddp_config.use_megatron_fsdp and ddp_config.data_parallel_sharding_strategy == "no_shard"


def _replicas_counted_once(get_group):
    """megatron-core's `DistributedOptimizer.get_grad_stats_parallel_group`, over the model-parallel group for
    Megatron-FSDP's no_shard."""

    @functools.wraps(get_group)
    def get_grad_stats_parallel_group(self):
        ddp_config = getattr(self, "ddp_config", None)
        if ddp_config is not None and _unsharded(ddp_config):
            return parallel_state.get_model_parallel_group()
        return get_group(self)

    return get_grad_stats_parallel_group


@torch.no_grad()
def _all_reduced(self, async_op: bool = False):
    """megatron-core's `ParamAndGradBuffer.all_reduce_gradients`, reducing the buffers there are."""
    handles = []
    for group in self.parameter_groups:
        buffer = group.main_grad_buffer
        if buffer is None:
            continue
        reduce_op = param_and_grad_buffer.gradient_reduce_preprocessing(buffer.data, buffer.gradient_scaling_factor,
                                                                         self.ddp_config)
        handles.append(dist.all_reduce(buffer.data, op=reduce_op, group=buffer.data_parallel_group,
                                       async_op=async_op))
    for handle in handles if async_op else ():
        handle.wait()


def _over_the_instances_too(reduce):
    """megatron-core's `ParamAndGradBuffer.reduce_scatter_gradients` (optim) or `all_reduce_gradients` (no_shard),
    then under hybrid sharding an all-reduce over the outer group of what the optimizer steps with (this rank's
    shard, or the whole gradient under no_shard), with the outer reduction's op of the backward hook's."""

    @functools.wraps(reduce)
    def reduce_over_the_instances_too(self, *args, **kwargs):
        reduce(self, *args, **kwargs)
        outer = self.dist_index.get_outer_fsdp_group()
        if outer is None:
            return
        whole = self.ddp_config.data_parallel_sharding_strategy == "no_shard"
        op = dist.ReduceOp.AVG if self.ddp_config.average_in_collective else dist.ReduceOp.SUM
        for group in self.parameter_groups:
            buffer = group.main_grad_buffer
            if buffer is not None:
                dist.all_reduce(buffer.data if whole else buffer.get_shard_from_local_buffer(), op=op, group=outer)

    return reduce_over_the_instances_too


def _replicated_everywhere(spec):
    """megatron-core's `_get_fsdp_tensor_spec`, with Replicate on every dimension of the mesh of a replicated
    parameter (no_shard's), where under hybrid sharding it gives one Replicate for the 2-D mesh."""

    @functools.wraps(spec)
    def _get_fsdp_tensor_spec(*args, **kwargs):
        mesh, placements = spec(*args, **kwargs)
        return mesh, list(placements) + [Replicate()] * (mesh.ndim - len(placements))

    return _get_fsdp_tensor_spec


def _whole_slices(init_named_parameters):
    """megatron-core's `ParamAndGradBuffer._init_optimizer_named_parameters`, with `megatron_fsdp_slice` on the
    parameters it leaves without one (no_shard's without a buffer): the whole of each (this tensor-parallel rank's)."""

    @functools.wraps(init_named_parameters)
    def _init_optimizer_named_parameters(self):
        named_parameters = init_named_parameters(self)
        for _, param in named_parameters:
            if not hasattr(param, "megatron_fsdp_slice"):
                param.megatron_fsdp_slice = slice(0, param.orig_param.numel())
        return named_parameters

    return _init_optimizer_named_parameters


def handle_swiglu_in_state_dict(model, model_state_dict, optimizer_state_dict):
    """megatron-core's `fsdp_dtensor_checkpoint.handle_swiglu_in_state_dict` (fc1's weight and its Adam state as
    their halves W and V), whose halves of no_shard's replicated weights are replicated DTensors too."""
    split = fsdp_dtensor_checkpoint.handle_swiglu_in_state_dict
    if not _unsharded(model.ddp_config):
        return split(model, model_state_dict, optimizer_state_dict)
    make = fsdp_dtensor_checkpoint.make_fsdp_dtensor

    def replicated(*args, **kwargs):
        return make(*args, **{**kwargs, "is_sharded_param": False, "update_uneven_dtensor_chunk_meta": False})

    fsdp_dtensor_checkpoint.make_fsdp_dtensor = replicated
    try:
        return split(model, model_state_dict, optimizer_state_dict)
    finally:
        fsdp_dtensor_checkpoint.make_fsdp_dtensor = make


def _nothing_to_gather(start_param_sync):
    """megatron-core's `MegatronFSDP.start_param_sync`, which gathers nothing under no_shard (upstream's)."""

    @functools.wraps(start_param_sync)
    def _start_param_sync(self, *args, **kwargs):
        if self.data_parallel_sharding_strategy == "no_shard":
            self._replace_param_with_raw_if_needed()
            return None
        return start_param_sync(self, *args, **kwargs)

    return _start_param_sync


def _gathered_at_once(gather):
    """megatron-core's `AllGatherPipeline.async_bucket_gather`, waiting for the all-gather it starts."""

    @functools.wraps(gather)
    def async_bucket_gather(self, bucket_id, bwd):
        gather(self, bucket_id, bwd)
        started = self.param_gather_event_map.get(self.get_bucket_key(bucket_id, bwd))
        # Inside a coalescing manager the work is a placeholder: the manager's exit waits for it.
        if started is not None and not isinstance(started[0], distributed_c10d._IllegalWork):
            started[0].wait()

    return async_bucket_gather


class _NoTELinear:
    """Transformer Engine's linear layer where it is not installed: no module is one."""


def install() -> None:
    """Apply the workarounds once per process (the CPU ones only without CUDA)."""
    global _installed
    if _installed:
        return
    _installed = True
    DistributedOptimizer.sharded_param_state_fsdp_dtensor = _every_parameters_state
    DistributedOptimizer._collect_main_grad_data_for_unscaling = _present_grads_unscaled(
        DistributedOptimizer._collect_main_grad_data_for_unscaling)
    megatron_fsdp.MegatronFSDP.forward = _forward_through_hooks
    megatron_fsdp.MegatronFSDP.start_param_sync = _nothing_to_gather(megatron_fsdp.MegatronFSDP.start_param_sync)
    DistributedOptimizer.get_grad_stats_parallel_group = _replicas_counted_once(
        DistributedOptimizer.get_grad_stats_parallel_group)
    buffer = param_and_grad_buffer.ParamAndGradBuffer
    buffer.all_reduce_gradients = _over_the_instances_too(_all_reduced)
    buffer.reduce_scatter_gradients = _over_the_instances_too(buffer.reduce_scatter_gradients)
    param_and_grad_buffer._get_fsdp_tensor_spec = _replicated_everywhere(param_and_grad_buffer._get_fsdp_tensor_spec)
    buffer._init_optimizer_named_parameters = _whole_slices(buffer._init_optimizer_named_parameters)
    if not isinstance(adapter.TELinear, type):
        adapter.TELinear = _NoTELinear
    pipeline = param_and_grad_buffer.GradReducePipeline
    pipeline._bucket_group_gradient_reduce = _reduced_once(pipeline._bucket_group_gradient_reduce)
    # Its classes (megatron-core's, when None is given) as a default: every module's `unwrap_model` is this function.
    utils.unwrap_model.__defaults__ = ((DistributedDataParallel, TorchFullyShardedDataParallel,
                                        adapter.FullyShardedDataParallel, megatron_fsdp.MegatronFSDP,
                                        Float16Module),)
    if torch.cuda.is_available():
        return
    adapter.FullyShardedDataParallel.__init__ = _adapter_on_the_cpu(adapter.FullyShardedDataParallel.__init__)
    megatron_fsdp.MegatronFSDP.__init__ = _cuda_index_while_built(megatron_fsdp.MegatronFSDP.__init__)
    megatron_fsdp.logger.addFilter(_NotTheCudaDevice())
    torch.cuda.Stream = _Stream
    torch.cuda.current_stream = lambda device=None: _Stream()
    torch.cuda.default_stream = lambda device=None: _Stream()
    param_and_grad_buffer.gradient_reduce_preprocessing = _premultiplied
    gathers = param_and_grad_buffer.AllGatherPipeline
    gathers.async_bucket_gather = _gathered_at_once(gathers.async_bucket_gather)
