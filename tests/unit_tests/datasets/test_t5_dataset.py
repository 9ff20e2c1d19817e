"""T5MaskedWordPieceDataset: span corruption equal to Megatron-LM's draw for draw, sentinel order, the
decoder input / labels relation, padding and the static attention-mask helpers."""

import numpy as np
import pytest
import torch

from megatron.core.datasets.t5_dataset import T5MaskedWordPieceDataset
from megatron.core.tokenizers.bert_wordpiece import BertWordPieceTokenizer
from tests.unit_tests.datasets import megatron_masking_reference
from tests.unit_tests.datasets.masked_fixtures import build_dataset, t5_config


def t5_dataset(corpus, tokenizer, tmp_path, num_samples=1000, **overrides):
    return build_dataset(T5MaskedWordPieceDataset, t5_config, corpus, tokenizer, tmp_path, num_samples, **overrides)


@pytest.mark.parametrize("overrides", [{}, {"sequence_length": 40, "sequence_length_decoder": 32}])
def test_samples_equal_megatron_draw_for_draw(sentence_corpus, wordpiece_tokenizer, tmp_path, overrides):
    dataset = t5_dataset(sentence_corpus, wordpiece_tokenizer, tmp_path, num_samples=300, **overrides)
    for idx in range(300):
        expected = megatron_masking_reference.t5_getitem(dataset.dataset, dataset.sample_index, dataset.config, idx)
        expected["labels"][expected["labels"] == -1] = 0  # the one departure: label padding is 0, not -1
        sample = dataset[idx]
        assert sample.keys() == expected.keys()
        for key, value in expected.items():
            np.testing.assert_array_equal(sample[key], value, err_msg=f"sample {idx}, {key}")


def test_keys_shapes_and_dtypes(sentence_corpus, wordpiece_tokenizer, tmp_path):
    sample = t5_dataset(sentence_corpus, wordpiece_tokenizer, tmp_path)[0]
    assert list(sample) == ["text_enc", "text_dec", "labels", "loss_mask", "truncated", "enc_mask", "dec_mask"]
    for key in sample:
        length = 96 if key in ("text_enc", "enc_mask") else 48
        assert key == "truncated" or (sample[key].shape == (length,) and sample[key].dtype == np.int64), key
    assert type(sample["truncated"]) is int


def test_spans_sentinels_decoder_input_and_labels(sentence_corpus, wordpiece_tokenizer, tmp_path):
    tokenizer = wordpiece_tokenizer
    sentinels = tokenizer.additional_special_tokens_ids
    dataset = t5_dataset(sentence_corpus, tokenizer, tmp_path)
    truncated = 0
    for idx in range(300):
        sample = dataset[idx]
        first, last, target = (int(value) for value in dataset.sample_index[idx])
        text = [token for i in range(first, last) for token in dataset.dataset[i].tolist()]
        encoder_length, decoder_length = int(sample["enc_mask"].sum()), int(sample["loss_mask"].sum())
        encoder = sample["text_enc"][:encoder_length].tolist()
        decoder = sample["text_dec"][:decoder_length].tolist()
        labels = sample["labels"][:decoder_length].tolist()

        # Labels are the decoder input shifted left, closed by [EOS]; everything else is padding.
        assert decoder[0] == tokenizer.bos and decoder[1:] == labels[:-1] and labels[-1] == tokenizer.eos
        decoder_mask = [1] * decoder_length + [0] * (48 - decoder_length)
        assert sample["dec_mask"].tolist() == sample["loss_mask"].tolist() == decoder_mask
        assert (sample["text_dec"][decoder_length:] == tokenizer.pad).all()
        assert (sample["labels"][decoder_length:] == 0).all()
        assert sample["enc_mask"].tolist() == [1] * encoder_length + [0] * (96 - encoder_length)
        assert (sample["text_enc"][encoder_length:] == tokenizer.pad).all()

        # Sentinels <extra_id_0>, <extra_id_1>, ... in order in both; putting each span back in place of
        # its sentinel gives the sample's text, cut to its target length.
        used = [token for token in encoder if token in sentinels]
        assert used == sentinels[: len(used)] and [token for token in labels if token in sentinels] == used
        spans, current = {}, None
        for token in labels[:-1]:
            if token in sentinels:
                current = spans.setdefault(token, [])
            else:
                current.append(token)
        assert all(spans.values())
        restored = [piece for token in encoder for piece in (spans[token] if token in spans else [token])]
        assert restored == text[:target]
        assert bool(sample["truncated"]) == (len(text) > target)
        truncated += sample["truncated"]
    assert truncated > 0


def test_a_short_decoder_is_a_clear_error(sentence_corpus, wordpiece_tokenizer, tmp_path):
    dataset = t5_dataset(sentence_corpus, wordpiece_tokenizer, tmp_path, sequence_length_decoder=3)
    with pytest.raises(ValueError, match="--decoder-seq-length is 3"):
        for idx in range(50):
            dataset[idx]


def test_too_few_sentinels_is_a_clear_error(sentence_corpus, wordpiece_tokenizer, tmp_path):
    vocab_file = wordpiece_tokenizer.unique_identifiers["tokenizer_path"][0]
    tokenizer = BertWordPieceTokenizer(vocab_file, lower_case=True, vocab_extra_ids=1)
    dataset = t5_dataset(sentence_corpus, tokenizer, tmp_path)
    with pytest.raises(ValueError, match="only 1 sentinel tokens: raise --vocab-extra-ids"):
        for idx in range(50):
            dataset[idx]
    without = BertWordPieceTokenizer(vocab_file, lower_case=True, vocab_extra_ids=0)
    with pytest.raises(ValueError, match="--vocab-extra-ids 100"):
        t5_config(without)


def test_config_checks_the_sequence_lengths(wordpiece_tokenizer):
    with pytest.raises(ValueError) as error:
        t5_config(wordpiece_tokenizer, sequence_length=3, sequence_length_decoder=None)
    assert "--encoder-seq-length" in str(error.value) and "--decoder-seq-length" in str(error.value)
    config = t5_config(wordpiece_tokenizer)
    assert config.sequence_length_encoder == config.sequence_length == 96


def test_local_attention_masks_against_a_plain_construction():
    generator = torch.Generator().manual_seed(0)
    encoder = torch.randint(1, 50, (3, 7), generator=generator)
    decoder = torch.randint(1, 50, (3, 5), generator=generator)
    encoder[0, 5:] = 0  # padding
    decoder[1, 3:] = 0
    encoder_mask, decoder_mask, cross_mask = T5MaskedWordPieceDataset.config_attention_mask(
        encoder, decoder, encoder > 0, decoder > 0, use_local=True
    )

    def plain(queries, keys, causal):
        mask = torch.zeros(queries.shape[0], 1, queries.shape[1], keys.shape[1], dtype=torch.bool)
        for b in range(queries.shape[0]):
            for q in range(queries.shape[1]):
                for k in range(keys.shape[1]):
                    allowed = queries[b, q] != 0 and keys[b, k] != 0 and (not causal or k <= q)
                    mask[b, 0, q, k] = not allowed  # True = masked
        return mask

    assert torch.equal(encoder_mask, plain(encoder, encoder, False))
    assert torch.equal(decoder_mask, plain(decoder, decoder, True))
    assert torch.equal(cross_mask, plain(decoder, encoder, False))
    with pytest.raises(ValueError, match="use_local=True"):
        T5MaskedWordPieceDataset.config_attention_mask(encoder, decoder, encoder > 0, decoder > 0)
