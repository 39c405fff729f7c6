"""The patches of megatron-core (0.16.1) objects that angpt applies in every process, by `install()`, which
`angpt.training.distributed.initialize` calls before anything is built. The table of `angpt.megatron_compat` says what
breaks without each."""

from __future__ import annotations

import functools
import logging

import megatron.core
import torch
from megatron.core.datasets.gpt_dataset import GPTDataset
from megatron.core.dist_checkpointing.optimizer import (
    get_param_id_to_sharded_param_map,
    make_sharded_optimizer_tensor,
    optim_state_to_sharding_state,
)
from megatron.core.dist_checkpointing.strategies import filesystem_async
from megatron.core.dist_checkpointing.strategies.async_utils import PersistentAsyncCaller
from megatron.core.full_cuda_graph import FullCudaGraphWrapper, StaticBufferLoader
from megatron.core.models.common.embeddings import rope_utils
from megatron.core.optimizer import clip_grads
from megatron.core.optimizer.distrib_optimizer import HAVE_APEX_OR_TE, DistributedOptimizer
from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params
from megatron.core.tensor_parallel import random as mp_random
from megatron.core.transformer import cuda_graphs
from megatron.core.utils import local_multi_tensor_l2_norm

from angpt.config.sections import EXIT_SIGNALS
from angpt.megatron_compat import (
    WRITTEN_FOR,
    checkpoint_unpickling,
    cpu,
    fsdp2,
    parent_watch,
    results_queue,
    wgrad_fusion,
)
from angpt.models.attention import fused_rotary_pos_emb

logger = logging.getLogger("angpt.megatron_compat")
_installed = False


def install() -> None:
    """Apply every patch once per process (the CPU adapter only without CUDA)."""
    global _installed
    if _installed:
        return
    _installed = True
    check_version(megatron.core.__version__)
    cpu.enable()
    logging.getLogger("megatron.core.transformer.transformer_layer").addFilter(_OwnMLPFilter())
    filesystem_async._get_write_results_queue = _results_queue_that_outlives_exit_signals
    checkpoint_unpickling.install()
    fsdp2.install()
    parent_watch.install()
    wgrad_fusion.install()
    PersistentAsyncCaller.async_loop = staticmethod(cpu.persistent_writer_loop)
    if not HAVE_APEX_OR_TE:
        _load_only_checkpointed_states()
    Float16OptimizerWithFloat16Params.sharded_state_dict = float16_optimizer_sharded_state_dict
    Float16OptimizerWithFloat16Params.load_state_dict = main_params_by_group(
        Float16OptimizerWithFloat16Params.load_state_dict)
    DistributedOptimizer.sharded_state_dict = saved_from_adams_start(DistributedOptimizer.sharded_state_dict)
    if clip_grads.l2_norm_impl is local_multi_tensor_l2_norm:
        clip_grads.l2_norm_impl = foreach_l2_norm
        clip_grads.multi_tensor_scale_impl = foreach_scale
    if rope_utils.fused_apply_rotary_pos_emb is None:  # Transformer Engine's, where it is installed
        rope_utils.fused_apply_rotary_pos_emb = fused_rotary_pos_emb
    cuda_graphs.TensorReusePool.insert = _insert_unless_saved_for_backward
    GPTDataset.__getitem__ = _loss_mask_cached_unmasked(GPTDataset.__getitem__)
    if not mp_random.HAVE_TE:
        mp_random.CheckpointWithoutOutput.__init__ = _checkpoint_without_output_without_fp8(
            mp_random.CheckpointWithoutOutput.__init__)


def _loss_mask_cached_unmasked(getitem):
    """GPTDataset caches the first sample's loss mask where it is the same for every sample (no --eod-mask-loss, no
    resets: all ones), then masks that very tensor at the first sample's pad labels; every later sample starts from the
    cache. Cached whole here, as a fresh one is."""
    @functools.wraps(getitem)
    def first_sample_apart(self, idx):
        caching = self.masks_and_position_ids_are_cacheable and not self.masks_and_position_ids_are_cached
        sample = getitem(self, idx)
        if caching:
            self.cached_loss_mask = torch.ones_like(self.cached_loss_mask)
        return sample
    return first_sample_apart


def _checkpoint_without_output_without_fp8(init):
    """CheckpointWithoutOutput's `fp8 is not None` makes its default fp8=False mean FP8, deliberately upstream
    (Transformer Engine then books FP8 scales); without Transformer Engine there is no FP8, and that path
    raises NameError (FP8GlobalStateManager), so GPT+'s `layernorm` recompute would fail."""

    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.fp8 = False

    return __init__


def check_version(installed: str) -> bool:
    """Whether `installed` is the megatron-core the workarounds were written for; a warning says so if not."""
    if installed == WRITTEN_FOR:
        return True
    logger.warning("angpt's megatron-core workarounds (angpt/megatron_compat) were written for megatron-core %s, "
                   "and %s is installed: check them with `make test`", WRITTEN_FOR, installed)
    return False


class _OwnMLPFilter(logging.Filter):
    """TransformerLayer warns "Unknown MLP type" for every MLP class but its own; ScaledSwiGLUMLP is an
    MLP and takes the same tensor-parallel group by default."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Unknown MLP type" not in record.getMessage()


def _results_queue_that_outlives_exit_signals():
    """megatron-core 0.16's `filesystem_async._get_write_results_queue`, served by a Manager that outlives the
    exit signals and not its process, and imports nothing to pass the results (`results_queue`)."""
    if filesystem_async._results_queue is None:
        _, filesystem_async._results_queue = results_queue.start(EXIT_SIGNALS)
    return filesystem_async._results_queue


def foreach_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """megatron-core's `local_multi_tensor_l2_norm` (its stand-in for apex's multi_tensor_l2norm, which the
    grad norm of every step goes through) without its host syncs: it gathers the per-tensor norms with
    `torch.tensor(list of device scalars)`, one `.item()` per gradient, 195 a step for GPT+ on a GPU, then
    one more for `float()`. Here the norms stay on the device: one 1-element fp32 tensor, as megatron's, which
    `get_grad_norm_fp32` then squares, all-reduces over its own group and reads with its one `.item()`."""
    norms = torch._foreach_norm(tensor_lists[0], dtype=torch.float32)
    return torch.linalg.vector_norm(torch.stack(norms)).reshape(1), None


def foreach_scale(chunk_size, noop_flag, tensor_lists, scale):
    """megatron-core's `local_multi_tensor_scale` (dst = src * scale; clipping calls it with dst = src) in
    one foreach kernel launch per dtype and device, instead of a multiply and a copy per gradient."""
    sources, targets = tensor_lists
    if sources is not targets:
        torch._foreach_copy_(targets, sources)
    torch._foreach_mul_(targets, scale)


def prepare_optimizer_for_loading(optimizer) -> None:
    """megatron-core's distributed optimizer over torch's Adam (no apex or Transformer Engine) can only
    build its sharded state dict for loading once Adam's state exists: create it with dummy values,
    which the load then overwrites."""
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        if isinstance(inner, DistributedOptimizer) and not inner.optimizer.state:
            inner._init_optimizer_states_with_dummy_values()


def _load_only_checkpointed_states() -> None:
    """With torch's Adam, the distributed optimizer's "fully_reshardable" load copies every key of
    Adam's per-parameter state from the checkpoint, but the checkpoint stores `step` once, in the
    parameter groups (KeyError: 'step'). Copy the keys the checkpoint has; `unshare_adam_steps` then
    fixes the steps."""
    original = DistributedOptimizer._set_main_param_and_optimizer_states

    @torch.no_grad()
    def set_states(self, model_param, tensors):
        if self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            return original(self, model_param, tensors)
        group_index, group_order = self.model_param_group_index_map[model_param]
        main_param = self.optimizer.param_groups[group_index]["params"][group_order]
        for key, target in {"param": main_param, **self.optimizer.state[main_param]}.items():
            if key in tensors:
                target.copy_(tensors[key])

    DistributedOptimizer._set_main_param_and_optimizer_states = set_states


# megatron-core's, which install() replaces: the tests show what fails without the replacement.
_float16_optimizer_sharded_state_dict = Float16OptimizerWithFloat16Params.sharded_state_dict


def float16_optimizer_sharded_state_dict(self, model_sharded_state_dict, is_loading: bool = False, metadata=None):
    """megatron-core 0.16.1's `Float16OptimizerWithFloat16Params.sharded_state_dict` (the 16-bit optimizer without
    --use-distributed-optimizer), with the optimizer state's ids mapped to the model's parameters in the inner
    optimizer's order, fp32 parameters included (as Megatron-LM's later fix, NVIDIA/Megatron-LM#5929, maps them).
    megatron-core numbers only the 16-bit parameters, while torch numbers the state by every parameter of every
    group: the fp32 learnable scales of anGPT and nGPT in a bf16 or fp16 model raised "Param id 10 does not match
    any model sharded param" at every save, and a group mixing both dtypes would have had its states matched to
    other parameters (megatron-core also pairs the fp32 main copies with the group's ids by position). The main
    copies are keyed by group (`main_params_by_group`). The saved keys are megatron-core's.

    Before Adam's first applied step (fp16's dynamic loss scale skips the first ones) it has no state, and a load,
    which asks for every moment, failed on the checkpoint (KeyError: optimizer.state.exp_avg...): saved instead are
    the zero moments and step 0 Adam starts from, which it then creates at its first step as before."""
    before_first_step = not is_loading and not self.optimizer.state
    if is_loading or before_first_step:
        self.init_state_fn(self.optimizer, self.config)
    state_dict = self.state_dict()
    if before_first_step:
        self.optimizer.state.clear()  # the saved state holds the zeros
    model_param_of = {id(main): model for models, mains in zip(self.float16_groups, self.fp32_from_float16_groups)
                      for model, main in zip(models, mains)}
    in_state_order = [param for group in self.optimizer.param_groups for param in group["params"]]
    id_to_sharded_param_map = get_param_id_to_sharded_param_map(
        model_sharded_state_dict, (model_param_of.get(id(param), param) for param in in_state_order))
    state_id = {id(param): i for i, param in enumerate(in_state_order)}
    state_dict["fp32_from_fp16_params"] = {
        group: [make_sharded_optimizer_tensor(id_to_sharded_param_map[state_id[id(main)]], main,
                                              prefix="optimizer.state.fp32_param") for main in mains]
        for group, mains in enumerate(self.fp32_from_float16_groups)
    }
    step = torch.tensor(0.0) if before_first_step else self._extract_common_per_param_step(state_dict["optimizer"])
    # torch's per-parameter step is saved once, as megatron-core saves it.
    optim_state_to_sharding_state(state_dict["optimizer"], id_to_sharded_param_map, exclude_keys="step")
    if step is not None:
        state_dict["optimizer"]["state"]["common_step"] = step
    return state_dict


def main_params_by_group(load_state_dict):
    """megatron-core 0.16.1's `Float16OptimizerWithFloat16Params.load_state_dict`, taking the main copies keyed by
    group (`float16_optimizer_sharded_state_dict`) as megatron-core's list. Distributed checkpointing splits a list
    into its sharded items and the rest, renumbering both from 0: the empty list of the group without 16-bit
    weights (anGPT's and nGPT's fp32 scales, group 1) came back at position 0, where the load merged it with group
    0's main copies, and every load raised "Cannot merge two lists with different lengths"."""

    @functools.wraps(load_state_dict)
    def load(self, state_dict):
        mains = state_dict.get("fp32_from_fp16_params")
        if isinstance(mains, dict):
            state_dict = {**state_dict, "fp32_from_fp16_params": [mains[group] for group in range(len(mains))]}
        return load_state_dict(self, state_dict)

    return load


def saved_from_adams_start(sharded_state_dict):
    """megatron-core 0.16.1's `DistributedOptimizer.sharded_state_dict`, able to save before Adam's first applied step
    (fp16's dynamic loss scale, 2^32 by default, skips the first ones). Adam has no state then: with torch's Adam the
    save raised AssertionError (`assert len(steps) == 1`: it reads the step from each parameter's state), and the
    gathered optimizer state reads every moment. Saved instead, as `float16_optimizer_sharded_state_dict` saves them,
    are the zero moments (megatron-core's `init_state_fn`) and step 0 Adam starts from; it still creates its own at
    its first applied step."""

    @functools.wraps(sharded_state_dict)
    def sharded(self, model_sharded_state_dict, is_loading: bool = False, *args, **kwargs):
        if is_loading or self.optimizer.state:
            return sharded_state_dict(self, model_sharded_state_dict, is_loading, *args, **kwargs)
        self.init_state_fn(self.optimizer, self.config)
        if not HAVE_APEX_OR_TE:  # torch's Adam counts its steps per parameter; the fused ones per group
            for state in self.optimizer.state.values():
                state["step"] = torch.tensor(0.0)
        state_dict = sharded_state_dict(self, model_sharded_state_dict, is_loading, *args, **kwargs)
        self.optimizer.state.clear()  # the live optimizer as it was; the saved state keeps the zeros
        return state_dict

    return sharded


def mark_decoupled_lr_groups(optimizer, max_lr: float, min_lr: float) -> None:
    """megatron-core 0.16 gives the --decoupled-lr parameters a group of their own (its max_lr and min_lr) but
    leaves its `is_decoupled_lr` False; a load matches saved groups to the optimizer's by (wd_mult, lr_mult,
    is_expert_parallel, is_decoupled_lr) and took that group for the other weights' (a resumed run's steps
    differed; the plain optimizer refused the load). Marked here, so that each group loads its own state."""
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        for group in inner.param_groups:
            if (group.get("max_lr"), group.get("min_lr")) == (max_lr, min_lr):
                group["is_decoupled_lr"] = True


def unshare_adam_steps(optimizer) -> None:
    """The distributed optimizer restores torch Adam's per-parameter `step` as one tensor shared by
    every parameter, which Adam then increments once per parameter per step (bias correction would
    restart in earnest): give each parameter its own copy."""
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        for state in inner.optimizer.state.values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()


_pool_insert = cuda_graphs.TensorReusePool.insert


def _insert_unless_saved_for_backward(pool, tensor: torch.Tensor) -> None:
    """megatron-core 0.16.1's TensorReusePool.insert, except for a forward graph's own input buffer (the first
    layer's: later layers read the previous graph's output buffer) captured with gradients on. megatron-core
    returns that buffer to the pool once the forward graph is captured, and the backward graphs captured after
    it take it as a gradient buffer: replaying the last layer's backward then overwrote the first layer's
    input before the first layer's backward read it (for its weight gradients, and for its norm's input
    gradient). On an H200 the first replayed step had eager's loss but wrong gradients in every family:
    layer 0's W_qkv gradient for anGPT (no pre-norm: its input gradient stayed right), the embedding's for
    GPT+ (its RMSNorm's backward reads the input). Such a buffer is marked `can_skip_replay_copy = False`
    (it is copied into at each replay); gradient buffers are not marked."""
    if getattr(tensor, "can_skip_replay_copy", None) is False and torch.is_grad_enabled():
        return
    _pool_insert(pool, tensor)


def delete_cuda_graphs(model_chunks) -> None:
    """Free megatron-core's local CUDA graphs of these model chunks (and of the whole iteration), for another
    micro-batch shape (the graphs are captured for one) or another model in the same process. megatron-core's
    `delete_cuda_graphs` keeps each layer's runners, whose graph inputs and outputs match any later call of the
    same shape, and the buffer pool's strong references to every input and output buffer: a process that builds
    several graphed models ran out of memory on their graphs' leftovers (the benchmark, on an H200). Nothing more
    to do for chunks built without layer graphs."""
    # --cuda-graph-scope full_iteration's graphs, their outputs, step counts and input buffers: class attributes
    # of megatron-core's, for the process (a later run would replay this one's graph).
    FullCudaGraphWrapper.cuda_graph = {"training": None, "validation": None}
    FullCudaGraphWrapper.result = {"training": None, "validation": None}
    FullCudaGraphWrapper.curr_iteration = {"training": 0, "validation": 0}
    StaticBufferLoader.static_buffers = {"training": [], "validation": []}
    managers = [module.cudagraph_manager for chunk in model_chunks for module in chunk.modules()
                if hasattr(module, "cudagraph_manager")]
    if not managers:
        return
    cuda_graphs.delete_cuda_graphs()
    for manager in managers:
        manager.cudagraph_runners = []
    pool = cuda_graphs._CudagraphGlobalRecord.tensor_reuse_pool
    pool.tensor_strong_refs.clear()
    pool.tensor_strong_refs_dataptrs.clear()
    pool.pool.clear()
    torch.cuda.empty_cache()
