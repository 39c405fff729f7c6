"""Offline tokenizers behind one interface, named as Megatron-LM's `--tokenizer-type` names them.

    HuggingFaceTokenizer  --tokenizer-model tokenizer.json, or a directory holding one
    TikTokenizer          --tokenizer-model file.tiktoken (BPE ranks; GPT-2's split pattern)
    GPT2BPETokenizer      --vocab-file gpt2-vocab.json --merge-file gpt2-merges.txt,
                          or --tokenizer-model gpt2.tiktoken (tools/fetch_gpt2_bpe.py)

Special-token text in a document is encoded as Megatron-LM encodes it (megatron-core 0.16's tokenizers):
a literal "<|endoftext|>" becomes the end-of-document token, as Hugging Face's `tokenize()` and tiktoken's
`encode(allowed_special="all")` read it. `special_tokens_as_text=True` encodes it as ordinary text instead,
so that the end-of-document token only ever comes from `--append-eod` (untrusted text cannot end a document).
"""

import hashlib
import json
import os
from typing import Optional, Protocol

import tiktoken
from tiktoken.load import load_tiktoken_bpe
from tiktoken_ext.openai_public import r50k_pat_str
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as RustTokenizer

EOD_TOKEN = "<|endoftext|>"
# GPT-2's pre-tokenizer regex, which TikTokenizer splits text with (angpt.hf.export gives it to the export).
GPT2_SPLIT_PATTERN = r50k_pat_str
TOKENIZER_TYPES = ("HuggingFaceTokenizer", "TikTokenizer", "GPT2BPETokenizer")
# Megatron-LM's tokenizer of already tokenized data: --vocab-size ids, the end-of-document id after them. The
# trainer takes it for datasets without a .json; it cannot tokenize text.
NULL_TOKENIZER = "NullTokenizer"
# Megatron-LM 0.16 reads all three through megatron-core's tokenizer library ("sentencepiece"): the model's
# pieces, end-of-document id its EOS. The trainer takes them for datasets Megatron-LM's tools wrote;
# tools/preprocess_data.py does not write them yet.
SENTENCEPIECE_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer")
# The other choices of Megatron-LM's --tokenizer-type (megatron/training/arguments.py, core_v0.16.1).
MEGATRON_ONLY_TOKENIZER_TYPES = ("BertWordPieceLowerCase", "BertWordPieceCase", "MultimodalTokenizer",
                                 "NullMultimodalTokenizer", "SFTTokenizer")


class Tokenizer(Protocol):
    vocab_size: int
    eod: int
    description: dict
    special_tokens_as_text: bool

    def encode_batch(self, texts: list[str]) -> list[list[int]]: ...

    def decode(self, ids: list[int]) -> str: ...

    def set_threads(self, threads: int) -> None: ...


def sha256_of(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def describe_file(path: str) -> dict:
    return {"path": os.path.abspath(path), "sha256": sha256_of(path)}


class HuggingFaceTokenizer:
    """A `tokenizers` tokenizer. Its special tokens in the text are matched as those tokens, as by Megatron-LM's
    HuggingFaceTokenizer (`tokens_to_ids(tokenize(text))`); with special_tokens_as_text, they are text."""

    def __init__(self, tokenizer, eod_token: str, description: dict, special_tokens_as_text: bool = False):
        tokenizer.encode_special_tokens = special_tokens_as_text
        self.special_tokens_as_text = special_tokens_as_text
        self.tokenizer = tokenizer
        self.eod = tokenizer.token_to_id(eod_token)
        if self.eod is None:
            raise ValueError(f"{description}: the tokenizer has no end-of-document token {eod_token!r}")
        self.vocab_size = max(tokenizer.get_vocab(with_added_tokens=True).values()) + 1
        self.description = {**description, "eod_token": eod_token}

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [encoding.ids for encoding in self.tokenizer.encode_batch_fast(texts, add_special_tokens=False)]

    def set_threads(self, threads: int) -> None:
        """Cap this process's encoding threads; Rust's thread pool reads it once, at the first encoding."""
        os.environ["RAYON_NUM_THREADS"] = str(threads)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)


class TikTokenizer:
    """A `tiktoken` encoding of a ranks file with GPT-2's split pattern; EOD is the id after the last rank.
    "<|endoftext|>" in the text is the EOD, as Megatron-LM's TikTokenizer encodes its special tokens
    (`allowed_special="all"`); with special_tokens_as_text, it is text (`encode_ordinary`)."""

    def __init__(self, path: str, tokenizer_type: str, special_tokens_as_text: bool = False):

        ranks = load_tiktoken_bpe(path)
        self.eod = max(ranks.values()) + 1
        self.encoding = tiktoken.Encoding(
            name=os.path.basename(path), pat_str=GPT2_SPLIT_PATTERN, mergeable_ranks=ranks,
            special_tokens={EOD_TOKEN: self.eod},
        )
        self.vocab_size = self.encoding.n_vocab
        self.threads = os.cpu_count()
        self.special_tokens_as_text = special_tokens_as_text
        self.description = {"type": tokenizer_type, "model": describe_file(path), "eod_token": EOD_TOKEN}

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        if self.special_tokens_as_text:
            return self.encoding.encode_ordinary_batch(texts, num_threads=self.threads)
        return self.encoding.encode_batch(texts, num_threads=self.threads, allowed_special="all")

    def set_threads(self, threads: int) -> None:
        self.threads = threads

    def decode(self, ids: list[int]) -> str:
        return self.encoding.decode(ids)


def load_huggingface(path: str, tokenizer_type: str, special_tokens_as_text: bool = False) -> HuggingFaceTokenizer:
    """A tokenizer.json file, or a directory with tokenizer.json (its tokenizer_config.json may name the EOS)."""
    eod_token = EOD_TOKEN
    if os.path.isdir(path):
        config_path = os.path.join(path, "tokenizer_config.json")
        if os.path.isfile(config_path):
            with open(config_path) as file:
                eos = json.load(file).get("eos_token")
            eod_token = (eos.get("content") if isinstance(eos, dict) else eos) or EOD_TOKEN
        path = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--tokenizer-model: no tokenizer file {path}")
    description = {"type": tokenizer_type, "model": describe_file(path)}
    return HuggingFaceTokenizer(RustTokenizer.from_file(path), eod_token, description, special_tokens_as_text)


def load_gpt2_vocab_merges(vocab_file: str, merge_file: str, special_tokens_as_text: bool = False
                           ) -> HuggingFaceTokenizer:
    """GPT-2's byte-level BPE from Megatron's vocab/merges pair; its "<|endoftext|>" (in vocab.json) is a
    special token, as in Megatron-LM's GPT2BPETokenizer (Hugging Face's GPT2Tokenizer)."""
    tokenizer = RustTokenizer(models.BPE.from_file(vocab_file, merge_file))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    if tokenizer.token_to_id(EOD_TOKEN) is not None:  # keeps its vocab.json id; a vocab without it is refused below
        tokenizer.add_special_tokens([AddedToken(EOD_TOKEN, special=True, normalized=False)])
    description = {"type": "GPT2BPETokenizer", "vocab_file": describe_file(vocab_file),
                   "merge_file": describe_file(merge_file)}
    return HuggingFaceTokenizer(tokenizer, EOD_TOKEN, description, special_tokens_as_text)


def sentencepiece_vocabulary(tokenizer_type: str, tokenizer_model: Optional[str]) -> tuple[int, int, dict]:
    """(vocab_size, end-of-document id, description) of a SentencePiece model as Megatron-LM 0.16 builds it
    (megatron-core's tokenizer library, not the legacy one: no added special tokens, EOD the model's EOS)."""
    if tokenizer_model is None or not os.path.isfile(tokenizer_model):
        raise ValueError(f"{tokenizer_type} needs --tokenizer-model (a SentencePiece .model file)"
                         + (f"; there is no {tokenizer_model}" if tokenizer_model else ""))
    try:
        from megatron.core.tokenizers import MegatronTokenizer  # noqa: PLC0415 (needs sentencepiece, optional)
    except ImportError as error:
        raise ValueError(f"{tokenizer_type} needs sentencepiece ({error}): pip install sentencepiece") from None
    tokenizer = MegatronTokenizer.from_pretrained(tokenizer_path=tokenizer_model,
                                                  metadata_path={"library": "sentencepiece"}, legacy=False)
    return tokenizer.vocab_size, tokenizer.eod, {"type": tokenizer_type, "model": describe_file(tokenizer_model)}


def recorded_tokenizer(description) -> Optional[Tokenizer]:
    """The tokenizer a dataset's metadata describes (its "tokenizer" entry), rebuilt from the files it
    names; None when one of them is no longer where it was, or the description is not one of ours.
    Raises ValueError when a file has changed since (its sha256 differs): the checkpoints would copy it."""
    if not isinstance(description, dict) or description.get("type") not in TOKENIZER_TYPES:
        return None
    files = {name: entry["path"] for name, entry in description.items() if isinstance(entry, dict) and "path" in entry}
    if not files or not all(os.path.isfile(path) for path in files.values()):
        return None
    for name, path in files.items():
        if sha256_of(path) != description[name].get("sha256"):
            raise ValueError(f"its tokenizer file {path} has changed since the dataset was written (sha256)")
    if description["type"] == "HuggingFaceTokenizer":
        return HuggingFaceTokenizer(RustTokenizer.from_file(files["model"]), description.get("eod_token", EOD_TOKEN),
                                    description)
    if "model" in files:
        return TikTokenizer(files["model"], description["type"])
    return load_gpt2_vocab_merges(files["vocab_file"], files["merge_file"])


def build_tokenizer(tokenizer_type: str, tokenizer_model: Optional[str] = None, vocab_file: Optional[str] = None,
                    merge_file: Optional[str] = None, special_tokens_as_text: bool = False) -> Tokenizer:
    """The tokenizer the flags name; special_tokens_as_text: special-token text in documents is ordinary text."""
    for flag, path in (("--tokenizer-model", tokenizer_model), ("--vocab-file", vocab_file),
                       ("--merge-file", merge_file)):
        if path is not None and not os.path.exists(path):
            raise FileNotFoundError(f"{flag} {path}: no such file")
    if tokenizer_type == "HuggingFaceTokenizer":
        if tokenizer_model is None:
            raise ValueError("HuggingFaceTokenizer needs --tokenizer-model (tokenizer.json or its directory)")
        return load_huggingface(tokenizer_model, tokenizer_type, special_tokens_as_text)
    if tokenizer_type == "TikTokenizer":
        if tokenizer_model is None:
            raise ValueError("TikTokenizer needs --tokenizer-model (a .tiktoken ranks file)")
        return TikTokenizer(tokenizer_model, tokenizer_type, special_tokens_as_text)
    if tokenizer_type == "GPT2BPETokenizer":
        if vocab_file is not None and merge_file is not None:
            return load_gpt2_vocab_merges(vocab_file, merge_file, special_tokens_as_text)
        if tokenizer_model is not None:
            return TikTokenizer(tokenizer_model, tokenizer_type, special_tokens_as_text)
        raise ValueError("GPT2BPETokenizer needs --vocab-file and --merge-file, or --tokenizer-model gpt2.tiktoken")
    raise ValueError(f"--tokenizer-type {tokenizer_type!r}: choose one of {', '.join(TOKENIZER_TYPES)}")
