"""megatron-core 0.16.1's FSDP2 (`TorchFullyShardedDataParallel`, Megatron-LM's --use-torch-fsdp2), made to train
angpt's models; each workaround says what breaks without it.

- On a machine without CUDA, its device mesh is the CPU's: it builds `DeviceMesh.from_group(group, "cuda")`, and
  fully_shard then asks CUDA for the device ("Torch not compiled with CUDA enabled", a TypeError under the CPU
  adapter's `current_device`).
- `finish_grad_sync` takes megatron-core's own argument: `finalize_model_grads` calls
  `finish_grad_sync(force_all_reduce=...)`, which FSDP2's inherited method does not take (a TypeError at the first
  step, on GPUs too: NVIDIA/Megatron-LM#4669, fixed after 0.16.1). FSDP2 reduce-scatters the gradients in its own
  backward hooks: there is nothing left to finish.
"""

from __future__ import annotations

import megatron.core.distributed.torch_fully_sharded_data_parallel as torch_fsdp
import torch
from torch.distributed.device_mesh import DeviceMesh


class _DeviceMeshOnThisDevice:
    """megatron-core's `DeviceMesh`, with "cuda" meaning the CPU where there is no CUDA."""

    @staticmethod
    def from_group(group, device_type, *args, **kwargs):
        if device_type == "cuda" and not torch.cuda.is_available():
            device_type = "cpu"
        return DeviceMesh.from_group(group, device_type, *args, **kwargs)


def _finish_grad_sync(self, force_all_reduce: bool = False) -> None:
    """FSDP2 reduce-scattered the gradients in its backward hooks."""


def install() -> None:
    torch_fsdp.DeviceMesh = _DeviceMeshOnThisDevice
    torch_fsdp.TorchFullyShardedDataParallel.finish_grad_sync = _finish_grad_sync
