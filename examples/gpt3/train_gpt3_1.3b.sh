#!/bin/bash
# GPT-3 XL, 1.3B parameters (Brown et al. 2020, table 2.1): 24 layers, d_model 2048, batch 1M tokens (512
# sequences of 2048), learning rate 2.0e-4. The table's "24 heads of 128" does not fit d_model 2048
# (24 x 128 = 3072); 16 heads of 128 do, as in other reproductions. The recipe is in gpt3_paper_recipe.sh.
#
#   bash examples/gpt3/train_gpt3_1.3b.sh \
#       CHECKPOINT_PATH TENSORBOARD_LOGS_PATH VOCAB_FILE MERGE_FILE DATA_PATH [flags ...]
#
# MOCK for DATA_PATH trains on generated tokens, MOCK for VOCAB_FILE uses the NullTokenizer; flags after
# the paths override the script's.

NUM_LAYERS=24
HIDDEN_SIZE=2048
NUM_ATTENTION_HEADS=16
GLOBAL_BATCH_SIZE=512
LR=2.0e-4
MIN_LR=2.0e-5

source "$(dirname "${BASH_SOURCE[0]}")/gpt3_paper_recipe.sh"
