"""The tokenizer a checkpoint records, as a Hugging Face fast tokenizer: tokenizer.json copied, or converted from
GPT-2's vocab.json + merges.txt, a tiktoken ranks file, Megatron-LM's TikTokenizer .json vocabulary or BERT's
vocab.txt (its WordPiece as the `tokenizers` library builds it, the BERT types' 100 <extra_id_N> added), with its
end-of-document token as the eos token (tokenizer_config.json)."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from typing import Optional

from tokenizers import Tokenizer
from transformers.convert_slow_tokenizer import TikTokenConverter

from angpt.data.tokenizers import (
    BERT_TYPES,
    EOD_TOKEN,
    GPT2_SPLIT_PATTERN,
    MegatronCoreTokenizer,
    TikTokenizer,
    add_special_tokens,
    load_bert_wordpiece,
    load_gpt2_vocab_merges,
)
from angpt.hf.checkpoint_reader import Checkpoint
from angpt.hf.errors import ExportError


def tokenizer_description(checkpoint: Checkpoint) -> Optional[dict]:
    path = os.path.join(checkpoint.path, "tokenizer", "angpt_tokenizer.json")
    if not os.path.isfile(path):
        return None
    with open(path) as file:
        return json.load(file)


@dataclass
class Vocabulary:
    size: int  # the tokenizer's, to which the padded vocabulary is trimmed
    eos_token_id: int
    tokenizer_file: Optional[str]  # tokenizer.json copied with the checkpoint, when there is one
    eos_token: Optional[str]
    # Converted from the checkpoint's GPT-2 BPE or tiktoken files, to be written as tokenizer.json.
    converted: Optional[Tokenizer] = None


def tokenizer_copy(checkpoint: Checkpoint, description: dict, name: str) -> str:
    """The copy in the checkpoint of the tokenizer file `name` of the description."""
    path = os.path.join(checkpoint.path, "tokenizer", os.path.basename(description[name]["path"]))
    if not os.path.isfile(path):
        raise ExportError(f"{path} is missing: {checkpoint.path}/tokenizer/angpt_tokenizer.json names it as its "
                          f"{name}")
    return path


def tiktoken_tokenizer(path: str, tokenizer_type: str) -> Tokenizer:
    """The byte-level BPE of a tiktoken ranks file (transformers' conversion: vocabulary = ranks, and a
    merge for each way of splitting a token into two tokens, in rank order), split as our TikTokenizer splits
    (GPT-2's pattern), with its end-of-document token as a special token."""
    ours = TikTokenizer(path, tokenizer_type)
    converter = TikTokenConverter(vocab_file=path, pattern=GPT2_SPLIT_PATTERN, extra_special_tokens=[EOD_TOKEN])
    # The ranks as we read them: tiktoken's loader would give a stale copy of a file changed at the same path.
    converter.load_tiktoken_bpe = lambda _: ours.encoding._mergeable_ranks
    converted = converter.converted()
    if converted.token_to_id(EOD_TOKEN) != ours.eod:  # the added token takes the next free id, or its own rank
        raise ExportError(f"{path}: {EOD_TOKEN} would be id {converted.token_to_id(EOD_TOKEN)} in the export, "
                          f"not {ours.eod} as in training (ranks with gaps, or a ranks file that holds it)")
    return converted


def megatron_tiktoken_tokenizer(path: str, description: dict) -> Tokenizer:
    """Megatron-LM's TikTokenizer (a .json vocabulary) as a byte-level BPE: transformers' conversion of the ranks
    tiktoken encodes with (shifted past the special tokens and cut to --vocab-size by megatron-core), split with
    its pattern, its special tokens at their ids 0..N-1."""
    ours = MegatronCoreTokenizer(description["type"], path, tiktoken_pattern=description["pattern"],
                                 tiktoken_num_special_tokens=description["num_special_tokens"],
                                 vocab_size=description["vocab_size"],
                                 special_tokens=tuple(description.get("special_tokens", ())))
    encoding = ours.encoder  # tiktoken keeps its ranks, special tokens and pattern private
    specials = encoding._special_tokens
    converter = TikTokenConverter(pattern=encoding._pat_str, extra_special_tokens=list(specials))
    converter.load_tiktoken_bpe = lambda _: encoding._mergeable_ranks  # megatron-core's, not a ranks file's
    vocab, merges = converter.extract_vocab_merges_from_model(path)
    # In the BPE's vocabulary, the special tokens keep their ids when added. (A rank spelt as one, which the
    # merge replaces, is never reached: tiktoken and the export both match the special token first.)
    converter.extract_vocab_merges_from_model = lambda _: ({**vocab, **specials}, merges)
    return converter.converted()


def vocabulary(checkpoint: Checkpoint) -> Vocabulary:
    description = tokenizer_description(checkpoint)
    if description is None:  # --mock-data: ids 0..vocab_size-1, the last one ending documents
        size = checkpoint.config.data.vocab_size
        return Vocabulary(size, size - 1, None, None)
    kind = description.get("type")
    special = tuple(description.get("special_tokens", ()))  # --tokenizer-special-tokens, as in training
    if kind == "HuggingFaceTokenizer":
        path = tokenizer_copy(checkpoint, description, "model")
        tokenizer, converted = Tokenizer.from_file(path), None
        eos = description["eod_token"]
        if special:  # the file with them added, not the file as it is
            add_special_tokens(tokenizer, special)
            path, converted = None, tokenizer
    elif kind == "TikTokenizer" and "num_special_tokens" in description:  # Megatron-LM's, not a ranks file
        path, eos = None, description["eod_token"]
        tokenizer = converted = megatron_tiktoken_tokenizer(tokenizer_copy(checkpoint, description, "model"),
                                                            description)
    elif kind in ("TikTokenizer", "GPT2BPETokenizer"):  # GPT2BPETokenizer: vocab.json + merges.txt, or ranks
        path, eos = None, EOD_TOKEN
        if "model" in description:
            tokenizer = converted = tiktoken_tokenizer(tokenizer_copy(checkpoint, description, "model"), kind)
        else:
            tokenizer = converted = load_gpt2_vocab_merges(tokenizer_copy(checkpoint, description, "vocab_file"),
                                                           tokenizer_copy(checkpoint, description, "merge_file"),
                                                           special_tokens=special).tokenizer
    elif kind in BERT_TYPES:
        path, eos = None, description["eod_token"]
        tokenizer = converted = load_bert_wordpiece(kind, tokenizer_copy(checkpoint, description, "vocab_file"),
                                                    special_tokens=special).tokenizer
    else:
        raise ExportError(f"{checkpoint.path}/tokenizer/angpt_tokenizer.json: tokenizer type {kind!r} cannot be "
                          "exported (HuggingFaceTokenizer, TikTokenizer, GPT2BPETokenizer and the BERT types can)")
    size = max(tokenizer.get_vocab(with_added_tokens=True).values()) + 1
    return Vocabulary(size, tokenizer.token_to_id(eos), path, eos, converted)


def save_tokenizer(vocab: Vocabulary, output: str, max_length: int) -> None:
    if vocab.tokenizer_file is not None:
        shutil.copy(vocab.tokenizer_file, os.path.join(output, "tokenizer.json"))
    elif vocab.converted is not None:
        vocab.converted.save(os.path.join(output, "tokenizer.json"))
    else:
        return
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": vocab.eos_token, "bos_token": vocab.eos_token,
              "pad_token": vocab.eos_token, "model_max_length": max_length, "clean_up_tokenization_spaces": False}
    with open(os.path.join(output, "tokenizer_config.json"), "w") as file:
        json.dump(config, file, indent=2)
