"""`--tokenizer-type NullTokenizer --vocab-size N`: text that already is token ids ("12 7 401")."""

from megatron.core.tokenizers.megatron_tokenizer import MegatronTokenizer


class NullTokenizer(MegatronTokenizer):
    """Parses whitespace-separated integers; for benchmarks, mock data and pre-tokenized corpora.

    Semantics of current Megatron-LM (since April 2026): `vocab_size` = N, `eod` = N - 1 unless
    `eod_id` (`--null-tokenizer-eod-id`) is given, `pad` = `pad_id` (`--null-tokenizer-pad-id`,
    default -1, an id no real token has). Older Megatron-LM (<= core v0.16) meant something else by the
    same flag: `vocab_size` = N + 1 with `eod` = N, an extra id past the N given ones; a model trained
    that way has one more embedding row than `--vocab-size` says.
    """

    megatron_class_name = "_NullTokenizer"

    def __init__(self, vocab_size: int, eod_id: int | None = None, pad_id: int = -1):
        super().__init__(None, vocab_size=vocab_size, eod_id=eod_id, pad_id=pad_id)
        if vocab_size < 1:
            raise ValueError(f"NullTokenizer needs --vocab-size >= 1, got {vocab_size}")
        self._vocab_size = int(vocab_size)
        self._eod_id = self._vocab_size - 1 if eod_id is None else int(eod_id)
        if not 0 <= self._eod_id < self._vocab_size:
            raise ValueError(
                f"--null-tokenizer-eod-id {self._eod_id} is outside the vocabulary [0, {self._vocab_size})"
            )
        if not -1 <= pad_id < self._vocab_size:
            raise ValueError(
                f"--null-tokenizer-pad-id {pad_id} must be -1 (no padding id) or in [0, {self._vocab_size})"
            )
        self._pad_id = int(pad_id)

    def tokenize(self, text: str) -> list[int]:
        try:
            ids = [int(token) for token in text.split()]
        except ValueError as error:
            raise ValueError(f"NullTokenizer expects whitespace-separated integers: {error}") from None
        out_of_range = [token_id for token_id in ids if not 0 <= token_id < self._vocab_size]
        if out_of_range:
            raise ValueError(
                f"NullTokenizer: ids {out_of_range[:5]} are outside the vocabulary [0, {self._vocab_size})"
            )
        return ids

    def detokenize(self, ids) -> str:
        return " ".join(str(int(token_id)) for token_id in ids)

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def vocab(self) -> dict:
        self._missing("vocab")

    @property
    def inv_vocab(self) -> dict:
        self._missing("inv_vocab")

    @property
    def eod(self) -> int:
        return self._eod_id

    @property
    def eos(self) -> int:
        return self._eod_id

    @property
    def pad(self) -> int:
        return self._pad_id
