# Sourced by the GPT-3 scripts (not run on its own): Megatron-LM's five positional arguments
#
#   CHECKPOINT_PATH TENSORBOARD_LOGS_PATH VOCAB_FILE MERGE_FILE DATA_PATH [more pretrain_gpt.py flags ...]
#
# into those variables, DATA_ARGS (without --split) and EXTRA_ARGS. MOCK as DATA_PATH trains on generated
# tokens (--mock-data); MOCK as VOCAB_FILE uses the NullTokenizer over GPT-2's 50257 ids instead of the BPE
# files (MERGE_FILE is then not read). The flags after the five paths are passed after the script's own,
# and argparse keeps the last occurrence, so they override it: e.g. `--num-layers 2 --train-samples 8`.

if [ $# -lt 5 ]; then
    echo "usage: $0 CHECKPOINT_PATH TENSORBOARD_LOGS_PATH VOCAB_FILE MERGE_FILE DATA_PATH [flags ...]" >&2
    echo "  MOCK as DATA_PATH: generated tokens (--mock-data); MOCK as VOCAB_FILE: the NullTokenizer" >&2
    echo "  flags after the five paths go to pretrain_gpt.py, after (so overriding) the script's own" >&2
    exit 1
fi
CHECKPOINT_PATH=$1
TENSORBOARD_LOGS_PATH=$2
VOCAB_FILE=$3
MERGE_FILE=$4
DATA_PATH=$5
EXTRA_ARGS=("${@:6}")

if [ "$DATA_PATH" = MOCK ]; then
    DATA_ARGS=(--mock-data)
else
    DATA_ARGS=(--data-path "$DATA_PATH")
fi
if [ "$VOCAB_FILE" = MOCK ]; then
    DATA_ARGS+=(--tokenizer-type NullTokenizer --vocab-size 50257)
else
    DATA_ARGS+=(--tokenizer-type GPT2BPETokenizer --vocab-file "$VOCAB_FILE" --merge-file "$MERGE_FILE")
fi
