"""Pretrain a BERT model (Megatron-LM's `pretrain_bert.py`, same flags).

    torchrun --nproc_per_node 8 pretrain_bert.py --num-layers 24 --hidden-size 1024 ... \\
        --data-path my-bert_text_sentence --vocab-file vocab.txt

The data must be sentence-split (`tools/preprocess_data.py --split-sentences` with a WordPiece vocab).
Logs `lm loss` (masked LM) and `sop loss` (sentence order, unless --bert-no-binary-head). The providers,
batch, loss and forward step live in `megatron/training/tasks/bert.py`.
"""

from megatron.core.enums import ModelType
from megatron.training import pretrain
from megatron.training.errors import run_entry_point
from megatron.training.tasks.bert import forward_step, model_provider, train_valid_test_datasets_provider

if __name__ == "__main__":
    run_entry_point(
        pretrain,
        train_valid_test_datasets_provider,
        model_provider,
        ModelType.encoder_or_decoder,
        forward_step,
        args_defaults={"tokenizer_type": "BertWordPieceLowerCase"},
    )
