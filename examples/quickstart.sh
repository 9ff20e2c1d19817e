#!/usr/bin/env bash
# Quick start on any machine, CPU included: builds a corpus from the Python standard library, trains a
# GPT-2-style BPE tokenizer on it, tokenizes it into Megatron .bin/.idx files, trains a small GPT on it
# (a few minutes on a CPU; a GPT-2-small-sized model in bf16 when a GPU is present) and prints a sample.
#   bash examples/quickstart.sh [WORKDIR]      (default: data/quickstart in the repository; a relative
#                                               WORKDIR is taken from the directory you run this from)
#   TRAIN_ITERS=10 bash examples/quickstart.sh  (a shorter run; warm-up, logging and evaluation follow it)
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
mkdir -p "${1:-$REPO/data/quickstart}"
WORKDIR="$(cd "${1:-$REPO/data/quickstart}" && pwd)"
cd "$REPO"
WORKERS=${WORKERS:-$(python -c "import os; print(min(8, os.cpu_count() or 1))")}

echo "== 1/5 corpus: the Python standard library as loose JSON"
python tools/build_stdlib_corpus.py --output "$WORKDIR/stdlib.jsonl"

echo "== 2/5 tokenizer: GPT-2-style byte-level BPE (vocab.json + merges.txt)"
python tools/train_tokenizer.py --input "$WORKDIR/stdlib.jsonl" --type gpt2 --vocab-size 8000 \
    --output-dir "$WORKDIR/tokenizer"

echo "== 3/5 preprocess: tokenize into $WORKDIR/stdlib_text_document.bin/.idx"
python tools/preprocess_data.py \
    --input "$WORKDIR/stdlib.jsonl" \
    --output-prefix "$WORKDIR/stdlib" \
    --tokenizer-type GPT2BPETokenizer \
    --vocab-file "$WORKDIR/tokenizer/vocab.json" \
    --merge-file "$WORKDIR/tokenizer/merges.txt" \
    --append-eod \
    --workers "$WORKERS"

if python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    ITERS=${TRAIN_ITERS:-2000} WARMUP=100
    MODEL=(--num-layers 12 --hidden-size 768 --num-attention-heads 12 --seq-length 1024
           --max-position-embeddings 1024 --micro-batch-size 8 --global-batch-size 32 --bf16 --lr 6e-4 --min-lr 6e-5)
else
    ITERS=${TRAIN_ITERS:-600} WARMUP=20
    MODEL=(--num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 256
           --max-position-embeddings 256 --micro-batch-size 8 --global-batch-size 8 --lr 2e-3 --min-lr 2e-4)
fi
# A short run (TRAIN_ITERS) keeps the warm-up under a tenth of it, and logs and evaluates within it.
WARMUP=$(( ITERS / 10 < WARMUP ? ITERS / 10 : WARMUP ))
LOG_INTERVAL=$(( ITERS < 50 ? ITERS : 50 ))
EVAL_INTERVAL=$(( ITERS < 200 ? ITERS : 200 ))
MODEL+=(--lr-warmup-iters "$WARMUP" --train-iters "$ITERS")

echo "== 4/5 train: a small GPT on the corpus (checkpoints in $WORKDIR/checkpoints)"
python pretrain_gpt.py "${MODEL[@]}" \
    --lr-decay-style cosine --weight-decay 0.1 --clip-grad 1.0 \
    --hidden-dropout 0 --attention-dropout 0 \
    --data-path "$WORKDIR/stdlib_text_document" \
    --vocab-file "$WORKDIR/tokenizer/vocab.json" \
    --merge-file "$WORKDIR/tokenizer/merges.txt" \
    --split 98,2,0 --num-workers 1 \
    --save "$WORKDIR/checkpoints" --save-interval 1000000 \
    --log-interval "$LOG_INTERVAL" --eval-interval "$EVAL_INTERVAL" --eval-iters 5 \
    --tensorboard-dir "$WORKDIR/tensorboard"

echo "== 5/5 sample: the model continues a prompt"
python tools/text_generation_cli.py --load "$WORKDIR/checkpoints" \
    --prompt "def " --max-new-tokens 80 --temperature 0.8 --top-k 20 --seed 1234
