"""Megatron-LM's TikTokenizer layout (megatron/core/tokenizers, core_v0.16.1): how many special tokens come first
in the vocabulary, and the names of its split patterns. Apart from angpt.data.tokenizers so that the flags
(angpt.config.arguments) read them without importing the tokenizer libraries: `--help` imports nothing heavy.
"""

TIKTOKEN_NUM_SPECIAL_TOKENS = 1000
TIKTOKEN_PATTERNS = ("v1", "v2")
