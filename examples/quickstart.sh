#!/usr/bin/env bash
# The main job, small: fetch Shakespeare's plays, train a byte-level BPE, write Megatron indexed datasets,
# and pretrain a small anGPT with tensor parallelism 2 on two CPU processes (gloo) for a few minutes,
# evaluating on the held-out plays and ending with a checkpoint and its validation loss; then export it
# to Hugging Face and generate a continuation through transformers.
# Each data step is skipped when its output exists; training resumes from $RUN_DIR if it was interrupted.
# On GPUs the same commands run on NCCL. Extra arguments go to angpt.pretrain.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONWARNINGS=ignore
corpus=${CORPUS_DIR:-data/shakespeare}
run=${RUN_DIR:-runs/quickstart}
iters=${TRAIN_ITERS:-300}

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
    --train-iters "$iters" --lr 1e-2 \
    --train-data-path "$corpus/train_text_document" --valid-data-path "$corpus/valid_text_document" \
    --data-cache-path "$corpus/cache" \
    --eval-interval 100 --eval-iters 8 --log-interval 10 \
    --save "$run" --load "$run" --save-interval 100 --keep-last-n-checkpoints 2 \
    "$@"

echo "checkpoint: $run/iter_$(printf %07d "$(cat "$run/latest_checkpointed_iteration.txt")")"
python - "$run/metrics.jsonl" <<'PY'
import json, sys
evals = [r for r in map(json.loads, open(sys.argv[1])) if r["kind"] == "eval" and r["split"] == "validation"]
print(f"validation loss at iteration {evals[-1]['iteration']}: {evals[-1]['lm_loss']:.4f}")
PY

# Export to Hugging Face (the converter checks the copy's logits against ours), then generate through
# transformers alone.
python tools/convert_to_hf.py --load "$run" --output "$run/hf"
python - "$run/hf" <<'PY'
import sys
from transformers import AutoModelForCausalLM, AutoTokenizer
tokenizer = AutoTokenizer.from_pretrained(sys.argv[1], trust_remote_code=True)
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True)
prompt = tokenizer("ROMEO:", return_tensors="pt")
print("transformers generates:", repr(tokenizer.decode(model.generate(**prompt, max_new_tokens=40, do_sample=False)[0])))
PY
