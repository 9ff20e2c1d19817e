#!/bin/bash
# Mixtral 8x7B pretraining, shaped as Megatron-LM's examples/mixtral/train_mixtral_8x7b_distributed.sh:
# the Mistral-7B body (32 layers, d_model 4096, FFN 14336 SwiGLU, 32 heads of 128 with 8 key/value groups,
# RoPE base 1e6, RMSNorm, untied embeddings, no biases) with every MLP replaced by 8 experts, top-2
# routing, load-balancing loss 1e-2, grouped GEMM and the all-to-all token dispatcher; sequence 4096,
# batch 256 sequences, lr 1e-4 cosine to 1e-5 with 500 warmup iterations, bf16; PP 4 x EP 8.
#
#   bash examples/mixtral/train_mixtral_8x7b.sh [CHECKPOINT_PATH [TENSORBOARD_LOGS_PATH [TOKENIZER [DATA_PATH]]]] [flags ...]
#
# TOKENIZER is Mixtral's SentencePiece tokenizer.model (Llama2Tokenizer) or MOCK for the NullTokenizer
# over its 32000 ids; DATA_PATH is a .bin/.idx prefix or MOCK for generated tokens. Both default to MOCK.
# Flags after the four positional arguments are passed last and override the script's (argparse keeps
# the last occurrence), e.g. `--num-layers 2 --num-experts 4 --expert-model-parallel-size 2`.
# GPUS_PER_NODE, NUM_NODES, NODE_RANK, MASTER_ADDR, MASTER_PORT: see examples/distributed_args.sh; the
# default layout (PP 4 x EP 8) needs 32 GPUs, e.g. NUM_NODES=4 GPUS_PER_NODE=8.

set -euo pipefail
EXAMPLES_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$EXAMPLES_DIR/distributed_args.sh"

RUN_NAME=mixtral_8x7b
TOKENIZER_TYPE=Llama2Tokenizer
TOKENIZER_FLAG=--tokenizer-model
MOCK_VOCAB_SIZE=32000
source "$EXAMPLES_DIR/tokenizer_positional_args.sh"

MODEL_ARGS=(
    --use-mcore-models
    --disable-bias-linear
    --seq-length 4096
    --max-position-embeddings 32768
    --num-layers 32
    --hidden-size 4096
    --ffn-hidden-size 14336
    --num-attention-heads 32
    --init-method-std 0.01
    --attention-dropout 0.0
    --hidden-dropout 0.0
    --normalization RMSNorm
    --position-embedding-type rope
    --swiglu
    --untie-embeddings-and-output-weights
    --group-query-attention
    --num-query-groups 8
    --no-masked-softmax-fusion
    --no-position-embedding
    --rotary-base 1000000
)

MOE_ARGS=(
    --num-experts 8
    --moe-router-topk 2
    --moe-router-load-balancing-type aux_loss
    --moe-aux-loss-coeff 1e-2
    --moe-grouped-gemm
    --moe-token-dispatcher-type alltoall
)

TRAINING_ARGS=(
    --micro-batch-size 1
    --global-batch-size 256
    --lr 1e-4
    --train-iters 500000
    --lr-decay-iters 320000
    --lr-decay-style cosine
    --min-lr 1.0e-5
    --weight-decay 0.1
    --lr-warmup-iters 500
    --clip-grad 1.0
    --bf16
    --use-distributed-optimizer
    --overlap-grad-reduce
    --overlap-param-gather
)

MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size 1
    --pipeline-model-parallel-size 4
    --expert-model-parallel-size 8
    --sequence-parallel
)

DATA_ARGS+=(
    --split 99990,8,2
    --num-workers 1
)

# Megatron's script loads with --no-load-optim --no-load-rng (it starts from converted Hugging Face
# weights); this script resumes its own checkpoints. torch_dist (sharded, resharding across TP/PP/EP) is
# Megatron's default format and the one that keeps the distributed optimizer's state under EP.
EVAL_AND_LOGGING_ARGS=(
    --log-interval 1
    --log-throughput
    --save-interval 10000
    --eval-interval 1000
    --eval-iters 10
    --ckpt-format torch_dist
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
