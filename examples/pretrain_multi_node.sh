#!/usr/bin/env bash
# Pretrain on several nodes: run this once on every node, each with its NODE_RANK (0 .. NNODES-1);
# torchrun meets the others at MASTER_ADDR:MASTER_PORT (node 0). examples/pretrain.slurm runs it
# under Slurm.
#
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 DATA_PATH=/shared/slimpajama_text_document \
#       bash examples/pretrain_multi_node.sh [more angpt.pretrain flags]
#
# Environment: as examples/pretrain_single_node.sh (SIZE, FAMILY, DATA_PATH, CHECKPOINT_DIR,
# DATA_CACHE_PATH), plus NNODES, NODE_RANK, MASTER_ADDR (required), MASTER_PORT [29500] and
# GPUS_PER_NODE [8]. CHECKPOINT_DIR and DATA_CACHE_PATH must be on a file system every node sees:
# every rank writes its part of each checkpoint, and rank 0 builds the dataset indices for all.
set -euo pipefail
cd "$(dirname "$0")/.."
SIZE=${SIZE:-0.5b}
FAMILY=${FAMILY:-angpt}
CHECKPOINT_DIR=${CHECKPOINT_DIR:-checkpoints/$FAMILY-$SIZE}
read -r -a data_path <<< "${DATA_PATH:?set DATA_PATH to a dataset prefix or a blend}"
export CUDA_DEVICE_MAX_CONNECTIONS=1

torchrun --nnodes "${NNODES:?}" --node-rank "${NODE_RANK:?}" --nproc-per-node "${GPUS_PER_NODE:-8}" \
    --master-addr "${MASTER_ADDR:?}" --master-port "${MASTER_PORT:-29500}" \
    -m angpt.pretrain \
    --config "examples/configs/angpt_$SIZE.yaml" --model-family "$FAMILY" \
    --data-path "${data_path[@]}" --data-cache-path "${DATA_CACHE_PATH:-data/cache}" \
    --save "$CHECKPOINT_DIR" --load "$CHECKPOINT_DIR" \
    "$@"
