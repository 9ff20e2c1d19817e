"""BERT pretraining pieces for `pretrain_bert.py`: model provider, batch, loss, forward step, datasets.

Megatron's BERT objective (`loss_func` of its pretrain_bert.py): masked-LM loss, the mean over the masked positions
of each microbatch, plus the 2-way sentence-order-prediction (SOP) cross entropy of the binary head,
the mean over the microbatch's sequences:

    loss = Σ ce(token)·loss_mask / Σ loss_mask  +  mean ce(binary_logits, is_random)

The logged `lm loss` and `sop loss` are exact global means (Σ loss / count over every microbatch and
data-parallel rank), reported as [sum, count] pairs, as the GPT losses are.
"""

from functools import partial

import torch
import torch.nn.functional as F

from megatron.core.datasets.bert_dataset import BERTMaskedWordPieceDataset, BERTMaskedWordPieceDatasetConfig
from megatron.core.models.bert import BertModel
from megatron.core.models.bert.bert_layer_specs import get_bert_layer_local_spec
from megatron.training.arguments import core_transformer_config_from_args
from megatron.training.console import print_rank_0
from megatron.training.global_vars import get_timers
from megatron.training.run_callbacks import RunCallback
from megatron.training.tasks.masked_wordpiece import (
    build_masked_datasets,
    check_layer_spec_flag,
    masked_dataset_config_args,
    next_batch,
    refuse_pipeline_parallelism,
)

BATCH_KEYS = ("text", "types", "labels", "is_random", "loss_mask", "padding_mask")


@RunCallback
def model_provider(args, pre_process: bool = True, post_process: bool = True, vp_stage: int | None = None) -> BertModel:
    """The BERT of the command line's shape (Megatron-Core's `BertModel`; token types and the binary head
    unless `--bert-no-binary-head`)."""
    check_layer_spec_flag(args, "BERT")
    refuse_pipeline_parallelism(args, "BERT")
    if args.calculate_per_token_loss:
        raise ValueError("--calculate-per-token-loss is not supported for BERT: its loss adds the per-sequence "
                         "sentence-order loss to the masked-LM token mean")
    print_rank_0("building BERT model ...")
    config = core_transformer_config_from_args(args)
    # --transformer-impl transformer_engine builds the same local layers (validation says so).
    layer_spec = get_bert_layer_local_spec()
    return BertModel(
        config=config,
        num_tokentypes=2 if args.bert_binary_head else 0,
        transformer_layer_spec=layer_spec,
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        fp16_lm_cross_entropy=args.fp16_lm_cross_entropy,
        parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        add_binary_head=args.bert_binary_head,
        vp_stage=vp_stage,
    )


def get_batch(data_iterator):
    """(tokens, types, sentence_order, loss_mask, lm_labels, padding_mask) of the next microbatch [b, s]
    (sentence_order [b]), on the device; read on TP rank 0 and broadcast to the other TP ranks."""
    batch = next_batch(data_iterator, BATCH_KEYS)
    return (
        batch["text"].long(),
        batch["types"].long(),
        batch["is_random"].long(),
        batch["loss_mask"].float(),
        batch["labels"].long(),
        batch["padding_mask"].long(),
    )


def loss_func(loss_mask: torch.Tensor, sentence_order: torch.Tensor, output_tensor):
    """(per-token MLM losses [b, s], SOP logits [b, 2] or None) -> (loss, {"lm loss": [sum, count],
    "sop loss": [sum, count]}); the loss is what Megatron backpropagates (see the module docstring)."""
    lm_losses, sop_logits = output_tensor
    mask = loss_mask.reshape(-1).float()
    lm_sum = torch.sum(lm_losses.reshape(-1).float() * mask)
    masked_tokens = mask.sum()
    loss = lm_sum / masked_tokens.clamp(min=1)
    report = {"lm loss": torch.stack([lm_sum.detach(), masked_tokens.detach()])}
    if sop_logits is not None:
        order = sentence_order.reshape(-1)
        sop_losses = F.cross_entropy(sop_logits.reshape(-1, 2).float(), order, ignore_index=-1, reduction="none")
        sop_sum, counted = sop_losses.sum(), (order != -1).sum().float()
        loss = loss + sop_sum / counted.clamp(min=1)
        report["sop loss"] = torch.stack([sop_sum.detach(), counted.detach()])
    return loss, report


@RunCallback
def forward_step(args, data_iterator, model):
    """Megatron's BERT forward step: the model returns (per-token MLM losses, SOP logits)."""
    timers = get_timers()
    timers("batch-generator", log_level=2).start()
    tokens, types, sentence_order, loss_mask, lm_labels, padding_mask = get_batch(data_iterator)
    timers("batch-generator").stop()
    if not args.bert_binary_head:
        types = None  # without the binary head there are no token-type embeddings
    output_tensor = model(tokens, padding_mask, tokentype_ids=types, lm_labels=lm_labels)
    return output_tensor, partial(loss_func, loss_mask, sentence_order)


def core_bert_dataset_config_from_args(args) -> BERTMaskedWordPieceDatasetConfig:
    """Megatron's BERT dataset config: whole-word masking with n-grams up to 3, SOP pairs with the binary head."""
    return BERTMaskedWordPieceDatasetConfig(
        **masked_dataset_config_args(args, "pretrain_bert.py"),
        sequence_length=args.seq_length,
        masking_max_ngram=3,
        masking_use_geometric_distribution=False,
        classification_head=args.bert_binary_head,
    )


@RunCallback
def train_valid_test_datasets_provider(args, train_val_test_num_samples):
    """BERT datasets for the three splits, built on tensor-parallel rank 0."""
    config = core_bert_dataset_config_from_args(args)
    return build_masked_datasets(BERTMaskedWordPieceDataset, train_val_test_num_samples, config, "BERT")


train_valid_test_datasets_provider.is_distributed = True
