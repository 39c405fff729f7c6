#!/usr/bin/env python
"""Export an angpt checkpoint (any tensor/pipeline/data layout) to a Hugging Face model directory.

    python tools/convert_to_hf.py --load runs/quickstart --output runs/quickstart/hf [--iteration N]
        [--dtype float32|bfloat16] [--max-shard-size-mb 5120] [--no-verify] [--overwrite]

anGPT and nGPT load with `AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)`; GPT+ is
written as transformers' Qwen3ForCausalLM. The tokenizer the checkpoint records (a Hugging Face
tokenizer.json, GPT-2's vocab.json + merges.txt, or tiktoken ranks) becomes tokenizer.json, which
`AutoTokenizer` loads to encode as the training data was; README.md is a model card (the model, its training
as the checkpoint and metrics.jsonl record it, how to load it). After writing, the output is loaded with
transformers and a fixed prompt is run through it and through angpt's own model: the largest logit
difference, their cosine similarity, the argmax and the greedy continuation are compared and printed. Other
arithmetic (another CPU, bf16) may break a near-tie the other way, so argmaxes are compared only where our
top logit leads by more than twice the tolerance (fp32: 1e-4; bf16: 16 bf16 roundoffs, 2^-8, of the
position's largest |logit|), and each generated token must be an argmax of angpt's logits up to twice the
tolerance. fp32 logits further apart than 1e-4 or a greedy token outside it (bf16: cosine similarity under
0.999 or another argmax where the margin decides it) exit with 1.
"""

import argparse
import sys

from angpt.config.choices import EXPORT_DTYPES
from angpt.megatron_compat import quiet_known_warnings


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--load", required=True, help="the checkpoint directory (as given to --save)")
    parser.add_argument("--iteration", type=int, help="the iteration to export (default: the latest)")
    parser.add_argument("--output", required=True, help="the Hugging Face model directory to write")
    parser.add_argument("--dtype", choices=EXPORT_DTYPES, default="float32", help="default: %(default)s")
    parser.add_argument("--max-shard-size-mb", type=float, default=5120,
                        help="weights above this size are split into shards with an index (default: %(default)s)")
    parser.add_argument("--no-verify", action="store_true", help="skip comparing the output with angpt's model")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace a non-empty --output whole (the new export is written beside it and swapped in)")
    args = parser.parse_args()
    quiet_known_warnings()
    # After parsing, so that --help and flag errors come without torch, transformers and megatron-core.
    from angpt.hf.export import ExportError, export  # noqa: PLC0415 (after parsing)
    from angpt.hf.verify import verify  # noqa: PLC0415 (after parsing)

    try:
        checkpoint = export(args.load, args.output, args.iteration, args.dtype, int(args.max_shard_size_mb * 2**20),
                            overwrite=args.overwrite)
    except ExportError as error:
        sys.exit(f"convert_to_hf: {error}")
    print(f"wrote {args.output} ({checkpoint.family}) from {checkpoint.path}")
    if args.no_verify:
        return
    result = verify(checkpoint, args.output)
    print(f"check prompt: max |logit difference| {result.max_logit_difference:.3g}, cosine similarity "
          f"{result.cosine_similarity:.6f}, same argmax where the margin exceeds twice the tolerance "
          f"({result.decided_positions} of {result.positions} positions): {result.same_argmax}")
    print(f"greedy continuation of 20 tokens {'agrees' if result.greedy_agrees else 'DIFFERS'} up to the "
          f"tolerance (identical: {result.greedy_identical}): angpt {result.ours}, exported {result.exported}")
    if result.text is not None:
        print(f"exported model's continuation: {result.text!r}")
    if not result.passed(args.dtype):
        sys.exit("convert_to_hf: the exported model does not compute what the checkpoint's does")


if __name__ == "__main__":
    main()
