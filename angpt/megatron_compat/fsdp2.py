"""megatron-core 0.16.1's FSDP2 (`TorchFullyShardedDataParallel`, Megatron-LM's --use-torch-fsdp2), made to train
angpt's models; each workaround says what breaks without it.

- On a machine without CUDA, its device mesh is the CPU's: it builds `DeviceMesh.from_group(group, "cuda")`, and
  fully_shard then asks CUDA for the device ("Torch not compiled with CUDA enabled", a TypeError under the CPU
  adapter's `current_device`).
- `finish_grad_sync` takes megatron-core's own argument: `finalize_model_grads` calls
  `finish_grad_sync(force_all_reduce=...)`, which FSDP2's inherited method does not take (a TypeError at the first
  step, on GPUs too: NVIDIA/Megatron-LM#4669, fixed after 0.16.1). FSDP2 reduce-scatters the gradients in its own
  backward hooks: there is nothing left to finish.
- The optimizer's checkpoint finds each parameter's state by the identity of its local shard: megatron-core takes
  `param.to_local()` on the optimizer's side and `param._local_tensor` on the model's. Since torch 2.13 (gh-166156)
  `to_local()` of a parameter returns a new view, so no parameter matches ("Param id 0 does not match any model
  sharded param" at the first save).
- The optimizer's state loads as local tensors: megatron-core's FP32Optimizer hands torch's `load_state_dict` the
  shards it read, and Adam then mixes them with DTensor gradients (a RuntimeError at the first step after a resume).
  `place_loaded_states` places them as their parameters are.
- A gated MLP's fc1 weight [W; V] is checkpointed by megatron-core's swiglu factory, which cuts each rank's part in
  two halves, taking it for a tensor-parallel shard holding rows of both W and V. An FSDP2 shard holds a run of
  [W; V]'s rows (rank 0 of 2 all of W): the halves went to the wrong rows of the saved weight, so an FSDP2
  checkpoint loaded under DDP (or DDP's under FSDP2) swapped rows of W and V. Without tensor parallelism the weight
  is [W; V] as it is, and an FSDP2 shard is saved at its own rows.
"""

from __future__ import annotations

import megatron.core.dist_checkpointing.optimizer as optimizer_checkpoint
import megatron.core.distributed.torch_fully_sharded_data_parallel as torch_fsdp
import megatron.core.transformer.mlp as megatron_mlp
import torch
from megatron.core import parallel_state
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor


class _DeviceMeshOnThisDevice:
    """megatron-core's `DeviceMesh`, with "cuda" meaning the CPU where there is no CUDA."""

    @staticmethod
    def from_group(group, device_type, *args, **kwargs):
        if device_type == "cuda" and not torch.cuda.is_available():
            device_type = "cpu"
        return DeviceMesh.from_group(group, device_type, *args, **kwargs)


def _finish_grad_sync(self, force_all_reduce: bool = False) -> None:
    """FSDP2 reduce-scattered the gradients in its backward hooks."""


def _local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor a DTensor holds on this rank, itself (not a view), or the tensor."""
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def place_loaded_states(optimizer) -> None:
    """Each loaded state tensor of an FSDP2 parameter (Adam's moments; not its step count), a DTensor sharded as
    the parameter is."""
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        for param, state in inner.optimizer.state.items():
            if not isinstance(param, DTensor):
                continue
            for key, value in state.items():
                if key != "step" and isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
                    state[key] = DTensor.from_local(value, param.device_mesh, param.placements, shape=param.shape,
                                                    stride=param.stride())


_swiglu_sharded_factory = megatron_mlp.apply_swiglu_sharded_factory


def _swiglu_sharded_factory_but_for_fsdp2_shards(original_sh_ten, sharded_offsets, *args, **kwargs):
    """megatron-core's factory, except for an FSDP2 shard without tensor parallelism (its rows cut over the
    data-parallel ranks), which is saved as it is."""
    if (parallel_state.get_tensor_model_parallel_world_size() == 1
            and original_sh_ten.axis_fragmentations[len(sharded_offsets)] > 1):
        return original_sh_ten
    return _swiglu_sharded_factory(original_sh_ten, sharded_offsets, *args, **kwargs)


def install() -> None:
    megatron_mlp.apply_swiglu_sharded_factory = _swiglu_sharded_factory_but_for_fsdp2_shards
    optimizer_checkpoint.to_local_if_dtensor = _local_shard
    torch_fsdp.DeviceMesh = _DeviceMeshOnThisDevice
    torch_fsdp.TorchFullyShardedDataParallel.finish_grad_sync = _finish_grad_sync
