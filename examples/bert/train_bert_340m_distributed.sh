#!/bin/bash
# Runs the "340M" parameter model (BERT-Large): Megatron-LM's examples/bert/train_bert_340m_distributed.sh.
#
#   bash examples/bert/train_bert_340m_distributed.sh \
#       CHECKPOINT_PATH TENSORBOARD_LOGS_PATH VOCAB_FILE DATA_PATH [flags ...]
#
# VOCAB_FILE is a WordPiece vocab.txt (BertWordPieceLowerCase); DATA_PATH the prefix of a sentence-split
# corpus (tools/preprocess_data.py --split-sentences ... writes PREFIX_text_sentence.bin/.idx). BERT trains on
# real sentence pairs, so there is no MOCK data. Flags after the four paths are passed after the script's own
# and override them (argparse keeps the last occurrence). GPUS_PER_NODE, NUM_NODES, NODE_RANK, MASTER_ADDR,
# MASTER_PORT: see examples/distributed_args.sh.
#
# One change from Megatron's script: TP 1 x PP 1 instead of TP 8 x PP 16. Its 24 layers do not split into 16
# pipeline stages (and pipeline parallelism is not supported here yet), and BERT-Large fits on one GPU; add
# e.g. `--tensor-model-parallel-size 2` to split it.

set -euo pipefail
EXAMPLES_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$EXAMPLES_DIR/distributed_args.sh"

if [ $# -lt 4 ]; then
    echo "usage: $0 CHECKPOINT_PATH TENSORBOARD_LOGS_PATH VOCAB_FILE DATA_PATH [flags ...]" >&2
    echo "  VOCAB_FILE: WordPiece vocab.txt; DATA_PATH: PREFIX_text_sentence of preprocess_data.py --split-sentences" >&2
    echo "  flags after the four paths go to pretrain_bert.py, after (so overriding) the script's own" >&2
    exit 1
fi
CHECKPOINT_PATH=$1
TENSORBOARD_LOGS_PATH=$2
VOCAB_FILE=$3
DATA_PATH=$4
EXTRA_ARGS=("${@:5}")

BERT_MODEL_ARGS=(
    --num-layers 24
    --hidden-size 1024
    --num-attention-heads 16
    --seq-length 512
    --max-position-embeddings 512
    --attention-backend auto
)

TRAINING_ARGS=(
    --micro-batch-size 4
    --global-batch-size 32
    --train-iters 1000000
    --weight-decay 1e-2
    --clip-grad 1.0
    --fp16
    --lr 0.0001
    --lr-decay-iters 990000
    --lr-decay-style linear
    --min-lr 1.0e-5
    --lr-warmup-fraction .01
)

MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size 1
    --pipeline-model-parallel-size 1
)

DATA_ARGS=(
    --data-path "$DATA_PATH"
    --vocab-file "$VOCAB_FILE"
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

torchrun "${DISTRIBUTED_ARGS[@]}" "$EXAMPLES_DIR/../pretrain_bert.py" \
    "${BERT_MODEL_ARGS[@]}" \
    "${TRAINING_ARGS[@]}" \
    "${MODEL_PARALLEL_ARGS[@]}" \
    "${DATA_ARGS[@]}" \
    "${EVAL_AND_LOGGING_ARGS[@]}" \
    "${EXTRA_ARGS[@]}"
