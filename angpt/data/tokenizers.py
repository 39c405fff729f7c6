"""Offline tokenizers behind one interface, named as Megatron-LM's `--tokenizer-type` names them.

    HuggingFaceTokenizer  --tokenizer-model tokenizer.json, or a directory holding one
    TikTokenizer          --tokenizer-model vocab.json: Megatron-LM's (megatron-core's tiktoken library:
                          --tiktoken-num-special-tokens special tokens first, </s> the end of document,
                          --vocab-size ids, --tiktoken-pattern v1 or v2);
                          or --tokenizer-model file.tiktoken: angpt's own layout (BPE ranks, GPT-2's split
                          pattern, <|endoftext|> after the last rank)
    GPT2BPETokenizer      --vocab-file gpt2-vocab.json --merge-file gpt2-merges.txt,
                          or --tokenizer-model gpt2.tiktoken (tools/fetch_gpt2_bpe.py)
    SentencePieceTokenizer, GPTSentencePieceTokenizer, Llama2Tokenizer
                          --tokenizer-model file.model (megatron-core's sentencepiece library, as Megatron-LM)
    BertWordPieceLowerCase, BertWordPieceCase
                          --vocab-file vocab.txt: BERT's WordPiece, lower-cased or not, as megatron-core's
                          "megatron" library reads it (transformers' BertTokenizer): [SEP] the end of document,
                          [PAD] the pad token

Special-token text in a document is encoded as Megatron-LM encodes it (megatron-core 0.16's tokenizers):
a literal "<|endoftext|>" (Megatron-LM's TikTokenizer: "</s>") becomes the end-of-document token, as Hugging
Face's `tokenize()` and tiktoken's `encode(allowed_special="all")` read it. `special_tokens_as_text=True`
encodes it as ordinary text instead, so that the end-of-document token only ever comes from `--append-eod`
(untrusted text cannot end a document). SentencePiece never reads its end of document from text.
"""

import base64
import binascii
import functools
import importlib.metadata
import json
import logging
import os
from itertools import chain
from typing import Optional, Protocol

import numpy
import psutil
import tiktoken
from tiktoken_ext.openai_public import r50k_pat_str
from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as RustTokenizer

from angpt.config.files import read_json, read_json_object, read_text, sha256_of
from angpt.config.tiktoken_layout import (
    BERT_TYPES,
    SENTENCEPIECE_TYPES,
    TIKTOKEN_NUM_SPECIAL_TOKENS,
    TIKTOKEN_PATTERNS,
)

EOD_TOKEN = "<|endoftext|>"
# A tokenizer without a pad token: megatron-core's MegatronDataset pads with this id (its _PAD_TOKEN_ID), which no
# token of the data has, so that no token of the data is masked as padding.
NO_PAD = -1
# GPT-2's pre-tokenizer regex, which TikTokenizer splits text with (angpt.hf.tokenizer_export gives it to the export).
GPT2_SPLIT_PATTERN = r50k_pat_str
# BERT's special tokens, each one of transformers' BertTokenizer (a special token, matched whole in the text).
BERT_SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
# The special tokens Megatron-LM 0.16.1's build_tokenizer gives BertWordPieceCase in place of
# --tokenizer-special-tokens (T5's sentinels): those of them the vocabulary lacks take the ids after it.
BERT_CASE_SPECIAL_TOKENS = tuple(f"<extra_id_{index}>" for index in range(100))
# The types build_tokenizer builds: the trainer reads them, tools/preprocess_data.py writes them.
TOKENIZER_TYPES = ("HuggingFaceTokenizer", "TikTokenizer", "GPT2BPETokenizer", *SENTENCEPIECE_TYPES, *BERT_TYPES)
# Megatron-LM's tokenizer of already tokenized data: --vocab-size ids, the end-of-document id after them. The
# trainer takes it for datasets without a .json; it cannot tokenize text.
NULL_TOKENIZER = "NullTokenizer"
# The other choices of Megatron-LM's --tokenizer-type (megatron/training/arguments.py, core_v0.16.1), and why a
# pretraining GPT has no use for them.
MULTIMODAL = ("a vision-language model's tokenizer (its image tokens, Megatron-LM's multimodal/LLaVA training): "
              "angpt pretrains text-only GPTs")
MEGATRON_ONLY_TOKENIZER_TYPES = {
    "MultimodalTokenizer": MULTIMODAL, "NullMultimodalTokenizer": MULTIMODAL,
    "SFTTokenizer": ("supervised fine-tuning's tokenizer of chat conversations (its prompt formats, for --sft's "
                     "chat data, which angpt refuses: supervised fine-tuning data is not built)"),
}


class Tokenizer(Protocol):
    vocab_size: int
    eod: int
    pad: int  # NO_PAD without one
    description: dict
    special_tokens_as_text: bool

    def encode_batch(self, texts: list[str]) -> list[list[int]]: ...

    def encode_flat(self, texts: list[str]) -> tuple: ...

    def decode(self, ids: list[int]) -> str: ...

    def set_threads(self, threads: int) -> None: ...


def flat_ids(encoded: list) -> tuple:
    """(every id of the texts, concatenated as int64; each text's count of ids) of lists of ids."""
    lengths = numpy.fromiter(map(len, encoded), dtype=numpy.int64, count=len(encoded))
    return numpy.fromiter(chain.from_iterable(encoded), dtype=numpy.int64, count=int(lengths.sum())), lengths


def describe_file(path: str) -> dict:
    return {"path": os.path.abspath(path), "sha256": sha256_of(path)}


def add_special_tokens(tokenizer, special_tokens) -> None:
    """--tokenizer-special-tokens, as megatron-core's HuggingFaceTokenizer gives them to transformers
    (additional_special_tokens): each becomes a special token, matched whole in the text; one the vocabulary lacks
    takes the next id."""
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in special_tokens])


class HuggingFaceTokenizer:
    """A `tokenizers` tokenizer. Its special tokens in the text are matched as those tokens, as by Megatron-LM's
    HuggingFaceTokenizer (`tokens_to_ids(tokenize(text))`); with special_tokens_as_text, they are text.
    special_tokens: --tokenizer-special-tokens (add_special_tokens); include_special_tokens:
    --tokenizer-hf-include-special-tokens, the post-processor's tokens too (megatron-core's `tokenizer(text)`:
    a Llama-style <s> before each text). pad_token: the pad token transformers reads from the directory's
    configuration, a special token (added, as transformers adds it, where the vocabulary lacks it)."""

    def __init__(self, tokenizer, eod_token: str, description: dict, special_tokens_as_text: bool = False,
                 special_tokens: tuple = (), include_special_tokens: bool = False, pad_token: Optional[str] = None):
        # transformers sets the pad token when it loads the tokenizer, before megatron-core adds its special tokens.
        add_special_tokens(tokenizer, (pad_token,) if pad_token else ())
        add_special_tokens(tokenizer, special_tokens)
        tokenizer.encode_special_tokens = special_tokens_as_text
        self.special_tokens_as_text = special_tokens_as_text
        self.include_special_tokens = include_special_tokens
        self.tokenizer = tokenizer
        self.eod = tokenizer.token_to_id(eod_token)
        if self.eod is None:
            raise ValueError(f"{description}: the tokenizer has no end-of-document token {eod_token!r}")
        self.pad = tokenizer.token_to_id(pad_token) if pad_token else NO_PAD
        self.vocab_size = max(tokenizer.get_vocab(with_added_tokens=True).values()) + 1
        # Recorded only when given: the descriptions of datasets written before stay equal.
        self.description = {**description, "eod_token": eod_token, **({"pad_token": pad_token} if pad_token else {}),
                            **({"special_tokens": list(special_tokens)} if special_tokens else {}),
                            **({"include_special_tokens": True} if include_special_tokens else {})}

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [encoding.ids for encoding in
                self.tokenizer.encode_batch_fast(texts, add_special_tokens=self.include_special_tokens)]

    def encode_flat(self, texts: list[str]) -> tuple:
        return flat_ids(self.encode_batch(texts))

    def set_threads(self, threads: int) -> None:
        """Cap this process's encoding threads; Rust's thread pool reads it once, at the first encoding."""
        os.environ["RAYON_NUM_THREADS"] = str(threads)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def library(self):
        """megatron-core's HuggingFaceTokenizer library object (over transformers' AutoTokenizer) as Megatron-LM
        0.16.1's build_tokenizer builds it for this tokenizer (library "megatron" for GPT2BPETokenizer and the BERT
        types, from --vocab-file and --merge-file; "huggingface" from the directory of tokenizer.json), for what
        Megatron-LM's GPTFIMDataset asks of it (--fim-data): the special tokens transformers names are the ones its
        ids_to_text leaves out."""
        from megatron.core.tokenizers import MegatronTokenizer  # noqa: PLC0415 (megatron-core takes seconds to import)

        kwargs = {"additional_special_tokens": list(self.description.get("special_tokens", [])), "use_fast": False,
                  "trust_remote_code": False, "include_special_tokens": self.include_special_tokens}
        if self.description["type"] in ("GPT2BPETokenizer", *BERT_TYPES):  # BERT's: bert-large-*'s hub configuration
            merge_file = self.description.get("merge_file")
            return MegatronTokenizer.from_pretrained(
                tokenizer_path=self.description["type"], metadata_path={"library": "megatron"},
                vocab_file=self.description["vocab_file"]["path"], merges_file=merge_file and merge_file["path"],
                **kwargs)._tokenizer
        path = self.description["model"]["path"]
        if os.path.basename(path) != "tokenizer.json":
            raise ValueError(f"--fim-data: Megatron-LM reads a Hugging Face tokenizer from its directory "
                             f"(transformers' AutoTokenizer), and {path} is not a directory's tokenizer.json: give "
                             "--tokenizer-model its directory")
        return MegatronTokenizer.from_pretrained(tokenizer_path=os.path.dirname(path),
                                                 metadata_path={"library": "huggingface"}, vocab_file=None,
                                                 merges_file=None, **kwargs)._tokenizer


class TikTokenizer:
    """A `tiktoken` encoding of a ranks file with GPT-2's split pattern; EOD is the id after the last rank.
    "<|endoftext|>" in the text is the EOD, as Megatron-LM's TikTokenizer encodes its special tokens
    (`allowed_special="all"`); with special_tokens_as_text, it is text (`encode_ordinary`)."""

    def __init__(self, path: str, tokenizer_type: str, special_tokens_as_text: bool = False):
        ranks = read_ranks(path)
        self.eod = max(ranks.values()) + 1
        self.pad = NO_PAD  # <|endoftext|> is its only special token
        self.encoding = tiktoken.Encoding(
            name=os.path.basename(path), pat_str=GPT2_SPLIT_PATTERN, mergeable_ranks=ranks,
            special_tokens={EOD_TOKEN: self.eod},
        )
        self.vocab_size = self.encoding.n_vocab
        self.threads = os.cpu_count()
        self.special_tokens_as_text = special_tokens_as_text
        self.description = {"type": tokenizer_type, "model": describe_file(path), "eod_token": EOD_TOKEN}

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return _tiktoken_batch(self.encoding, texts, self.threads, self.special_tokens_as_text)

    def encode_flat(self, texts: list[str]) -> tuple:
        return flat_ids(self.encode_batch(texts))

    def set_threads(self, threads: int) -> None:
        self.threads = threads

    def decode(self, ids: list[int]) -> str:
        return self.encoding.decode(ids)


def read_ranks(path: str) -> dict:
    """A .tiktoken ranks file: a base64 token and its rank per line. Read here rather than by tiktoken's
    load_tiktoken_bpe, which caches a local file by its path (a file changed in place was read as it was before)
    and names no line; a ValueError names the file and the line."""
    with open(path, "rb") as file:
        data = file.read()
    ranks, seen = {}, set()
    for number, line in enumerate(data.splitlines(), start=1):
        if not line:
            continue
        try:
            token, rank = line.split()
            token, rank = base64.b64decode(token, validate=True), int(rank)
        except (ValueError, binascii.Error):
            raise ValueError(f"{path}:{number}: not a base64 token and its rank: {line[:40]!r}") from None
        if token in ranks or rank in seen:
            raise ValueError(f"{path}:{number}: token {token!r} or rank {rank} given twice")
        ranks[token] = rank
        seen.add(rank)
    if not ranks:
        raise ValueError(f"{path}: no ranks (an empty file)")
    return ranks


def _tiktoken_batch(encoding, texts: list[str], threads: int, special_tokens_as_text: bool) -> list[list[int]]:
    """A tiktoken Encoding's ids of `texts` on `threads` threads: special-token text as those tokens, as
    Megatron-LM's TikTokenizer reads it (allowed_special="all"), or as ordinary text."""
    if special_tokens_as_text:
        return encoding.encode_ordinary_batch(texts, num_threads=threads)
    return encoding.encode_batch(texts, num_threads=threads, allowed_special="all")


def read_huggingface_tokenizer(path: str) -> RustTokenizer:
    """A tokenizer.json; a ValueError names the file, and the line where it is not UTF-8 or (as the tokenizers
    library says) not JSON."""
    try:
        text = read_text(path)
    except ValueError as error:
        raise ValueError(f"{path}: {error}") from None
    try:
        return RustTokenizer.from_str(text)
    except Exception as error:  # noqa: BLE001 (only the bare Exception the tokenizers library raises; see below)
        if type(error) is not Exception:  # anything more specific is not the file's fault
            raise
        raise ValueError(f"{path}: not a Hugging Face tokenizer: {error}") from None


def configured_special_tokens(directory: str) -> dict:
    """The special tokens a Hugging Face directory configures, as transformers' from_pretrained reads them:
    tokenizer_config.json's, then special_tokens_map.json's over them; each a string or an added token's
    "content" ({"eos_token": "</s>", "pad_token": "<pad>", ...}; a token given as null left out)."""
    tokens = {}
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        config_path = os.path.join(directory, name)
        if os.path.isfile(config_path):
            for key, token in read_json_object(config_path).items():
                token = token.get("content") if isinstance(token, dict) else token
                if key.endswith("_token") and (token is None or isinstance(token, str)):
                    tokens[key] = token
    return {key: token for key, token in tokens.items() if token}


def load_huggingface(path: str, tokenizer_type: str, special_tokens_as_text: bool = False, special_tokens: tuple = (),
                     include_special_tokens: bool = False) -> HuggingFaceTokenizer:
    """A tokenizer.json file, or a directory with tokenizer.json (configured_special_tokens may name its EOS, the end
    of document, and its pad token)."""
    configured = {}
    if os.path.isdir(path):
        configured = configured_special_tokens(path)
        path = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--tokenizer-model: no tokenizer file {path}")
    description = {"type": tokenizer_type, "model": describe_file(path)}
    return HuggingFaceTokenizer(read_huggingface_tokenizer(path), configured.get("eos_token", EOD_TOKEN), description,
                                special_tokens_as_text, special_tokens, include_special_tokens,
                                configured.get("pad_token"))


def read_gpt2_bpe(vocab_file: str, merge_file: str) -> models.BPE:
    """The BPE of a vocab.json and merges.txt, read as the tokenizers library reads them (BPE.from_file), but a
    ValueError names the file and the line that is not UTF-8, not JSON, or not a merge of two tokens."""
    try:
        vocab = read_json(vocab_file)
    except ValueError as error:
        raise ValueError(f"{vocab_file}: {error}") from None
    if not isinstance(vocab, dict) or not all(type(index) is int and index >= 0 for index in vocab.values()):
        raise ValueError(f"{vocab_file}: not a BPE vocab.json (an object of tokens to ids)")
    try:
        text = read_text(merge_file)
    except ValueError as error:
        raise ValueError(f"{merge_file}: {error}") from None
    if not text:
        raise ValueError(f"{merge_file}: no merges (an empty file)")
    lines = text.split("\n")
    merges = []
    for number, line in enumerate(lines[:-1] if lines[-1] == "" else lines, start=1):
        line = line.removesuffix("\r")
        if line.startswith("#version"):
            continue
        parts = line.split(" ")
        # Both tokens and the merged one must be in the vocabulary (tokenizers refuses the BPE otherwise).
        if len(parts) != 2 or any(token not in vocab for token in (*parts, "".join(parts))):
            raise ValueError(f"{merge_file}:{number}: not a merge of two tokens of {vocab_file}: {line[:40]!r}")
        merges.append((parts[0], parts[1]))
    return models.BPE(vocab, merges)


def load_gpt2_vocab_merges(vocab_file: str, merge_file: str, special_tokens_as_text: bool = False,
                           special_tokens: tuple = (), include_special_tokens: bool = False) -> HuggingFaceTokenizer:
    """GPT-2's byte-level BPE from Megatron's vocab/merges pair; its "<|endoftext|>" (in vocab.json) is a
    special token, as in Megatron-LM's GPT2BPETokenizer (Hugging Face's GPT2Tokenizer)."""
    tokenizer = RustTokenizer(read_gpt2_bpe(vocab_file, merge_file))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    if tokenizer.token_to_id(EOD_TOKEN) is not None:  # keeps its vocab.json id; a vocab without it is refused below
        tokenizer.add_special_tokens([AddedToken(EOD_TOKEN, special=True, normalized=False)])
    description = {"type": "GPT2BPETokenizer", "vocab_file": describe_file(vocab_file),
                   "merge_file": describe_file(merge_file)}
    return HuggingFaceTokenizer(tokenizer, EOD_TOKEN, description, special_tokens_as_text, special_tokens,
                                include_special_tokens)


def load_bert_wordpiece(tokenizer_type: str, vocab_file: Optional[str], special_tokens_as_text: bool = False,
                        special_tokens: tuple = (), include_special_tokens: bool = False) -> HuggingFaceTokenizer:
    """BERT's WordPiece over a vocab.txt (one token a line, its id the line's index), built as transformers 5's
    BertTokenizer builds it in the `tokenizers` library (BertNormalizer, lower-casing and stripping accents for
    BertWordPieceLowerCase, BertPreTokenizer, WordPiece with [UNK], [CLS] $A [SEP] with
    --tokenizer-hf-include-special-tokens), which megatron-core's library reads it with for Megatron-LM: [SEP] the
    end of document (transformers' BertTokenizer has no EOS, and megatron-core takes its SEP for one), [PAD] the pad.
    BertWordPieceCase takes Megatron-LM's 100 <extra_id_N> in place of special_tokens (build_tokenizer's choice)."""
    if vocab_file is None:
        raise ValueError(f"{tokenizer_type} needs --vocab-file (BERT's vocab.txt)")
    try:
        text = read_text(vocab_file)
    except ValueError as error:
        raise ValueError(f"{vocab_file}: {error}") from None
    # transformers' load_vocab: the lines of the file read as text (universal newlines).
    lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    vocab = {token: index for index, token in enumerate(lines[:-1] if lines[-1] == "" else lines)}
    if len(vocab) != len(lines) - (lines[-1] == ""):
        raise ValueError(f"--vocab-file {vocab_file}: a token given twice (transformers would give it its last line's "
                         "id and leave a hole in the ids)")
    missing = [token for token in BERT_SPECIAL_TOKENS if token not in vocab]
    if missing:
        raise ValueError(f"--vocab-file {vocab_file}: not BERT's vocab.txt, which holds "
                         f"{' '.join(BERT_SPECIAL_TOKENS)}: {' '.join(missing)} missing")
    lower_case = BERT_TYPES[tokenizer_type]
    tokenizer = RustTokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True, strip_accents=None,
                                                      lowercase=lower_case)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece(prefix="##")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])])
    add_special_tokens(tokenizer, BERT_SPECIAL_TOKENS)
    special_tokens = special_tokens if lower_case else BERT_CASE_SPECIAL_TOKENS
    description = {"type": tokenizer_type, "vocab_file": describe_file(vocab_file)}
    return HuggingFaceTokenizer(tokenizer, "[SEP]", description, special_tokens_as_text, special_tokens,
                                include_special_tokens, pad_token="[PAD]")


class MegatronCoreTokenizer:
    """A tokenizer of megatron-core's tokenizer library, built with the arguments Megatron-LM 0.16's
    build_tokenizer gives MegatronTokenizer.from_pretrained (megatron/core/tokenizers/text/utils/
    build_tokenizer.py): the SENTENCEPIECE_TYPES (library "sentencepiece", legacy=False: the model's pieces, its
    EOS the end of document), and TikTokenizer with a Megatron-LM .json vocabulary (library "tiktoken": the
    special tokens <unk>, <s>, </s> (the end of document), <mask>, <pad>, <cls>, <sep>, <SPECIAL_7>, ... up to
    --tiktoken-num-special-tokens, then the ranks shifted past them; --vocab-size ids, 2**17 without it;
    --tiktoken-pattern v1 or v2, v2 without it).

    encode_batch gives the ids of its tokenize(text), which Megatron-LM's tools/preprocess_data.py writes,
    batched on threads by the library underneath:
    - tiktoken: encode(text, allowed_special="all"): a special token's text ("</s>", "<SPECIAL_7>") is that
      token, so a literal "</s>" ends a document; with special_tokens_as_text, encode_ordinary: it is text.
    - sentencepiece: encode_as_ids(text) (legacy=False adds no special tokens of its own), which never reads
      the model's control symbols (<s>, </s>, <unk>) from text: a literal "</s>" is ordinary pieces, the end of
      document comes only from --append-eod, and special_tokens_as_text changes nothing. The model's
      user-defined symbols are read from text, as SentencePiece always reads them.
    """

    def __init__(self, tokenizer_type: str, path: Optional[str], special_tokens_as_text: bool = False,
                 tiktoken_pattern: Optional[str] = None, tiktoken_num_special_tokens: int = TIKTOKEN_NUM_SPECIAL_TOKENS,
                 vocab_size: Optional[int] = None, special_tokens: tuple = ()):
        is_tiktoken = tokenizer_type == "TikTokenizer"
        if path is None or not os.path.isfile(path):
            kind = "a Megatron-LM .json vocabulary" if is_tiktoken else "a SentencePiece .model file"
            raise ValueError(f"{tokenizer_type} needs --tokenizer-model ({kind})"
                             + (f"; there is no {path}" if path else ""))
        from megatron.core.tokenizers import MegatronTokenizer  # noqa: PLC0415 (megatron-core takes seconds to import)
        from megatron.core.tokenizers.text.libraries import tiktoken_tokenizer  # noqa: PLC0415 (as megatron-core)

        # Its INFO lines ("Adding special tokens: ...") would print with every build.
        logging.getLogger(tiktoken_tokenizer.__name__).setLevel(logging.WARNING)
        if is_tiktoken:
            size = vocab_size or tiktoken_tokenizer.DEFAULT_TIKTOKEN_MAX_VOCAB
            if tiktoken_pattern not in (None, *TIKTOKEN_PATTERNS):
                raise ValueError(f"--tiktoken-pattern {tiktoken_pattern}: choose v1 or v2")
            if not len(tiktoken_tokenizer.SPECIAL_TOKENS) <= tiktoken_num_special_tokens < size:
                raise ValueError(f"--tiktoken-num-special-tokens {tiktoken_num_special_tokens}: at least the "
                                 f"{len(tiktoken_tokenizer.SPECIAL_TOKENS)} of <unk> to <sep>, and below --vocab-size "
                                 f"{size}")
            # As Megatron-LM's build_tokenizer: the pattern and the vocabulary size only when given.
            kwargs = {name: value for name, value in (("pattern", tiktoken_pattern), ("vocab_size", vocab_size))
                      if value}
            _check_tiktoken_special_tokens(special_tokens, tiktoken_num_special_tokens,
                                           tiktoken_tokenizer.SPECIAL_TOKENS)
            kwargs.update(num_special_tokens=tiktoken_num_special_tokens, special_tokens=list(special_tokens) or None)
            library = "tiktoken"
        else:
            if special_tokens:  # megatron-core's SentencePieceTokenizer raises it with legacy=False, Megatron-LM's
                raise ValueError(f"--tokenizer-special-tokens with {tokenizer_type}: megatron-core's SentencePiece "
                                 "library takes special tokens only with legacy=True (ValueError there: 'Special "
                                 "tokens must be None when legacy is set to False. Provide special tokens at train "
                                 "time.'): give them to the SentencePiece model when training it")
            kwargs, library = {"legacy": False, "special_tokens": None}, "sentencepiece"
        try:
            tokenizer = MegatronTokenizer.from_pretrained(tokenizer_path=path, metadata_path={"library": library},
                                                          **kwargs)
        except (AssertionError, ValueError, TypeError, AttributeError, OSError, RuntimeError) as error:
            if not is_tiktoken:
                raise ValueError(f"--tokenizer-model {path}: not a SentencePiece model ({error})") from None
            raise ValueError(_tiktoken_vocabulary_error(path, tiktoken_num_special_tokens, size,
                                                        given=bool(vocab_size))) from None
        # The library object underneath (megatron-core keeps it private): tiktoken's Encoding, or sentencepiece's
        # SentencePieceProcessor, whose batch encodings are the library's own text_to_ids on threads.
        self.encoder = tokenizer._tokenizer.tokenizer
        self.megatron_library = tokenizer._tokenizer
        self.is_tiktoken = is_tiktoken
        self.vocab_size, self.eod = tokenizer.vocab_size, tokenizer.eod
        # MegatronDataset's: tiktoken's <pad>; the SentencePiece model's pad_id() (-1, NO_PAD, without one).
        self.pad = tokenizer.pad
        self.special_tokens_as_text = special_tokens_as_text
        self.threads = os.cpu_count()
        self.description = {"type": tokenizer_type, "model": describe_file(path)}
        if is_tiktoken:
            self.description.update(pattern=tiktoken_pattern or "v2", num_special_tokens=tiktoken_num_special_tokens,
                                    vocab_size=self.vocab_size, eod_token=self.decode([self.eod]),
                                    **({"special_tokens": list(special_tokens)} if special_tokens else {}))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        if not self.is_tiktoken:
            return self.encoder.encode(texts, out_type=int, num_threads=self.threads)
        return _tiktoken_batch(self.encoder, texts, self.threads, self.special_tokens_as_text)

    def encode_flat(self, texts: list[str]) -> tuple:
        return flat_ids(self.encode_batch(texts))

    def set_threads(self, threads: int) -> None:
        self.threads = threads

    def decode(self, ids: list[int]) -> str:
        return self.encoder.decode(ids)

    def library(self):
        """megatron-core's library object itself, which Megatron-LM's GPTFIMDataset asks (--fim-data)."""
        return self.megatron_library


def _check_tiktoken_special_tokens(special_tokens: tuple, num_special_tokens: int, required: list) -> None:
    """megatron-core's tiktoken library's asserts on --tokenizer-special-tokens, as one line naming the flag: they
    replace its list of special tokens (ids 0, 1, ... in their order, </s> the end of document), so they must hold
    its own, once each, and fit in --tiktoken-num-special-tokens."""
    if not special_tokens:
        return
    shown = f"--tokenizer-special-tokens {' '.join(special_tokens)}"
    missing = [token for token in required if token not in special_tokens]
    if missing:
        raise ValueError(f"{shown}: TikTokenizer's must hold {' '.join(required)} (megatron-core's check); "
                         f"{' '.join(missing)} missing")
    if len(set(special_tokens)) != len(special_tokens):
        raise ValueError(f"{shown}: a token given twice (megatron-core's check)")
    fillers = {f"<SPECIAL_{index}>" for index in range(len(special_tokens), num_special_tokens)}
    if len(special_tokens) > num_special_tokens or fillers & set(special_tokens):
        raise ValueError(f"{shown}: more than --tiktoken-num-special-tokens {num_special_tokens}, or one named as "
                         "megatron-core names the special tokens after them (<SPECIAL_N>) (megatron-core's check)")


def _tiktoken_vocabulary_error(path: str, num_special_tokens: int, vocab_size: int, given: bool) -> str:
    """Why megatron-core's tiktoken library refused the vocabulary (it asserts), naming the flags."""
    try:
        with open(path, encoding="utf-8") as file:
            entries = json.load(file)
    except ValueError:
        entries = None
    # It reads the first vocab_size - num_special_tokens entries, and asserts that there are as many.
    if isinstance(entries, list) and vocab_size > num_special_tokens + len(entries):
        shown = f"--vocab-size {vocab_size}" if given else f"Megatron-LM's default vocabulary size {vocab_size}"
        return (f"{shown} exceeds --tiktoken-num-special-tokens {num_special_tokens} plus the "
                f"{len(entries)} tokens of --tokenizer-model {path}: give --vocab-size "
                f"{num_special_tokens + len(entries)} (or less, to cut the vocabulary)")
    return (f"--tokenizer-model {path}: not a Megatron-LM tiktoken vocabulary (a .json list of rank, token_bytes "
            "and token_str entries in rank order, the 256 single bytes first)")


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
    special = {"special_tokens": tuple(description.get("special_tokens", ()))}
    included = {"include_special_tokens": description.get("include_special_tokens", False)}
    if description["type"] == "HuggingFaceTokenizer":
        return HuggingFaceTokenizer(read_huggingface_tokenizer(files["model"]), description.get("eod_token", EOD_TOKEN),
                                    description, **special, **included, pad_token=description.get("pad_token"))
    if description["type"] in SENTENCEPIECE_TYPES:
        return MegatronCoreTokenizer(description["type"], files["model"])
    if description["type"] in BERT_TYPES:
        return load_bert_wordpiece(description["type"], files["vocab_file"], **special, **included)
    if "num_special_tokens" in description:  # Megatron-LM's TikTokenizer, not angpt's ranks-file layout
        return MegatronCoreTokenizer(description["type"], files["model"], tiktoken_pattern=description["pattern"],
                                     tiktoken_num_special_tokens=description["num_special_tokens"],
                                     vocab_size=description["vocab_size"], **special)
    if "model" in files:
        return TikTokenizer(files["model"], description["type"])
    return load_gpt2_vocab_merges(files["vocab_file"], files["merge_file"], **special, **included)


# The library of megatron-core's tokenizer library that Megatron-LM 0.16's build_tokenizer names for each type
# (megatron/core/tokenizers/text/utils/build_tokenizer.py), which --tokenizer-metadata's "library" replaces.
LIBRARIES = {"HuggingFaceTokenizer": "huggingface", "TikTokenizer": "tiktoken", "GPT2BPETokenizer": "megatron",
             **{kind: "sentencepiece" for kind in SENTENCEPIECE_TYPES}, **{kind: "megatron" for kind in BERT_TYPES}}


def check_metadata(path: str, tokenizer_type: str) -> None:
    """--tokenizer-metadata: the JSON file that megatron-core's MegatronTokenizer.from_pretrained reads in place of
    {"library": <the type's library>}. Its "library" decides the tokenizer built; its "model_type" picks a class
    (default, gpt, mamba, bert, t5) that tokenizes alike, its "chat_template" serves chats only. A file that names
    another library, or that megatron-core 0.16.1 cannot read, is refused naming why."""
    try:
        metadata = read_json_object(path)
    except ValueError as error:
        raise ValueError(f"--tokenizer-metadata {path}: {error}") from None
    from megatron.core.tokenizers.megatron_tokenizer import TOKENIZER_MAPPING_NAMES  # noqa: PLC0415 (as above)

    expected = LIBRARIES[tokenizer_type]
    if metadata.get("library") != expected:
        raise ValueError(f"--tokenizer-metadata {path}: library {metadata.get('library')!r}, where --tokenizer-type "
                         f"{tokenizer_type} is megatron-core's {expected!r} library (Megatron-LM would build that "
                         f"library with {tokenizer_type}'s arguments): give \"library\": \"{expected}\"")
    if metadata.get("model_type", "default") not in TOKENIZER_MAPPING_NAMES:
        raise ValueError(f"--tokenizer-metadata {path}: model_type {metadata['model_type']!r}: megatron-core has "
                         f"{', '.join(TOKENIZER_MAPPING_NAMES)} (KeyError there)")
    if metadata.get("tokenizer_class"):
        raise ValueError(f"--tokenizer-metadata {path}: tokenizer_class: megatron-core 0.16.1 looks it up with "
                         "getattr on the string tokenizer_class_path, which fails (AttributeError or KeyError)")


def build_tokenizer(tokenizer_type: str, tokenizer_model: Optional[str] = None, vocab_file: Optional[str] = None,
                    merge_file: Optional[str] = None, special_tokens_as_text: bool = False,
                    tiktoken_pattern: Optional[str] = None,
                    tiktoken_num_special_tokens: int = TIKTOKEN_NUM_SPECIAL_TOKENS,
                    vocab_size: Optional[int] = None, special_tokens: Optional[tuple] = None,
                    include_special_tokens: bool = False, metadata: Optional[str] = None) -> Tokenizer:
    """The tokenizer the flags name; special_tokens_as_text: special-token text in documents is ordinary text.
    tiktoken_pattern, tiktoken_num_special_tokens and vocab_size (--tiktoken-pattern,
    --tiktoken-num-special-tokens, --vocab-size) are Megatron-LM's TikTokenizer's: read with TikTokenizer only,
    as Megatron-LM reads them, and refused with a ranks file when they would ask for something else.
    special_tokens, include_special_tokens and metadata are --tokenizer-special-tokens,
    --tokenizer-hf-include-special-tokens (read by the Hugging Face and GPT-2 tokenizers, as Megatron-LM reads it)
    and --tokenizer-metadata (check_metadata)."""
    for flag, path in (("--tokenizer-model", tokenizer_model), ("--vocab-file", vocab_file),
                       ("--merge-file", merge_file), ("--tokenizer-metadata", metadata)):
        if path is not None and not os.path.exists(path):
            raise FileNotFoundError(f"{flag} {path}: no such file")
    if metadata is not None and tokenizer_type in LIBRARIES:
        check_metadata(metadata, tokenizer_type)
    special_tokens = tuple(special_tokens or ())
    hugging_face = {"special_tokens": special_tokens, "include_special_tokens": include_special_tokens}
    if tokenizer_type == "HuggingFaceTokenizer":
        if tokenizer_model is None:
            raise ValueError("HuggingFaceTokenizer needs --tokenizer-model (tokenizer.json or its directory)")
        return load_huggingface(tokenizer_model, tokenizer_type, special_tokens_as_text, **hugging_face)
    if tokenizer_type in SENTENCEPIECE_TYPES:
        return MegatronCoreTokenizer(tokenizer_type, tokenizer_model, special_tokens_as_text,
                                     special_tokens=special_tokens)
    if tokenizer_type == "TikTokenizer":
        if tokenizer_model is None:
            raise ValueError("TikTokenizer needs --tokenizer-model (a Megatron-LM .json vocabulary, or a .tiktoken "
                             "ranks file)")
        if tokenizer_model.endswith(".json"):  # Megatron-LM's tiktoken library reads only .json vocabularies
            return MegatronCoreTokenizer(tokenizer_type, tokenizer_model, special_tokens_as_text, tiktoken_pattern,
                                         tiktoken_num_special_tokens, vocab_size, special_tokens)
        only_json = "TikTokenizer reads it only with a Megatron-LM .json vocabulary"
        if special_tokens:
            raise ValueError(f"--tokenizer-special-tokens: {only_json}; {tokenizer_model} is a ranks file (angpt's "
                             "layout), <|endoftext|> its one special token")
        if tiktoken_pattern is not None:
            raise ValueError(f"--tiktoken-pattern {tiktoken_pattern}: {only_json}; {tokenizer_model} is a ranks "
                             "file, split with GPT-2's pattern")
        if tiktoken_num_special_tokens != TIKTOKEN_NUM_SPECIAL_TOKENS:
            raise ValueError(f"--tiktoken-num-special-tokens {tiktoken_num_special_tokens}: {only_json}; "
                             f"{tokenizer_model} is a ranks file, <|endoftext|> after its last rank")
        tokenizer = TikTokenizer(tokenizer_model, tokenizer_type, special_tokens_as_text)
        if vocab_size is not None and vocab_size != tokenizer.vocab_size:
            raise ValueError(f"--vocab-size {vocab_size}: {only_json}; the ranks file {tokenizer_model} has "
                             f"{tokenizer.vocab_size} ids")
        return tokenizer
    if tokenizer_type in BERT_TYPES:
        return load_bert_wordpiece(tokenizer_type, vocab_file, special_tokens_as_text, **hugging_face)
    if tokenizer_type == "GPT2BPETokenizer":
        if vocab_file is not None and merge_file is not None:
            return load_gpt2_vocab_merges(vocab_file, merge_file, special_tokens_as_text, **hugging_face)
        if special_tokens:
            raise ValueError("--tokenizer-special-tokens: GPT2BPETokenizer reads them with --vocab-file and "
                             "--merge-file, as Megatron-LM's; a ranks file (--tokenizer-model) has <|endoftext|> "
                             "its one special token")
        if tokenizer_model is not None:
            return TikTokenizer(tokenizer_model, tokenizer_type, special_tokens_as_text)
        raise ValueError("GPT2BPETokenizer needs --vocab-file and --merge-file, or --tokenizer-model gpt2.tiktoken")
    raise ValueError(f"--tokenizer-type {tokenizer_type!r}: choose one of {', '.join(TOKENIZER_TYPES)}")


# --tokenizer-backend: the tokenizer's own library ("tokenizers": Hugging Face tokenizers, tiktoken or
# SentencePiece, whichever build_tokenizer built), or gigatoken encoding the same vocabulary, 15-70x faster here.
TOKENIZER_BACKENDS = ("tokenizers", "gigatoken")
# The texts gigatoken must encode exactly as the tokenizer's own library before it is used: the cases where
# pre-tokenizers differ (whitespace runs, newlines, contractions, digits, letters of every script and case,
# marks, emoji, code), special-token text alone, inside words and repeated, and the empty text.
PROBE_TEXTS = [
    "", " ", "  \n\n\t \r\n x", "Hello, world! It's 2026; they'll've DON'T 'S 's",
    "<|endoftext|>", "a<|endoftext|>b", "<|endoftext|><|endoftext|> <|endoftext|>\n", "<|endoftext",
    "</s> <s> <unk>", "12345678901234567890 3.14159 1,000,000 ½ ²", "ünïcødé ✓ naïve café Ωmega ЖЖ жизнь",
    "日本語のテキスト、中文文本。한국어 텍스트", "e\u0301 a\u0308 \u200d \ufeff \u00a0x", "👍🏽 🇩🇪 👨‍👩‍👧 🙂🙂",
    "def f(x):\n    return {'a': [1, 2]}  # comment\n\n\n", "    \t  trailing spaces   ", "x" * 3000,
    "CamelCaseHTTPServer snake_case kebab-case URL https://example.com/a?b=c&d=e",
    "\x00\x01\x7f control", "ǅungla ǈ ǋ ẞ ß", "ab" * 700 + " " + "\n" * 50,
]
# gigatoken keeps every piece of text it has encoded, and its ids, in caches that grow without bound on
# distinct text: 7 MiB per MB of random words, 900 MiB after 120 MB (benchmarks/preprocess.py --cache-growth).
# The encoder is rebuilt (0.3-0.9 s for a 32k BPE here) when the process's resident memory has grown by this
# much since it was built; natural text, whose pieces repeat, rarely gets there.
GIGATOKEN_CACHE_BYTES = 512 << 20


class TokenizerBackendError(ValueError):
    """gigatoken cannot encode as the tokenizer does: the reason, or the first text it encodes differently."""


class GigatokenTokenizer:
    """The tokenizer `reference`, encoded by gigatoken (`gigatoken.Tokenizer`) instead of its own library: the
    same ids (checked on PROBE_TEXTS when built, and on whole corpora by the tests and
    benchmarks/preprocess.py); decoding, the vocabulary and the description stay the reference's.
    Batches encode on gigatoken's threads, or on the calling thread in a forked process, where a thread pool
    started before the fork would hang (gigatoken's own choice)."""

    def __init__(self, reference: Tokenizer, build):
        self.reference, self.build = reference, build
        self.vocab_size, self.eod, self.description = reference.vocab_size, reference.eod, reference.description
        self.pad = reference.pad
        self.special_tokens_as_text = reference.special_tokens_as_text
        self.version = importlib.metadata.version("gigatoken")
        self.rebuilds = 0
        self._rebuild()
        for text, expected, got in zip(PROBE_TEXTS, reference.encode_batch(PROBE_TEXTS),
                                       self.encode_batch(PROBE_TEXTS)):
            if expected != got:
                raise TokenizerBackendError(f"gigatoken {self.version} encodes {text[:60]!r} as {got[:12]}, "
                                            f"the tokenizer as {expected[:12]}")

    def _rebuild(self) -> None:
        self.encoder = None  # its caches go before the new encoder's grow
        self.encoder = self.build()
        self.built_at = psutil.Process().memory_info().rss

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        ids, lengths = self.encode_flat(texts)
        return [part.tolist() for part in numpy.split(ids, numpy.cumsum(lengths)[:-1])] if len(texts) else []

    def encode_flat(self, texts: list[str]) -> tuple:
        encoded = self.encoder.encode_batch(texts)
        # The jagged array's flat ids and offsets, without a copy.
        ids = numpy.asarray(encoded.layout.content.data)
        lengths = numpy.diff(numpy.asarray(encoded.layout.offsets.data))
        if psutil.Process().memory_info().rss - self.built_at > GIGATOKEN_CACHE_BYTES:
            self.rebuilds += 1
            self._rebuild()
        return ids, lengths

    def set_threads(self, threads: int) -> None:
        """Cap this process's encoding threads; gigatoken's thread pool reads it once, at its first batch."""
        os.environ["RAYON_NUM_THREADS"] = str(threads)

    def decode(self, ids: list[int]) -> str:
        return self.reference.decode(ids)


def gigatoken_builder(tokenizer: Tokenizer):
    """A function that builds the gigatoken encoder of `tokenizer`'s vocabulary, split pattern and special
    tokens; raises TokenizerBackendError when gigatoken has no such tokenizer."""
    try:
        import gigatoken  # noqa: PLC0415 (optional, as in GigatokenTokenizer)
    except ImportError:
        raise TokenizerBackendError("gigatoken is not installed (pip install gigatoken)") from None
    if isinstance(tokenizer, HuggingFaceTokenizer):
        data = tokenizer.tokenizer.to_str()
        if tokenizer.special_tokens_as_text:
            # As tokenizers' encode_special_tokens: special tokens are not matched in the text, the other added
            # tokens still are. (Parsed only here: 0.2 s for a 32k vocabulary, a tenth of the tool's start-up.)
            config = json.loads(data)
            config["added_tokens"] = [token for token in config["added_tokens"] if not token["special"]]
            data = json.dumps(config)
        return functools.partial(_gigatoken_from_json, gigatoken, data)
    if isinstance(tokenizer, TikTokenizer):  # a ranks file split with GPT-2's pattern
        path = tokenizer.description["model"]["path"]
        special = None if tokenizer.special_tokens_as_text else {EOD_TOKEN: tokenizer.eod}
        return lambda: gigatoken.Tokenizer.from_tiktoken(path, pretokenizer="gpt2", special_tokens=special)
    raise TokenizerBackendError(f"gigatoken does not encode {tokenizer.description['type']} here (Megatron-LM's "
                                "tiktoken patterns v1/v2 and SentencePiece models are not verified)")


def _gigatoken_from_json(gigatoken, data: str):
    """gigatoken's encoder of a tokenizer.json; its RuntimeError for a model it lacks (WordLevel, Unigram: BPE only)
    a TokenizerBackendError, so that the tokenizer's own library encodes instead."""
    try:
        return gigatoken.Tokenizer.from_json(data)
    except RuntimeError as error:
        raise TokenizerBackendError(f"gigatoken does not read this tokenizer.json: {str(error).splitlines()[0]}") \
            from None


def select_backend(tokenizer: Tokenizer, backend: Optional[str]) -> tuple:
    """(the tokenizer that encodes, the backend's description for the log and the dataset's metadata).
    backend None chooses gigatoken where it encodes as the tokenizer does, else the tokenizer's own library;
    "gigatoken" raises TokenizerBackendError where it does not."""
    if backend not in (None, *TOKENIZER_BACKENDS):
        raise ValueError(f"--tokenizer-backend {backend}: choose one of {', '.join(TOKENIZER_BACKENDS)}")
    if backend != "tokenizers":
        try:
            fast = GigatokenTokenizer(tokenizer, gigatoken_builder(tokenizer))
            return fast, {"name": "gigatoken", "version": fast.version, "chosen": "by hand" if backend else "auto"}
        except TokenizerBackendError as error:
            if backend == "gigatoken":
                raise TokenizerBackendError(f"--tokenizer-backend gigatoken: {error}") from None
            reason = str(error)
    else:
        reason = None
    library = {"HuggingFaceTokenizer": "tokenizers", "TikTokenizer": "tiktoken"}.get(type(tokenizer).__name__)
    if isinstance(tokenizer, MegatronCoreTokenizer):
        library = "tiktoken" if tokenizer.is_tiktoken else "sentencepiece"
    description = {"name": "tokenizers", "library": library, "version": importlib.metadata.version(library),
                   "chosen": "by hand" if backend else "auto"}
    if reason:
        description["gigatoken_not_used"] = reason
    return tokenizer, description
