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
  `place_loaded_states` places them as their parameters are; the 16-bit optimizer's fp32 weights likewise (their
  copy into the DTensors raised a RuntimeError in the load).
- A gated MLP's fc1 weight [W; V] is checkpointed by megatron-core's swiglu factory, which cuts each rank's part in
  two halves, taking it for a tensor-parallel shard holding rows of both W and V. An FSDP2 shard holds a run of
  the rows of the tensor-parallel part [W_t; V_t] (rank 0 of 2 all of W_t): the halves went to the wrong rows of
  the saved weight, so an FSDP2 checkpoint loaded under DDP (or DDP's under FSDP2) swapped rows of W and V.
  `place_shards` saves the shard's rows of W_t and of V_t each at its rows of [W; V].
- megatron-core describes an FSDP2 shard as the rank's equal part of the rows (local rows x data-parallel size),
  which FSDP2's shards are only when the rows divide: 256 rows over 3 ranks are 86, 86 and 84, and the save
  stopped in an AssertionError on a global shape of 258. `place_shards` gives such a shard its true rows
  (megatron-core's irregular sharding, which torch's checkpoint validates) without tensor parallelism, and is
  refused with it. A weight with fewer rows than ranks is not saved: megatron-core saves it gathered whole, which
  the optimizer's state then matches no parameter of (a ValueError at the first save), and torch's checkpoint
  cannot write the empty shards it leaves (an IndexError in its planner); `fewer_rows_than_ranks` names such
  weights, for a refusal at the start.
- Under --bf16 a layer holds bf16 weights and fp32 learnable scales (angpt.models.scales), and FSDP2 gathers a
  unit's weights as one tensor of one dtype ("FSDP expects uniform original parameter dtype" at the first forward).
  `_fully_shard_scales_first` makes each scale of such a unit a unit of its own before the unit: tiny, and kept
  gathered from its forward to its backward, since the layers take the scale's tensor itself (`surrogate`, made an
  FSDP2 forward method) and use it after that method returns. megatron-core's 16-bit optimizer then takes an fp32
  parameter's gradient from the DDP buffer's `main_grad`, which FSDP2's parameters have none of (an AttributeError
  at the first step): `_copy_model_grads_of_shards` lends them their own `.grad` as one.
"""

from __future__ import annotations

import megatron.core.dist_checkpointing.optimizer as optimizer_checkpoint
import megatron.core.distributed.torch_fully_sharded_data_parallel as torch_fsdp
import torch
from megatron.core import parallel_state
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from angpt.models.scales import LearnableScale


class _DeviceMeshOnThisDevice:
    """megatron-core's `DeviceMesh`, with "cuda" meaning the CPU where there is no CUDA."""

    @staticmethod
    def from_group(group, device_type, *args, **kwargs):
        if device_type == "cuda" and not torch.cuda.is_available():
            device_type = "cpu"
        return DeviceMesh.from_group(group, device_type, *args, **kwargs)


def _fully_shard_scales_first(module: torch.nn.Module, **kwargs) -> FSDPModule:
    """megatron-core's fully_shard of a layer or of the model; where its weights are of more than one dtype, after
    each learnable scale in it in a unit of its own, gathered until its backward."""
    if len({param.dtype for param in module.parameters()}) > 1:
        for scale in module.modules():
            if isinstance(scale, LearnableScale) and not isinstance(scale, FSDPModule):
                fully_shard(scale, **{**kwargs, "reshard_after_forward": False})
                register_fsdp_forward_method(scale, "surrogate")
    return fully_shard(module, **kwargs)


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
            for key, value in state.items():
                if key != "step" and isinstance(value, torch.Tensor):
                    state[key] = _placed_as(value, param)


def _placed_as(tensor: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """A local shard `tensor` of FSDP2 parameter `param` as a DTensor placed as `param`, or `tensor`."""
    if not isinstance(param, DTensor) or isinstance(tensor, DTensor):
        return tensor
    return DTensor.from_local(tensor, param.device_mesh, param.placements, shape=param.shape, stride=param.stride())


_float16_load_state_dict = Float16OptimizerWithFloat16Params.load_state_dict


def _float16_load_state_dict_of_shards(self, state_dict):
    """megatron-core's, with the fp32 weights it copies from `state_dict` placed as the optimizer's own."""
    key = "fp32_from_fp16_params" if "fp32_from_fp16_params" in state_dict else "fp32_from_fp16"
    if key in state_dict:
        state_dict[key] = [[_placed_as(saved, current) for current, saved in zip(current_group, saved_group)]
                           for current_group, saved_group in zip(self.fp32_from_float16_groups, state_dict[key])]
    _float16_load_state_dict(self, state_dict)


_copy_model_grads_to_main_grads = Float16OptimizerWithFloat16Params._copy_model_grads_to_main_grads


def _copy_model_grads_of_shards(self) -> None:
    """megatron-core's, with each fp32 FSDP2 parameter's gradient its own `.grad`, reduce-scattered by FSDP2."""
    sharded = [param for group in self.fp32_from_fp32_groups for param in group if isinstance(param, DTensor)]
    for param in sharded:
        param.main_grad = param.grad
    _copy_model_grads_to_main_grads(self)
    for param in sharded:
        del param.main_grad


def place_shards(sharded_state_dict: dict, module: torch.nn.Module) -> dict:
    """`module`'s sharded state dict with each FSDP2 shard at its rows (in place): a gated MLP's fc1 as W's rows and
    V's, and, without tensor parallelism, rows that do not divide over the ranks as torch.chunk cut them."""
    params = {id(param._local_tensor): param for param in module.parameters() if isinstance(param, DTensor)}
    for key, sharded in list(sharded_state_dict.items()):
        param = params.get(id(getattr(sharded, "data", None)))
        if isinstance(sharded, dict):
            place_shards(sharded, module)
        elif param is None:
            continue
        elif isinstance(sharded, ShardedTensorFactory):  # megatron-core's swiglu factory: the only one it builds
            sharded_state_dict[key] = _gated_rows(sharded, param)
        elif param.shape[0] % param.device_mesh.size():  # else megatron-core's equal parts hold
            _, (start, *_) = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
            sharded_state_dict[key] = _rows_at(sharded, sharded.data,
                                               [(start, start + sharded.data.shape[0], 0)], param.shape[0], start)
    return sharded_state_dict


def _gated_rows(factory: ShardedTensorFactory, param: DTensor) -> ShardedTensorFactory:
    """An FSDP2 shard of a gated fc1's [W_t; V_t] (this tensor-parallel rank's rows of W and V): its rows of W_t at
    their rows of W, its rows of V_t at theirs, in [W; V] over all tensor-parallel ranks."""
    layer, _ = factory.build_fn(factory.key, factory.data, factory.replica_id, None)  # its prepended axes
    tp, tp_rank = (parallel_state.get_tensor_model_parallel_world_size(),
                   parallel_state.get_tensor_model_parallel_rank())
    half = param.shape[0] // 2
    _, (start, *_) = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    stop = start + factory.data.shape[0]
    # (first row, end, the global row of row 0 of [W_t; V_t]'s part): W_t's rows, then V_t's.
    runs = [(start, min(stop, half), tp_rank * half), (max(start, half), stop, tp * half + tp_rank * half - half)]
    return _rows_at(layer, factory.data, [run for run in runs if run[0] < run[1]], 2 * tp * half, start)


def _rows_at(like: ShardedTensor, shard: torch.Tensor, runs: list[tuple[int, int, int]], rows: int,
             start: int) -> ShardedTensorFactory:
    """A factory saving the runs (first, end, base) of `shard`, which starts at row `start` of its weight, at rows
    base + first ... base + end of a global tensor of `rows` rows (megatron-core's irregular sharding; `like`: a
    sharded tensor of the same key and layer). The layer axes megatron-core prepends become leading axes of one."""
    prepended = like.prepend_axis_num
    leading = (1,) * prepended

    def build(key, tensor, replica_id, flattened_range):
        pieces = []
        for first, end, base in runs:
            piece = tensor[first - start:end - start]
            pieces.append(ShardedTensor(
                key, piece.reshape(leading + tuple(piece.shape)), piece.dtype, leading + tuple(piece.shape),
                (*like.global_shape[:prepended], rows, *piece.shape[1:]),
                (*like.global_offset[:prepended], base + first, *(0,) * (piece.dim() - 1)), None, replica_id))
        return pieces

    def merge(pieces):
        return torch.cat([piece.reshape(piece.shape[prepended:]) for piece in pieces])

    return ShardedTensorFactory(like.key, shard, build, merge, like.replica_id)


def fewer_rows_than_ranks(rows: dict[str, int], ranks: int) -> dict[str, int]:
    """The weights (name: rows) whose rows, cut into `ranks` FSDP2 shards, leave a rank an empty one."""
    return {name: count for name, count in rows.items() if count < ranks}


def install() -> None:
    Float16OptimizerWithFloat16Params.load_state_dict = _float16_load_state_dict_of_shards
    Float16OptimizerWithFloat16Params._copy_model_grads_to_main_grads = _copy_model_grads_of_shards
    optimizer_checkpoint.to_local_if_dtensor = _local_shard
    torch_fsdp.DeviceMesh = _DeviceMeshOnThisDevice
    torch_fsdp.fully_shard = _fully_shard_scales_first
    torch_fsdp.TorchFullyShardedDataParallel.finish_grad_sync = _finish_grad_sync
