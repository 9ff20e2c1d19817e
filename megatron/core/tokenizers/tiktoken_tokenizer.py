"""`--tokenizer-type TikTokenizer`: a tiktoken BPE from Megatron's JSON rank file, behind special tokens.

The file (`--tokenizer-model`) is a JSON list whose i-th entry is `{"rank": i, "token_bytes": base64,
"token_str": str}`; entries 0..255 must be the single bytes 0..255. Id layout, as Megatron-LM's
`CustomTikTokenizer`:

    ids [0, num_special)            special tokens: `--tokenizer-special-tokens` (default `<unk> <s> </s>`),
                                    then fillers `<SPECIAL_i>` up to `--tiktoken-num-special-tokens`
    ids [num_special, vocab_size)   BPE rank r -> id r + num_special, for the first
                                    vocab_size - num_special ranks of the file

Special tokens are never produced from text (`encode_ordinary`); `eod` is `</s>`.
The `tiktoken` package is imported only when this tokenizer is built.
"""

import base64
import json
from pathlib import Path

from megatron.core.tokenizers.megatron_tokenizer import DictVocabTokenizer
from megatron.core.tokenizers.optional_import import import_optional

# Megatron-LM's pre-split patterns, verbatim. v1 keeps each digit apart; v2 also splits camelCase words.
PATTERN_TIKTOKEN = (
    r"[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"
)
PATTERN_TIKTOKEN_V2 = "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+|[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"  # noqa: E501
PATTERNS = {"v1": PATTERN_TIKTOKEN, "v2": PATTERN_TIKTOKEN_V2}
DEFAULT_VOCAB_SIZE = 2**17
REQUIRED_SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]


def read_rank_file(path: str, max_ranks: int) -> dict[bytes, int]:
    """Token bytes -> BPE rank for the first `max_ranks` entries of the JSON rank file."""
    if not str(path).endswith(".json"):
        raise ValueError(f"--tokenizer-model {path!r}: TikTokenizer expects a .json rank file")
    try:
        with open(path, encoding="utf-8") as file:
            entries = json.load(file)
    except (OSError, ValueError) as error:
        raise ValueError(f"--tokenizer-model {path!r} is not a readable JSON rank file: {error}") from error
    if not isinstance(entries, list):
        raise ValueError(f"--tokenizer-model {path!r} must hold a JSON list of {{rank, token_bytes, token_str}}")
    ranks = {}
    for rank, entry in enumerate(entries[:max_ranks]):
        if not isinstance(entry, dict) or entry.keys() != {"rank", "token_bytes", "token_str"}:
            raise ValueError(f"--tokenizer-model {path!r} entry {rank}: expected keys rank, token_bytes, token_str")
        if entry["rank"] != rank:
            raise ValueError(f"--tokenizer-model {path!r} entry {rank} has rank {entry['rank']}; ranks must be 0, 1, ...")
        token = base64.b64decode(entry["token_bytes"])
        if rank < 256 and token != bytes([rank]):
            raise ValueError(f"--tokenizer-model {path!r} entry {rank} must be the single byte {rank}")
        if token in ranks:
            raise ValueError(f"--tokenizer-model {path!r} entry {rank} repeats the token of rank {ranks[token]}")
        ranks[token] = rank
    return ranks


class TikTokenizer(DictVocabTokenizer):
    """tiktoken BPE with Megatron's special-token block in front of the BPE ranks.

    `vocab` maps BPE tokens as `bytes` and special tokens as `str` (as Megatron's).
    """

    megatron_class_name = "CustomTikTokenizer"

    def __init__(
        self,
        path: str,
        pattern: str,
        vocab_size: int | None = DEFAULT_VOCAB_SIZE,
        num_special_tokens: int = 1000,
        special_tokens: list[str] | None = None,
    ):
        if pattern not in PATTERNS:
            raise ValueError(f"--tiktoken-pattern must be v1 or v2, got {pattern!r}")
        # Megatron hashes the pattern text and the vocab size exactly as passed (None included).
        super().__init__(
            path, pattern=PATTERNS[pattern], vocab_size=vocab_size, num_special_tokens=num_special_tokens,
            special_tokens=special_tokens,
        )
        tiktoken = import_optional("tiktoken", "TikTokenizer")
        vocab_size = DEFAULT_VOCAB_SIZE if vocab_size is None else vocab_size
        given = list(REQUIRED_SPECIAL_TOKENS if special_tokens is None else special_tokens)
        specials = self._with_fillers(given, num_special_tokens)
        inner_size = vocab_size - num_special_tokens
        if inner_size < 1:
            raise ValueError(
                f"--vocab-size {vocab_size} leaves no room for BPE tokens after "
                f"--tiktoken-num-special-tokens {num_special_tokens}"
            )
        ranks = read_rank_file(path, inner_size)
        if len(ranks) < inner_size:
            raise ValueError(
                f"--vocab-size {vocab_size} with --tiktoken-num-special-tokens {num_special_tokens} needs "
                f"{inner_size} BPE ranks, but {path!r} has {len(ranks)}; pass --vocab-size "
                f"{len(ranks) + num_special_tokens} or less"
            )
        # ids = rank + num_special: the special tokens take ids [0, num_special).
        shifted = {token: rank + num_special_tokens for token, rank in ranks.items()}
        self._specials = {token: token_id for token_id, token in enumerate(specials)}
        self._model = tiktoken.Encoding(
            name=Path(path).parent.name, pat_str=PATTERNS[pattern], mergeable_ranks=shifted,
            special_tokens=self._specials,
        )
        self._vocab = {**shifted, **self._specials}
        self._inv_vocab = {token_id: token for token, token_id in self._vocab.items()}
        self._additional_ids = [i for i, token in enumerate(given) if token not in REQUIRED_SPECIAL_TOKENS]

    @staticmethod
    def _with_fillers(special_tokens: list[str], num_special_tokens: int) -> list[str]:
        """The given special tokens followed by `<SPECIAL_i>` fillers, `num_special_tokens` in all."""
        if len(set(special_tokens)) != len(special_tokens):
            raise ValueError(f"--tokenizer-special-tokens must be unique, got {special_tokens}")
        missing = [token for token in REQUIRED_SPECIAL_TOKENS if token not in special_tokens]
        if missing:
            raise ValueError(f"--tokenizer-special-tokens must include {REQUIRED_SPECIAL_TOKENS}; missing {missing}")
        if num_special_tokens < len(special_tokens):
            raise ValueError(
                f"--tiktoken-num-special-tokens {num_special_tokens} is less than the "
                f"{len(special_tokens)} special tokens given"
            )
        fillers = [f"<SPECIAL_{i}>" for i in range(len(special_tokens), num_special_tokens)]
        clash = set(fillers) & set(special_tokens)
        if clash:
            raise ValueError(f"--tokenizer-special-tokens {sorted(clash)} collide with the filler names")
        return special_tokens + fillers

    def tokenize(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        ids = self._model.encode_ordinary(text)
        return ([self.bos] if bos else []) + ids + ([self.eos] if eos else [])

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        return self._model.encode_ordinary_batch(list(texts))

    def detokenize(self, ids) -> str:
        """Concatenated token bytes decoded as UTF-8 (invalid bytes -> U+FFFD); specials by their names."""
        return self._model.decode([int(token_id) for token_id in ids])

    def _special(self, name: str, token: str) -> int:
        if token not in self._specials:
            self._missing(name, f" (add {token} to --tokenizer-special-tokens)")
        return self._specials[token]

    @property
    def unk(self) -> int:
        """Id of `<unk>`."""
        return self._specials["<unk>"]

    @property
    def bos(self) -> int:
        return self._specials["<s>"]

    @property
    def eos(self) -> int:
        return self._specials["</s>"]

    @property
    def eod(self) -> int:
        return self._specials["</s>"]

    @property
    def pad(self) -> int:
        return self._special("pad", "<pad>")

    @property
    def mask(self) -> int:
        return self._special("mask", "<mask>")

    @property
    def cls(self) -> int:
        return self._special("cls", "<cls>")

    @property
    def sep(self) -> int:
        return self._special("sep", "<sep>")

    @property
    def additional_special_tokens_ids(self) -> list[int]:
        """The given special tokens other than `<unk> <s> </s>` (fillers excluded), as current Megatron."""
        return self._additional_ids
