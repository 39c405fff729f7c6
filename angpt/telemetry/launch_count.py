"""What a training step launches, counted on the CPU from the profiler's CPU-side view: on a GPU each launch costs
host time (a few microseconds each, more than the kernel itself for small ones), so the counts say where a
launch-bound step's host time goes without a GPU (benchmarks/step_time.py --compiled, tests/test_op_count.py)."""

from __future__ import annotations

import collections
import contextlib

import torch
from torch._inductor import config as inductor_config

from angpt import kernels

# Allocations, and views not annotated as such, launch nothing on a GPU; nor do the operations with a view among
# their overloads (the profiler does not name the overload).
LAUNCH_NOTHING = ("aten::empty", "aten::empty_strided", "aten::empty_like", "aten::new_empty",
                  "aten::new_empty_strided", "aten::resize_", "aten::_unsafe_view")


def launches_nothing(name: str) -> bool:
    packet = getattr(torch.ops.aten, name.removeprefix("aten::"), None)
    return name in LAUNCH_NOTHING or (packet is not None and any(getattr(packet, overload).is_view
                                                                 for overload in packet.overloads()))


def kernel_launches(run) -> collections.Counter:
    """What `run()` launches on the CPU, as a GPU would launch it, by the profiler's CPU-side view: each kernel
    that torch.compile generated (C++ here, Triton on a GPU; "compiled kernel", from a compilation under
    `compiled_kernels_profiled`), and each aten operation that computes something outside them (a leaf of the
    profile: no such operation below it; not a view nor an allocation). The extension's fused kernels
    (angpt.kernels) are not aten operations and are not counted."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        run()
    counts = collections.Counter()

    def count(event) -> bool:
        """Count the launches at and under `event`; whether there were any."""
        if "cpp_fused" in event.name:
            counts["compiled kernel"] += 1
            return True
        below = [count(child) for child in event.cpu_children]  # every child, counted
        if any(below):
            return True
        if event.name.startswith("aten::") and not launches_nothing(event.name):
            counts[event.name] += 1
            return True
        return False

    for event in profile.events():
        if event.cpu_parent is None:
            count(event)
    return counts


@contextlib.contextmanager
def compiled_kernels_profiled():
    """Inside, the `fused_on_gpu` functions run compiled (kernels.compiled_everywhere), as on a GPU, compiled
    afresh with each generated kernel named in the profiler (Inductor's cpp.enable_kernel_profile), for
    kernel_launches; what was compiled inside is dropped on the way out."""
    with inductor_config.patch({"cpp.enable_kernel_profile": True}), kernels.compiled_everywhere():
        torch._dynamo.reset()  # what was compiled before without the profiler's names
        try:
            yield
        finally:
            torch._dynamo.reset()  # nor does what follows run these kernels
