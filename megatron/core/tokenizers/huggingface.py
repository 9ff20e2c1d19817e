"""Any Hugging Face tokenizer (`--tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR_OR_HUB_ID`).

`transformers.AutoTokenizer` picks the tokenizer class from the files in the directory
(`tokenizer.json` / `tokenizer_config.json` / `special_tokens_map.json`, or a slow tokenizer's own files),
so Llama-3, Mistral, Qwen, ... tokenizers all come through here. As current Megatron-LM: the vocabulary
size is `len(tokenizer)` (added tokens included), `eod` is `eos_token_id`, and the tokenizer's own
special tokens are added to each text (a Llama-style BOS per document) unless
`include_special_tokens=False` (`--tokenizer-hf-no-include-special-tokens`).
"""

import functools
import os

from megatron.core.tokenizers.megatron_tokenizer import MegatronTokenizer
from megatron.core.tokenizers.optional_import import import_optional

_EXPECTED = "a local directory holding the tokenizer files (tokenizer.json and/or tokenizer_config.json)"


def _looks_like_a_path(name: str) -> bool:
    return name.startswith((".", "~", os.sep)) or name.count("/") > 1 or os.path.exists(name)


def _load_auto_tokenizer(name_or_path: str, trust_remote_code: bool, **kwargs):
    transformers = import_optional("transformers", "HuggingFaceTokenizer")
    load = functools.partial(
        transformers.AutoTokenizer.from_pretrained, name_or_path, trust_remote_code=trust_remote_code, **kwargs
    )
    if os.path.isdir(name_or_path):
        try:
            return load()
        except Exception as error:  # for a directory without tokenizer files it raises anything, AttributeError too
            raise ValueError(
                f"--tokenizer-model {name_or_path!r}: could not load a tokenizer from this directory "
                f"({type(error).__name__}: {error}); expected {_EXPECTED}"
            ) from error
    if _looks_like_a_path(name_or_path):
        raise ValueError(f"--tokenizer-model {name_or_path!r} is not a directory; expected {_EXPECTED}")
    try:
        return load()
    except (OSError, ValueError) as error:
        raise ValueError(
            f"--tokenizer-model {name_or_path!r} is not a local directory, and loading it as a Hugging Face "
            f"Hub id failed (is the hub reachable from here?): {error}. Without the hub, pass {_EXPECTED}, "
            "e.g. written by `AutoTokenizer.from_pretrained(id).save_pretrained(DIR)` on a connected machine"
        ) from error


class HuggingFaceTokenizer(MegatronTokenizer):
    """`transformers.AutoTokenizer` behind Megatron's tokenizer interface."""

    megatron_class_name = "_HuggingFaceTokenizer"

    def __init__(
        self,
        pretrained_model_name_or_path: str,
        trust_remote_code: bool = False,
        include_special_tokens: bool = True,
        additional_special_tokens: list[str] | None = None,
        **kwargs,
    ):
        super().__init__(pretrained_model_name_or_path, **kwargs)
        self._tokenizer = _load_auto_tokenizer(pretrained_model_name_or_path, trust_remote_code, **kwargs)
        if additional_special_tokens:
            # Tokens not in the vocabulary get new ids after it (Megatron-LM's --tokenizer-special-tokens).
            self._tokenizer.add_special_tokens({"additional_special_tokens": list(additional_special_tokens)})
        self._include_special_tokens = include_special_tokens
        self._vocab = None
        self._inv_vocab = None

    def tokenize(self, text: str) -> list[int]:
        return self._tokenizer(text, add_special_tokens=self._include_special_tokens)["input_ids"]

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        return self._tokenizer(list(texts), add_special_tokens=self._include_special_tokens)["input_ids"]

    def detokenize(self, ids) -> str:
        return self._tokenizer.decode([int(token_id) for token_id in ids])

    def tokens_to_ids(self, tokens: list[str]) -> list[int]:
        return self._tokenizer.convert_tokens_to_ids(list(tokens))

    def text_to_ids(self, text: str) -> list[int]:
        if self._include_special_tokens:
            return self._tokenizer(text).input_ids
        return self.tokens_to_ids(self._tokenizer.tokenize(text))

    def ids_to_text(self, ids, remove_special_tokens: bool = False) -> str:
        tokens = self._tokenizer.convert_ids_to_tokens([int(token_id) for token_id in ids])
        special = set(self._tokenizer.all_special_tokens) if remove_special_tokens else set()
        return self._tokenizer.convert_tokens_to_string([t for t in tokens if t is not None and t not in special])

    @property
    def vocab_size(self) -> int:
        return len(self._tokenizer)

    @property
    def vocab(self) -> dict[str, int]:
        if self._vocab is None:
            self._vocab = self._tokenizer.get_vocab()
        return self._vocab

    @property
    def inv_vocab(self) -> dict[int, str]:
        if self._inv_vocab is None:
            self._inv_vocab = {token_id: token for token, token_id in self.vocab.items()}
        return self._inv_vocab

    def _special(self, name: str, attribute: str) -> int:
        token_id = getattr(self._tokenizer, attribute, None)
        if token_id is None:
            self._missing(name, f" ({type(self._tokenizer).__name__} defines no {attribute})")
        return token_id

    @property
    def eod(self) -> int:
        return self._special("eod", "eos_token_id")

    @property
    def eos(self) -> int:
        return self._special("eos", "eos_token_id")

    @property
    def bos(self) -> int:
        return self._special("bos", "bos_token_id")

    @property
    def pad(self) -> int:
        return self._special("pad", "pad_token_id")

    @property
    def cls(self) -> int:
        return self._special("cls", "cls_token_id")

    @property
    def sep(self) -> int:
        return self._special("sep", "sep_token_id")

    @property
    def mask(self) -> int:
        return self._special("mask", "mask_token_id")

    @property
    def additional_special_tokens_ids(self) -> list[int]:
        return list(self._tokenizer.additional_special_tokens_ids)
