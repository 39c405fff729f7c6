#!/usr/bin/env bash
# A small anGPT trained for a few steps with tensor parallelism 2 on two CPU processes (gloo).
# On GPUs the same command runs on NCCL; raise the sizes to taste.
set -euo pipefail
export PYTHONWARNINGS=ignore
torchrun --standalone --nproc-per-node 2 -m angpt.pretrain \
    --model-family angpt \
    --tensor-model-parallel-size 2 \
    --num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 128 \
    --micro-batch-size 8 --global-batch-size 16 \
    --train-iters 60 --lr 1e-2 --log-interval 5 \
    "$@"
