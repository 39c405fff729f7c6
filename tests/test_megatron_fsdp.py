"""Megatron-FSDP (--use-megatron-fsdp): its flags and refusals; against DDP at DP 2, fp32, every family, the loss
of each step, every gradient the optimizer steps with (after clipping, so the grad norm too) and the weights after
each step, for each sharding strategy angpt takes, and at bf16 each step's loss and grad norm; anGPT's rows within
the unit ball and nGPT's unit vectors after each step and after a projection alone (docs/model.md); its fsdp_dtensor
checkpoints resumed bit for bit and loaded at DP 1; at DP 1 anGPT under each strategy as DDP; the trainer's logged
figures as DDP's, in hybrid sharding too (2 instances at 4 ranks, each strategy); checkpoints read across formats,
fsdp_dtensor under the distributed optimizer (or plain DDP's weights alone) and torch_dist under Megatron-FSDP,
continuing as the saving run went on.

The long tests launch this file as torchrun's two ranks (one job for everything) and compare what they saved.
"""

from __future__ import annotations

import argparse
import os
import sys

import pytest
import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallelConfig
from safetensors.torch import load_file
from test_trainer import copy_checkpoint, losses, records, train
from torch.distributed.tensor import DTensor

from angpt.config.arguments import parse_args
from angpt.config.sections import RunConfig
from angpt.hf.export import export
from angpt.models import WEIGHT_CONSTRAINTS
from angpt.training import checkpointing, distributed
from angpt.training.megatron_configs import ddp_config
from angpt.training.optimizer import build_optimizer
from angpt.training.step import build_model_chunks, train_step

from conftest import ROOT, run_workers

sys.path.insert(0, os.path.join(ROOT, "tests", "distributed"))
from equivalence_worker import replica_checks  # noqa: E402

from common import MICRO_BATCH, S, V, fixed_batches, small_config  # noqa: E402

FAMILIES = ["gpt", "gptplus", "angpt", "ngpt"]
STRATEGIES = ["no_shard", "optim", "optim_grads", "optim_grads_params"]
LR, STEPS = 1e-2, 3
# Three layers: with optim and optim_grads the shard boundary then falls inside layer 1's W_o (linear_proj), whose
# vectors are its rows in anGPT (unit_norm_dim 1: 20 rows on rank 0, 28 on rank 1) and its columns in nGPT
# (unit_norm_dim 0: each column split over the two ranks); with optim_grads_params inside fc1 and W_head (rows).
LAYERS = 3
# Saved at DP 2 after STEPS steps and resumed: at DP 2 exactly, at DP 1 under optim (its DTensors resharded).
RESUMED = ("angpt", "optim_grads_params")
# Checkpoints read across formats (checkpointing.load_checkpoint): each family saved at DP 2 under Megatron-FSDP
# (fsdp_dtensor) and under the distributed optimizer (torch_dist), each loaded under the other at DP 1, anGPT's
# torch_dist checkpoint under every strategy, and at DP 2 under one.
CROSSED = ["gpt", "angpt", "ngpt"]
SPLIT = {("angpt", "optim"): {1}, ("angpt", "optim_grads"): {1}, ("angpt", "optim_grads_params"): {1},
         ("ngpt", "optim"): {0}, ("ngpt", "optim_grads"): {0}, ("ngpt", "optim_grads_params"): {1}}


BASE = ["--mock-data", "--vocab-size", "64", "--train-iters", "4", "--num-layers", "2", "--hidden-size", "32",
        "--num-attention-heads", "4", "--seq-length", "16"]
FSDP = ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads", "--use-distributed-optimizer",
        "--ckpt-format", "fsdp_dtensor"]


@pytest.mark.parametrize("argv, message", [
    (["--use-megatron-fsdp"], "--use-megatron-fsdp needs --ckpt-format fsdp_dtensor (Megatron-LM's check)"),
    (["--ckpt-format", "fsdp_dtensor"], "--ckpt-format fsdp_dtensor needs --use-megatron-fsdp (Megatron-LM's check)"),
    (["--data-parallel-sharding-strategy", "optim"], "need --use-megatron-fsdp"),
    (["--no-gradient-reduce-div-fusion"], "need --use-megatron-fsdp"),
    ([*FSDP, "--no-use-distributed-optimizer"], "needs --use-distributed-optimizer"),
    ([*FSDP, "--use-torch-fsdp2"], "--use-torch-fsdp2"),
    ([*FSDP, "--data-parallel-sharding-strategy", "optim_grads_params", "--check-weight-hash-across-dp-replicas-"
      "interval", "1"], "no replicas (Megatron-LM's check)"),
    ([*FSDP, "--pipeline-model-parallel-size", "2"], "with pipeline parallelism: megatron-core 0.16.1's"),
    ([*FSDP, "--fsdp-double-buffer"], "not supported: not built with Megatron-FSDP"),
])
def test_megatron_fsdp_refuses_in_one_line(argv, message, capsys):
    with pytest.raises(SystemExit):
        parse_args([*BASE, "--micro-batch-size", "1", *argv], world_size=4)
    error = capsys.readouterr().err.splitlines()
    assert len(error) == 1 and message in error[0], error


def test_megatron_fsdp_flags_reach_megatron_cores_config():
    """As Megatron-LM's get_model builds it: Megatron-FSDP's settings in DistributedDataParallelConfig."""
    for strategy in STRATEGIES:
        config = ddp_config(parse_args([*BASE, *FSDP, "--data-parallel-sharding-strategy", strategy], world_size=2))
        assert (config.use_megatron_fsdp, config.use_custom_fsdp, config.data_parallel_sharding_strategy,
                config.use_distributed_optimizer, config.gradient_reduce_div_fusion) == (True, True, strategy, True,
                                                                                         True)
    unfused = ddp_config(parse_args([*BASE, *FSDP, "--no-gradient-reduce-div-fusion"], world_size=2))
    assert not unfused.gradient_reduce_div_fusion
    overlapped = ddp_config(parse_args([*BASE, *FSDP, "--overlap-grad-reduce", "--overlap-param-gather"], world_size=2))
    assert overlapped.overlap_grad_reduce and overlapped.overlap_param_gather
    context = parse_args([*BASE, *FSDP, "--context-parallel-size", "2", "--cp-comm-type", "all_gather"], world_size=2)
    assert context.parallel.context_parallel_size == 2 and context.parallel.use_megatron_fsdp
    hybrid = ddp_config(parse_args([*BASE, *FSDP, "--micro-batch-size", "1", "--num-distributed-optimizer-instances",
                                    "2"], world_size=4))
    assert hybrid.use_megatron_fsdp and hybrid.num_distributed_optimizer_instances == 2
    plain = ddp_config(parse_args(BASE, world_size=2))
    assert not plain.use_megatron_fsdp and plain.data_parallel_sharding_strategy == "no_shard"


@pytest.mark.parametrize("found, ckpt_format, message", [
    ("fsdp_dtensor", "torch", "is a distributed checkpoint (fsdp_dtensor) and this run has --ckpt-format torch: give "
                              "--auto-detect-ckpt-format to load it (as Megatron-LM)"),
    ("torch", "fsdp_dtensor", "is in Megatron-LM's torch format, which --use-megatron-fsdp does not read: continue it "
                              "under --ckpt-format torch_dist for a step and load that checkpoint"),
])
def test_checkpoint_formats_read_across_only_where_built_else_refused_in_one_line(tmp_path, found, ckpt_format,
                                                                                 message):
    """Told by the files (torch's .metadata without metadata.json: fsdp_dtensor; mp_rank_*: Megatron-LM's torch
    format), as in Megatron-LM, before anything is read. fsdp_dtensor and torch_dist read each other (the long tests
    below); Megatron-LM's torch format is read at its layout only, by a run outside Megatron-FSDP."""
    path = tmp_path / "iter_0000002"
    path.mkdir()
    (path / checkpointing.DCP_METADATA).write_bytes(b"")
    if found == "torch":
        (path / checkpointing.DCP_METADATA).unlink()
        (path / "mp_rank_00").mkdir()
    assert checkpointing.checkpoint_format(str(path)) == found
    with pytest.raises(checkpointing.CheckpointError) as error:
        checkpointing.load_checkpoint(str(path), [], None, None, ckpt_format=ckpt_format)
    assert str(error.value) == f"{path} {message}"


def _full(tensor) -> torch.Tensor:
    """The whole tensor of a Megatron-FSDP shard (a collective: its rows, rank after rank), or the tensor (no_shard's
    replicated DTensors too)."""
    if isinstance(tensor, DTensor) and not all(placement.is_replicate() for placement in tensor.placements):
        shards = [None] * dist.get_world_size()
        dist.all_gather_object(shards, tensor.to_local().detach().clone())
        return torch.cat(shards)
    return (tensor.to_local() if isinstance(tensor, DTensor) else tensor).detach().clone()


class _Run:
    """`family` at this job's data-parallel size under DDP (`strategy` None) or Megatron-FSDP, built as the trainer
    builds it (seeded alike), with what its steps are compared by."""

    def __init__(self, family: str, strategy: str | None, bf16: bool = False, tp: int = 1, cp: int = 1,
                 overlap: bool = False, distributed_optimizer: bool = False):
        # At bf16 DDP with the distributed optimizer (its fp32 main weights, as Megatron-FSDP's).
        distributed_optimizer = distributed_optimizer or bf16
        flags = dict(model_family=family, lr=LR, train_iters=2 * STEPS, bf16=bf16,
                     use_distributed_optimizer=distributed_optimizer)
        if strategy:
            flags.update(use_megatron_fsdp=True, data_parallel_sharding_strategy=strategy,
                         use_distributed_optimizer=True, ckpt_format="fsdp_dtensor", overlap_grad_reduce=overlap,
                         overlap_param_gather=overlap)
        distributed.initialize(tensor_model_parallel_size=tp, context_parallel_size=cp)
        config = RunConfig.from_flags(flags)
        dtype = torch.bfloat16 if bf16 else torch.float32
        model = small_config(family, num_layers=LAYERS, bf16=bf16, params_dtype=dtype, pipeline_dtype=dtype,
                             tensor_model_parallel_size=tp, context_parallel_size=cp,
                             **({"cp_comm_type": "all_gather"} if cp > 1 else {}))
        self.chunks = build_model_chunks(model, V, S, ddp_config(config) if strategy else DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, use_distributed_optimizer=distributed_optimizer))
        self.optimizer, self.scheduler = build_optimizer(self.chunks, config)
        model = self.chunks[0].module.module if strategy else self.chunks[0].module
        # Megatron-FSDP's model and optimizer hold DTensors over the model's weights (orig_param).
        weights = {name: getattr(param, "orig_param", param) for name, param in model.named_parameters()}
        self.names = {id(weight): name for name, weight in weights.items()}
        self.constrained = {name: weight.unit_norm_dim for name, weight in weights.items()
                            if hasattr(weight, "unit_norm_dim")}
        # The weights the optimizer steps: the model's under DDP, the main weights' shards under Megatron-FSDP (its
        # model's own shards are left to its buffers between steps); under DDP's distributed optimizer at fp32 the
        # model's, which its shards are views of.
        self.params = [param for group in self.optimizer.optimizer.param_groups for param in group["params"]] if (
            strategy or not distributed_optimizer) else list(model.parameters())
        rank, size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
        self.mine = fixed_batches()[rank::size]

    def by_name(self, tensors) -> dict:
        return {self.names[id(getattr(param, "orig_param", param))]: _full(tensor)
                for param, tensor in zip(self.params, tensors)}

    def weights(self) -> dict:
        return self.by_name(self.params)

    def step(self) -> tuple[float, float]:
        loss, grad_norm, updated = train_step(iter(self.mine), self.chunks, self.optimizer, self.scheduler,
                                              len(self.mine), MICRO_BATCH, S)
        assert updated
        return loss, grad_norm


def _run(family: str, strategy: str | None, **layout) -> dict:
    """Three steps: the losses, and after each step the gradients the optimizer stepped with and the weights, whole,
    by name; under Megatron-FSDP with anGPT or nGPT, `_projection`'s too. `layout`: _Run's cp and overlap."""
    run = _Run(family, strategy, **layout)
    grads = []
    run.optimizer.optimizer.register_step_pre_hook(lambda *_: grads.append(run.by_name(
        param.grad if param.grad is not None else torch.zeros_like(param) for param in run.params)))
    losses, grad_norms, weights = [], [], [run.weights()]
    for _ in range(STEPS):
        loss, grad_norm = run.step()
        losses.append(loss)
        grad_norms.append(grad_norm)
        weights.append(run.weights())
    result = dict(losses=losses, grad_norms=grad_norms, grads=grads, weights=weights, constrained=run.constrained)
    if strategy not in (None, "optim_grads_params") and parallel_state.get_data_parallel_world_size() > 1:
        result["replicas"] = replica_checks(run.chunks)
    if strategy and run.constrained:
        result.update(_projection(run))
    distributed.destroy_model_parallel()
    return result


def _bf16_run(family: str, strategy: str | None) -> dict:
    """Three steps at bf16: the losses and grad norms; under Megatron-FSDP the fp32 weights Adam steps after each
    step."""
    run = _Run(family, strategy, bf16=True)
    steps = [run.step() for _ in range(STEPS)] if not strategy else [(run.step(), run.weights())
                                                                      for _ in range(STEPS)]
    result = dict(steps=steps, constrained=run.constrained)
    distributed.destroy_model_parallel()
    return result


def _resume(family: str, strategy: str | None, root: str, saving: bool, tp: int = 1,
            distributed_optimizer: bool = False, load_optimizer: bool = True) -> dict:
    """STEPS steps, a save (`saving`, else a load of the save, in a fresh run), and STEPS more: the weights at the save
    or load, the last steps' losses and the weights after them; at tensor-parallel size `tp`; under Megatron-FSDP
    (`strategy`) in its fsdp_dtensor format, else DDP's torch_dist, whichever format the load finds."""
    run = _Run(family, strategy, tp=tp, distributed_optimizer=distributed_optimizer)
    ckpt_format = "fsdp_dtensor" if strategy else "torch_dist"
    if saving:
        os.makedirs(root, exist_ok=True)
        for _ in range(STEPS):
            run.step()
        checkpointing.save_checkpoint(root, checkpointing.TrainState(iteration=STEPS), run.chunks, run.optimizer,
                                      run.scheduler, {}, ckpt_format=ckpt_format)
    else:
        checkpointing.load_checkpoint(checkpointing.checkpoint_dir(root, STEPS), run.chunks, run.optimizer,
                                      run.scheduler, ckpt_format=ckpt_format, load_optimizer=load_optimizer)
    start = run.weights()
    losses = [run.step() for _ in range(STEPS)]
    result = dict(start=start, losses=losses, weights=run.weights())
    distributed.destroy_model_parallel()
    return result


def _projection(run: _Run) -> dict:
    """One more step at lr 0 from the weights with rows scaled by 0.3-3 (pushed out of the unit ball and into it):
    the perturbed weights, the weights after the step (the projection alone), and where each rank's shard of each
    constrained weight lies ({name: [(first element, elements) per rank]})."""
    generator = torch.Generator().manual_seed(7)
    current = run.weights()
    perturbed = {name: tensor * torch.empty(tensor.shape[0], 1).uniform_(0.3, 3.0, generator=generator)
                 for name, tensor in sorted(current.items()) if name in run.constrained}
    shards = {}
    with torch.no_grad():
        for param in run.params:
            name = run.names[id(param.orig_param)]
            if name in perturbed:
                shard = param.megatron_fsdp_slice
                param.to_local().view(-1).copy_(perturbed[name].view(-1)[shard])
                shards[name] = (shard.start, shard.stop - shard.start)
    for group in run.optimizer.param_groups:
        group["lr"] = 0.0
    run.step()
    projected = {name: tensor for name, tensor in run.weights().items() if name in run.constrained}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, shards)
    return dict(perturbed=perturbed, projected=projected,
                shards={name: [rank_shards[name] for rank_shards in everyone] for name in perturbed})


def worker(out: str, families: list[str], strategies: list[str], resumed: str | None) -> None:
    """At DP 2: each family under DDP and each strategy, then RESUMED's saves, loads and continuous runs (in `out`);
    at DP 1 (`resumed`, the DP 2 job's `out`): the load of its save under optim, and anGPT under DDP and each
    strategy."""
    distributed.initialize()  # joins the torchrun job
    distributed.destroy_model_parallel()
    if resumed:
        result = _resume(RESUMED[0], "optim", os.path.join(resumed, "checkpoints"), saving=False)
        torch.save(result, os.path.join(out, "resumed_dp1.pt"))
        for strategy in (None, *STRATEGIES):
            torch.save(_run("angpt", strategy), os.path.join(out, f"dp1_angpt_{strategy or 'ddp'}.pt"))
        for family in CROSSED:  # the DP 2 job's checkpoints, read across formats
            fsdp_dtensor, torch_dist = (os.path.join(resumed, f"{kind}_{family}") for kind in ("fsdp", "distopt"))
            torch.save(_resume(family, None, fsdp_dtensor, saving=False, distributed_optimizer=True),
                       os.path.join(out, f"crossed_{family}_fsdp_to_distopt_dp1.pt"))
            for strategy in STRATEGIES if family == "angpt" else ["optim_grads_params"]:
                torch.save(_resume(family, strategy, torch_dist, saving=False),
                           os.path.join(out, f"crossed_{family}_distopt_to_{strategy}_dp1.pt"))
        # Plain DDP takes the weights alone (Adam's state of the distributed optimizer is not its own).
        torch.save(_resume("angpt", None, os.path.join(resumed, "fsdp_angpt"), saving=False, load_optimizer=False),
                   os.path.join(out, "crossed_angpt_fsdp_to_ddp_dp1.pt"))
        torch.save(_run("angpt", "optim", overlap=True), os.path.join(out, "dp1_angpt_optim_overlap.pt"))
        dist.destroy_process_group()
        return
    for family in families:
        for strategy in [None, *strategies]:
            result = _run(family, strategy)
            if dist.get_rank() == 0:
                torch.save(result, os.path.join(out, f"{family}_{strategy or 'ddp'}.pt"))
                print(f"{family} {strategy or 'ddp'}: losses {result['losses']} grad norms {result['grad_norms']}",
                      flush=True)
    for family in ("angpt", "ngpt"):  # CP 2 x DP 1: sharded over the data x context group
        for strategy in strategies:
            result = _run(family, strategy, cp=2)
            if dist.get_rank() == 0:
                torch.save(result, os.path.join(out, f"{family}_{strategy}_cp2.pt"))
        result = _run(family, "optim", overlap=True)
        if dist.get_rank() == 0:
            torch.save(result, os.path.join(out, f"{family}_optim_overlap.pt"))
    for family in families:
        for strategy in [None, *strategies]:
            result = _bf16_run(family, strategy)
            if dist.get_rank() == 0:
                torch.save(result, os.path.join(out, f"{family}_{strategy or 'ddp'}_bf16.pt"))
    family, strategy = RESUMED
    for saving in (True, False):
        result = _resume(family, strategy, os.path.join(out, "checkpoints"), saving)
        if dist.get_rank() == 0:
            torch.save(result, os.path.join(out, f"resumed_{'saved' if saving else 'loaded'}.pt"))
    for saving in (True, False):  # no_shard's whole replicated weights
        result = _resume(family, "no_shard", os.path.join(out, "checkpoints_no_shard"), saving)
        if dist.get_rank() == 0:
            torch.save(result, os.path.join(out, f"no_shard_{'saved' if saving else 'loaded'}.pt"))
    for tp, saving in ((2, True), (1, False)):  # saved at TP 2 x DP 1, loaded at TP 1 x DP 2
        result = _resume(family, strategy, os.path.join(out, "checkpoints_tp2"), saving, tp)
        if dist.get_rank() == 0:
            torch.save(result, os.path.join(out, f"resharded_tp{tp}.pt"))
    for family in CROSSED:  # saved for the DP 1 job; the distributed optimizer's loaded here too
        for name, strategy in (("fsdp", "optim_grads"), ("distopt", None)):
            result = _resume(family, strategy, os.path.join(out, f"{name}_{family}"), saving=True,
                             distributed_optimizer=True)
            if dist.get_rank() == 0:
                torch.save(result, os.path.join(out, f"crossed_{family}_{name}_saved.pt"))
        result = _resume(family, "optim", os.path.join(out, f"distopt_{family}"), saving=False)
        if dist.get_rank() == 0:
            torch.save(result, os.path.join(out, f"crossed_{family}_distopt_to_optim_dp2.pt"))
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    # The DP 2 job: about 60 runs of 3 to 6 steps, 4.5 minutes on a quiet 2-core machine, twice that beside another
    # long job (it overran 600 s in make test-long once).
    out = tmp_path_factory.mktemp("megatron_fsdp")
    run_workers(os.path.abspath(__file__), "--out", str(out), timeout=1500)
    run_workers(os.path.abspath(__file__), "--out", str(out), "--resumed", str(out), nproc=1, timeout=900)
    return out


@pytest.mark.long
@pytest.mark.multiprocess
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("family", FAMILIES)
def test_megatron_fsdp_trains_as_ddp(runs, family, strategy):
    _trains_as(torch.load(runs / f"{family}_ddp.pt"), torch.load(runs / f"{family}_{strategy}.pt"))


@pytest.mark.long
@pytest.mark.multiprocess
@pytest.mark.parametrize("strategy", ["no_shard", "optim", "optim_grads"])
@pytest.mark.parametrize("family", FAMILIES)
def test_the_weight_hash_check_finds_a_megatron_fsdp_replica_one_ulp_apart(runs, family, strategy):
    """--check-weight-hash-across-dp-replicas-interval under the strategies whose ranks hold the weights whole (as
    Megatron-LM, which refuses optim_grads_params only): it passes on the replicas as trained and fails on every rank
    when one weight of one replica is one ulp off."""
    assert torch.load(runs / f"{family}_{strategy}.pt")["replicas"] == {"as trained": True,
                                                                         "one weight changed on rank 1": False}


# Megatron-FSDP's other layouts at world size 2 against DDP at DP 2, anGPT and nGPT: CP 2 x DP 1 under each strategy
# (sharded over the data x context group, each rank holding half of each sequence), and optim with
# --overlap-grad-reduce and --overlap-param-gather (its unsharded gradient buffer reduced in the backward pass).
VARIANTS = [*(f"{strategy}_cp2" for strategy in STRATEGIES), "optim_overlap"]


@pytest.mark.long
@pytest.mark.multiprocess
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("family", ["angpt", "ngpt"])
def test_megatron_fsdp_with_context_parallelism_or_overlap_trains_as_ddp(runs, family, variant):
    """Each step's loss, gradients and weights as DDP's, and one projection alone as the spec's. optim's overlapped
    reduction installs the reduced shard into the unsharded buffer (angpt.megatron_compat.megatron_fsdp): added to the
    unreduced one, or dropped, the grad norm was 0.147 against DDP's 0.215."""
    fsdp = torch.load(runs / f"{family}_{variant}.pt")
    _trains_as(torch.load(runs / f"{family}_ddp.pt"), fsdp)
    _projected_as_the_spec(family, fsdp)


def _trains_as(ddp: dict, fsdp: dict) -> None:
    # fp32 arithmetic in another order (the reduce-scatter's sums, the grad norm's): the bounds that
    # tests/test_parallel_equivalence.py holds parallel layouts to.
    assert fsdp["losses"] == pytest.approx(ddp["losses"], rel=1e-6)
    assert fsdp["grad_norms"] == pytest.approx(ddp["grad_norms"], rel=1e-6)
    assert len(ddp["grads"]) == STEPS  # Megatron-FSDP's run has a fourth, the projection's (lr 0)
    for step, (theirs, ours) in enumerate(zip(ddp["grads"], fsdp["grads"])):
        assert set(ours) == set(theirs)
        for name in theirs:
            scale = theirs[name].abs().max().clamp_min(1e-30)
            assert (ours[name] - theirs[name]).abs().max() <= 1e-5 * scale, f"step {step}: the gradient of {name}"
    init = ddp["weights"][0]
    assert fsdp["weights"][0].keys() == init.keys()
    for name in init:
        assert torch.equal(fsdp["weights"][0][name], init[name]), name
    # Adam turns round-off in near-zero gradients into steps of up to lr for a few elements: the weights are compared
    # through their updates.
    for step, (theirs, ours) in enumerate(zip(ddp["weights"][1:], fsdp["weights"][1:]), 1):
        for name in init:
            moved = (theirs[name] - init[name]).norm().clamp_min(1e-30)
            assert (ours[name] - theirs[name]).norm() / moved < 1e-3, f"step {step}: {name}"


@pytest.mark.long
@pytest.mark.multiprocess
@pytest.mark.parametrize("strategy", [*STRATEGIES, "optim_overlap"])
def test_megatron_fsdp_trains_as_ddp_at_one_data_parallel_rank(runs, strategy):
    """At DP 1 Megatron-FSDP's buffers are not distributed, where megatron-core 0.16.1 added each reduced gradient
    bucket into itself (angpt.megatron_compat.megatron_fsdp): anGPT's gradients, over the global batch's micro-batches
    accumulated (optim_overlap: reduced in the last one's backward pass), as DDP's."""
    ddp, fsdp = (torch.load(runs / f"dp1_angpt_{name}.pt") for name in ("ddp", strategy))
    assert fsdp["losses"] == pytest.approx(ddp["losses"], rel=1e-6)
    assert fsdp["grad_norms"] == pytest.approx(ddp["grad_norms"], rel=1e-6)
    for step, (theirs, ours) in enumerate(zip(ddp["grads"], fsdp["grads"])):
        for name in theirs:
            scale = theirs[name].abs().max().clamp_min(1e-30)
            assert (ours[name] - theirs[name]).abs().max() <= 1e-5 * scale, f"step {step}: the gradient of {name}"


@pytest.mark.long
@pytest.mark.multiprocess
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("family", ["angpt", "ngpt"])
def test_megatron_fsdp_shards_are_bounded_as_the_spec(runs, family, strategy):
    """anGPT's rows (or columns) within the unit ball and nGPT's on the unit sphere after each step, and one
    projection alone (lr 0) of weights pushed out of the ball and into it equal to the spec's
    w / max(1, ||w||) (anGPT) or w / ||w|| (nGPT), computed here, where a rank's shard holds part of a vector too."""
    fsdp = torch.load(runs / f"{family}_{strategy}.pt")
    _projected_as_the_spec(family, fsdp)
    if strategy == "no_shard":  # every weight whole on both ranks
        assert all(shards == [(0, fsdp["perturbed"][name].numel())] * 2 for name, shards in fsdp["shards"].items())
        return
    # The unit_norm_dim of the weights held on both ranks (whole rows on each): 1, its rows on one rank each; 0, each
    # column split over the ranks.
    split = {fsdp["constrained"][name] for name, shards in fsdp["shards"].items() if all(size for _, size in shards)}
    assert split == SPLIT[family, strategy]


def _projected_as_the_spec(family: str, fsdp: dict) -> None:
    constraint = WEIGHT_CONSTRAINTS[family]
    assert fsdp["constrained"]
    for weights in fsdp["weights"][1:]:
        for name, dim in fsdp["constrained"].items():
            norms = weights[name].norm(dim=dim)
            if constraint == "bound":
                assert norms.max() <= 1 + 1e-6, name
            else:
                assert torch.allclose(norms, torch.ones_like(norms), atol=1e-6), name
    for name, perturbed in fsdp["perturbed"].items():
        norms = perturbed.norm(dim=fsdp["constrained"][name], keepdim=True)
        expected = perturbed / (norms.clamp_min(1.0) if constraint == "bound" else norms)
        assert torch.allclose(fsdp["projected"][name], expected, rtol=1e-6, atol=1e-7), name


@pytest.mark.long
@pytest.mark.multiprocess
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("family", FAMILIES)
def test_megatron_fsdp_trains_as_ddp_at_bf16(runs, family, strategy):
    """At bf16 against DDP with the distributed optimizer: each step's loss and grad norm within bf16 round-off (the
    weights all-gathered and the gradients reduced in other orders), and anGPT's and nGPT's fp32 weights bounded or
    normalized after each step (docs/model.md)."""
    ddp = torch.load(runs / f"{family}_ddp_bf16.pt")
    fsdp = torch.load(runs / f"{family}_{strategy}_bf16.pt")
    ours = [value for (loss_and_norm, _) in fsdp["steps"] for value in loss_and_norm]
    assert ours == pytest.approx([value for loss_and_norm in ddp["steps"] for value in loss_and_norm], rel=1e-3)
    constraint = WEIGHT_CONSTRAINTS[family]
    assert bool(fsdp["constrained"]) == bool(constraint)
    for _, weights in fsdp["steps"]:
        for name, dim in fsdp["constrained"].items():
            assert weights[name].dtype == torch.float32
            norms = weights[name].norm(dim=dim)
            if constraint == "bound":
                assert norms.max() <= 1 + 1e-6, name
            else:
                assert torch.allclose(norms, torch.ones_like(norms), atol=1e-6), name


@pytest.mark.long
@pytest.mark.multiprocess
def test_fsdp_dtensor_checkpoint_resumes_bit_for_bit_and_loads_at_another_data_parallel_size(runs):
    """--ckpt-format fsdp_dtensor (RESUMED, DP 2): the three steps after a load equal those after the save, every
    loss and weight bit for bit; loaded at DP 1 under optim, they equal them within fp32 round-off (the micro-batches'
    gradients summed in another order)."""
    saved, loaded = torch.load(runs / "resumed_saved.pt"), torch.load(runs / "resumed_loaded.pt")
    assert loaded["losses"] == saved["losses"]
    assert loaded["weights"].keys() == saved["weights"].keys()
    for name, weight in saved["weights"].items():
        assert torch.equal(loaded["weights"][name], weight), name
    elsewhere = torch.load(runs / "resumed_dp1.pt")
    assert [loss for loss, _ in elsewhere["losses"]] == pytest.approx([loss for loss, _ in saved["losses"]], rel=1e-6)
    assert [norm for _, norm in elsewhere["losses"]] == pytest.approx([norm for _, norm in saved["losses"]], rel=1e-5)
    for name, weight in saved["weights"].items():
        assert (elsewhere["weights"][name] - weight).norm() <= 1e-5 * weight.norm(), name


@pytest.mark.long
@pytest.mark.multiprocess
def test_fsdp_dtensor_checkpoint_of_no_shard_resumes_bit_for_bit(runs):
    """anGPT under no_shard (DP 2): the three steps after a load of its fsdp_dtensor save equal those after the save,
    every loss and weight bit for bit (its gated fc1 split into W and V over its whole weights)."""
    saved, loaded = torch.load(runs / "no_shard_saved.pt"), torch.load(runs / "no_shard_loaded.pt")
    assert loaded["losses"] == saved["losses"]
    assert loaded["weights"].keys() == saved["weights"].keys()
    for name, weight in saved["weights"].items():
        assert torch.equal(loaded["weights"][name], weight), name


@pytest.mark.long
@pytest.mark.multiprocess
def test_fsdp_dtensor_checkpoint_saved_at_tp2_continues_at_tp1(runs):
    """anGPT under optim_grads_params saved at TP 2 x DP 1 and loaded at TP 1 x DP 2: the loaded run's next steps are
    the saving run's, to the rounding of TP's partial sums. fc1 holds W and V; saved whole, its DTensor over TP would be
    [W_0; V_0; W_1; V_1] and load at TP 1 as [W; V] wrongly (Megatron-LM's split: angpt.training.checkpointing)."""
    saved, loaded = (torch.load(runs / f"resharded_tp{tp}.pt") for tp in (2, 1))
    assert [loss for loss, _ in loaded["losses"]] == pytest.approx([loss for loss, _ in saved["losses"]], rel=1e-5)
    assert [norm for _, norm in loaded["losses"]] == pytest.approx([norm for _, norm in saved["losses"]], rel=1e-4)


def _continues(saved: dict, loaded: dict) -> None:
    """`loaded` (`_resume`'s, after a load) continued `saved` (`_resume`'s, after the save) as if uninterrupted: the
    weights read back bit for bit, and the next steps' losses within 1e-6 and grad norms within 1e-5 relative (fp32;
    the micro-batches' gradients summed in another order and by other ranks: the bounds of the DP 1 resume above), the
    weights through their updates as in test_megatron_fsdp_trains_as_ddp (Adam turns round-off in gpt's key biases,
    whose true gradient is 0, into steps)."""
    assert loaded["start"].keys() == saved["start"].keys()
    for name, weight in saved["start"].items():
        assert torch.equal(loaded["start"][name], weight), name
    assert [loss for loss, _ in loaded["losses"]] == pytest.approx([loss for loss, _ in saved["losses"]], rel=1e-6)
    assert [norm for _, norm in loaded["losses"]] == pytest.approx([norm for _, norm in saved["losses"]], rel=1e-5)
    for name, weight in saved["weights"].items():
        moved = (weight - saved["start"][name]).norm().clamp_min(1e-30)
        assert (loaded["weights"][name] - weight).norm() / moved < 1e-3, name


@pytest.mark.long
@pytest.mark.multiprocess
@pytest.mark.parametrize("family", CROSSED)
def test_an_fsdp_dtensor_checkpoint_continues_under_the_distributed_optimizer_at_dp1(runs, family):
    """Megatron-FSDP's checkpoint (optim_grads, DP 2) loaded by DDP with the distributed optimizer at DP 1, read
    across formats: Megatron-FSDP's fp32 main weights as the weights (fc1's W and V joined into [W; V], the layers
    stacked), Adam's moments and step, the scheduler; it continues as Megatron-FSDP went on after its save."""
    _continues(*(torch.load(runs / f"crossed_{family}_{name}.pt") for name in ("fsdp_saved", "fsdp_to_distopt_dp1")))


@pytest.mark.long
@pytest.mark.multiprocess
def test_plain_ddp_takes_an_fsdp_dtensor_checkpoints_weights_alone(runs):
    """Without the distributed optimizer (--no-load-optim: its Adam state is not plain DDP's, the rule for every
    resume into the other optimizer kind), anGPT's weights as saved, bit for bit: the first step's loss, which they
    alone give, as Megatron-FSDP's after its save (1e-6, the DP 1 resume's bound); Adam starts afresh, so the next
    are not."""
    saved, loaded = (torch.load(runs / f"crossed_angpt_{name}.pt") for name in ("fsdp_saved", "fsdp_to_ddp_dp1"))
    for name, weight in saved["start"].items():
        assert torch.equal(loaded["start"][name], weight), name
    assert loaded["losses"][0][0] == pytest.approx(saved["losses"][0][0], rel=1e-6)
    assert loaded["losses"][1][0] != pytest.approx(saved["losses"][1][0], rel=1e-6)


@pytest.mark.long
@pytest.mark.multiprocess
@pytest.mark.parametrize("family, strategy, size", [
    *(("angpt", strategy, 1) for strategy in STRATEGIES), ("gpt", "optim_grads_params", 1),
    ("ngpt", "optim_grads_params", 1), *((family, "optim", 2) for family in CROSSED)])
def test_a_torch_dist_checkpoint_continues_under_megatron_fsdp(runs, family, strategy, size):
    """The distributed optimizer's torch_dist checkpoint (DP 2) loaded under Megatron-FSDP at DP `size`, read across
    formats: the distributed optimizer's fp32 main weights into Megatron-FSDP's shards (fc1's rows [W; V] into W and
    V), Adam's moments and step, the scheduler; it continues as the distributed optimizer went on after its save."""
    _continues(*(torch.load(runs / f"crossed_{family}_{name}.pt")
                 for name in ("distopt_saved", f"distopt_to_{strategy}_dp{size}")))


def _main_weights(run_dir, iteration: int) -> dict[str, torch.Tensor]:
    """The fp32 main weights a checkpoint holds, by torch_dist's names: Megatron-FSDP's model weights (fsdp_dtensor),
    the distributed optimizer's `param` state (torch_dist)."""
    path = os.path.join(run_dir, f"iter_{iteration:07d}")
    tensors, state = checkpointing.read_plain_tensors(path), "optimizer.state.param."
    if checkpointing.checkpoint_format(path) == "fsdp_dtensor":
        return {name: tensor for name, tensor in tensors.items() if not name.startswith("optimizer.")}
    return {name[len(state):]: tensor for name, tensor in tensors.items() if name.startswith(state)}


@pytest.mark.long
@pytest.mark.multiprocess
def test_the_trainer_reads_checkpoints_across_megatron_fsdp_and_the_distributed_optimizer_at_bf16(tmp_path,
                                                                                                 single_process):
    """angpt.pretrain, anGPT at --bf16 (bf16 weights, fp32 scales and main weights): Megatron-FSDP's checkpoint of
    iteration 2 (optim_grads_params, DP 2) continued by the distributed optimizer at DP 1, and the distributed
    optimizer's (DP 2) by Megatron-FSDP at DP 1, each saying so in its load's line. Iterations 3 and 4 log the
    uninterrupted run's losses within 1e-5 relative: iteration 3's is the forward of the same bf16 weights (the
    roundings of the same fp32 main weights) averaged in another order (1e-6); iteration 4's follows an update from
    gradients summed in another order, whose 1e-6 can flip the bf16 rounding (2^-8) of a few weights. The fp32 main
    weights saved at iteration 4 are the uninterrupted run's within 1e-6 relative (two Adam steps from gradients
    equal to 1e-6; main weights taken from the bf16 weights would be 2^-9 off). Plain DDP is
    refused the distributed optimizer's state in one line, and with --no-load-optim takes the weights: its first
    loss, theirs alone, is the uninterrupted run's."""
    common = ["--model-family", "angpt", "--lr-decay-iters", "4", "--bf16", "--train-iters", "4", "--save-interval",
              "2"]
    fsdp = [*FSDP, "--data-parallel-sharding-strategy", "optim_grads_params"]
    sharded, distributed_optimizer = tmp_path / "fsdp", tmp_path / "distributed_optimizer"
    train(*common, *fsdp, "--save", str(sharded))
    train(*common, "--use-distributed-optimizer", "--save", str(distributed_optimizer))
    for source, flags, found, run_format in ((sharded, ["--use-distributed-optimizer"], "fsdp_dtensor", "torch_dist"),
                                             (distributed_optimizer, fsdp, "torch_dist", "fsdp_dtensor")):
        continued = copy_checkpoint(source, 2, tmp_path / f"from_{found}")
        output = train(*common, *flags, "--load", continued, "--save", continued, nproc=1)
        assert output.count(f"(iteration 2), its {found} read across formats into this run's {run_format}") == 1
        theirs, ours = _main_weights(source, 4), _main_weights(continued, 4)
        assert ours.keys() == theirs.keys()
        for name, weight in theirs.items():
            assert (ours[name] - weight).norm() <= 1e-6 * weight.norm(), (found, name)
        assert losses(continued).keys() == {3, 4}
        for iteration, loss in losses(continued).items():
            assert loss == pytest.approx(losses(source)[iteration], rel=1e-5), (found, iteration)
    plain = copy_checkpoint(sharded, 2, tmp_path / "plain")
    output = train(*common, "--load", plain, "--save", plain, nproc=1, expect=1)
    assert output.count("was saved with the distributed optimizer and this run is without the distributed optimizer: "
                        "its optimizer state does not convert") == 1
    train(*common, "--load", plain, "--save", plain, "--no-load-optim", nproc=1)
    assert losses(plain)[3] == pytest.approx(losses(sharded)[3], rel=1e-6)


@pytest.mark.long
@pytest.mark.multiprocess
@pytest.mark.parametrize("family, strategy, health", [("ngpt", "optim_grads", "health/alpha_mlp/layer_01"),
                                                      ("angpt", "optim_grads_params", "health/rows_at_bound")])
def test_the_trainer_under_megatron_fsdp_logs_as_ddp_and_resumes_its_checkpoint_bit_for_bit(tmp_path, family,
                                                                                           strategy, health):
    """angpt.pretrain with --use-megatron-fsdp (DP 2): every logged figure (loss, grad norm, params norm, the health
    probe's, which optim_grads_params reads from the weights its step gathers) as DDP's within fp32 round-off; stopped
    at iteration 2 and resumed from its fsdp_dtensor checkpoint, iterations 3 and 4 as the uninterrupted run's, bit
    for bit; its Hugging Face export (fc1's halves joined again) as DDP's torch_dist checkpoint's, weight by weight.
    With optim_grads, the weight-hash check after every step finds the replicas alike (no false alarm)."""
    common = ["--model-family", family, "--lr-decay-iters", "4", "--log-params-norm"]
    fsdp = [*FSDP, "--data-parallel-sharding-strategy", strategy]
    if strategy != "optim_grads_params":  # whole weights on every rank: replicas to compare after each step
        fsdp += ["--check-weight-hash-across-dp-replicas-interval", "1"]
    ddp, whole, resumed = (tmp_path / name for name in ("ddp", "whole", "resumed"))
    train(*common, "--train-iters", "4", "--save", str(ddp))
    train(*common, *fsdp, "--train-iters", "4", "--save", str(whole))
    # --async-save, which Megatron-LM ignores with fsdp_dtensor (said in one line): the same checkpoint, at once.
    said = "--async-save: fsdp_dtensor checkpoints are written by the training processes before training goes on"
    assert train(*common, *fsdp, "--train-iters", "2", "--save", str(resumed), "--async-save").count(said) == 1
    train(*common, *fsdp, "--train-iters", "4", "--save", str(resumed), "--load", str(resumed))

    theirs, ours, again = _figures(ddp), _figures(whole), _figures(resumed)
    assert set(ours) == set(theirs) == set(again) == {1, 2, 3, 4}
    for iteration, figure in theirs.items():
        assert figure.keys() == ours[iteration].keys() and health in figure
        assert ours[iteration] == pytest.approx(figure, rel=1e-5, abs=1e-9), iteration
    assert {i: again[i] for i in (3, 4)} == {i: ours[i] for i in (3, 4)}
    exported = {}
    for name, run_dir in (("ddp", ddp), ("fsdp", whole)):
        export(str(run_dir), str(tmp_path / f"hf_{name}"))
        exported[name] = load_file(str(tmp_path / f"hf_{name}" / "model.safetensors"))
    assert exported["fsdp"].keys() == exported["ddp"].keys()
    for key, weight in exported["ddp"].items():
        assert (exported["fsdp"][key] - weight).norm() <= 1e-5 * weight.norm(), key


def _figures(run_dir) -> dict[int, dict]:
    """The logged figures of each iteration: the loss, the norms, the health probe's."""
    return {r["iteration"]: {key: value for key, value in r.items() if key == "lm_loss" or key.endswith("_norm")
                             or key.startswith("health/")} for r in records(run_dir)}


HYBRID = ["--model-family", "angpt", "--lr-decay-iters", "4", "--log-params-norm", "--train-iters", "4",
          "--use-distributed-optimizer", "--num-distributed-optimizer-instances", "2"]


@pytest.fixture(scope="module")
def hybrid_ddp(tmp_path_factory) -> dict[int, dict]:
    """The figures DDP logs with the distributed optimizer in 2 instances at 4 ranks (anGPT)."""
    run_dir = tmp_path_factory.mktemp("hybrid") / "ddp"
    train(*HYBRID, "--save", str(run_dir), nproc=4)
    return _figures(run_dir)


@pytest.mark.long
@pytest.mark.multiprocess
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_megatron_fsdp_in_two_instances_logs_as_ddp_and_resumes_its_checkpoint_bit_for_bit(tmp_path, hybrid_ddp,
                                                                                          strategy):
    """Hybrid sharding (--num-distributed-optimizer-instances 2 at 4 ranks: each strategy within an instance of 2
    ranks, replicated over the instances; anGPT): every logged figure (loss, grad norm, params norm, the health
    probe's) as DDP's with the distributed optimizer in 2 instances, within fp32 round-off, where before iteration 2
    logged a loss of 5.5041 against 5.4701 (the bounding summed each row's squared norm over both instances: every
    weight row at norm 1/sqrt(2)), optim and no_shard stepped each instance with its own half of the gradient (grad
    norm 0.093 against 0.152), and no_shard failed at its first step (its DTensors over the 2-D mesh with one
    placement); stopped at iteration 2 and resumed from its fsdp_dtensor checkpoint, iterations 3 and 4 as the
    uninterrupted run's, bit for bit. Where weights are whole on every rank the weight-hash check after every step
    finds the replicas, of both instances, alike."""
    fsdp = [*FSDP, "--data-parallel-sharding-strategy", strategy]
    if strategy != "optim_grads_params":
        fsdp += ["--check-weight-hash-across-dp-replicas-interval", "1"]
    whole = tmp_path / "whole"
    train(*HYBRID, *fsdp, "--save", str(whole), "--save-interval", "2", nproc=4)
    resumed = copy_checkpoint(whole, 2, tmp_path / "resumed")
    train(*HYBRID, *fsdp, "--save", resumed, "--load", resumed, nproc=4)
    ours, again = _figures(whole), _figures(resumed)
    assert set(ours) == set(hybrid_ddp) == {1, 2, 3, 4} and set(again) == {3, 4}
    for iteration, figure in hybrid_ddp.items():
        assert figure.keys() == ours[iteration].keys() and "health/rows_at_bound" in figure
        assert ours[iteration] == pytest.approx(figure, rel=1e-5, abs=1e-9), iteration
    assert again == {i: ours[i] for i in (3, 4)}


@pytest.mark.long
@pytest.mark.multiprocess
def test_megatron_fsdp_at_fp16_finds_its_loss_scale_as_ddp_and_resumes_exactly(tmp_path):
    """--fp16 under Megatron-FSDP (optim_grads_params, DP 2, anGPT; refused before: megatron-core's loss scaler read
    the gradient of every parameter, and a rank's empty shard has none): megatron-core's dynamic loss scaler, from
    Megatron-LM's 2^32, skips the same steps and settles at the same scale as DDP with the distributed optimizer, whose
    losses it logs within fp16 round-off (rel 1e-3: the weights all-gathered and the gradients reduced in other
    orders, 2^-11 per rounding). Resumed at 12 from its fsdp_dtensor checkpoint, iterations 13-16 and their loss scales
    are the uninterrupted run's, bit for bit: the scaler's state is in the checkpoint (a scale started over from 2^32
    would skip steps again)."""
    fp16 = ["--model-family", "angpt", "--fp16", "--train-iters", "16", "--lr-decay-iters", "16",
            "--max-skipped-steps", "3"]
    fsdp = [*FSDP, "--data-parallel-sharding-strategy", "optim_grads_params"]
    ddp, whole = tmp_path / "ddp", tmp_path / "whole"
    train(*fp16, "--use-distributed-optimizer", "--save", str(ddp))
    train(*fp16, *fsdp, "--save", str(whole), "--save-interval", "12")
    theirs, ours = records(ddp), records(whole)
    skipped = [r["skipped"] for r in ours]
    assert skipped == [r["skipped"] for r in theirs] and skipped[0] and not any(skipped[11:])
    assert [r["loss_scale"] for r in ours] == [r["loss_scale"] for r in theirs]
    assert [r["lm_loss"] for r in ours] == pytest.approx([r["lm_loss"] for r in theirs], rel=1e-3)
    resumed = copy_checkpoint(whole, 12, tmp_path / "resumed")
    train(*fp16, *fsdp, "--save", resumed, "--load", resumed)
    assert losses(resumed) == {iteration: loss for iteration, loss in losses(whole).items() if iteration > 12}
    assert [r["loss_scale"] for r in records(resumed)] == [r["loss_scale"] for r in ours[12:]]


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--resumed", help="load this DP 2 job's checkpoint at DP 1")
    args = parser.parse_args()
    worker(args.out, args.families.split(","), args.strategies.split(","), args.resumed)

