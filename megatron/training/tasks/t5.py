"""T5 pretraining pieces for `pretrain_t5.py`: model provider, batch, loss, forward step, datasets.

Span corruption (Megatron-LM's `T5MaskedWordPieceDataset`, megatron/core/datasets/t5_dataset.py): the encoder
reads the text with each masked span replaced by a sentinel, the decoder predicts `sentinel, span tokens` for
each span then [EOS]. The loss is GPT's: token-summed cross entropy over `loss_mask`.
"""

import copy
from functools import partial

import torch

from megatron.core.datasets.t5_dataset import T5MaskedWordPieceDataset, T5MaskedWordPieceDatasetConfig
from megatron.core.models.T5 import T5Model
from megatron.core.models.T5.t5_spec import (
    get_t5_decoder_with_local_block_spec,
    get_t5_encoder_with_local_block_spec,
)
from megatron.training.arguments import core_transformer_config_from_args
from megatron.training.console import print_rank_0
from megatron.training.global_vars import get_timers
from megatron.training.run_callbacks import RunCallback
from megatron.training.tasks.gpt import loss_func
from megatron.training.tasks.masked_wordpiece import (
    build_masked_datasets,
    check_layer_spec_flag,
    masked_dataset_config_args,
    next_batch,
    refuse_pipeline_parallelism,
)

BATCH_KEYS = ("text_enc", "text_dec", "labels", "loss_mask", "enc_mask", "dec_mask")


@RunCallback
def model_provider(args, pre_process: bool = True, post_process: bool = True, add_encoder: bool = True,
                   add_decoder: bool = True) -> T5Model:
    """The T5 of the command line's shape: `--encoder-num-layers` (or `--num-layers`) encoder layers and
    `--decoder-num-layers` decoder layers (default: as many as the encoder)."""
    check_layer_spec_flag(args, "T5")
    refuse_pipeline_parallelism(args, "T5")
    if args.decoder_seq_length is None:
        raise ValueError("pretrain_t5.py needs --decoder-seq-length (the padded length of the decoder input, e.g. "
                         "128 with --encoder-seq-length 512)")
    print_rank_0("building T5 model ...")
    encoder_config = core_transformer_config_from_args(args)
    encoder_config.num_layers = args.encoder_num_layers
    config = copy.deepcopy(encoder_config)
    config.num_layers = args.decoder_num_layers or args.encoder_num_layers
    # --transformer-impl transformer_engine builds the same local layers (validation says so).
    encoder_spec = get_t5_encoder_with_local_block_spec(encoder_config.num_layers)
    decoder_spec = get_t5_decoder_with_local_block_spec(config.num_layers)
    return T5Model(
        config=config,
        encoder_config=encoder_config,
        transformer_encoder_layer_spec=encoder_spec,
        transformer_decoder_layer_spec=decoder_spec,
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        fp16_lm_cross_entropy=args.fp16_lm_cross_entropy,
        parallel_output=True,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        add_encoder=add_encoder,
        add_decoder=add_decoder,
    )


def attention_masks(encoder_padding_mask: torch.Tensor):
    """(encoder mask, decoder mask, encoder-decoder mask), True = masked, from the encoder's padding mask
    [b, se] (1 = token).

    Encoder self-attention and cross-attention hide the encoder's padding keys: [b, 1, 1, se]. The
    decoder gets None: its built-in causal mask already hides its padding (which follows every real
    token) from the real positions. Queries are never masked, so no softmax row is empty.
    """
    padding_keys = (encoder_padding_mask < 0.5).unsqueeze(1).unsqueeze(1)
    return padding_keys, None, padding_keys


def get_batch(data_iterator):
    """(tokens_enc [b, se], tokens_dec [b, sd], loss_mask, labels [b, sd], enc_mask, dec_mask,
    enc_dec_mask) of the next microbatch, on the device; read on TP rank 0 and broadcast to the other TP ranks."""
    batch = next_batch(data_iterator, BATCH_KEYS)
    enc_mask, dec_mask, enc_dec_mask = attention_masks(batch["enc_mask"])
    return (
        batch["text_enc"].long(),
        batch["text_dec"].long(),
        batch["loss_mask"].float(),
        batch["labels"].long(),
        enc_mask,
        dec_mask,
        enc_dec_mask,
    )


def forward_step(data_iterator, model):
    """Megatron's T5 forward step: the model returns per-token losses of the decoder."""
    timers = get_timers()
    timers("batch-generator", log_level=2).start()
    tokens_enc, tokens_dec, loss_mask, lm_labels, enc_mask, dec_mask, enc_dec_mask = get_batch(data_iterator)
    timers("batch-generator").stop()
    output_tensor = model(tokens_enc, tokens_dec, enc_mask, dec_mask, enc_dec_mask, lm_labels=lm_labels)
    return output_tensor, partial(loss_func, loss_mask)


def core_t5_dataset_config_from_args(args) -> T5MaskedWordPieceDatasetConfig:
    """Megatron's T5 dataset config: whole-word span masking, geometric n-gram lengths up to 10."""
    if not getattr(args, "vocab_extra_ids", 0):
        raise ValueError("pretrain_t5.py needs sentinel tokens for span corruption: give --vocab-extra-ids "
                         "(Megatron's example uses 100)")
    return T5MaskedWordPieceDatasetConfig(
        **masked_dataset_config_args(args, "pretrain_t5.py"),
        sequence_length=args.encoder_seq_length,
        sequence_length_decoder=args.decoder_seq_length,
        masking_max_ngram=10,
        masking_use_geometric_distribution=True,
    )


@RunCallback
def train_valid_test_datasets_provider(args, train_val_test_num_samples):
    """T5 datasets for the three splits, built on tensor-parallel rank 0."""
    config = core_t5_dataset_config_from_args(args)
    return build_masked_datasets(T5MaskedWordPieceDataset, train_val_test_num_samples, config, "T5")


train_valid_test_datasets_provider.is_distributed = True
