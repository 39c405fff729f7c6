#!/usr/bin/env bash
# Megatron-LM's examples/gpt3/train_gpt3_175b_distributed.sh (core_v0.16.1) run by angpt: the same flags and the
# same data (a .bin/.idx pair written by Megatron-LM's tools/preprocess_data.py, no .json needed). Each line
# that differs from Megatron-LM's says so in a comment; docs/megatron.md lists what every Megatron-LM flag does
# here. tests/test_megatron_examples.py runs this argument list, shapes shrunk, on two CPU processes.
#
#   bash examples/pretrain_from_megatron.sh CHECKPOINT_PATH TENSORBOARD_LOGS_PATH VOCAB_FILE MERGE_FILE DATA_PATH
set -euo pipefail
cd "$(dirname "$0")/.."

GPUS_PER_NODE=8
# Change for multinode config
MASTER_ADDR=localhost
MASTER_PORT=6000
NUM_NODES=1
NODE_RANK=0

CHECKPOINT_PATH=$1 #<Specify path>
TENSORBOARD_LOGS_PATH=$2 #<Specify path>
VOCAB_FILE=$3 #<Specify path to file>/gpt2-vocab.json
MERGE_FILE=$4 #<Specify path to file>/gpt2-merges.txt
DATA_PATH=$5 #<Specify path and file prefix>_text_document

GPT_MODEL_ARGS=(
    --model-family gptplus  # added: anGPT, GPT+ (Megatron-LM's GPT with QK-norm and SwiGLU) or nGPT
    --num-layers 96
    --hidden-size 12288
    --num-attention-heads 96
    --seq-length 2048
    --max-position-embeddings 2048
    --attention-backend auto # Can use (flash/fused/unfused/local)
)

TRAINING_ARGS=(
    --micro-batch-size 1
    --global-batch-size 1536
    --rampup-batch-size 16 16 5859375
    --train-samples 146484375  # was --train-iters 500000: Megatron-LM refuses the ramp-up without --train-samples
    --weight-decay 0.1
    --adam-beta1 0.9
    --adam-beta2 0.95
    --init-method-std 0.006
    --clip-grad 1.0
    --fp16
    --use-distributed-optimizer  # added: angpt's fp16 and bf16 keep the fp32 learnable scales in its checkpoints
    --lr 6.0e-5
    --lr-decay-style cosine
    --min-lr 6.0e-6
    --lr-warmup-fraction .001
    --lr-decay-samples 126953125  # was --lr-decay-iters 430000, in samples as --train-samples asks
)

MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size 8
    --pipeline-model-parallel-size 16
)

DATA_ARGS=(
    --data-path $DATA_PATH
    --tokenizer-type GPT2BPETokenizer  # added: Megatron-LM 0.16 needs it too (no default tokenizer type)
    --vocab-file $VOCAB_FILE
    --merge-file $MERGE_FILE
    --split 949,50,1
)

EVAL_AND_LOGGING_ARGS=(
    --log-interval 100
    --save-interval 10000
    --eval-interval 1000
    --save $CHECKPOINT_PATH
    --load $CHECKPOINT_PATH
    --eval-iters 10
    --tensorboard-dir $TENSORBOARD_LOGS_PATH
)

# Megatron-LM's DISTRIBUTED_ARGS, on torchrun's line.
torchrun --nproc-per-node $GPUS_PER_NODE --nnodes $NUM_NODES --master-addr $MASTER_ADDR \
    --master-port $MASTER_PORT --node-rank $NODE_RANK -m angpt.pretrain \
    ${GPT_MODEL_ARGS[@]} \
    ${TRAINING_ARGS[@]} \
    ${MODEL_PARALLEL_ARGS[@]} \
    ${DATA_ARGS[@]} \
    ${EVAL_AND_LOGGING_ARGS[@]}
# was: torchrun ${DISTRIBUTED_ARGS[@]} pretrain_gpt.py ...
