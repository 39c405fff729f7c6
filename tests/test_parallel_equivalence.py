"""Parallel layouts against the single-process model with the same weights, for all three families, fp32.

The layouts run as real processes under torchrun on gloo, all in one job
(tests/distributed/equivalence_worker.py), and record logits, loss, every gradient, the parameters after
three optimizer steps (with the family's bounding), and one bounding projection of weights pushed partly
outside the unit ball."""

import pytest
import torch

from conftest import run_workers

FAMILIES = ["angpt", "gptplus", "ngpt"]
LR = 1e-2  # the worker's learning rate
LAYOUTS = ["tp2", "tp2_sequence_parallel", "pp2", "pp2_interleaved", "pp2_interleaved_overlap_optimizer_step",
           "pp2_uneven", "pp2_layout", "pp2_layout_interleaved", "dp2", "dp2_fsdp2",
           "dp2_distributed_optimizer", "dp2_distributed_optimizer_instances2", "tp2_sequence_parallel_recompute",
           "cp2", "cp2_fsdp2", "tp2_distribute_saved_activations"]
# Context parallelism with the other splits: one launch of four processes, 75-115 s on the 2 cores of the test
# machine, so with the long checks (make test-long).
LAYOUTS_4 = ["tp2_sequence_parallel_cp2", "cp2_pp2", "cp4", "cp2_dp2_distributed_optimizer_instances2", "tp2_dp2_fsdp2"]


def params(names: list[str]) -> list:
    return [pytest.param(name, marks=pytest.mark.long) if name in LAYOUTS_4 else name for name in names]


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("reference")
    run_workers("equivalence_worker.py", "--reference", "--out", str(out), nproc=0)
    return out


@pytest.fixture(scope="session")
def layouts(reference, tmp_path_factory):
    out = tmp_path_factory.mktemp("layouts")
    run_workers("equivalence_worker.py", "--layouts", ",".join(LAYOUTS), "--reference-dir", str(reference),
                "--out", str(out))
    return out


@pytest.fixture(scope="session")
def layouts_4(reference, tmp_path_factory):
    out = tmp_path_factory.mktemp("layouts_4")
    run_workers("equivalence_worker.py", "--layouts", ",".join(LAYOUTS_4), "--reference-dir", str(reference),
                "--out", str(out), nproc=4)
    return out


@pytest.fixture(params=params(LAYOUTS + LAYOUTS_4))
def layout(request):
    return request.param, request.getfixturevalue("layouts_4" if request.param in LAYOUTS_4 else "layouts")


@pytest.mark.multiprocess
@pytest.mark.parametrize("family", FAMILIES)
def test_parallel_layout_matches_single_process(family, layout, reference):
    name, out = layout
    ref = torch.load(reference / f"{family}_reference.pt")
    par = torch.load(out / f"{family}_{name}.pt")
    assert set(par["params"]) == set(ref["params"])

    logits = relative(par["logits"], ref["logits"])
    loss = abs(par["loss"] - ref["loss"]) / abs(ref["loss"])
    # With the distributed optimizer only the optimizer differs from dp2, whose gradients are checked.
    grads = par["grads"] or ref["grads"]
    grad, grad_name = max((relative(grads[k], ref["grads"][k]), k) for k in ref["grads"])
    # Adam turns round-off in near-zero gradients into steps of up to lr for a few elements, so the
    # parameters are compared through their updates: ||update - reference update|| / ||reference update||.
    init = torch.load(reference / f"{family}_init.pt")
    param, param_name = max(
        ((par["params"][k] - ref["params"][k]).norm() / (ref["params"][k] - init[k]).norm().clamp_min(1e-30), k)
        for k in ref["params"]
    )
    print(f"{family} {name}: logits {logits:.2e} loss {loss:.2e} "
          f"grads {f'{grad:.2e} ({grad_name})' if par['grads'] else 'n/a (checked in dp2)'} "
          f"params after 3 steps {param:.2e} ({param_name})")
    assert logits < 1e-5 and loss < 1e-5
    assert grad < 1e-5, grad_name
    assert param < 1e-3, param_name
    # The parameters really moved, so the comparison above is not vacuous.
    assert max((ref["params"][k] - init[k]).abs().max().item() for k in ref["params"]) > LR


@pytest.mark.multiprocess
@pytest.mark.parametrize("family", ["angpt", "ngpt"])
def test_parallel_bounding_equals_single_process_exactly(family, layout, reference):
    name, out = layout
    ref = torch.load(reference / f"{family}_reference.pt")
    par = torch.load(out / f"{family}_{name}.pt")
    for key, tensor in ref["projected"].items():
        assert torch.equal(par["projected"][key], tensor), (name, key)
    if name == "dp2_distributed_optimizer":
        # The main-parameter shards cut weight rows, so partial row norms were reduced across ranks.
        assert par["optimizer"] == "DistributedOptimizer"
        assert par["rows_cut_by_shards"] > 0
    if name == "pp2_interleaved_overlap_optimizer_step":  # megatron-core's own optimizer for the first chunk
        assert par["optimizers"] == 2 and par["optimizer"] == "DistributedOptimizer"
    if name.endswith("_instances2"):  # two instances of the distributed optimizer, of DP x CP / 2 ranks each
        ranks = 2 if name.startswith("cp2_dp2") else 1
        assert par["optimizer"] == "DistributedOptimizer"
        assert par["instances"] == (2, ranks)
        assert (par["rows_cut_by_shards"] > 0) == (ranks > 1)


# "reference", a fixture of this file, puts these tests on the worker that built the layouts (tests/conftest.py:
# worker_group); a fixture asked for with getfixturevalue alone is not seen there, and the other worker ran the
# whole job a second time (109 s).
@pytest.mark.usefixtures("reference")
@pytest.mark.multiprocess
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("name", params(["cp2", "cp4"]))
def test_context_parallel_attention_paths_match_cp1(family, name, request):
    """Under CP, torch's SDPA (causal, lower-right aligned per chunk) and megatron-core's softmax with documents
    (--reset-attention-mask rows, --reset-position-ids angles) give CP 1's logits; the documents change them,
    so the masks and positions are not vacuous."""
    out = request.getfixturevalue("layouts_4" if name in LAYOUTS_4 else "layouts")
    par = torch.load(out / f"{family}_{name}.pt")
    for path in ("sdpa", "documents"):
        assert relative(par["cp_logits"][path], par["cp1_logits"][path]) < 1e-5, path
    assert relative(par["cp1_logits"]["documents"], par["cp1_logits"]["sdpa"]) > 1e-2


@pytest.mark.usefixtures("reference")
@pytest.mark.multiprocess
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("name", ["dp2", "dp2_distributed_optimizer"])
def test_the_weight_hash_check_finds_a_replica_one_ulp_apart(family, name, request):
    """--check-weight-hash-across-dp-replicas-interval's check passes on replicas as trained (the distributed
    optimizer's gathered shards included) and fails on every rank when one weight of one replica is one ulp off."""
    par = torch.load(request.getfixturevalue("layouts") / f"{family}_{name}.pt")
    assert par["replicas"] == {"as trained": True, "one weight changed on rank 1": False}
