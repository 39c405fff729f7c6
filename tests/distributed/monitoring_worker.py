"""HealthProbe summaries of one anGPT model (weights from --weights) at TP 2 with sequence parallelism and
at PP 2, printed by global rank 0 for comparison with the single-process summary.

    torchrun --nproc-per-node 2 tests/distributed/monitoring_worker.py --weights FILE
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from megatron.core.pipeline_parallel import get_forward_backward_func

from angpt.telemetry.health import HealthProbe
from angpt.training import distributed
from angpt.training.step import build_model_chunks, forward_step

from common import MICRO_BATCH, S, V, fixed_batches, load_full, report, small_config

LAYOUTS = {
    "tp2_sequence_parallel": dict(tensor_model_parallel_size=2, sequence_parallel=True),
    "pp2": dict(pipeline_model_parallel_size=2),
}


def probe_summary(layout: dict, weights: dict[str, torch.Tensor]) -> dict[str, float]:
    config = small_config("angpt", **layout)
    distributed.initialize(config.tensor_model_parallel_size, config.pipeline_model_parallel_size)
    chunks = build_model_chunks(config, V, S)
    load_full(chunks, weights)
    probe = HealthProbe(chunks)
    batches = fixed_batches()
    with probe.capture():
        get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(batches), model=chunks,
            num_microbatches=len(batches), seq_length=S, micro_batch_size=MICRO_BATCH, forward_only=True,
        )
    summary = probe.summary()
    distributed.destroy_model_parallel()
    return summary


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--weights", required=True)
    args = parser.parse_args()
    distributed.initialize()  # joins the torchrun job
    distributed.destroy_model_parallel()
    weights = torch.load(args.weights)
    for name, layout in LAYOUTS.items():
        summary = probe_summary(layout, weights)
        if dist.get_rank() == 0:
            report({"layout": name, "summary": summary})
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
