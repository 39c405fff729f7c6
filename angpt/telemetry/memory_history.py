"""Megatron-LM's --record-memory-history and --memory-snapshot-path, as core_v0.16.1 does it: model_provider.py
starts torch's record of the CUDA caching allocator (its last 100,000 allocations and frees, each with its Python
stack) before the model is built and attaches an out-of-memory observer that writes a snapshot from the rank that
ran out; training.py's training_log writes a snapshot from the last rank at every logged iteration (and the
first), over the previous one, so that the file holds the state at the last log. Open the pickles at
https://pytorch.org/memory_viz (or `python -m torch.cuda._memory_viz trace_plot snapshot.pickle -o trace.html`)."""

from __future__ import annotations

import os
import pickle

import torch
import torch.distributed as dist


def start(snapshot_path: str) -> None:
    if not torch.cuda.is_available():
        raise ValueError("--record-memory-history records the CUDA caching allocator's history and needs CUDA "
                         "(on CPU the log line's mem is the process's resident memory)")
    torch.cuda.memory._record_memory_history(True, trace_alloc_max_entries=100000, trace_alloc_record_context=True)
    # Megatron-LM writes oom_rank-<rank>_<path> into the working directory; here next to the snapshot (the same
    # file for a path without a directory).
    directory, name = os.path.split(snapshot_path)
    oom_path = os.path.join(directory, f"oom_rank-{dist.get_rank()}_{name}")

    def on_out_of_memory(device, alloc, device_alloc, device_free):
        print(f"saving allocated state during OOM to {oom_path}", flush=True)
        write_snapshot(oom_path)

    torch._C._cuda_attach_out_of_memory_observer(on_out_of_memory)


def write_snapshot(path: str) -> None:
    with open(path, "wb") as file:
        pickle.dump(torch.cuda.memory._snapshot(), file)


def stop() -> None:
    torch.cuda.memory._record_memory_history(None)
