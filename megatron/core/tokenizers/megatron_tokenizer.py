"""The interface every tokenizer offers: Megatron-LM's `MegatronLegacyTokenizer`, plus `tokenize_batch`."""

import json
import os
from abc import ABC, abstractmethod
from collections import OrderedDict


class MissingTokenizerAttribute(AttributeError, NotImplementedError):
    """Raised by a property (a special token, a vocabulary) that a tokenizer does not have.

    An `AttributeError`, so that `getattr(tokenizer, "pad", None)` and `hasattr` work; also a
    `NotImplementedError`, which is what Megatron-LM raises and what code written for it catches.
    """


class MegatronTokenizer(ABC):
    """Base of all tokenizers: ids in, ids out, plus the special-token ids the datasets need.

    `unique_identifiers` is the ordered dict that the dataset index caches hash (through
    `json.dumps(..., indent=4)`): the class name, the tokenizer files as given, then every option as a
    string, exactly as Megatron-LM builds it, so that an index cache built by Megatron-LM for the same
    data and tokenizer is found and reused. `megatron_class_name` is the class name Megatron-LM uses for
    the same tokenizer (its classes carry a leading underscore).
    """

    megatron_class_name: str = ""

    def __init__(self, *tokenizer_paths, **tokenizer_options):
        self.unique_identifiers = OrderedDict()
        self.unique_identifiers["class"] = self.megatron_class_name or type(self).__name__
        self.unique_identifiers["tokenizer_path"] = [
            None if path is None else os.fspath(path) for path in tokenizer_paths
        ]
        for option, value in tokenizer_options.items():
            self.unique_identifiers[option] = str(value)
        self.unique_description = json.dumps(self.unique_identifiers, indent=4)

    @abstractmethod
    def tokenize(self, text: str) -> list[int]:
        """Token ids of `text`."""

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text; tokenizers with a native batch encoder override this for speed."""
        return [self.tokenize(text) for text in texts]

    @abstractmethod
    def detokenize(self, ids) -> str:
        """Text of a sequence of token ids."""

    @property
    @abstractmethod
    def vocab(self) -> dict:
        """Token -> id."""

    @property
    @abstractmethod
    def inv_vocab(self) -> dict:
        """Id -> token."""

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Number of ids, before padding for tensor parallelism."""

    def tokens_to_ids(self, tokens: list[str]) -> list[int]:
        """Ids of vocabulary tokens, an unknown one giving the unknown-token id (the fill-in-the-middle
        dataset's sentinels; Megatron-LM's text tokenizers' `tokens_to_ids`)."""
        self._missing("tokens_to_ids")

    def text_to_ids(self, text: str) -> list[int]:
        """Ids of `text` with special-token strings in it read as those tokens (Megatron-LM's `text_to_ids`)."""
        self._missing("text_to_ids")

    def ids_to_text(self, ids, remove_special_tokens: bool = False) -> str:
        """Text of `ids`, without the special tokens if asked (Megatron-LM's `ids_to_text`)."""
        self._missing("ids_to_text")

    def _missing(self, name: str, detail: str = ""):
        raise MissingTokenizerAttribute(f"{type(self).__name__} has no attribute {name!r}{detail}")

    @property
    def cls(self) -> int:
        """Id of the classification token."""
        self._missing("cls")

    @property
    def sep(self) -> int:
        """Id of the separator token."""
        self._missing("sep")

    @property
    def pad(self) -> int:
        """Id of the padding token."""
        self._missing("pad")

    @property
    def eod(self) -> int:
        """Id of the end-of-document token that `--append-eod` appends."""
        self._missing("eod")

    @property
    def bos(self) -> int:
        """Id of the beginning-of-sequence token."""
        self._missing("bos")

    @property
    def eos(self) -> int:
        """Id of the end-of-sequence token."""
        self._missing("eos")

    @property
    def mask(self) -> int:
        """Id of the mask token (BERT / T5 masking)."""
        self._missing("mask")

    @property
    def additional_special_tokens_ids(self) -> list[int]:
        """Ids of the T5 sentinels `<extra_id_0>`, `<extra_id_1>`, ..."""
        self._missing("additional_special_tokens_ids")


class DictVocabTokenizer(MegatronTokenizer):
    """A tokenizer whose whole vocabulary is held as Python dicts `_vocab` (token -> id) and `_inv_vocab`."""

    _vocab: dict
    _inv_vocab: dict

    @property
    def vocab_size(self) -> int:
        return len(self._vocab)

    @property
    def vocab(self) -> dict:
        return self._vocab

    @property
    def inv_vocab(self) -> dict:
        return self._inv_vocab
