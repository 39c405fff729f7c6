#!/usr/bin/env python
"""Train a byte-level BPE tokenizer (Hugging Face `tokenizers`) with the end-of-document token <|endoftext|>.

    python tools/train_tokenizer.py --input data/train.jsonl --vocab-size 32000 --output-dir tokenizers/bpe32k
    python tools/preprocess_data.py ... --tokenizer-type HuggingFaceTokenizer --tokenizer-model tokenizers/bpe32k

Reads the same inputs as tools/preprocess_data.py (.jsonl, .jsonl.gz, .txt, globs; --json-keys) and writes
OUTPUT_DIR/tokenizer.json, and OUTPUT_DIR/tokenizer_config.json naming <|endoftext|> as the EOS (and BOS and
UNK, as GPT-2's), so that transformers' AutoTokenizer, and Megatron-LM's HuggingFaceTokenizer with it (its
EOD is the EOS), find the end-of-document token. A bad line stops training with its file and line, unless
--skip-bad-lines.
"""

import argparse
import json
import os
import sys
from collections import Counter

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from angpt.data.corpus import BadLine, InputError, expand_inputs, iter_records, parse_record
from angpt.data.tokenizers import EOD_TOKEN


def iter_texts(paths: list, keys: list, skip_bad_lines: bool, skipped: Counter):
    for record in iter_records(paths):
        parsed = parse_record(record, keys)
        if isinstance(parsed, BadLine):
            if not skip_bad_lines:
                raise InputError(f"{parsed} (--skip-bad-lines skips such lines)")
            skipped[parsed.reason] += 1
            continue
        yield from parsed.values()


def train(paths: list, keys: list, vocab_size: int, skip_bad_lines: bool = False):
    """A byte-level BPE of vocab_size tokens, <|endoftext|> (id 0) among them; returns it and the skipped lines."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    # The progress bars draw on stderr, but each stage ends with a newline on stdout even when no bar was
    # drawn: without a terminal, they would only leave blank lines.
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOD_TOKEN],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=sys.stderr.isatty())
    skipped = Counter()
    tokenizer.train_from_iterator(iter_texts(paths, keys, skip_bad_lines, skipped), trainer=trainer)
    return tokenizer, skipped


def tokenizer_config() -> dict:
    """tokenizer_config.json for transformers' AutoTokenizer: the tokenizer.json as it is (no post-processor,
    so no BOS is added), with <|endoftext|> as its EOS, BOS and UNK, as GPT-2's."""
    return {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": EOD_TOKEN, "eos_token": EOD_TOKEN,
            "unk_token": EOD_TOKEN, "clean_up_tokenization_spaces": False}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", nargs="+", required=True, help="input files or glob patterns")
    parser.add_argument("--json-keys", nargs="+", default=["text"], help="keys whose text to train on")
    parser.add_argument("--vocab-size", type=int, required=True, help="tokens in all, <|endoftext|> included")
    parser.add_argument("--output-dir", required=True, help="where to write tokenizer.json and tokenizer_config.json")
    parser.add_argument("--skip-bad-lines", action="store_true", help="skip unreadable lines instead of stopping")
    args = parser.parse_args()
    minimum = 256 + 1  # every byte, and the EOD
    if args.vocab_size < minimum:
        parser.error(f"--vocab-size {args.vocab_size}: a byte-level BPE needs at least {minimum} (256 bytes + EOD)")
    try:
        tokenizer, skipped = train(expand_inputs(args.input), args.json_keys, args.vocab_size, args.skip_bad_lines)
    except (InputError, OSError) as error:
        sys.exit(f"error: {error}")
    os.makedirs(args.output_dir, exist_ok=True)
    path = os.path.join(args.output_dir, "tokenizer.json")
    tokenizer.save(path)
    with open(os.path.join(args.output_dir, "tokenizer_config.json"), "w") as file:
        json.dump(tokenizer_config(), file, indent=2)
        file.write("\n")
    print(f"{path}: {tokenizer.get_vocab_size()} tokens, {EOD_TOKEN} = {tokenizer.token_to_id(EOD_TOKEN)}")
    if skipped:
        print(f"skipped {sum(skipped.values())} bad lines: "
              + ", ".join(f"{count} {reason}" for reason, count in sorted(skipped.items())))


if __name__ == "__main__":
    main()
