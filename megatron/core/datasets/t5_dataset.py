"""The T5 dataset: span corruption with sentinel tokens (Megatron-LM's `t5_dataset.py`).

A sample's sentences are concatenated and cut to its target length; spans of whole words are masked
(n-gram lengths from SpanBERT's geometric distribution in Megatron-LM's T5 settings, see
`masked_dataset.py`). The k-th masked span, in order of position, gets the sentinel
`additional_special_tokens_ids[k]` (`<extra_id_k>`, from `--vocab-extra-ids`):

    text:           a b c d e f g          spans (b c) and (f)
    encoder input:  a <X0> d e <X1> g
    decoder input:  [BOS] <X0> b c <X1> f
    labels:         <X0> b c <X1> f [EOS]

so the labels are the decoder input shifted left by one, ending with [EOS].
"""

from dataclasses import dataclass, field

import numpy as np
import torch

from megatron.core.datasets.masked_dataset import (
    MaskedWordPieceDataset,
    MaskedWordPieceDatasetConfig,
    missing_tokenizer_attributes,
    padded,
)

_SPECIAL_TOKENS = 2  # room left for [BOS] and [EOS], as in Megatron-LM


@dataclass
class T5MaskedWordPieceDatasetConfig(MaskedWordPieceDatasetConfig):
    """Configuration of the T5 dataset; `sequence_length` is the encoder's (`--encoder-seq-length`)."""

    sequence_length_encoder: int | None = field(init=False, default=None)
    """The encoder sequence length, an alias of `sequence_length` (not an argument)."""

    sequence_length_decoder: int | None = None
    """The decoder sequence length (`--decoder-seq-length`)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.sequence_length_encoder = self.sequence_length
        problems = []
        if self.sequence_length - _SPECIAL_TOKENS < 2:
            problems.append(
                f"sequence_length (--encoder-seq-length) must be at least {_SPECIAL_TOKENS + 2}, got "
                f"{self.sequence_length}"
            )
        if self.sequence_length_decoder is None or self.sequence_length_decoder < 2:
            problems.append(
                f"sequence_length_decoder (--decoder-seq-length) must be at least 2, got {self.sequence_length_decoder}"
            )
        missing = missing_tokenizer_attributes(self.tokenizer, ("bos", "eos", "additional_special_tokens_ids"))
        if missing:
            problems.append(f"the tokenizer ({type(self.tokenizer).__name__}) lacks {', '.join(missing)}")
        elif not self.tokenizer.additional_special_tokens_ids:
            problems.append(
                "the tokenizer has no sentinel tokens (additional_special_tokens_ids): T5 needs them, e.g. "
                "--vocab-extra-ids 100 for <extra_id_0> ... <extra_id_99>"
            )
        if problems:
            raise ValueError(f"{type(self).__name__} is not valid:\n  " + "\n  ".join(problems))


class T5MaskedWordPieceDataset(MaskedWordPieceDataset):
    """One split of a sentence-level dataset as T5 samples (see the module docstring).

    Each sample is a dict of int64 numpy arrays and one int:

    * `text_enc` [encoder length]: encoder input, padded with the tokenizer's pad id;
    * `text_dec` [decoder length]: decoder input, padded with the pad id;
    * `labels` [decoder length]: decoder targets, padded with 0 (Megatron-LM pads with -1; the loss
      mask excludes those positions either way, and 0 is a valid id for any embedding or loss);
    * `loss_mask` [decoder length]: 1 on the `len(decoder input)` target positions;
    * `enc_mask` [encoder length], `dec_mask` [decoder length]: 1 on tokens, 0 on padding;
    * `truncated`: 1 if the sentences were cut to the target length.
    """

    special_tokens_per_sample = _SPECIAL_TOKENS

    @staticmethod
    def _key_config_attributes() -> list[str]:
        return MaskedWordPieceDataset._key_config_attributes() + ["sequence_length_decoder"]

    def __getitem__(self, idx: int) -> dict[str, np.ndarray | int]:
        sentences, target_length, random_state = self._sample_sentences(idx)
        tokenizer = self.config.tokenizer

        tokens = [token for sentence in sentences for token in sentence]
        truncated = len(tokens) > target_length
        tokens = tokens[:target_length]
        tokens, _, _, _, spans = self._create_masked_lm_predictions(tokens, target_length, random_state)

        sentinels = tokenizer.additional_special_tokens_ids
        if len(spans) > len(sentinels):
            raise ValueError(
                f"T5 sample {idx} has {len(spans)} masked spans but the tokenizer has only {len(sentinels)} "
                f"sentinel tokens: raise --vocab-extra-ids (100 is usual)"
            )
        encoder_input, decoder_input, labels = [], [tokenizer.bos], []
        kept_from = 0
        for sentinel, (positions, span_ids) in zip(sentinels, spans):
            encoder_input += tokens[kept_from : positions[0]]
            encoder_input.append(sentinel)
            decoder_input += [sentinel, *span_ids]
            labels += [sentinel, *span_ids]
            kept_from = positions[-1] + 1
        encoder_input += tokens[kept_from:]
        labels.append(tokenizer.eos)

        encoder_length, decoder_length = self.config.sequence_length_encoder, self.config.sequence_length_decoder
        if len(decoder_input) > decoder_length:
            raise ValueError(
                f"T5 sample {idx} needs {len(decoder_input)} decoder positions ([BOS], a sentinel per masked span "
                f"and the masked tokens) but --decoder-seq-length is {decoder_length}: raise it, or lower "
                f"--mask-prob or --encoder-seq-length"
            )
        return {
            "text_enc": padded(encoder_input, encoder_length, tokenizer.pad),
            "text_dec": padded(decoder_input, decoder_length, tokenizer.pad),
            "labels": padded(labels, decoder_length, 0),
            "loss_mask": padded([1] * len(decoder_input), decoder_length, 0),
            "truncated": int(truncated),
            "enc_mask": padded([1] * len(encoder_input), encoder_length, 0),
            "dec_mask": padded([1] * len(decoder_input), decoder_length, 0),
        }

    def _get_token_mask(self, numpy_random_state: np.random.RandomState) -> int:
        """Always [MASK] (the spans leave the encoder input anyway); draws nothing."""
        return self.config.tokenizer.mask

    @staticmethod
    def _build_b1ss_attention_mask(
        source_block: torch.Tensor, target_block: torch.Tensor, make_history_mask: bool = False
    ) -> torch.Tensor:
        """Attention mask `[b, 1, q, kv]` (bool, True = masked) between query tokens `source_block`
        `[b, q]` and key tokens `target_block` `[b, kv]`: a pair may attend iff both ids are >= 1 (pad
        is id 0 in BERT vocabularies) and, with `make_history_mask`, the key is not after the query."""
        allowed = (target_block[:, None, :] >= 1) & (source_block[:, :, None] >= 1)  # [b, q, kv]
        if make_history_mask:
            query = torch.arange(source_block.shape[1], device=source_block.device)
            key = torch.arange(target_block.shape[1], device=source_block.device)
            allowed = allowed & (key[None, :] <= query[:, None])
        return (~allowed).unsqueeze(1)

    @staticmethod
    def config_attention_mask(
        encoder_tokens: torch.Tensor,
        decoder_tokens: torch.Tensor,
        encoder_mask: torch.Tensor,
        decoder_mask: torch.Tensor,
        use_local: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The encoder, decoder (causal) and encoder-decoder masks of a batch, `[b, 1, q, kv]` bool with
        True = masked, built from the token ids as Megatron-LM does for its local transformer.

        `encoder_mask`/`decoder_mask` (the padding masks) shape Transformer Engine's masks in Megatron-LM;
        only the local implementation exists here, so `use_local=False` is refused.
        """
        if not use_local:
            raise ValueError(
                "T5 attention masks for --transformer-impl transformer_engine are not supported yet (only the "
                "local implementation exists): call config_attention_mask with use_local=True"
            )
        build = T5MaskedWordPieceDataset._build_b1ss_attention_mask
        return (
            build(encoder_tokens, encoder_tokens),
            build(decoder_tokens, decoder_tokens, make_history_mask=True),
            build(decoder_tokens, encoder_tokens),
        )

