#!/bin/bash
# Qwen3-30B-A3B pretraining (Qwen's config.json, as Megatron-LM's Qwen3-30B-A3B configuration sets it):
# 48 layers, d_model 2048, 32 query heads of 128 with 4 key/value groups and RMSNorm on every query and key
# head (--qk-layernorm), RoPE base 1e6, 128 experts of 768 in every layer with top-8 softmax routing
# (renormalised: Qwen's norm_topk_prob), no shared expert, load-balancing loss 1e-3, RMSNorm 1e-6, untied
# embeddings, no biases; sequence 4096, batch 512 sequences, lr 3e-4 cosine to 3e-5, bf16, EP 16 with the
# distributed optimizer on 16 GPUs (NUM_NODES=2 GPUS_PER_NODE=8; the dry run, `--dry-run` after the
# positional arguments, puts EP 8 at 92 GiB per GPU). Exported with tools/checkpoint/convert.py --saver hf it
# is a Qwen3MoeForCausalLM.
#
#   bash examples/qwen3/train_qwen3_30b_a3b.sh [CHECKPOINT_PATH [TENSORBOARD_LOGS_PATH [TOKENIZER [DATA_PATH]]]] [flags ...]
#
# TOKENIZER is a Hugging Face tokenizer (a directory, e.g. Qwen3's) or MOCK for the NullTokenizer over
# Qwen3's 151936 ids; DATA_PATH is a .bin/.idx prefix or MOCK for generated tokens. Both default to MOCK.
# Flags after the four positional arguments override the script's (argparse keeps the last one).
# GPUS_PER_NODE, NUM_NODES, NODE_RANK, MASTER_ADDR, MASTER_PORT: see examples/distributed_args.sh.

set -euo pipefail
EXAMPLES_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$EXAMPLES_DIR/distributed_args.sh"

RUN_NAME=qwen3_30b_a3b
TOKENIZER_TYPE=HuggingFaceTokenizer
TOKENIZER_FLAG=--tokenizer-model
MOCK_VOCAB_SIZE=151936
source "$EXAMPLES_DIR/tokenizer_positional_args.sh"

MODEL_ARGS=(
    --num-layers 48
    --hidden-size 2048
    --ffn-hidden-size 6144
    --num-attention-heads 32
    --group-query-attention
    --num-query-groups 4
    --kv-channels 128
    --qk-layernorm
    --seq-length 4096
    --max-position-embeddings 40960
    --position-embedding-type rope
    --rotary-base 1000000
    --swiglu
    --normalization RMSNorm
    --norm-epsilon 1e-6
    --untie-embeddings-and-output-weights
    --disable-bias-linear
    --attention-dropout 0.0
    --hidden-dropout 0.0
    --make-vocab-size-divisible-by 1187
)

MOE_ARGS=(
    --num-experts 128
    --moe-ffn-hidden-size 768
    --moe-router-topk 8
    --moe-router-load-balancing-type aux_loss
    --moe-aux-loss-coeff 1e-3
    --moe-router-dtype fp32
    --moe-grouped-gemm
    --moe-token-dispatcher-type alltoall
)

TRAINING_ARGS=(
    --micro-batch-size 1
    --global-batch-size 512
    --train-iters 100000
    --lr 3e-4
    --min-lr 3e-5
    --lr-decay-style cosine
    --lr-warmup-iters 2000
    --clip-grad 1.0
    --weight-decay 0.1
    --adam-beta1 0.9
    --adam-beta2 0.95
    --bf16
    --use-distributed-optimizer
)

MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size 1
    --pipeline-model-parallel-size 1
    --expert-model-parallel-size 16
)

DATA_ARGS+=(
    --split 99,1,0
    --num-workers 1
)

EVAL_AND_LOGGING_ARGS=(
    --ckpt-format torch_dist
    --log-interval 1
    --log-throughput
    --eval-iters 16
    --eval-interval 1000
    --save-interval 1000
    --save "$CHECKPOINT_PATH"
    --load "$CHECKPOINT_PATH"
    --tensorboard-dir "$TENSORBOARD_LOGS_PATH"
)

torchrun "${DISTRIBUTED_ARGS[@]}" "$PRETRAIN_GPT" \
    "${MODEL_ARGS[@]}" \
    "${MOE_ARGS[@]}" \
    "${TRAINING_ARGS[@]}" \
    "${MODEL_PARALLEL_ARGS[@]}" \
    "${DATA_ARGS[@]}" \
    "${EVAL_AND_LOGGING_ARGS[@]}" \
    "${EXTRA_ARGS[@]}"
