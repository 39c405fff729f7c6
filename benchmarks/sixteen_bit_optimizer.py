#!/usr/bin/env python
"""bf16 training with and without --use-distributed-optimizer, under --use-torch-fsdp2, and under --use-megatron-fsdp
with each --data-parallel-sharding-strategy, side by side in one run: the memory each rank holds for the weights, their
gradients and the optimizer's state, beside the dry run's estimate of it (angpt.training.memory_estimate), and the
training step time.

    python benchmarks/sixteen_bit_optimizer.py [--family gptplus --hidden-size 256 --num-layers 4 --rounds 10]
    torchrun --nproc-per-node 2 benchmarks/sixteen_bit_optimizer.py [...] [--output docs/results/memory_dp2.json]

The first runs at data-parallel size 1, the second at 2 (each rank a micro-batch of its own: the same global
batch per rank). Without the distributed optimizer each rank keeps megatron-core's Float16OptimizerWithFloat16Params
whole: bf16 weights (2 bytes a parameter; anGPT's and nGPT's learnable scales stay fp32), fp32 gradients (4,
reduced in fp32 as Megatron-LM's) and an fp32 main copy and Adam's two moments (12). The distributed optimizer
divides the last 12 over the data-parallel ranks. FSDP2 divides all of it: 18 bytes over the ranks (its bf16
gradients, reduce-scattered in the weights' dtype, are freed once the optimizer has copied them into its fp32
gradients, which stay between steps); anGPT's and nGPT's fp32 scales are FSDP2 units of their own
(angpt.megatron_compat.fsdp2). The embeddings are untied, as FSDP2 needs. Megatron-FSDP's buffers (main weights
fp32 beside the bf16 ones) shard none of the 18 bytes (no_shard, which trains the model's own bf16 weights and keeps
no weight buffer), 12 (optim), 16 (optim_grads) or all (optim_grads_params); its
optim_grads_params also holds whole the weights its step's all-gather prefetches (here all: fewer than its 5e8
elements), and each strategy that shards gradients holds them whole in temporary buckets from the backward pass to
their reduce-scatter: its "backward peak" is the most its state and temporary buckets held at the start of a
gradient reduction in one step (megatron_fsdp_gathered estimates it). It runs with --no-gradient-reduce-div-fusion
(gloo has no PREMUL_SUM; harmless elsewhere).
Memory is counted from the tensors themselves, after a first
step (Adam's moments exist from then on), each storage once: the distributed optimizer's weights live in one
buffer, its fp32 scales' "main copies" are views of the weights; FSDP2's are this rank's shards, between steps
(what it gathers for a layer's forward and backward is transient, and not counted). The process's resident memory is
not reported: in one process the variant built first pays for torch's and the allocator's one-off growth (the same
108 MiB of tensors grew it by 216 MiB built first, by 68 MiB built second). The variants step in turn on the same
batch, so that machine noise hits all alike; the median step of each is reported, the slowest rank's, with the
ratio to the distributed optimizer's. On the CPU over gloo the step times say little of a GPU's (NCCL overlaps
FSDP2's and Megatron-FSDP's gathers and reduce-scatters with compute, on their own streams; here they run in turn).
"""

import argparse
import json
import os
import statistics
import sys

from angpt.megatron_compat import quiet_known_warnings

quiet_known_warnings()  # before megatron-core is imported

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from step_time import interleaved_step_times, random_batch  # noqa: E402

from angpt.config.sections import RunConfig  # noqa: E402
from angpt.training import distributed  # noqa: E402
from angpt.training.megatron_configs import ddp_config, transformer_config  # noqa: E402
from angpt.training.memory_estimate import bytes_per_parameter, megatron_fsdp_gathered  # noqa: E402
from angpt.training.optimizer import build_optimizer  # noqa: E402
from angpt.training.step import build_model_chunks, train_step  # noqa: E402

MEGATRON_FSDP = dict(use_megatron_fsdp=True, use_distributed_optimizer=True, ckpt_format="fsdp_dtensor",
                     gradient_reduce_div_fusion=False)
# {name: flags}
VARIANTS = {"distributed optimizer": dict(use_distributed_optimizer=True), "without": {},
            "fsdp2": dict(use_torch_fsdp2=True),
            **{f"megatron-fsdp {strategy}": dict(MEGATRON_FSDP, data_parallel_sharding_strategy=strategy)
               for strategy in ("no_shard", "optim", "optim_grads", "optim_grads_params")}}


def storage_bytes(tensors, exclude: set) -> tuple[int, set]:
    """Bytes of the distinct storages of `tensors` (of this rank's shards of DTensors) not in `exclude`, and those
    storages."""
    seen = {}
    for tensor in tensors:
        storage = (tensor._local_tensor if isinstance(tensor, DTensor) else tensor).untyped_storage()
        if storage.data_ptr() not in exclude:
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values()), set(seen)


def view_bytes(tensors) -> int:
    """Bytes of `tensors`, each view once (Megatron-FSDP keeps its main weights and gradients in one storage)."""
    return sum({tensor.data_ptr(): tensor.numel() * tensor.element_size() for tensor in tensors
                if tensor is not None}.values())


def gathered_bytes(buffer) -> tuple[int, int]:
    """Bytes of Megatron-FSDP's temporary buckets alive now: weights gathered whole, gradients whole before their
    reduce-scatter (storages resized to nothing once freed)."""
    weights = {id(b): b.data.untyped_storage().nbytes() for b in buffer.weight_alloc.buckets.values()}
    grads = {id(b): b.data.untyped_storage().nbytes() for group in buffer.parameter_groups if group.main_grad_buffer
             for b in group.main_grad_buffer.temporary_bucket_allocator.buckets.values()}
    return sum(weights.values()), sum(grads.values())


def megatron_fsdp_memory(chunks, optimizer) -> dict[str, int]:
    """memory() of Megatron-FSDP: its buffers (this rank's shards, or whole where the strategy keeps them so) and the
    weights it holds gathered (no_shard's: the model's own, it has no weight buffer); Adam's moments from the
    optimizer."""
    weights = grads = main = 0
    for chunk in chunks:
        buffer = chunk.module.param_and_grad_buffer
        groups = buffer.parameter_groups
        weights += view_bytes(tensor for g in groups
                              for tensor in ([g.model_weight_buffer.data] if g.model_weight_buffer else g.params))
        weights += gathered_bytes(buffer)[0]
        grads += view_bytes(g.main_grad_buffer.data for g in groups if g.main_grad_buffer)
        main += view_bytes(g.main_weight_buffer.data for g in groups if g.main_weight_buffer)
    moments = [value._local_tensor if isinstance(value, DTensor) else value
               for inner in getattr(optimizer, "chained_optimizers", [optimizer])
               for values in inner.optimizer.state.values()
               for value in values.values() if isinstance(value, torch.Tensor) and value.dim()]
    return {"weights": weights, "gradients": grads, "optimizer state": main + view_bytes(moments)}


def backward_peak(chunks, run) -> int:
    """The most bytes Megatron-FSDP's temporary buckets hold at the start of a gradient reduction in one step of
    `run()`: sampled before each bucket group's reduce-scatter."""
    peak = 0
    pipelines = [chunk.module.grad_reduce_pipeline for chunk in chunks]

    def sampled(reduce):
        def sample(*args, **kwargs):
            nonlocal peak
            peak = max(peak, sum(sum(gathered_bytes(chunk.module.param_and_grad_buffer)) for chunk in chunks))
            return reduce(*args, **kwargs)
        return sample

    for pipeline in pipelines:
        pipeline._bucket_group_gradient_reduce = sampled(pipeline._bucket_group_gradient_reduce)
    run()
    for pipeline in pipelines:
        del pipeline._bucket_group_gradient_reduce  # the class's again
    return peak


def memory(chunks, optimizer) -> dict[str, int]:
    """Bytes this rank holds for the weights, their gradients and the optimizer's state (main copies and moments)."""
    if isinstance(chunks[0], FullyShardedDataParallel):
        return megatron_fsdp_memory(chunks, optimizer)
    params = [param for chunk in chunks for param in chunk.parameters()]
    weights, counted = storage_bytes(params, set())
    # FSDP2's weights have no main_grad: the 16-bit optimizer frees their .grad once copied into its fp32 copies'.
    grads, grad_storages = storage_bytes([grad for param in params
                                          if (grad := getattr(param, "main_grad", param.grad)) is not None], counted)
    state = []
    for inner in optimizer.chained_optimizers:
        state += [param for group in inner.optimizer.param_groups for param in group["params"]]
        state += [param.grad for group in inner.optimizer.param_groups for param in group["params"]
                  if param.grad is not None]
        state += [value for values in inner.optimizer.state.values() for value in values.values()
                  if isinstance(value, torch.Tensor)]
    optimizer_state, _ = storage_bytes(state, counted | grad_storages)
    return {"weights": weights, "gradients": grads, "optimizer state": optimizer_state}


def build(args, flags: dict, batch: dict):
    config = RunConfig.from_flags(dict(
        model_family=args.family, lr=1e-3, train_iters=10 * args.rounds, num_layers=args.num_layers,
        hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads, bf16=True,
        tie_embeddings_and_output_weights=False, untie_embeddings_and_output_weights=True, **flags))
    distributed.set_random_seed(1234)
    chunks = build_model_chunks(transformer_config(config), args.vocab_size, args.seq_length, ddp_config(config))
    optimizer, scheduler = build_optimizer(chunks, config)
    b, s = batch["tokens"].shape
    train_step(iter([batch]), chunks, optimizer, scheduler, 1, b, s)
    return chunks, optimizer, scheduler


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", default="gptplus", choices=("angpt", "ngpt", "gptplus", "gpt"))
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--num-attention-heads", type=int, default=4)
    parser.add_argument("--seq-length", type=int, default=256)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS),
                        help="those to run, the distributed optimizer always among them (the ratios' reference)")
    parser.add_argument("--output", help="a JSON file of the table")
    args = parser.parse_args()

    distributed.initialize()  # without torchrun, a one-process group
    dp = parallel_state.get_data_parallel_world_size()
    batch = random_batch(args.micro_batch_size, args.seq_length, args.vocab_size)
    variants = {name: flags for name, flags in VARIANTS.items()
                if name in args.variants or name == "distributed optimizer"}
    runs = {name: build(args, flags, batch) for name, flags in variants.items()}
    held = {name: memory(chunks, optimizer) for name, (chunks, optimizer, _) in runs.items()}
    b, s = batch["tokens"].shape
    peaks = {name: backward_peak(chunks, lambda: train_step(iter([batch]), chunks, optimizer, scheduler, 1, b, s))
             for name, (chunks, optimizer, scheduler) in runs.items() if "use_megatron_fsdp" in VARIANTS[name]}
    device_peaks = {}
    if torch.cuda.is_available():  # the device's own count of a step's peak, activations included
        for name, (chunks, optimizer, scheduler) in runs.items():
            torch.cuda.reset_peak_memory_stats()
            train_step(iter([batch]), chunks, optimizer, scheduler, 1, b, s)
            device_peaks[name] = torch.cuda.max_memory_allocated()
    model = runs["distributed optimizer"][0][0].module
    parameters = sum(param.numel() for param in model.parameters())
    outside = model.embedding.word_embeddings.weight.numel() + model.output_layer.weight.numel()
    steps = interleaved_step_times(runs, batch, args.rounds)
    medians = {name: torch.tensor(statistics.median(times)) for name, times in steps.items()}
    for median in medians.values():  # the slowest rank's
        dist.all_reduce(median, op=dist.ReduceOp.MAX)
    if dist.get_rank() != 0:
        return
    print(f"{args.family} bf16, {parameters / 1e6:.2f}M parameters, d={args.hidden_size} layers={args.num_layers} "
          f"seq={args.seq_length} micro-batch={args.micro_batch_size} vocab={args.vocab_size}; data-parallel size "
          f"{dp}, {torch.get_num_threads()} threads a rank, {args.rounds} rounds")
    columns = [*held["distributed optimizer"], "total", "dry run", "measured/est", "bytes/param", "median step"]
    print(f"{'per rank':<34}" + "".join(f"{column:>16}" for column in columns))
    rows, peak_line = {}, []
    for name, flags in variants.items():
        strategy = flags.get("data_parallel_sharding_strategy")
        sharded = parameters * bytes_per_parameter(True, flags.get("use_distributed_optimizer", False), dp,
                                                   flags.get("use_torch_fsdp2", False), strategy)
        gathered, whole = (megatron_fsdp_gathered(strategy, parameters, (parameters - outside) / args.num_layers,
                                                  outside, 2) if strategy and dp > 1 else (0, 0))
        estimate = sharded + 2 * gathered
        total = sum(held[name].values())
        rows[name] = dict(**{key: value / 2**20 for key, value in held[name].items()}, total=total / 2**20,
                          estimate=estimate / 2**20, measured_over_estimate=total / estimate,
                          bytes_per_parameter=total / parameters, median_step_ms=medians[name].item() * 1e3,
                          **({"device_peak": device_peaks[name] / 2**20} if device_peaks else {}))
        units = ["MiB"] * 5 + ["", "", "ms"]
        print(f"{name:<34}" + "".join(f"{value:>13.2f}{unit:>3}" for value, unit in zip(rows[name].values(), units)))
        if name in peaks:  # the sharded state (what is held between steps less its gathered weights) and the buckets
            peak = total - gathered_bytes(runs[name][0][0].module.param_and_grad_buffer)[0] + peaks[name]
            peak_estimate = sharded + whole
            rows[name].update(backward_peak=peak / 2**20, backward_peak_estimate=peak_estimate / 2**20,
                              backward_peak_measured_over_estimate=peak / peak_estimate,
                              backward_peak_bytes_per_parameter=peak / parameters)
            peak_line.append(f"{name}: {peak / parameters:.2f} bytes a parameter (estimate "
                             f"{peak_estimate / parameters:.2f})")
    if peak_line:
        print("backward peak, Megatron-FSDP's state with its temporary buckets: " + "; ".join(peak_line))
    for name in rows:
        if name != "distributed optimizer":
            ratios = [rows[name][key] / rows["distributed optimizer"][key] for key in ("total", "median_step_ms")]
            print(f"{name} / distributed optimizer: memory {ratios[0]:.3f}, step time {ratios[1]:.3f}"
                  + (f", device peak {rows[name]['device_peak'] / rows['distributed optimizer']['device_peak']:.3f}"
                     if device_peaks else ""))
    print("step times on the CPU over gloo say little of a GPU's, where gathers and reduce-scatters overlap compute")
    if args.output:
        with open(args.output, "w") as file:
            json.dump(dict(command=" ".join(sys.argv), family=args.family, parameters=parameters, data_parallel=dp,
                           rows=rows), file, indent=1)
        print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
