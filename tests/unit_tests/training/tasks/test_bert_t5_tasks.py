"""The pieces pretrain_bert.py and pretrain_t5.py hand to pretrain(): losses on hand-worked examples, the T5
attention masks, batches, the model providers' shapes, and the refusals of what is not supported."""

import math

import pytest
import torch

from megatron.training import global_vars
from megatron.training.arguments import parse_args, validate_args
from megatron.training.tasks import bert as bert_task
from megatron.training.tasks import t5 as t5_task

COMMON = ["--hidden-size", "32", "--num-attention-heads", "4", "--max-position-embeddings", "32",
          "--micro-batch-size", "2", "--train-iters", "1", "--lr", "1e-4", "--use-cpu-initialization"]


@pytest.fixture
def set_args():
    """Makes validated arguments the run's (`get_args()`), and forgets them afterwards."""
    def install(*flags):
        args = validate_args(parse_args(args_list=[*COMMON, *flags]))
        args.padded_vocab_size = 128
        global_vars.set_args(args)
        return args

    yield install
    global_vars.unset_global_variables()


def test_bert_loss_is_the_masked_token_mean_plus_the_sentence_order_mean():
    losses = torch.tensor([[1.0, 2.0, 5.0], [3.0, 4.0, 9.0]])
    loss_mask = torch.tensor([[1, 0, 0], [1, 1, 0]])
    sop_logits = torch.tensor([[0.0, 0.0], [2.0, 0.0]])
    order = torch.tensor([1, 0])
    loss, report = bert_task.loss_func(loss_mask, order, (losses, sop_logits))
    lm_mean = (1 + 3 + 4) / 3
    sop_mean = (math.log(2) + math.log(1 + math.exp(-2))) / 2  # -log softmax of the right class
    assert loss.item() == pytest.approx(lm_mean + sop_mean)
    assert report["lm loss"].tolist() == [8.0, 3.0]
    assert report["sop loss"].tolist() == pytest.approx([2 * sop_mean, 2.0])

    ignored = torch.tensor([1, -1])  # Megatron's ignore_index
    loss, report = bert_task.loss_func(loss_mask, ignored, (losses, sop_logits))
    assert report["sop loss"].tolist() == pytest.approx([math.log(2), 1.0])
    loss, report = bert_task.loss_func(loss_mask, order, (losses, None))
    assert loss.item() == pytest.approx(lm_mean) and sorted(report) == ["lm loss"]


def test_t5_masks_hide_encoder_padding_keys_and_leave_the_decoder_causal():
    encoder_padding = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    encoder_mask, decoder_mask, cross_mask = t5_task.attention_masks(encoder_padding)
    assert encoder_mask.shape == (2, 1, 1, 4) and decoder_mask is None
    assert encoder_mask[:, 0, 0].tolist() == [[False, False, False, True], [False] * 4]
    assert torch.equal(cross_mask, encoder_mask)


def test_get_batch_reads_the_dataset_keys_and_names_missing_ones():
    sample = dict(text=torch.tensor([[2, 5, 3, 0]]), types=torch.tensor([[0, 0, 0, 0]]),
                  labels=torch.tensor([[-1, 5, -1, -1]]), is_random=torch.tensor([1]),
                  loss_mask=torch.tensor([[0, 1, 0, 0]]), padding_mask=torch.tensor([[1, 1, 1, 0]]))
    tokens, types, order, loss_mask, labels, padding = bert_task.get_batch(iter([sample]))
    assert tokens.tolist() == [[2, 5, 3, 0]] and order.tolist() == [1] and loss_mask.dtype == torch.float32
    assert labels.tolist() == [[-1, 5, -1, -1]] and padding.tolist() == [[1, 1, 1, 0]]
    del sample["types"]
    with pytest.raises(ValueError, match=r"lack the keys \['types'\]"):
        bert_task.get_batch(iter([sample]))


def test_bert_model_provider_follows_the_binary_head_flag(set_args):
    set_args("--num-layers", "2", "--seq-length", "16")
    model = bert_task.model_provider()
    assert model.embedding.tokentype_embeddings.weight.shape == (2, 32) and model.binary_head is not None
    set_args("--num-layers", "2", "--seq-length", "16", "--bert-no-binary-head")
    model = bert_task.model_provider()
    assert not hasattr(model.embedding, "tokentype_embeddings") and model.binary_head is None


def test_t5_model_provider_takes_encoder_and_decoder_depths(set_args):
    set_args("--encoder-num-layers", "2", "--decoder-num-layers", "3", "--encoder-seq-length", "32",
             "--decoder-seq-length", "16")
    model = t5_task.model_provider()
    assert (len(model.encoder.layers), len(model.decoder.layers)) == (2, 3)
    set_args("--encoder-num-layers", "2", "--encoder-seq-length", "32", "--decoder-seq-length", "16")
    model = t5_task.model_provider()
    assert (len(model.encoder.layers), len(model.decoder.layers)) == (2, 2)  # default: as deep as the encoder


def test_what_is_not_supported_is_refused_by_name(set_args):
    set_args("--num-layers", "2", "--seq-length", "16", "--calculate-per-token-loss")
    with pytest.raises(ValueError, match="--calculate-per-token-loss is not supported for BERT"):
        bert_task.model_provider()
    set_args("--num-layers", "2", "--seq-length", "16", "--spec", "my.module", "my_spec")
    with pytest.raises(ValueError, match="--spec my.module my_spec: custom layer specs are not supported yet"):
        bert_task.model_provider()
    args = set_args("--num-layers", "2", "--seq-length", "32")
    with pytest.raises(ValueError, match="pretrain_t5.py needs --decoder-seq-length"):
        t5_task.model_provider()
    with pytest.raises(ValueError, match="needs sentence-split data: give --data-path"):
        bert_task.core_bert_dataset_config_from_args(args)
    args = set_args("--num-layers", "2", "--seq-length", "32", "--decoder-seq-length", "16", "--data-path", "x",
                    "--split", "1,0,0")
    with pytest.raises(ValueError, match="needs sentinel tokens for span corruption: give --vocab-extra-ids"):
        t5_task.core_t5_dataset_config_from_args(args)
