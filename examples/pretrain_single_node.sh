#!/usr/bin/env bash
# Pretrain on one node of 8 GPUs (NCCL): the paper's 0.5B or 1B shape (docs/model.md, Model shapes) from
# examples/configs/.
#
#   DATA_PATH=/data/slimpajama_text_document bash examples/pretrain_single_node.sh [more angpt.pretrain flags]
#
# Environment (defaults in brackets):
#   SIZE             0.5b or 1b [0.5b]: examples/configs/angpt_$SIZE.yaml
#   FAMILY           angpt, gptplus or ngpt [angpt]: the same shape with that family's model and recipe
#                    (GPT+: weight decay 0.1 and 1% warm-up); give each family its own --lr
#   DATA_PATH        a Megatron dataset prefix, or "W1 PREFIX1 W2 PREFIX2 ..." to blend (required)
#   CHECKPOINT_DIR   --save and --load, so that running again resumes [checkpoints/$FAMILY-$SIZE]
#   DATA_CACHE_PATH  where GPTDataset keeps its index files [data/cache]
#   GPUS             processes on this node [8]
# Flags after the script override the config (e.g. --train-iters 100 --lr 2e-3).
set -euo pipefail
cd "$(dirname "$0")/.."
SIZE=${SIZE:-0.5b}
FAMILY=${FAMILY:-angpt}
CHECKPOINT_DIR=${CHECKPOINT_DIR:-checkpoints/$FAMILY-$SIZE}
read -r -a data_path <<< "${DATA_PATH:?set DATA_PATH to a dataset prefix or a blend}"
export CUDA_DEVICE_MAX_CONNECTIONS=1  # megatron-core's overlap of communication with compute needs it

torchrun --standalone --nproc-per-node "${GPUS:-8}" -m angpt.pretrain \
    --config "examples/configs/angpt_$SIZE.yaml" --model-family "$FAMILY" \
    --data-path "${data_path[@]}" --data-cache-path "${DATA_CACHE_PATH:-data/cache}" \
    --save "$CHECKPOINT_DIR" --load "$CHECKPOINT_DIR" \
    "$@"
