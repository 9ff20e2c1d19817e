#!/bin/bash
# DeepSeek-V3's architecture at 16B total / 2.8B active parameters (the shape of Moonlight-16B-A3B and
# DeepSeek-V2-Lite, with DeepSeek-V3's routing and multi-token prediction, as Megatron-LM's DeepSeek-V3
# recipe sets them): 27 layers, d_model 2048, 16 heads of multi-latent attention (kv latent 512, no query
# latent, 128 + 64 query/key and 128 value channels per head, YaRN factor 40 with mscale 1 / 1), the first
# layer dense (FFN 10944), then 64 routed experts of 1408 in 8 groups (top-8 in 4 groups, sigmoid scores with
# an expert bias, weights x2.5) and a shared expert of 2816, sequence-level balancing loss 1e-4, one
# multi-token-prediction depth (weight 0.1); sequence 4096, batch 512 sequences, lr 3e-4 cosine to 3e-5,
# bf16, EP 8 with the distributed optimizer on 8 GPUs.
#
#   bash examples/deepseek_v3/train_deepseek_v3_16b.sh [CHECKPOINT_PATH [TENSORBOARD_LOGS_PATH [TOKENIZER [DATA_PATH]]]] [flags ...]
#
# TOKENIZER is a Hugging Face tokenizer (a directory, e.g. DeepSeek-V3's) or MOCK for the NullTokenizer over
# DeepSeek-V3's 129280 ids; DATA_PATH is a .bin/.idx prefix or MOCK for generated tokens. Both default to
# MOCK. Flags after the four positional arguments override the script's (argparse keeps the last one).
# GPUS_PER_NODE, NUM_NODES, NODE_RANK, MASTER_ADDR, MASTER_PORT: see examples/distributed_args.sh.
# DeepSeek-V3 671B itself (61 layers, d_model 7168, 128 heads, q latent 1536, 256 experts of 2048, 3 dense
# layers) takes the same flags with its sizes, and pipeline parallelism (its MTP depth on the last stage).

set -euo pipefail
EXAMPLES_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$EXAMPLES_DIR/distributed_args.sh"

RUN_NAME=deepseek_v3_16b
TOKENIZER_TYPE=HuggingFaceTokenizer
TOKENIZER_FLAG=--tokenizer-model
MOCK_VOCAB_SIZE=129280
source "$EXAMPLES_DIR/tokenizer_positional_args.sh"

MODEL_ARGS=(
    --num-layers 27
    --hidden-size 2048
    --ffn-hidden-size 10944
    --num-attention-heads 16
    --seq-length 4096
    --max-position-embeddings 4096
    --position-embedding-type rope
    --rotary-base 10000
    --swiglu
    --normalization RMSNorm
    --norm-epsilon 1e-6
    --untie-embeddings-and-output-weights
    --disable-bias-linear
    --attention-dropout 0.0
    --hidden-dropout 0.0
    --init-method-std 0.006
)

MLA_ARGS=(
    --multi-latent-attention
    --kv-lora-rank 512
    --qk-head-dim 128
    --qk-pos-emb-head-dim 64
    --v-head-dim 128
    --qk-layernorm
    --rotary-scaling-factor 40
    --mscale 1.0
    --mscale-all-dim 1.0
)

MOE_ARGS=(
    --num-experts 64
    --moe-layer-freq "[0]*1+[1]*26"
    --moe-ffn-hidden-size 1408
    --moe-shared-expert-intermediate-size 2816
    --moe-router-topk 8
    --moe-router-num-groups 8
    --moe-router-group-topk 4
    --moe-router-topk-scaling-factor 2.5
    --moe-router-score-function sigmoid
    --moe-router-enable-expert-bias
    --moe-router-bias-update-rate 1e-3
    --moe-router-load-balancing-type seq_aux_loss
    --moe-aux-loss-coeff 1e-4
    --moe-router-dtype fp32
    --moe-grouped-gemm
    --moe-token-dispatcher-type alltoall
    --mtp-num-layers 1
    --mtp-loss-scaling-factor 0.1
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
    --expert-model-parallel-size 8
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
    "${MLA_ARGS[@]}" \
    "${MOE_ARGS[@]}" \
    "${TRAINING_ARGS[@]}" \
    "${MODEL_PARALLEL_ARGS[@]}" \
    "${DATA_ARGS[@]}" \
    "${EVAL_AND_LOGGING_ARGS[@]}" \
    "${EXTRA_ARGS[@]}"
