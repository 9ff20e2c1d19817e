#!/bin/bash
# GPT-3 Small, 125M parameters (Brown et al. 2020, table 2.1): 12 layers, d_model 768, 12 heads of 64,
# batch 0.5M tokens (256 sequences of 2048), learning rate 6.0e-4. The recipe is in gpt3_paper_recipe.sh.
#
#   bash examples/gpt3/train_gpt3_125m.sh \
#       CHECKPOINT_PATH TENSORBOARD_LOGS_PATH VOCAB_FILE MERGE_FILE DATA_PATH [flags ...]
#
# MOCK for DATA_PATH trains on generated tokens, MOCK for VOCAB_FILE uses the NullTokenizer; flags after
# the paths override the script's. examples/gpt3/config.yaml holds the same run as a --config-file.

NUM_LAYERS=12
HIDDEN_SIZE=768
NUM_ATTENTION_HEADS=12
GLOBAL_BATCH_SIZE=256
LR=6.0e-4
MIN_LR=6.0e-5

source "$(dirname "${BASH_SOURCE[0]}")/gpt3_paper_recipe.sh"
