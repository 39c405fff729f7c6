"""Megatron-LM's TikTokenizer layout (megatron/core/tokenizers, core_v0.16.1): how many special tokens come first
in the vocabulary, and the names of its split patterns: a flag's default and choices (angpt.config.sections), and
what angpt.data.tokenizers reads such a vocabulary with. Here, not in angpt.data.tokenizers, so that `--help`
imports no tokenizer library.
"""

TIKTOKEN_NUM_SPECIAL_TOKENS = 1000
TIKTOKEN_PATTERNS = ("v1", "v2")
