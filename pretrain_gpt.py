"""Pretrain a GPT model (Megatron-LM's `pretrain_gpt.py`, same flags).

    torchrun --nproc_per_node 8 pretrain_gpt.py --num-layers 24 --hidden-size 1024 ... \\
        --data-path my-gpt2_text_document --vocab-file vocab.json --merge-file merges.txt

The providers, batch, loss and forward step live in `megatron/training/tasks/gpt.py`.
"""

from megatron.core.enums import ModelType
from megatron.training import pretrain
from megatron.training.errors import run_entry_point
from megatron.training.tasks.gpt import forward_step, model_provider, train_valid_test_datasets_provider

if __name__ == "__main__":
    run_entry_point(
        pretrain,
        train_valid_test_datasets_provider,
        model_provider,
        ModelType.encoder_or_decoder,
        forward_step,
        args_defaults={"tokenizer_type": "GPT2BPETokenizer"},
    )
