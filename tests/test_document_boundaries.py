"""Megatron-LM's --reset-position-ids and --reset-attention-mask: each document of a sample gets positions from
0 and attends within itself only, so a token's logits are those of its document run alone."""

import pytest
import torch
from megatron.core.transformer.enums import AttnBackend
from test_gpt_datasets import EOD as DATASET_EOD
from test_gpt_datasets import two_prefixes  # noqa: F401 (a fixture)
from test_megatron_training_flags import MOCK

from angpt.config.arguments import parse_args
from angpt.config.sections import DataSection
from angpt.data.gpt_datasets import build_datasets, dataset_vocabulary, micro_batches
from angpt.models import attention, build_model, model_config

SHAPE = dict(num_layers=2, hidden_size=64, num_attention_heads=4)
VOCAB, SEQ, EOD = 128, 16, 127


def document_ids(tokens: torch.Tensor, eod: int) -> torch.Tensor:
    """Each token's document index: a document ends with its EOD token (which belongs to it)."""
    ends = (tokens == eod).long()
    return torch.cumsum(ends, dim=-1) - ends


def expected_positions_and_mask(tokens: torch.Tensor, eod: int = EOD):
    """Written from the flags' meaning, not megatron-core's code: positions count from each document's first
    token; a token attends to the earlier tokens of its own document (the mask is True where masked out)."""
    documents = document_ids(tokens, eod)
    index = torch.arange(tokens.shape[-1])
    starts = torch.stack([index[(documents[b] == documents[b][:, None]).int().argmax(-1)] for b in range(len(tokens))])
    same_document = documents[:, :, None] == documents[:, None, :]
    causal = index[None, :] <= index[:, None]
    return index - starts, ~(same_document & causal).unsqueeze(1)


def logits(model, tokens, positions=None, mask=None):
    if positions is None:
        positions = torch.arange(tokens.shape[-1]).expand_as(tokens)
    with torch.no_grad():
        return model(tokens, positions, mask)


@pytest.mark.parametrize("backend", [AttnBackend.unfused, AttnBackend.flash])
@pytest.mark.parametrize("family", ["angpt", "gptplus"])
def test_each_document_gives_the_logits_of_its_own_run(seeded, family, backend):
    attention.clear_attention_backend_environment()
    config = model_config(family, **SHAPE, attention_backend=backend, rope_position_ids=True)
    model = build_model(config, VOCAB, SEQ).eval()
    attention.clear_attention_backend_environment()
    generator = torch.Generator().manual_seed(3)
    first = torch.randint(0, EOD, (1, 6), generator=generator)
    second = torch.randint(0, EOD, (1, 10), generator=generator)
    first[0, -1] = EOD
    tokens = torch.cat([first, second], dim=1)
    positions, mask = expected_positions_and_mask(tokens)
    assert positions[0].tolist() == [*range(6), *range(10)]
    together = logits(model, tokens, positions, mask)
    torch.testing.assert_close(together[:, :6], logits(model, first), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(together[:, 6:], logits(model, second), rtol=1e-5, atol=1e-5)
    # Without the mask the second document sees the first: the mask is what isolates it.
    assert not torch.allclose(logits(model, tokens, positions)[:, 6:], logits(model, second), rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("family", ["angpt", "gptplus"])
def test_rope_follows_the_position_ids_only_with_rope_position_ids(seeded, family):
    """Every position id 0: RoPE rotates nothing, so one causal layer cannot tell the order of the tokens before
    the current one (swapping the first two leaves the logits from the third on); rotating by index, it can.
    (Two layers could: the second attends to the first's outputs at those positions, which differ.)"""
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(4))
    swapped = tokens.clone()
    swapped[:, [0, 1]] = tokens[:, [1, 0]]
    zeros = torch.zeros_like(tokens)
    for rope_position_ids in (True, False):
        attention.clear_attention_backend_environment()
        config = model_config(family, **{**SHAPE, "num_layers": 1}, rope_position_ids=rope_position_ids)
        model = build_model(config, VOCAB, SEQ).eval()
        order_blind = torch.allclose(logits(model, tokens, zeros)[:, 2:], logits(model, swapped, zeros)[:, 2:],
                                     rtol=1e-5, atol=1e-5)
        assert order_blind == rope_position_ids
    # With the ids of the sequence's indices, the angles are the same: the logits too (to an ulp or two of
    # the angles' cos and sin, which torch may compute in another vector width for another shape).
    by_index = logits(model, tokens)
    model.config.rope_position_ids = True
    torch.testing.assert_close(logits(model, tokens), by_index, rtol=1e-6, atol=1e-6)


def test_the_batches_carry_each_documents_positions_and_mask(two_prefixes, tmp_path, single_process):  # noqa: F811
    data = DataSection(train_data_path=(two_prefixes[0],), data_cache_path=str(tmp_path / "cache"),
                       reset_position_ids=True, reset_attention_mask=True)
    vocabulary = dataset_vocabulary(data)
    train, _, _ = build_datasets(data, vocabulary, 16, 1234, [16, 0, 0])
    batches = micro_batches(train, 0, 16, 4, 0, 1)
    tokens = torch.cat([batch["tokens"] for batch in batches])
    assert vocabulary.eod == DATASET_EOD and (tokens[:, :-1] == DATASET_EOD).any()  # documents end inside samples
    positions, mask = expected_positions_and_mask(tokens, DATASET_EOD)
    assert torch.equal(torch.cat([batch["position_ids"] for batch in batches]), positions)
    assert torch.equal(torch.cat([batch["attention_mask"] for batch in batches]), mask)
    plain = DataSection(train_data_path=(two_prefixes[0],), data_cache_path=str(tmp_path / "cache"))
    train, _, _ = build_datasets(plain, vocabulary, 16, 1234, [16, 0, 0])
    assert "attention_mask" not in micro_batches(train, 0, 4, 4, 0, 1)[0]  # the model is causal by itself


@pytest.mark.parametrize("argv,message", [
    (["--reset-attention-mask", "--no-create-attention-mask-in-dataloader"],
     "--reset-attention-mask needs the dataset's mask"),
])
def test_a_reset_attention_mask_without_its_mask_is_refused(argv, message, capsys):
    with pytest.raises(SystemExit):
        parse_args([*MOCK, *argv])
    assert message in capsys.readouterr().err
