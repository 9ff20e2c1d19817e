#!/bin/bash
# Runs the "220M" parameter model (T5-Base): Megatron-LM's examples/t5/train_t5_220m_distributed.sh.
#
#   bash examples/t5/train_t5_220m_distributed.sh \
#       CHECKPOINT_PATH TENSORBOARD_LOGS_PATH VOCAB_FILE DATA_PATH [flags ...]
#
# VOCAB_FILE is a cased WordPiece vocab.txt (BertWordPieceCase; --vocab-extra-ids adds the 100 span-corruption
# sentinels <extra_id_0..99>); DATA_PATH the prefix of a sentence-split corpus (tools/preprocess_data.py
# --split-sentences ... writes PREFIX_text_sentence.bin/.idx). There is no MOCK data for T5. Flags after the
# four paths are passed after the script's own and override them. GPUS_PER_NODE, NUM_NODES, NODE_RANK,
# MASTER_ADDR, MASTER_PORT: see examples/distributed_args.sh. --transformer-impl transformer_engine, as in
# Megatron's script, builds this project's own PyTorch layers (the same model; one line says so).

set -euo pipefail
EXAMPLES_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$EXAMPLES_DIR/distributed_args.sh"

if [ $# -lt 4 ]; then
    echo "usage: $0 CHECKPOINT_PATH TENSORBOARD_LOGS_PATH VOCAB_FILE DATA_PATH [flags ...]" >&2
    echo "  VOCAB_FILE: WordPiece vocab.txt; DATA_PATH: PREFIX_text_sentence of preprocess_data.py --split-sentences" >&2
    echo "  flags after the four paths go to pretrain_t5.py, after (so overriding) the script's own" >&2
    exit 1
fi
CHECKPOINT_PATH=$1
TENSORBOARD_DIR=$2
VOCAB_FILE=$3
DATA_PATH=$4
EXTRA_ARGS=("${@:5}")

T5_ARGS=(
    --encoder-num-layers 12
    --decoder-num-layers 12
    --hidden-size 768
    --num-attention-heads 12
    --kv-channels 64
    --ffn-hidden-size 3072
    --encoder-seq-length 512
    --decoder-seq-length 128
    --max-position-embeddings 512
    --micro-batch-size 64
    --global-batch-size 512
    --lr 0.0001
    --train-iters 1000000
    --lr-decay-iters 1000000
    --lr-decay-style linear
    --min-lr 0.00001
    --weight-decay 1e-2
    --lr-warmup-fraction .01
    --clip-grad 1.0
    --bf16
    --vocab-extra-ids 100
    --init-method-std 0.015
    --transformer-impl transformer_engine
    --tensor-model-parallel-size 1
    --pipeline-model-parallel-size 1
    --attention-backend auto
)

DATA_ARGS=(
    --data-path "$DATA_PATH"
    --vocab-file "$VOCAB_FILE"
    --tokenizer-type BertWordPieceCase
    --split 99982,9,9
)

OUTPUT_ARGS=(
    --log-interval 100
    --tensorboard-dir "$TENSORBOARD_DIR"
    --save-interval 500
    --eval-interval 1000
    --eval-iters 10
)

torchrun "${DISTRIBUTED_ARGS[@]}" "$EXAMPLES_DIR/../pretrain_t5.py" \
    "${T5_ARGS[@]}" \
    "${DATA_ARGS[@]}" \
    "${OUTPUT_ARGS[@]}" \
    --distributed-backend nccl \
    --save "$CHECKPOINT_PATH" \
    --load "$CHECKPOINT_PATH" \
    "${EXTRA_ARGS[@]}"
