"""Pretrain a T5 model (Megatron-LM's `pretrain_t5.py`, same flags).

    torchrun --nproc_per_node 8 pretrain_t5.py --encoder-num-layers 12 --decoder-num-layers 12 \\
        --hidden-size 768 ... --encoder-seq-length 512 --decoder-seq-length 128 \\
        --data-path my-bert_text_sentence --vocab-file vocab.txt --vocab-extra-ids 100

The data must be sentence-split (`tools/preprocess_data.py --split-sentences` with a WordPiece vocab);
`--vocab-extra-ids` adds the sentinels of span corruption. The providers, batch and forward step live in
`megatron/training/tasks/t5.py`.
"""

from megatron.core.enums import ModelType
from megatron.training import pretrain
from megatron.training.errors import run_entry_point
from megatron.training.tasks.t5 import forward_step, model_provider, train_valid_test_datasets_provider

if __name__ == "__main__":
    run_entry_point(
        pretrain,
        train_valid_test_datasets_provider,
        model_provider,
        ModelType.encoder_and_decoder,
        forward_step,
        args_defaults={"tokenizer_type": "BertWordPieceLowerCase"},
    )
