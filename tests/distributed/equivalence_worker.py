"""Runs the three families at parallel layouts and records logits, loss, gradients, parameters after three
optimizer steps, and one bounding projection, for comparison with the single-process reference.

    python tests/distributed/equivalence_worker.py --reference --out DIR         (1 process)
    torchrun --nproc-per-node 2 tests/distributed/equivalence_worker.py --layouts tp2,pp2 --out DIR \
        --reference-dir REF

Every layout runs in the one job (megatron-core's groups are rebuilt for each): a torchrun start costs more
than a layout.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallelConfig, TorchFullyShardedDataParallelConfig
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region
from megatron.core.transformer.enums import AttnBackend
from megatron.core.utils import get_batch_on_this_cp_rank

from angpt.config.sections import RunConfig
from angpt.models import WEIGHT_CONSTRAINTS
from angpt.models.attention import clear_attention_backend_environment
from angpt.models.bounding import _optimizer_pieces, project_parameters_
from angpt.training import distributed
from angpt.training.optimizer import build_optimizer
from angpt.training.replica_check import ReplicasDifferError, check_weight_hashes
from angpt.training.step import build_model_chunks, forward_step, param_gather_finished, train_step

from common import MICRO_BATCH, S, V, fixed_batches, gather_full, load_full, small_config, unwrap

LR = 1e-2
# Two processes: megatron-core's layout arguments, and whether the distributed optimizer shards Adam's state.
LAYOUTS = {
    "tp2": dict(tensor_model_parallel_size=2),
    "tp2_sequence_parallel": dict(tensor_model_parallel_size=2, sequence_parallel=True),
    "pp2": dict(pipeline_model_parallel_size=2),
    "pp2_interleaved": dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2),
    # Uneven splits of the 4 layers: 1 + 3, and the layout string's 3 + 1.
    "pp2_uneven": dict(pipeline_model_parallel_size=2, num_layers_in_first_pipeline_stage=1),
    "pp2_layout": dict(pipeline_model_parallel_size=2, pipeline_model_parallel_layout="Ettt|tL"),
    # A layout of 4 stages over 2 ranks, virtual stages of 1, 2, 1 and 0 layers: rank 0 holds layers 0 and 3, rank 1
    # layers 1 and 2 and then the loss alone (the interleaved schedule over uneven chunks).
    "pp2_layout_interleaved": dict(pipeline_model_parallel_size=2, pipeline_model_parallel_layout="Et|tt|t|L"),
    "dp2": dict(),
    "dp2_distributed_optimizer": dict(distributed_optimizer=True),
    # PyTorch's FSDP2 (--use-torch-fsdp2): every weight, gradient and Adam state sharded by rows.
    "dp2_fsdp2": dict(fsdp2=True),
    # With tensor parallelism: FSDP2 shards each tensor-parallel part by rows over the two data-parallel ranks.
    "tp2_dp2_fsdp2": dict(tensor_model_parallel_size=2, fsdp2=True),
    # With context parallelism: FSDP2 shards over the data x context group (megatron-core's), here the CP 2 ranks.
    "cp2_fsdp2": dict(context_parallel_size=2, cp_comm_type="all_gather", fsdp2=True),
    # --num-distributed-optimizer-instances 2: each instance shards over its DP x CP / 2 ranks (one, then two), and
    # the reduced shards are all-reduced between the instances.
    "dp2_distributed_optimizer_instances2": dict(distributed_optimizer=True, instances=2),
    "cp2_dp2_distributed_optimizer_instances2": dict(context_parallel_size=2, cp_comm_type="all_gather",
                                                     distributed_optimizer=True, instances=2),
    # --overlap-param-gather-with-optimizer-step: the first chunk's optimizer (of two, chained) starts its chunk's
    # weight all-gather once it has stepped (and projected); the all-gathers finish in the next forward. At DP 1:
    # the interleaved schedule needs a micro-batch per pipeline stage on each data-parallel rank, and the global
    # batch has two.
    "pp2_interleaved_overlap_optimizer_step": dict(pipeline_model_parallel_size=2,
                                                   virtual_pipeline_model_parallel_size=2,
                                                   distributed_optimizer=True, overlap_optimizer_step=True),
    # Selective recompute of the parts that touch TP-sharded or sequence-parallel tensors, with the family's
    # own choice (recompute_modules filled in by run_family).
    "tp2_sequence_parallel_recompute": dict(tensor_model_parallel_size=2, sequence_parallel=True,
                                            recompute_granularity="selective"),
    # --distribute-saved-activations: full recompute keeps 1 / TP of each layer's input per rank and gathers it
    # for the recompute (megatron-core's CheckpointFunction), where it would keep the whole input.
    "tp2_distribute_saved_activations": dict(tensor_model_parallel_size=2, recompute_granularity="full",
                                             recompute_method="uniform", recompute_num_layers=1,
                                             distribute_saved_activations=True),
    # Context parallelism: each rank holds 2 of the 2 x CP chunks of every sequence (Megatron-LM's all_gather).
    "cp2": dict(context_parallel_size=2, cp_comm_type="all_gather"),
    # Four processes (tests/test_parallel_equivalence.py, one launch of its own).
    "tp2_sequence_parallel_cp2": dict(tensor_model_parallel_size=2, sequence_parallel=True, context_parallel_size=2,
                                      cp_comm_type="all_gather"),
    "cp2_pp2": dict(pipeline_model_parallel_size=2, context_parallel_size=2, cp_comm_type="all_gather"),
    "cp4": dict(context_parallel_size=4, cp_comm_type="all_gather"),
}
# What the recompute layout recomputes: mlp, qk_norm and the family's own norms (core_attn is megatron-core's,
# checked in tests/test_recompute.py, and would recompute anGPT's QK normalization in its stead).
RECOMPUTED = {"gptplus": ["mlp", "qk_norm", "layernorm"], "angpt": ["mlp", "qk_norm", "residual_update"],
              "ngpt": ["mlp", "qk_norm", "residual_update"]}


def logits_step(data_iterator, model):
    batch = get_batch_on_this_cp_rank(dict(next(data_iterator)))
    logits = model(batch["tokens"], batch["position_ids"], None)

    def collect(output, non_loss_data=True):
        return in_sequence_order(gather_from_tensor_model_parallel_region(output).detach())

    return logits, collect


def in_sequence_order(local: torch.Tensor) -> torch.Tensor:
    """The whole sequence of [b, s / CP, ...] from the CP group, whose rank r holds chunks r and 2 CP - 1 - r."""
    group = parallel_state.get_context_parallel_group()
    size = group.size()
    if size == 1:
        return local
    parts = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(parts, local.contiguous(), group=group)
    chunks = [None] * (2 * size)
    for rank, part in enumerate(parts):
        chunks[rank], chunks[2 * size - 1 - rank] = part.chunk(2, dim=1)
    return torch.cat(chunks, dim=1)


def document_batch() -> dict:
    """The first micro-batch cut into documents, as megatron-core's GPTDataset writes them with
    --reset-position-ids and --reset-attention-mask: positions restart and attention stays inside each
    document. The boundaries (5 and 11) fall inside CP chunks."""
    batch = dict(fixed_batches()[0])
    document = torch.zeros(MICRO_BATCH, S, dtype=torch.long)
    document[0, 5:], document[1, 11:] = 1, 1
    index = torch.arange(S)
    starts = torch.where(document == 1, torch.tensor([5, 11]).unsqueeze(1), 0)
    batch["position_ids"] = index - starts
    causal = index.unsqueeze(0) > index.unsqueeze(1)
    batch["attention_mask"] = (causal | (document.unsqueeze(2) != document.unsqueeze(1))).unsqueeze(1)
    return batch


def context_parallel_logits(family: str, layout: dict, init: dict, cp: int) -> dict:
    """Logits of the whole micro-batch at context-parallel size `cp` (other splits as `layout`): causal through
    torch's SDPA (attention_backend flash), and with documents (attention mask and position ids)."""
    layout = {**layout, "context_parallel_size": cp}
    logits = {}
    for name, backend, batch, settings in (("sdpa", AttnBackend.flash, fixed_batches()[0], {}),
                                           ("documents", AttnBackend.auto, document_batch(),
                                            dict(rope_position_ids=True))):
        distributed.initialize(context_parallel_size=cp)
        clear_attention_backend_environment()
        chunks = build_model_chunks(small_config(family, **layout, attention_backend=backend, **settings), V, S)
        load_full(chunks, init)
        mine = get_batch_on_this_cp_rank(dict(batch))
        with torch.no_grad():
            output = unwrap(chunks[0])(mine["tokens"], mine["position_ids"], mine.get("attention_mask"))
        logits[name] = in_sequence_order(gather_from_tensor_model_parallel_region(output))
        distributed.destroy_model_parallel()
    clear_attention_backend_environment()
    return logits


def from_last_stage(value):
    """The value held by a last-pipeline-stage rank, on every rank."""
    held = [None] * dist.get_world_size()
    dist.all_gather_object(held, value)
    return next(v for v in held if v is not None)


def perturbed_weights(init: dict[str, torch.Tensor], family: str) -> dict[str, torch.Tensor]:
    """Initial weights with some rows pushed outside the unit ball and others inside it."""
    generator = torch.Generator().manual_seed(7)
    out = {}
    for name, tensor in init.items():
        if tensor.dim() == 2:
            factors = torch.empty(tensor.shape[0], 1).uniform_(0.3, 3.0, generator=generator)
            tensor = tensor * factors
        out[name] = tensor
    return out


def describe_shards(optimizer) -> dict:
    """The inner optimizer's class, and how many weights this rank holds only part of a row of."""
    inner = optimizer.chained_optimizers[0] if hasattr(optimizer, "chained_optimizers") else optimizer
    _, pieces, _ = _optimizer_pieces(inner)

    def cols(piece):
        return piece.param.shape[1]

    cut = sum((piece.offset % cols(piece) != 0) + ((piece.offset + piece.data.numel()) % cols(piece) != 0)
              for piece in pieces)
    counts = [None] * dist.get_world_size()
    dist.all_gather_object(counts, cut)
    return dict(optimizer=type(inner).__name__, rows_cut_by_shards=sum(counts))


def replica_checks(chunks) -> dict[str, bool]:
    """--check-weight-hash-across-dp-replicas-interval's check, as trained and with one weight of data-parallel
    rank 1 changed by one ulp: {case: whether every rank found the replicas the same}."""
    found = {}
    param = next(unwrap(chunks[0]).parameters())
    for case in ("as trained", "one weight changed on rank 1"):
        original = param.data.clone()
        if case != "as trained" and parallel_state.get_data_parallel_rank() == 1:
            param.data.view(-1)[0] = torch.nextafter(param.data.view(-1)[0], torch.tensor(float("inf")))
        try:
            check_weight_hashes(chunks, 3, param_gather_overlapped=False)
            found[case] = True
        except ReplicasDifferError:
            found[case] = False
        param.data.copy_(original)
    return found


def run_family(family: str, args, layout: dict, world: int) -> dict | None:
    layout = dict(layout)
    distributed_optimizer = layout.pop("distributed_optimizer", False)
    fsdp2 = layout.pop("fsdp2", False)
    instances = layout.pop("instances", 1)
    overlap_optimizer_step = layout.pop("overlap_optimizer_step", False)
    optimizer_flags = dict(use_distributed_optimizer=distributed_optimizer,
                           overlap_param_gather=overlap_optimizer_step,
                           overlap_param_gather_with_optimizer_step=overlap_optimizer_step)
    if layout.get("recompute_granularity") == "selective":
        layout["recompute_modules"] = RECOMPUTED[family]
    config = small_config(family, **layout)
    cp = config.context_parallel_size
    dp = world // (config.tensor_model_parallel_size * config.pipeline_model_parallel_size * cp)
    distributed.initialize(
        config.tensor_model_parallel_size,
        config.pipeline_model_parallel_size,
        config.virtual_pipeline_model_parallel_size,
        context_parallel_size=cp,
        num_distributed_optimizer_instances=instances,
    )
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True)
    if distributed_optimizer:
        # Small buckets with overlapped reduction, as on clusters; their shard boundaries cut rows.
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, use_distributed_optimizer=True, overlap_grad_reduce=True, bucket_size=10000,
            num_distributed_optimizer_instances=instances, overlap_param_gather=overlap_optimizer_step,
        )
    if fsdp2:
        ddp_config = TorchFullyShardedDataParallelConfig()
    chunks = build_model_chunks(config, V, S, ddp_config, one_bucket_group=overlap_optimizer_step)
    init_path = os.path.join(args.reference_dir or args.out, f"{family}_init.pt")
    if args.reference:
        init = gather_full(chunks)
        torch.save(init, init_path)
    else:
        init = torch.load(init_path)
        load_full(chunks, init)

    batches = fixed_batches()
    dp_rank = parallel_state.get_data_parallel_rank()
    mine = batches[dp_rank::dp]

    def iterators(data):
        return [iter(data) for _ in chunks] if len(chunks) > 1 else iter(data)

    schedule = get_forward_backward_func()
    run = dict(model=chunks, seq_length=S, micro_batch_size=MICRO_BATCH)

    # Logits of the global batch (every data-parallel rank computes all of it).
    outputs = schedule(forward_step_func=logits_step, data_iterator=iterators(batches),
                       num_microbatches=len(batches), forward_only=True, collect_non_loss_data=True, **run)
    is_last = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
    logits = from_last_stage(torch.cat(outputs) if is_last and dp_rank == 0 else None)

    # Loss and gradients over the global batch, then three optimizer steps.
    optimizer, scheduler = build_optimizer(chunks, RunConfig.from_flags(dict(
        model_family=family, lr=LR, train_iters=3, **optimizer_flags)))
    for chunk in chunks:
        chunk.zero_grad_buffer()
    losses = schedule(forward_step_func=forward_step, data_iterator=iterators(mine), num_microbatches=len(mine),
                      forward_only=False, **run)
    # Each micro-batch's [loss sum, tokens] (angpt.training.step.language_model_loss), of this rank's part of
    # the sequence under CP, summed over the CP ranks of each data-parallel rank: the mean of their means.
    local_sums = torch.stack([o["lm loss"] for o in losses]) if is_last else None
    all_losses = [None] * world
    dist.all_gather_object(all_losses, (parallel_state.get_data_parallel_rank(),
                                        parallel_state.get_context_parallel_rank(), local_sums))
    per_dp = {}
    for dp_rank, cp_rank, sums in all_losses:
        if sums is not None:
            per_dp.setdefault(dp_rank, {})[cp_rank] = sums
    means = [torch.stack(list(by_cp.values())).sum(0) for by_cp in per_dp.values()]
    loss = sum((m[:, 0] / m[:, 1]).mean().item() for m in means) / len(means)
    # The distributed optimizer reduce-scatters gradients: each rank holds only its shard reduced.
    grads = None if distributed_optimizer else gather_full(chunks, "grad")
    optimizer.step()
    scheduler.step(1)
    for _ in range(2):
        train_step(iterators(mine), chunks, optimizer, scheduler, len(mine), MICRO_BATCH, S)
    with param_gather_finished(chunks, overlap_optimizer_step):  # the last step's all-gathers
        params = gather_full(chunks)

    result = dict(logits=logits, loss=loss, grads=grads, params=params,
                  optimizers=len(getattr(optimizer, "chained_optimizers", [optimizer])))
    if instances > 1:  # the instances megatron-core built, and the ranks of each
        result["instances"] = (dist.get_world_size(parallel_state.get_inter_distributed_optimizer_instance_group()),
                               dist.get_world_size(parallel_state.get_intra_distributed_optimizer_instance_group()))
    if dp > 1 and not fsdp2:  # FSDP2's ranks hold different shards: no replicas to compare
        result["replicas"] = replica_checks(chunks)

    constraint = WEIGHT_CONSTRAINTS[family]
    if constraint:
        # One projection through the optimizer's post-step hook, from weights partly outside the ball,
        # with lr = 0 so that the Adam update itself changes nothing.
        perturbed = perturbed_weights(init, family)
        distributed.destroy_model_parallel()
        distributed.initialize(config.tensor_model_parallel_size, config.pipeline_model_parallel_size,
                               config.virtual_pipeline_model_parallel_size, context_parallel_size=cp,
                               num_distributed_optimizer_instances=instances)
        chunks = build_model_chunks(small_config(family, **layout), V, S, ddp_config,
                                    one_bucket_group=overlap_optimizer_step)
        load_full(chunks, perturbed)
        optimizer, _ = build_optimizer(chunks, RunConfig.from_flags(dict(
            model_family=family, lr=0.0, train_iters=1, min_lr=0.0, **optimizer_flags)))
        for chunk in chunks:
            chunk.zero_grad_buffer()
        optimizer.step()
        with param_gather_finished(chunks, overlap_optimizer_step):
            projected = gather_full(chunks)
        result.update(perturbed=perturbed, projected=projected, **describe_shards(optimizer))
        if args.reference:
            project_parameters_([unwrap(c) for c in chunks], constraint)  # idempotent: a second pass changes nothing
            result["projected_twice"] = gather_full(chunks)
    distributed.destroy_model_parallel()
    if cp > 1 and config.pipeline_model_parallel_size == config.tensor_model_parallel_size == 1 and instances == 1:
        # The same at CP 1 (data parallel instead) in this job: the reference runs neither. CP alone (cp2, cp4):
        # the attention paths do not meet the other splits.
        result["cp_logits"] = context_parallel_logits(family, layout, init, cp)
        result["cp1_logits"] = context_parallel_logits(family, layout, init, 1)
    return result if dist.get_rank() == 0 else None


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--reference", action="store_true")
    parser.add_argument("--reference-dir")
    parser.add_argument("--out", required=True)
    parser.add_argument("--families", default="angpt,gptplus,ngpt")
    parser.add_argument("--layouts", default="", help=f"comma-separated, of {', '.join(LAYOUTS)}")
    args = parser.parse_args()
    if args.reference:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
        dist.init_process_group("gloo", rank=0, world_size=1)
    else:
        distributed.initialize()  # joins the torchrun job
        distributed.destroy_model_parallel()
    layouts = {"reference": {}} if args.reference else {name: LAYOUTS[name] for name in args.layouts.split(",")}
    os.makedirs(args.out, exist_ok=True)
    for name, layout in layouts.items():
        for family in args.families.split(","):
            result = run_family(family, args, layout, dist.get_world_size())
            if result is not None:
                torch.save(result, os.path.join(args.out, f"{family}_{name}.pt"))
                print(f"{family} {name}: loss {result['loss']:.6f}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
