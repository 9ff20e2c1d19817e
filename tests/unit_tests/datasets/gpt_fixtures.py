"""Small `.bin/.idx` datasets and a stand-in tokenizer for the GPT dataset tests."""

from collections import OrderedDict

import numpy as np

from megatron.core.datasets.gpt_dataset import GPTDatasetConfig
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

EOD = 0


class StubTokenizer:
    """What the datasets use of a tokenizer: `eod`, `vocab_size`, optional `pad`, `unique_identifiers`."""

    def __init__(self, pad=None, vocab_size=1000):
        self.eod = EOD
        self.vocab_size = vocab_size
        if pad is not None:
            self.pad = pad
        self.unique_identifiers = OrderedDict([("class", "StubTokenizer"), ("tokenizer_path", ["vocab.json"])])


def random_documents(num_documents: int, seed: int, max_length: int = 40) -> list[np.ndarray]:
    """Documents of 1..max_length tokens (ids 1..999) each ending with EOD."""
    rng = np.random.default_rng(seed)
    return [np.append(rng.integers(1, 1000, int(rng.integers(0, max_length))), EOD) for _ in range(num_documents)]


def write_dataset(prefix: str, documents: list[np.ndarray]) -> str:
    """`prefix.bin/.idx` with one sequence per document (uint16, as GPT-2 data)."""
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for document in documents:
        builder.add_document(document, [len(document)])
    builder.finalize(prefix + ".idx")
    return prefix


def gpt_config(**overrides) -> GPTDatasetConfig:
    settings = dict(
        random_seed=1234,
        sequence_length=8,
        tokenizer=StubTokenizer(),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
    )
    settings.update(overrides)
    return GPTDatasetConfig(**settings)
