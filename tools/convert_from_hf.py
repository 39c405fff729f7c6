#!/usr/bin/env python
"""Import a Hugging Face model directory as an angpt checkpoint that the trainer loads with --finetune.

    python tools/convert_from_hf.py --input runs/quickstart/hf --save runs/imported \\
        [--make-vocab-size-divisible-by 128] [--tensor-model-parallel-size 1]

Takes anGPT and nGPT directories written by tools/convert_to_hf.py (the folded factors are divided back
out) and Qwen3 models as GPT+. The vocabulary is padded with zero rows as the trainer pads it at the
tensor-parallel size given. Prints the model flags to train with.
"""

import argparse
import sys

from angpt.megatron_compat import quiet_known_warnings


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", required=True, help="the Hugging Face model directory")
    parser.add_argument("--save", required=True, help="the checkpoint directory to write")
    parser.add_argument("--make-vocab-size-divisible-by", type=int, default=128, help="default: %(default)s")
    parser.add_argument("--tensor-model-parallel-size", type=int, default=1,
                        help="the TP size of the run that will load it (the vocabulary is padded for it; "
                        "default: %(default)s)")
    args = parser.parse_args()
    quiet_known_warnings()
    # After parsing, so that --help and flag errors come without torch, transformers and megatron-core.
    from angpt.hf.errors import ExportError  # noqa: PLC0415 (after parsing)
    from angpt.hf.importer import import_hf, model_flags  # noqa: PLC0415 (after parsing)

    try:
        flags = import_hf(args.input, args.save, args.make_vocab_size_divisible_by, args.tensor_model_parallel_size)
    except ExportError as error:
        sys.exit(f"convert_from_hf: {error}")
    print(f"wrote {args.save}; train from it with: {model_flags(flags)} --load {args.save} --finetune")


if __name__ == "__main__":
    main()
