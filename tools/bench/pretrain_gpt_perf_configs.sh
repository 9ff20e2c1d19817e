#!/usr/bin/env bash
# Train the benchmark GPT configurations with pretrain_gpt.py on mock data (bf16, one GPU) and print the
# last console line of each: tokens/s/GPU, TFLOP/s/GPU, MFU, then the peak memory line.
#   bash tools/bench/pretrain_gpt_perf_configs.sh [ITERS]
set -euo pipefail
cd "$(dirname "$0")/../.."
ITERS=${1:-40}
COMMON=(--mock-data --tokenizer-type NullTokenizer --vocab-size 50304 --bf16
        --hidden-dropout 0 --attention-dropout 0 --lr 1e-4 --min-lr 1e-5 --lr-decay-style cosine
        --lr-warmup-iters 5 --weight-decay 0.1 --adam-beta2 0.95 --clip-grad 1.0
        --train-iters "$ITERS" --log-interval 10 --eval-interval 100000 --eval-iters 0 --num-workers 2)
run() {
    local name=$1; shift
    echo "== $name"
    python pretrain_gpt.py "${COMMON[@]}" "$@" 2>&1 | grep -E "iteration +$ITERS/|memory \(MB\)|Error|error" | tail -3
}
run "GPT-2 small (12L h768 s1024 mbs8)" --num-layers 12 --hidden-size 768 --num-attention-heads 12 \
    --seq-length 1024 --max-position-embeddings 1024 --micro-batch-size 8 --global-batch-size 8
run "GPT 1.3B (24L h2048 s2048 mbs4)" --num-layers 24 --hidden-size 2048 --num-attention-heads 16 \
    --seq-length 2048 --max-position-embeddings 2048 --micro-batch-size 4 --global-batch-size 4
