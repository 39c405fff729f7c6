"""Learnable scales (docs/model.md, Learnable scales) one at a time, in one process (tensor-parallel size 1): the
table of s_init and s_scale, the value a scale gives, its fp32 under a bf16 cast, its tensor-parallel attributes and
its checkpoint entry. Its effective learning rate under Adam: tests/test_optimizer.py."""

import math
from types import SimpleNamespace

import pytest
import torch
from megatron.core.dist_checkpointing.mapping import ShardedTensor

from angpt.models import model_config
from angpt.models.scales import LearnableScale, scale_init

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
