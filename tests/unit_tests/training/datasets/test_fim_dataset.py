"""--fim-data: Megatron-LM's fill-in-the-middle transformation on a hand-worked sample (the fixture GPT-2 BPE)."""

import os

import numpy as np
import pytest

from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from megatron.core.datasets.split import Split
from megatron.core.tokenizers.gpt2_bpe import GPT2BPETokenizer
from megatron.training.datasets.fim_dataset import GPTFIMDataset, GPTFIMDatasetConfig

DATA = os.path.join(os.path.dirname(__file__), "..", "..", "..", "fixtures", "megatron_lm", "data")
EOD = 511
DEFAULT_TOKENS = {"prefix": "<fim_prefix>", "middle": "<fim_middle>", "suffix": "<fim_suffix>", "pad": "<fim_pad>",
                  "eod": "<|endoftext|>"}


@pytest.fixture(scope="module")
def tokenizer():
    return GPT2BPETokenizer(os.path.join(DATA, "vocab.json"), os.path.join(DATA, "merges.txt"))


def _sample(tmp_path, tokenizer, document, **fim):
    """Sample 0 of a FIM dataset over one document, the sample being the whole document."""
    builder = IndexedDatasetBuilder(str(tmp_path / "doc.bin"), dtype=np.uint16)
    builder.add_document(np.array(document), [len(document)])
    builder.finalize(str(tmp_path / "doc.idx"))
    config = GPTFIMDatasetConfig(random_seed=2, sequence_length=len(document) - 1, tokenizer=tokenizer,
                                 reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
                                 fim_spm_rate=0.5, **fim)
    dataset = GPTFIMDataset(IndexedDataset(str(tmp_path / "doc")), None, np.arange(1), 1, Split.train, config)
    return dataset._query_document_sample_shuffle_indices(0).tolist()


def test_hand_worked_sample(tmp_path, tokenizer):
    # "def f(x):" <eod> "return x" <eod>, 11 tokens. RandomState(2) draws, segment by segment: rearrange (rate
    # 1), cut points 6 and 8 of "def f(x):", SPM; rearrange, cut points 2 and 7 of "return x", PSM; then the
    # empty rest after the last <eod> is rearranged too (three sentinels, cut off with the overflow).
    document = [468, 294, 7, 87, 287, EOD, 264, 299, 220, 87, EOD]
    assert tokenizer.text_to_ids("def f(x):") + [EOD] + tokenizer.text_to_ids("return x") + [EOD] == document
    prefix, middle, suffix = 31, 2, 3  # "@", "#", "$"
    sentinels = {"prefix": "@", "middle": "#", "suffix": "$", "pad": "%", "eod": "<|endoftext|>"}
    spm = [prefix, suffix, *tokenizer.text_to_ids(":"), middle, *tokenizer.text_to_ids("def f("),
           *tokenizer.text_to_ids("x)")]
    psm = [prefix, *tokenizer.text_to_ids("re"), suffix, *tokenizer.text_to_ids("x"), middle,
           *tokenizer.text_to_ids("turn ")]
    assert _sample(tmp_path, tokenizer, document, fim_rate=1.0, fim_extra_tokens=sentinels) == [*spm, EOD, *psm][:11]
    # Megatron-LM's default sentinels are not in a GPT-2 vocabulary: they become its unknown token, <|endoftext|>.
    assert _sample(tmp_path, tokenizer, document, fim_rate=1.0, fim_extra_tokens=DEFAULT_TOKENS) == [
        EOD if token in (prefix, middle, suffix) else token for token in [*spm, EOD, *psm][:11]]


def test_empty_segments_drop_their_end_token_and_the_sample_is_padded(tmp_path, tokenizer):
    # Nothing rearranged (rate 0): the empty segment between two <eod> goes, with one of them; "%" pads.
    document = [468, 294, EOD, EOD, 264, 299]
    sentinels = {"prefix": "@", "middle": "#", "suffix": "$", "pad": "%", "eod": "<|endoftext|>"}
    assert _sample(tmp_path, tokenizer, document, fim_rate=0.0, fim_extra_tokens=sentinels) == [
        468, 294, EOD, 264, 299, 4]


def test_fragments_split_at_fim_split_sample(tmp_path, tokenizer):
    # "def f(x):" split at "(" (id 7): the sample is rearranged (rate 1), each fragment with rate 0 here, so
    # only the draws happen and the fragments come back with "(" between them.
    document = [468, 294, 7, 87, 287]
    sentinels = {"prefix": "@", "middle": "#", "suffix": "$", "pad": "%", "eod": "<|endoftext|>"}
    assert _sample(tmp_path, tokenizer, document, fim_rate=1.0, fim_extra_tokens=sentinels, fim_split_sample="(",
                   fim_fragment_rate=0.0) == document
