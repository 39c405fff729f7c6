"""--tokenizer-type BertWordPieceLowerCase and BertWordPieceCase: the ids, vocabulary size, end of document and pad
of megatron-core's own tokenizer object as Megatron-LM 0.16.1's build_tokenizer builds it (library "megatron":
transformers' BertTokenizer over --vocab-file under bert-large-uncased's or bert-large-cased's configuration, which
Megatron-LM fetches from the Hugging Face hub: here a local directory with that configuration stands in for it)."""

import json

import numpy
import pytest
from megatron.core.tokenizers.text.libraries import megatron_hf_tokenizer
from test_hf_tokenizer_export import export_tokenizer
from test_megatron_loop_flags import TINY
from test_preprocess_data import run_preprocess, write_jsonl

from angpt.config.sections import DataSection
from angpt.data.gpt_datasets import flag_vocabulary
from angpt.data.indexed import read_metadata
from angpt.data.tokenizers import build_tokenizer, recorded_tokenizer, select_backend

from conftest import in_process_trainer, megatron_tokenizer

# BERT's layout: [PAD] first, unused slots, then [UNK] [CLS] [SEP] [MASK], then pieces and ## continuations.
VOCAB = ["[PAD]", "[unused0]", "[unused1]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *"abcdefghijklmnopqrstuvwxyz.,!?'0123",
         "the", "quick", "brown", "fox", "##es", "##ing", "jump", "over", "lazy", "dog", "The", "Quick", "##e", "cafe",
         "日", "本", "<extra_id_3>"]
TEXTS = ["The Quick brown foxes jumping, café! 日本 [SEP] xyz", "", "  ",
         "THE DOG's [MASK] [unused1] [sep] <extra_id_3>",
         "Ünïcødé naïve Café ÉCOLE\u00a0x\tq\x00\x01 the", "thequickbrownfox jumpingly", "a" * 120, "<my> résumé"]


@pytest.fixture
def vocab_txt(tmp_path):
    (tmp_path / "vocab.txt").write_text("\n".join(VOCAB) + "\n")
    return str(tmp_path / "vocab.txt")


def megatron_bert(tokenizer_type, vocab_file, special_tokens, include, tmp_path, monkeypatch):
    """megatron-core's object, with Megatron-LM's build_tokenizer's arguments (BertWordPieceCase: 100 <extra_id_N>
    in place of --tokenizer-special-tokens; merges_file is given vocab_file, as megatron-core passes it)."""
    lower = tokenizer_type == "BertWordPieceLowerCase"
    hub = tmp_path / f"hub_{tokenizer_type}"
    hub.mkdir()
    (hub / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "BertTokenizer", "do_lower_case": lower}))
    (hub / "config.json").write_text(json.dumps({"model_type": "bert"}))
    monkeypatch.setitem(megatron_hf_tokenizer.MEGATRON_CONFIG_MAP[tokenizer_type], "tokenizer_name", str(hub))
    added = list(special_tokens) if lower else [f"<extra_id_{index}>" for index in range(100)]
    return megatron_tokenizer("megatron", tokenizer_type, vocab_file=vocab_file, merges_file=None,
                              additional_special_tokens=added, use_fast=False, trust_remote_code=False,
                              include_special_tokens=include)


@pytest.mark.parametrize("tokenizer_type", ["BertWordPieceLowerCase", "BertWordPieceCase"])
@pytest.mark.parametrize("special, include", [((), False), (("<my>", "[SEP]"), True)])
def test_bert_types_encode_as_megatron_core(tokenizer_type, special, include, vocab_txt, tmp_path, monkeypatch):
    theirs = megatron_bert(tokenizer_type, vocab_txt, special, include, tmp_path, monkeypatch)
    ours = build_tokenizer(tokenizer_type, vocab_file=vocab_txt, special_tokens=special, include_special_tokens=include)
    assert [theirs.tokenize(text) for text in TEXTS] == ours.encode_batch(TEXTS)
    assert (ours.vocab_size, ours.eod, ours.pad) == (theirs.vocab_size, theirs.eod, theirs.pad)
    # [SEP] ends documents, [PAD] pads; Case adds 99 <extra_id_N> (its vocab.txt has <extra_id_3>), LowerCase <my>.
    assert (ours.eod, ours.pad) == (5, 0)
    assert ours.vocab_size == len(VOCAB) + (99 if tokenizer_type == "BertWordPieceCase" else "<my>" in special)
    rebuilt = recorded_tokenizer(json.loads(json.dumps(ours.description)))
    assert rebuilt.encode_batch(TEXTS) == ours.encode_batch(TEXTS)
    assert ours.description == rebuilt.description
    # gigatoken builds BPEs only: the tokenizers library encodes, and the log says why.
    assert "WordPiece" in select_backend(ours, None)[1]["gigatoken_not_used"]


def test_bert_types_are_the_trainers_vocabulary_and_refuse_a_bad_vocab_txt(vocab_txt, tmp_path):
    data = DataSection(tokenizer_type="BertWordPieceCase", vocab_file=vocab_txt)
    vocabulary = flag_vocabulary(data)
    assert (vocabulary.vocab_size, vocabulary.eod, vocabulary.pad) == (len(VOCAB) + 99, 5, 0)
    with pytest.raises(ValueError, match="^BertWordPieceLowerCase needs --vocab-file"):
        build_tokenizer("BertWordPieceLowerCase")
    (tmp_path / "bad.txt").write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\n")
    with pytest.raises(ValueError, match=r"holds \[PAD\] \[UNK\] \[CLS\] \[SEP\] \[MASK\]: \[MASK\] missing"):
        build_tokenizer("BertWordPieceCase", vocab_file=str(tmp_path / "bad.txt"))
    (tmp_path / "twice.txt").write_text("\n".join([*VOCAB, "the"]))
    with pytest.raises(ValueError, match="a token given twice"):
        build_tokenizer("BertWordPieceCase", vocab_file=str(tmp_path / "twice.txt"))


@pytest.mark.parametrize("tokenizer_type", ["MultimodalTokenizer", "NullMultimodalTokenizer", "SFTTokenizer"])
def test_the_other_megatron_types_are_refused_with_their_reason(tokenizer_type):
    reason = "supervised fine-tuning" if tokenizer_type == "SFTTokenizer" else "a vision"
    with pytest.raises(ValueError, match=f"^--tokenizer-type {tokenizer_type}: {reason}"):
        flag_vocabulary(DataSection(tokenizer_type=tokenizer_type))


@pytest.mark.slow  # an in-process trainer run
def test_preprocess_data_writes_bert_ids_that_train(vocab_txt, tmp_path, monkeypatch, single_process):
    corpus = write_jsonl(tmp_path / "corpus.jsonl", [{"text": text} for text in TEXTS * 20])
    run_preprocess("--input", corpus, "--output-prefix", tmp_path / "out", "--tokenizer-type", "BertWordPieceLowerCase",
                   "--vocab-file", vocab_txt, "--append-eod", "--workers", "1")
    theirs = megatron_bert("BertWordPieceLowerCase", vocab_txt, (), False, tmp_path, monkeypatch)
    expected = [token for text in TEXTS * 20 if text.strip() for token in [*theirs.tokenize(text), theirs.eod]]
    prefix = str(tmp_path / "out_text_document")
    assert numpy.fromfile(f"{prefix}.bin", dtype=numpy.uint16).tolist() == expected
    metadata = read_metadata(prefix)
    assert (metadata["vocab_size"], metadata["eod"], metadata["pad"]) == (len(VOCAB), 5, 0)
    run = ["--model-family", "gpt", *TINY, "--data-path", prefix, "--data-cache-path", str(tmp_path / "cache"),
           "--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file", vocab_txt, "--eval-iters", "0",
           "--train-iters", "2", "--split", "100,0,0"]
    assert in_process_trainer(run).run() == 0


def test_the_export_encodes_as_the_bert_tokenizer(vocab_txt, tmp_path):
    """The Hugging Face export: the WordPiece of the checkpoint's vocab.txt copy, [SEP] its eos, read by
    transformers' AutoTokenizer to the ids of ours (without the post-processor's [CLS] ... [SEP])."""
    (tmp_path / "source").mkdir()
    ours = build_tokenizer("BertWordPieceCase", vocab_file=vocab_txt)
    vocab, theirs = export_tokenizer(ours, tmp_path)
    assert (vocab.size, vocab.eos_token_id, vocab.eos_token) == (ours.vocab_size, ours.eod, "[SEP]")
    assert [theirs(text, add_special_tokens=False).input_ids for text in TEXTS] == ours.encode_batch(TEXTS)
