"""Megatron-LM's TikTokenizer layout (megatron/core/tokenizers, core_v0.16.1): how many special tokens come first
in the vocabulary, and the names of its split patterns: a flag's default and choices (angpt.config.sections), and
what angpt.data.tokenizers reads such a vocabulary with. Here, not in angpt.data.tokenizers, so that `--help`
imports no tokenizer library.
"""

TIKTOKEN_NUM_SPECIAL_TOKENS = 1000
TIKTOKEN_PATTERNS = ("v1", "v2")
# Megatron-LM 0.16 reads all three through megatron-core's tokenizer library ("sentencepiece"): the model's
# pieces, end-of-document id its EOS (angpt.data.tokenizers.MegatronCoreTokenizer); angpt.config.megatron_lm
# checks --tokenizer-sentencepiece-legacy against them.
SENTENCEPIECE_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer")
# Megatron-LM's BERT WordPiece types and whether each lower-cases the text: megatron-core's "megatron" library reads
# --vocab-file with transformers' BertTokenizer under bert-large-uncased's or bert-large-cased's configuration.
BERT_TYPES = {"BertWordPieceLowerCase": True, "BertWordPieceCase": False}
