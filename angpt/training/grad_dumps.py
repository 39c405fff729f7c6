"""--save-wgrads-interval and --save-dgrads-interval (Megatron-LM's train_step, its checkpointing.save_grads and
dgrad_logging, which megatron-core lacks): every so many iterations, the weights' reduced gradients (main_grad,
before clipping) or the gradients of each linear and embedding layer's inputs and outputs (the last micro-batch's),
saved as Megatron-LM saves them: <save>/{wgrads,dgrads}/iter_XXXXXXX/mp_rank_TT[_PPP][_EEE].pth, a dict
{"model_chunk<i>": {name: tensor on the CPU}}, written by each expert-data-parallel rank 0 (data-parallel rank 0 of
a dense model). The weights' gradients are all-reduced in those iterations, not reduce-scattered (megatron-core's
force_all_reduce), so that every rank of the distributed optimizer holds them whole.
"""

from __future__ import annotations

import logging
import os
from collections import defaultdict
from contextlib import contextmanager

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.utils import unwrap_model

logger = logging.getLogger("angpt.grad_dumps")


def _linear_types() -> tuple[type, ...]:
    """Megatron-LM's: the layers whose gradients --save-dgrads-interval saves, Transformer Engine's where it is
    installed."""
    types = [torch.nn.Linear, torch.nn.Embedding, ColumnParallelLinear, RowParallelLinear]
    try:
        from megatron.core.extensions import transformer_engine as te  # noqa: PLC0415 (optional dependency)
    except ImportError:
        return tuple(types)
    names = ("TELinear", "TEColumnParallelLinear", "TERowParallelLinear", "TELayerNormColumnParallelLinear",
             "TEGroupedLinear", "TEColumnParallelGroupedLinear", "TERowParallelGroupedLinear")
    types.extend(layer for layer in (getattr(te, name, None) for name in names) if isinstance(layer, type))
    return tuple(types)


def save_grads(save_dir: str, state_dict: dict, iteration: int, label: str) -> None:
    """Megatron-LM's save_grads: `state_dict` to <save_dir>/<label>/iter_XXXXXXX/mp_rank_TT[_PPP][_EEE].pth from each
    expert-data-parallel rank 0."""
    if parallel_state.get_expert_data_parallel_rank() == 0:
        directory = os.path.join(save_dir, label, f"iter_{iteration:07d}")
        os.makedirs(directory, exist_ok=True)
        name = f"mp_rank_{parallel_state.get_tensor_model_parallel_rank():02d}"
        if parallel_state.get_pipeline_model_parallel_world_size() > 1:
            name += f"_{parallel_state.get_pipeline_model_parallel_rank():03d}"
        if parallel_state.get_expert_model_parallel_world_size() > 1:
            name += f"_{parallel_state.get_expert_model_parallel_rank():03d}"
        torch.save(dict(state_dict), os.path.join(directory, f"{name}.pth"))
    if dist.get_rank() == 0:
        logger.info("iteration %d: %s saved in %s", iteration, label, os.path.join(save_dir, label))


class GradDumps:
    """What one iteration saves (`wgrads`, `dgrads`: whether it saves them), around its forward-backward passes."""

    def __init__(self, save_dir: str, iteration: int, wgrads: bool, dgrads: bool):
        self.save_dir, self.iteration, self.wgrads, self.dgrads = save_dir, iteration, wgrads, dgrads

    @contextmanager
    def forward_backward(self, model_chunks):
        """Around one run of the forward-backward passes: the gradients all-reduced for `wgrads`; for `dgrads`,
        backward hooks on the linear and embedding layers, whose gradients (the last micro-batch's) are saved
        after."""
        for chunk in model_chunks:
            chunk.force_all_reduce = self.wgrads  # read by megatron-core's DDP in its overlapped reduction
        captured, hooks = defaultdict(dict), []
        if self.dgrads:
            types = _linear_types()
            for index, chunk in enumerate(model_chunks):
                for module_name, module in unwrap_model(chunk).named_modules():
                    if isinstance(module, types):
                        hooks.append(module.register_full_backward_hook(
                            _capture(captured[f"model_chunk{index}"], module_name)))
        try:
            yield
        finally:
            for hook in hooks:
                hook.remove()
            for chunk in model_chunks:
                chunk.force_all_reduce = False
        if self.dgrads and captured:
            save_grads(self.save_dir, captured, self.iteration, "dgrads")

    def save_wgrads(self, model_chunks) -> None:
        """The weights' main_grad, reduced and not yet clipped (before the optimizer's step)."""
        if not self.wgrads:
            return
        state_dict = defaultdict(dict)
        for index, chunk in enumerate(model_chunks):
            for name, param in unwrap_model(chunk).named_parameters():
                if getattr(param, "main_grad", None) is not None:
                    state_dict[f"model_chunk{index}"][name] = param.main_grad.cpu()
        save_grads(self.save_dir, state_dict, self.iteration, "wgrads")


def _capture(into: dict, module_name: str):
    def hook(_module, grad_input, grad_output):
        for kind, grads in (("output", grad_output), ("input", grad_input)):
            for index, grad in enumerate(grads):
                if grad is not None:
                    into[f"{module_name}/{kind}{index}"] = grad.detach().cpu()
    return hook
