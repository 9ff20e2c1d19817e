#!/bin/bash
# Llama-3 8B pretraining, shaped as Megatron-LM's examples/llama/train_llama3_8b_h100_fp8.sh, in bf16:
# 32 layers, d_model 4096, FFN 14336 (SwiGLU), 32 heads of 128 with 8 key/value groups, sequence 8192,
# RoPE, RMSNorm, untied embeddings, no biases, no dropout; batch 128 sequences, lr 1.5e-4 cosine to 1e-5.
#
#   bash examples/llama/train_llama3_8b.sh [CHECKPOINT_PATH [TENSORBOARD_LOGS_PATH [TOKENIZER [DATA_PATH]]]] [flags ...]
#
# TOKENIZER is a Hugging Face tokenizer (a directory, or a hub id already in the local cache) or MOCK for
# the NullTokenizer over Llama 3's 128256 ids; DATA_PATH is a .bin/.idx prefix or MOCK for generated
# tokens. Both default to MOCK. Flags after the four positional arguments are passed last and override
# the script's (argparse keeps the last occurrence), e.g. `--num-layers 2 --train-samples 8`.
# GPUS_PER_NODE, NUM_NODES, NODE_RANK, MASTER_ADDR, MASTER_PORT: see examples/distributed_args.sh.

set -euo pipefail
EXAMPLES_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$EXAMPLES_DIR/distributed_args.sh"

RUN_NAME=llama3_8b
TOKENIZER_TYPE=HuggingFaceTokenizer
TOKENIZER_FLAG=--tokenizer-model
MOCK_VOCAB_SIZE=128256
source "$EXAMPLES_DIR/tokenizer_positional_args.sh"

MODEL_ARGS=(
    --num-layers 32
    --hidden-size 4096
    --ffn-hidden-size 14336
    --num-attention-heads 32
    --group-query-attention
    --num-query-groups 8
    --kv-channels 128
    --seq-length 8192
    --max-position-embeddings 8192
    --position-embedding-type rope
    # Megatron's script uses 1e6; Llama 3 itself was trained with RoPE base 500000.
    --rotary-base 1000000
    --rotary-percent 1.0
    --swiglu
    # Megatron's script keeps LayerNorm with --apply-layernorm-1p; Llama 3 is RMSNorm with a plain gain,
    # which is what Hugging Face's LlamaForCausalLM loads after conversion.
    --normalization RMSNorm
    --norm-epsilon 1e-5
    --attention-dropout 0.0
    --hidden-dropout 0.0
    --init-method-std 0.0134
    # Megatron's script asks for fused (cuDNN) attention; auto lets PyTorch pick the fastest SDPA kernel
    # on the GPU (flash or cuDNN) and still runs on a CPU.
    --attention-backend auto
    --untie-embeddings-and-output-weights
    --disable-bias-linear
)

# 8T tokens = 1,953,125,000 sequences of 8192 (sample-based); warmup over 3,906,252 samples.
TRAINING_ARGS=(
    --micro-batch-size 1
    --global-batch-size 128
    --train-samples 1953125000
    --lr-decay-samples 1949218748
    --lr-warmup-samples 3906252
    --lr 0.00015
    --min-lr 0.00001
    --decoupled-lr 5.0e-4
    --decoupled-min-lr 4.5e-5
    --lr-decay-style cosine
    --clip-grad 1.0
    --weight-decay 0.1
    --adam-beta1 0.9
    --adam-beta2 0.95
    --bf16
    --grad-reduce-in-bf16
    --cross-entropy-loss-fusion
    --calculate-per-token-loss
    --manual-gc
    --empty-unused-memory-level 1
)
# Megatron's script also trains in FP8 (--fp8-format hybrid --fp8-amax-history-len 1024
# --fp8-amax-compute-algo max --fp8-param-gather, which work here on GPUs of compute capability 8.9+: pass
# them after the positional arguments) and shards the optimizer with overlapped communication
# (--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather, which --fp8-param-gather needs);
# they are left out here.

# TP 1: one 8B model fits a GPU in bf16 (--sequence-parallel, which Megatron's script adds, only acts at TP > 1).
MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size 1
    --context-parallel-size 1
)

DATA_ARGS+=(
    --split 99,1,0
    --no-create-attention-mask-in-dataloader
    --no-mmap-bin-files
    --num-workers 1
)

EVAL_AND_LOGGING_ARGS=(
    --ckpt-format torch_dist
    --log-interval 1
    --log-throughput
    --eval-iters 32
    --eval-interval 100
    --save-interval 1000
    --distributed-timeout-minutes 60
    --save "$CHECKPOINT_PATH"
    --load "$CHECKPOINT_PATH"
    --tensorboard-dir "$TENSORBOARD_LOGS_PATH"
)

torchrun "${DISTRIBUTED_ARGS[@]}" "$PRETRAIN_GPT" \
    "${MODEL_ARGS[@]}" \
    "${TRAINING_ARGS[@]}" \
    "${MODEL_PARALLEL_ARGS[@]}" \
    "${DATA_ARGS[@]}" \
    "${EVAL_AND_LOGGING_ARGS[@]}" \
    "${EXTRA_ARGS[@]}"
