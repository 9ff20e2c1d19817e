"""pretrain_gpt.py's dataset config: the attention mask is built only where the batches use it."""

import pytest

from megatron.core.tokenizers.null_tokenizer import NullTokenizer
from megatron.training.arguments import parse_args, validate_args
from megatron.training.tasks import gpt as gpt_task

COMMON = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
          "--max-position-embeddings", "16", "--micro-batch-size", "2", "--train-iters", "1", "--lr", "1e-4",
          "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128"]


@pytest.mark.parametrize("flags, built", [
    ([], False),  # the plain causal mask: attention applies it by itself, get_batch drops it
    (["--reset-attention-mask"], True),
    (["--reset-attention-mask", "--no-create-attention-mask-in-dataloader"], False),
])
def test_dataset_builds_the_attention_mask_only_for_reset_attention_mask(monkeypatch, flags, built):
    monkeypatch.setattr(gpt_task, "get_tokenizer", lambda: NullTokenizer(128))
    args = validate_args(parse_args(args_list=[*COMMON, *flags]))
    assert gpt_task.core_gpt_dataset_config_from_args(args).create_attention_mask is built
