# Sourced by the Llama and Mixtral scripts (not run on its own): their four optional positional arguments
#
#   [CHECKPOINT_PATH [TENSORBOARD_LOGS_PATH [TOKENIZER [DATA_PATH]]]] [more pretrain_gpt.py flags ...]
#
# into CHECKPOINT_PATH, TENSORBOARD_LOGS_PATH, DATA_ARGS (without --split) and EXTRA_ARGS. Set before
# sourcing: RUN_NAME (the default paths are checkpoints/$RUN_NAME and tensorboard_logs/$RUN_NAME),
# TOKENIZER_TYPE and TOKENIZER_FLAG (how a real TOKENIZER is passed), MOCK_VOCAB_SIZE (the NullTokenizer's
# size for TOKENIZER=MOCK). MOCK as DATA_PATH trains on generated tokens (--mock-data); both default to
# MOCK. The flags after the four positional arguments are passed after the script's own, and argparse
# keeps the last occurrence, so they override it: e.g. `--num-layers 2 --train-samples 8`.

for positional in "${@:1:4}"; do
    if [[ "$positional" == --* ]]; then
        echo "usage: $0 [CHECKPOINT_PATH [TENSORBOARD_LOGS_PATH [TOKENIZER [DATA_PATH]]]] [flags ...]" >&2
        echo "  flags go after all four positional arguments (MOCK for TOKENIZER and DATA_PATH); got $positional" >&2
        exit 1
    fi
done
CHECKPOINT_PATH=${1:-checkpoints/$RUN_NAME}
TENSORBOARD_LOGS_PATH=${2:-tensorboard_logs/$RUN_NAME}
TOKENIZER_ARG=${3:-MOCK}
DATA_ARG=${4:-MOCK}
EXTRA_ARGS=("${@:5}")

if [ "$DATA_ARG" = MOCK ]; then
    DATA_ARGS=(--mock-data)
else
    DATA_ARGS=(--data-path "$DATA_ARG")
fi
if [ "$TOKENIZER_ARG" = MOCK ]; then
    DATA_ARGS+=(--tokenizer-type NullTokenizer --vocab-size "$MOCK_VOCAB_SIZE")
else
    DATA_ARGS+=(--tokenizer-type "$TOKENIZER_TYPE" "$TOKENIZER_FLAG" "$TOKENIZER_ARG")
fi
