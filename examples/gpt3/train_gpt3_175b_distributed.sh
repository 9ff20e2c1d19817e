#!/bin/bash
# Runs the "175B" parameter model: Megatron-LM's examples/gpt3/train_gpt3_175b_distributed.sh.
#
#   bash examples/gpt3/train_gpt3_175b_distributed.sh \
#       CHECKPOINT_PATH TENSORBOARD_LOGS_PATH VOCAB_FILE MERGE_FILE DATA_PATH [flags ...]
#
# 96 layers, d_model 12288, 96 heads; TP 8 x PP 16 = 128 GPUs per model replica, e.g. on 16 nodes of 8:
#   NUM_NODES=16 NODE_RANK=<0..15> MASTER_ADDR=<first node> bash examples/gpt3/train_gpt3_175b_distributed.sh ...
# (GPUS_PER_NODE, MASTER_PORT: see examples/distributed_args.sh; MOCK paths and extra flags: positional_args.sh.)
#
# The script is kept as Megatron's, and tests/functional_tests/test_examples.py checks that its arguments
# validate (TP 8 x PP 16 on 128 ranks). One change from Megatron's script: it gives --train-iters 500000 with
# --rampup-batch-size, which Megatron's own validate_args refuses ("expected no batch-size rampup for
# iteration-based training"), so the run length is in samples, with the values of Megatron's earlier
# sample-based 175B script: 300B tokens, warmup over 375M, cosine decay over 260B (GPT-3 paper, appendix B).

set -euo pipefail
EXAMPLES_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$EXAMPLES_DIR/distributed_args.sh"
source "$EXAMPLES_DIR/gpt3/positional_args.sh"

GPT_MODEL_ARGS=(
    --num-layers 96
    --hidden-size 12288
    --num-attention-heads 96
    --seq-length 2048
    --max-position-embeddings 2048
    --attention-backend auto
)

TRAINING_ARGS=(
    --micro-batch-size 1
    --global-batch-size 1536
    --rampup-batch-size 16 16 5859375
    --train-samples 146484375
    --weight-decay 0.1
    --adam-beta1 0.9
    --adam-beta2 0.95
    --init-method-std 0.006
    --clip-grad 1.0
    --fp16
    --lr 6.0e-5
    --lr-decay-style cosine
    --min-lr 6.0e-6
    --lr-warmup-samples 183105
    --lr-decay-samples 126953125
)

MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size 8
    --pipeline-model-parallel-size 16
)

DATA_ARGS+=(
    --split 949,50,1
)

EVAL_AND_LOGGING_ARGS=(
    --log-interval 100
    --save-interval 10000
    --eval-interval 1000
    --save "$CHECKPOINT_PATH"
    --load "$CHECKPOINT_PATH"
    --eval-iters 10
    --tensorboard-dir "$TENSORBOARD_LOGS_PATH"
)

torchrun "${DISTRIBUTED_ARGS[@]}" "$PRETRAIN_GPT" \
    "${GPT_MODEL_ARGS[@]}" \
    "${TRAINING_ARGS[@]}" \
    "${MODEL_PARALLEL_ARGS[@]}" \
    "${DATA_ARGS[@]}" \
    "${EVAL_AND_LOGGING_ARGS[@]}" \
    "${EXTRA_ARGS[@]}"
