#!/bin/bash
# GPT-3 Medium, 350M parameters (Brown et al. 2020, table 2.1): 24 layers, d_model 1024, 16 heads of 64,
# batch 0.5M tokens (256 sequences of 2048), learning rate 3.0e-4. The recipe is in gpt3_paper_recipe.sh.
#
#   bash examples/gpt3/train_gpt3_350m.sh \
#       CHECKPOINT_PATH TENSORBOARD_LOGS_PATH VOCAB_FILE MERGE_FILE DATA_PATH [flags ...]
#
# MOCK for DATA_PATH trains on generated tokens, MOCK for VOCAB_FILE uses the NullTokenizer; flags after
# the paths override the script's.

NUM_LAYERS=24
HIDDEN_SIZE=1024
NUM_ATTENTION_HEADS=16
GLOBAL_BATCH_SIZE=256
LR=3.0e-4
MIN_LR=3.0e-5

source "$(dirname "${BASH_SOURCE[0]}")/gpt3_paper_recipe.sh"
