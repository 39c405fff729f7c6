"""Learnable scales (docs/model.md, Learnable scales) one at a time, in one process (tensor-parallel size 1, and
either rank of a tensor-parallel pair faked in this process): the table of s_init and s_scale, the value a scale
gives, its fp32 under a bf16 cast, its share of a vector split over tensor-parallel ranks, its tensor-parallel
attributes, the all-reduce of its gradient and its checkpoint entry. Its effective learning rate under Adam:
tests/test_optimizer.py; two real processes at TP = 2: tests/test_parallel_equivalence.py."""

import contextlib
import math
import warnings
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from torch.testing._internal.distributed.fake_pg import FakeStore

from angpt.models import model_config
from angpt.models.scales import LearnableScale, scale_init
from angpt.training import distributed

D = 64


def config(family="angpt", **overrides):
    return model_config(family, num_layers=2, hidden_size=D, num_attention_heads=4, **overrides)


@pytest.mark.parametrize("family, name, expected", [
    ("angpt", "alpha", (0.01, 1 / math.sqrt(D))),
    ("ngpt", "alpha", (0.05, 1 / math.sqrt(D))),
    ("angpt", "s_qk", (1.0, 1 / math.sqrt(D))),
    ("angpt", "s_z", (1.0, 1 / math.sqrt(D))),
    ("angpt", "s_u", (1.0, 1.0)),
    ("ngpt", "s_v", (1.0, 1.0)),
])
def test_each_scale_starts_as_the_table_of_docs_model_md_says(family, name, expected):
    assert scale_init(config(family), name) == pytest.approx(expected)


def test_an_alpha_init_given_replaces_the_familys_and_an_unknown_scale_is_refused_by_name():
    assert scale_init(config(alpha_init=0.2), "alpha") == pytest.approx((0.2, 1 / math.sqrt(D)))
    with pytest.raises(KeyError, match="'s_w'"):
        scale_init(config(), "s_w")


def test_a_scale_is_its_multiplier_times_its_surrogate_times_a_gain(single_process):
    """s = (s_init / s_scale) * s_hat, with a gain folded in; a gain that makes the product 2 (beside 1, where no
    multiply is needed) is applied."""
    alpha, s_u = LearnableScale(config(), "alpha", 4), LearnableScale(config(), "s_u", 4)
    with torch.no_grad():
        alpha.s_hat.copy_(torch.tensor([1.0, 2.0, -3.0, 0.5]))
        s_u.s_hat.copy_(alpha.s_hat)
    assert alpha.multiplier == pytest.approx(0.01 * math.sqrt(D))
    torch.testing.assert_close(alpha(), 0.01 * math.sqrt(D) * alpha.s_hat, rtol=1e-6, atol=0)
    assert torch.equal(s_u(), s_u.s_hat)
    assert torch.equal(s_u(2.0), 2 * s_u.s_hat)


def test_a_scale_starts_at_its_s_scale_in_fp32_and_stays_fp32_when_the_model_is_cast(single_process):
    scale = LearnableScale(config(), "s_qk", 16)
    assert scale.s_hat.dtype == torch.float32 and scale.s_hat.shape == (16,)
    assert torch.equal(scale.s_hat, torch.full((16,), 1 / math.sqrt(D)))
    assert scale.config.hidden_size == D  # megatron-core's modules hold their config
    scale.bfloat16()
    assert scale.s_hat.dtype == torch.float32
    assert torch.equal(scale.s_hat, torch.full((16,), 1 / math.sqrt(D)))  # 1/8, a bf16 value too


@pytest.mark.parametrize("cast", [torch.nn.Module.bfloat16, torch.nn.Module.half])
def test_a_cast_to_16_bits_keeps_every_fp32_digit_of_the_surrogate(single_process, cast):
    """At d = 1280, s_scale = 1/sqrt(1280) is no bf16 (or fp16) value: a cast that rounds through 16 bits and back
    would start s_qk 1.2e-4 (relative) off the table under --bf16."""
    d = 1280
    scale = LearnableScale(model_config("angpt", num_layers=2, hidden_size=d, num_attention_heads=4), "s_qk", 8)
    expected = torch.full((8,), 1 / math.sqrt(d), dtype=torch.float32)
    assert not torch.equal(expected.bfloat16().float(), expected)  # the case is one a rounding would change
    cast(scale)
    assert scale.s_hat.dtype == torch.float32
    assert torch.equal(scale.s_hat, expected)


def test_only_a_partitioned_scale_carries_megatrons_tensor_parallel_attributes(single_process):
    """megatron-core's attributes of a vector split along its only dimension (as its VocabParallelEmbedding's
    rows): tensor_model_parallel, partition_dim 0, stride 1. A scale is replicated unless said otherwise."""
    replicated = LearnableScale(config(), "s_qk", 8)
    assert not replicated.partitioned and not replicated.reduce_grad_over_tp
    assert not getattr(replicated.s_hat, "tensor_model_parallel", False)
    partitioned = LearnableScale(config(), "s_u", 8, partitioned=True)
    attributes = {name: getattr(partitioned.s_hat, name) for name in
                  ("tensor_model_parallel", "partition_dim", "partition_stride")}
    assert partitioned.partitioned and attributes == {"tensor_model_parallel": True, "partition_dim": 0,
                                                      "partition_stride": 1}
    # At one tensor-parallel rank no gradient is a partial sum: nothing to reduce, whatever was asked.
    assert not LearnableScale(config(), "s_qk", 8, reduce_grad_over_tp=True).reduce_grad_over_tp


def test_the_checkpoint_entry_is_the_surrogate_under_its_prefixed_name(single_process):
    scale = LearnableScale(config(), "s_u", 8, partitioned=True)
    entries = scale.sharded_state_dict(prefix="decoder.layers.0.mlp.s_u.")
    (key, entry), = entries.items()
    assert key == "decoder.layers.0.mlp.s_u.s_hat"
    assert isinstance(entry, ShardedTensor) and entry.key == key
    assert entry.data is scale.s_hat and entry.global_shape == (8,) and entry.global_offset == (0,)
    assert list(scale.sharded_state_dict()) == ["s_hat"]  # no prefix by default


def test_the_checkpoint_entry_takes_its_layers_offset_and_data_parallel_replica(single_process):
    """megatron-core's convention: a layer passes (axis, its index, the layer count), which prepends an axis of the
    layers to each of its tensors; the replica is numbered by the data-parallel rank of the group in metadata."""
    scale = LearnableScale(config(), "s_u", 8)
    (entry,) = scale.sharded_state_dict("layer.s_u.", ((0, 3, 8),)).values()
    assert (entry.global_shape, entry.global_offset, entry.prepend_axis_num) == ((8, 8), (3, 0), 1)
    second_replica = SimpleNamespace(rank=lambda: 1, size=lambda: 2)
    (entry,) = scale.sharded_state_dict("layer.s_u.", (), {"dp_cp_group": second_replica}).values()
    assert entry.replica_id == (0, 0, 1)


@contextlib.contextmanager
def tensor_parallel_pair(rank: int):
    """This process as rank `rank` of a world of 2 at tensor-parallel size 2, with megatron-core's groups built over
    torch's fake process group (torch.testing._internal.distributed.fake_pg): the groups have their real sizes and
    ranks, and a collective returns at once, leaving its tensor as it was. The session's one-process group
    (conftest's single_process), if it has one, is closed first and opened again after."""
    joined = dist.is_initialized()
    if joined:
        distributed.destroy_model_parallel()
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=2)
    try:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=2, create_gloo_process_groups=False)
        yield
    finally:
        distributed.destroy_model_parallel()
        dist.destroy_process_group()
        if joined:
            port = distributed.free_port()
            dist.init_process_group("cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo",
                                    init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
            distributed.initialize()


TP_ATTRIBUTES = ("tensor_model_parallel", "partition_dim", "partition_stride")


@pytest.mark.parametrize("rank", [0, 1])
def test_at_tensor_parallel_size_2_a_partitioned_scale_holds_its_half_and_a_replicated_one_all(rank):
    """A vector split over TP ranks along its only dimension holds size / TP entries, carries megatron-core's
    attributes of such a split (as its VocabParallelEmbedding's rows: partition_dim 0, stride 1), and is saved as
    rank's slice of the whole: global shape (size,), offset rank * size / TP, the axis in TP fragments, one
    replica. A replicated scale holds all of it, is saved whole and is the TP rank's replica (megatron-core's
    replica_id (0, TP rank, DP rank))."""
    with tensor_parallel_pair(rank):
        partitioned = LearnableScale(config(), "s_u", 8, partitioned=True)
        replicated = LearnableScale(config(), "s_qk", 8)
        assert partitioned.s_hat.shape == (4,) and torch.equal(partitioned.s_hat, torch.ones(4))
        assert {name: getattr(partitioned.s_hat, name) for name in TP_ATTRIBUTES} == {
            "tensor_model_parallel": True, "partition_dim": 0, "partition_stride": 1}
        assert replicated.s_hat.shape == (8,) and torch.equal(replicated.s_hat, torch.full((8,), 1 / math.sqrt(D)))
        assert not getattr(replicated.s_hat, "tensor_model_parallel", False)
        (entry,) = partitioned.sharded_state_dict("mlp.s_u.").values()
        assert entry.key == "mlp.s_u.s_hat" and entry.data is partitioned.s_hat
        assert (entry.global_shape, entry.global_offset, entry.axis_fragmentations, entry.replica_id) == (
            (8,), (4 * rank,), (2,), (0, 0, 0))
        (entry,) = replicated.sharded_state_dict("attention.s_qk.").values()
        assert (entry.global_shape, entry.global_offset, entry.axis_fragmentations, entry.replica_id) == (
            (8,), (0,), (1,), (0, rank, 0))


def test_at_tensor_parallel_size_2_a_partitioned_size_must_be_even_and_is_refused_naming_both():
    with tensor_parallel_pair(0):
        assert LearnableScale(config(), "s_u", 2, partitioned=True).s_hat.shape == (1,)  # the least that splits
        for size in (7, 1):
            with pytest.raises(ValueError, match=rf"^s_u of size {size} does not split over 2 tensor-parallel ranks$"):
                LearnableScale(config(), "s_u", size, partitioned=True)
        assert LearnableScale(config(), "s_u", 7).s_hat.shape == (7,)  # a replicated vector is not split


def test_at_tensor_parallel_size_2_only_a_replicated_scale_asked_to_reduces_its_gradient_over_the_group(
        monkeypatch):
    """reduce_grad_over_tp: the gradient of a replicated scale is all-reduced over the TP group in the backward
    pass (megatron-core's copy_to_tensor_model_parallel_region), once; not without the flag (its default), nor for
    a partitioned scale, whose ranks hold different entries. The fake all-reduce leaves the gradient as computed
    here: d sum(s) / d s_hat = s_init / s_scale."""
    reduced = []
    real_all_reduce = dist.all_reduce
    monkeypatch.setattr(dist, "all_reduce", lambda tensor, *args, **kwargs: (
        reduced.append(kwargs.get("group", args[1] if len(args) > 1 else None)),
        real_all_reduce(tensor, *args, **kwargs))[1])
    with tensor_parallel_pair(0):
        asked = LearnableScale(config(), "s_qk", 8, reduce_grad_over_tp=True)
        assert asked.reduce_grad_over_tp
        asked().sum().backward()
        assert reduced == [parallel_state.get_tensor_model_parallel_group()]
        torch.testing.assert_close(asked.s_hat.grad, torch.full((8,), math.sqrt(D)))
        for scale in (LearnableScale(config(), "s_qk", 8),
                      LearnableScale(config(), "s_u", 8, partitioned=True, reduce_grad_over_tp=True)):
            assert not scale.reduce_grad_over_tp
            scale().sum().backward()
            assert len(reduced) == 1 and torch.equal(scale.s_hat.grad, torch.full_like(scale.s_hat, scale.multiplier))


def test_the_scale_gives_megatron_core_its_tensor_parallel_group():
    """megatron-core falls back to parallel_state's TP group when given none, with a DeprecationWarning that
    passing it "will be mandatory soon": the scale passes the group it was built with, and no warning comes."""
    with tensor_parallel_pair(0):
        scales = [LearnableScale(config(), "s_qk", 8, reduce_grad_over_tp=True),
                  LearnableScale(config(), "s_u", 8, partitioned=True)]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for scale in scales:
                scale().sum().backward()
                scale.sharded_state_dict("scale.", metadata={"dp_cp_group": parallel_state.get_data_parallel_group(
                    with_context_parallel=True)})
                scale.sharded_state_dict("scale.")
        assert not [str(warning.message) for warning in caught if "tp_group" in str(warning.message)]


def test_a_cast_that_also_moves_the_model_moves_the_scale_and_keeps_it_fp32(single_process):
    """Module.to(device, dtype) (as .to("cuda", torch.bfloat16)) moves every parameter: the scale goes where the
    model goes and stays fp32 there; here to the meta device, which every machine has."""
    scale = LearnableScale(config(), "s_qk", 8)
    scale.to(device="meta", dtype=torch.bfloat16)
    assert (scale.s_hat.device.type, scale.s_hat.dtype, scale.s_hat.shape) == ("meta", torch.float32, (8,))


@pytest.mark.parametrize("cpu_initialization", [False, True])
def test_a_scale_is_made_on_the_current_gpu_unless_cpu_initialization(single_process, monkeypatch,
                                                                      cpu_initialization):
    """As megatron-core's own parameters: on torch.cuda.current_device(), or on the CPU with
    --use-cpu-initialization. The current device stands in as the meta device (on the CPU, megatron_compat's
    adapter makes it the CPU, which would not tell the two apart)."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: torch.device("meta"))
    scale = LearnableScale(config(use_cpu_initialization=cpu_initialization), "s_u", 8)
    assert scale.s_hat.device.type == ("cpu" if cpu_initialization else "meta")
    assert scale.s_hat.dtype == torch.float32 and scale.s_hat.shape == (8,)
