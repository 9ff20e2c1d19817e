#!/usr/bin/env bash
# A DeepSeek-V3-style model of 2.77B parameters (0.6B active) trained with expert parallelism 2 on 2 GPUs
# through pretrain_gpt.py on mock data (bf16): 16 layers, d_model 1536, 12 heads of multi-latent attention
# (q latent 768, kv latent 512, 128 + 64 query/key and 128 value channels, YaRN), one dense layer (FFN 8192)
# then 15 MoE layers of 32 experts of 1024 (top-4 within the best 2 of 4 groups, sigmoid with expert bias,
# x2.5) with a shared expert of 1024, one multi-token-prediction depth; sequence 4096, micro batch 2, global
# batch 32, distributed optimizer. Prints the console lines (tokens/s/GPU, TFLOP/s/GPU and MFU against the
# 989 TFLOP/s dense bf16 peak, lm loss, mtp_1 loss) and the memory report; the dry run puts it at 41 GiB
# per GPU.
#   bash tools/bench/deepseek_v3_ep2.sh [ITERS [more pretrain_gpt.py flags, which override these]]
set -euo pipefail
cd "$(dirname "$0")/../.."
ITERS=${1:-30}
EXTRA=("${@:2}")
torchrun --nproc-per-node 2 pretrain_gpt.py \
    --num-layers 16 --hidden-size 1536 --ffn-hidden-size 8192 --num-attention-heads 12 \
    --seq-length 4096 --max-position-embeddings 4096 --position-embedding-type rope --swiglu \
    --normalization RMSNorm --norm-epsilon 1e-6 --untie-embeddings-and-output-weights --disable-bias-linear \
    --attention-dropout 0 --hidden-dropout 0 \
    --multi-latent-attention --q-lora-rank 768 --kv-lora-rank 512 --qk-head-dim 128 --qk-pos-emb-head-dim 64 \
    --v-head-dim 128 --qk-layernorm --rotary-scaling-factor 40 --mscale 1.0 --mscale-all-dim 1.0 \
    --num-experts 32 --moe-layer-freq "[0]+[1]*15" --moe-ffn-hidden-size 1024 \
    --moe-shared-expert-intermediate-size 1024 --moe-router-topk 4 --moe-router-num-groups 4 \
    --moe-router-group-topk 2 --moe-router-topk-scaling-factor 2.5 --moe-router-score-function sigmoid \
    --moe-router-enable-expert-bias --moe-router-load-balancing-type seq_aux_loss --moe-aux-loss-coeff 1e-4 \
    --moe-router-dtype fp32 --moe-grouped-gemm --moe-token-dispatcher-type alltoall \
    --mtp-num-layers 1 --mtp-loss-scaling-factor 0.1 \
    --expert-model-parallel-size 2 --micro-batch-size 2 --global-batch-size 32 --train-iters "$ITERS" \
    --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 5 --weight-decay 0.1 --adam-beta2 0.95 \
    --clip-grad 1.0 --bf16 --use-distributed-optimizer \
    --mock-data --tokenizer-type NullTokenizer --vocab-size 32768 \
    --log-interval 5 --eval-iters 0 --eval-interval 100000 "${EXTRA[@]}" 2>&1 \
    | grep -E "iteration +[0-9]+/|memory \(MB\)|parameters;|Error|error"
