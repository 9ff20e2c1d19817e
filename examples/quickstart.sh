#!/usr/bin/env bash
# Quick start on any machine, CPU included: builds a corpus from the Python standard library, trains a
# GPT-2-style BPE tokenizer on it, and tokenizes it into Megatron .bin/.idx files.
#   bash examples/quickstart.sh [WORKDIR]      (default: data/quickstart)
set -euo pipefail
cd "$(dirname "$0")/.."
WORKDIR=${1:-data/quickstart}
WORKERS=${WORKERS:-$(python -c "import os; print(min(8, os.cpu_count() or 1))")}
mkdir -p "$WORKDIR"

echo "== 1/3 corpus: the Python standard library as loose JSON"
python tools/build_stdlib_corpus.py --output "$WORKDIR/stdlib.jsonl"

echo "== 2/3 tokenizer: GPT-2-style byte-level BPE (vocab.json + merges.txt)"
python tools/train_tokenizer.py --input "$WORKDIR/stdlib.jsonl" --type gpt2 --vocab-size 8000 \
    --output-dir "$WORKDIR/tokenizer"

echo "== 3/3 preprocess: tokenize into $WORKDIR/stdlib_text_document.bin/.idx"
python tools/preprocess_data.py \
    --input "$WORKDIR/stdlib.jsonl" \
    --output-prefix "$WORKDIR/stdlib" \
    --tokenizer-type GPT2BPETokenizer \
    --vocab-file "$WORKDIR/tokenizer/vocab.json" \
    --merge-file "$WORKDIR/tokenizer/merges.txt" \
    --append-eod \
    --workers "$WORKERS"
