#!/usr/bin/env bash
# The whole path on a small real corpus: fetch Shakespeare's plays, train a byte-level BPE, write Megatron
# indexed datasets, and pretrain a small anGPT with tensor parallelism 2 on two CPU processes (gloo).
# Each data step is skipped when its output exists. On GPUs the same commands run on NCCL.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONWARNINGS=ignore
corpus=${CORPUS_DIR:-data/shakespeare}

[ -f "$corpus/train.jsonl" ] || python tools/fetch_example_corpus.py --output-dir "$corpus"
[ -f "$corpus/tokenizer/tokenizer.json" ] || \
    python tools/train_tokenizer.py --input "$corpus/train.jsonl" --vocab-size 8192 --output-dir "$corpus/tokenizer"
for split in train valid; do
    [ -f "$corpus/${split}_text_document.idx" ] || \
        python tools/preprocess_data.py --input "$corpus/$split.jsonl" --output-prefix "$corpus/$split" \
            --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$corpus/tokenizer" --append-eod --workers 2
done

torchrun --standalone --nproc-per-node 2 -m angpt.pretrain \
    --model-family angpt \
    --tensor-model-parallel-size 2 \
    --num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 128 \
    --micro-batch-size 8 --global-batch-size 16 \
    --train-iters 100 --lr 1e-2 --log-interval 10 \
    --train-data-path "$corpus/train_text_document" --valid-data-path "$corpus/valid_text_document" \
    --data-cache-path "$corpus/cache" \
    "$@"
