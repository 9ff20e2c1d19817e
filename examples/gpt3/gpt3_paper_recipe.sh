# Sourced by train_gpt3_125m.sh, train_gpt3_350m.sh and train_gpt3_1.3b.sh, which set the size-dependent
# NUM_LAYERS HIDDEN_SIZE NUM_ATTENTION_HEADS GLOBAL_BATCH_SIZE LR MIN_LR first: the training recipe of the
# GPT-3 paper (Brown et al. 2020, "Language Models are Few-Shot Learners", section 2.3 and appendix B) as
# Megatron flags, launched with torchrun on pretrain_gpt.py.
#
# Run length is counted in sequences of 2048 tokens (samples): 300B tokens = 146,484,375 samples, linear
# warmup over the first 375M tokens (183,105 samples), cosine decay to 10% of the peak learning rate over
# 260B tokens (126,953,125 samples), then constant. The paper also ramps the batch size up over the first
# 4-12B tokens; add e.g. `--rampup-batch-size 16 16 1953125` to do the same.

set -euo pipefail
EXAMPLES_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$EXAMPLES_DIR/distributed_args.sh"
source "$EXAMPLES_DIR/gpt3/positional_args.sh"

GPT_MODEL_ARGS=(
    --num-layers "$NUM_LAYERS"
    --hidden-size "$HIDDEN_SIZE"
    --num-attention-heads "$NUM_ATTENTION_HEADS"
    --seq-length 2048
    --max-position-embeddings 2048
    --init-method-std 0.02  # the paper gives none; GPT-2's value
)

TRAINING_ARGS=(
    --micro-batch-size 4
    --global-batch-size "$GLOBAL_BATCH_SIZE"
    --train-samples 146484375
    --lr-warmup-samples 183105
    --lr-decay-samples 126953125
    --lr-decay-style cosine
    --lr "$LR"
    --min-lr "$MIN_LR"
    --optimizer adam
    --adam-beta1 0.9
    --adam-beta2 0.95
    --adam-eps 1e-8
    --weight-decay 0.1
    --clip-grad 1.0
    --bf16
)

MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size 1
    --pipeline-model-parallel-size 1
)

DATA_ARGS+=(
    --split 949,50,1
)

EVAL_AND_LOGGING_ARGS=(
    --log-interval 10
    --save-interval 10000
    --eval-interval 1000
    --eval-iters 10
    --save "$CHECKPOINT_PATH"
    --load "$CHECKPOINT_PATH"
    --tensorboard-dir "$TENSORBOARD_LOGS_PATH"
)

torchrun "${DISTRIBUTED_ARGS[@]}" "$PRETRAIN_GPT" \
    "${GPT_MODEL_ARGS[@]}" \
    "${TRAINING_ARGS[@]}" \
    "${MODEL_PARALLEL_ARGS[@]}" \
    "${DATA_ARGS[@]}" \
    "${EVAL_AND_LOGGING_ARGS[@]}" \
    "${EXTRA_ARGS[@]}"
