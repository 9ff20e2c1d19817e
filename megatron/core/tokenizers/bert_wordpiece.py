"""BERT WordPiece (`--tokenizer-type BertWordPieceLowerCase` / `BertWordPieceCase`) from a `vocab.txt`.

Ids are those of Megatron-LM's `_BertWordPieceTokenizer` (Google's original BERT tokenizer): basic
splitting (`bert_basic_splitter.py`), then greedy longest-match-first WordPiece on each word, with
continuation pieces spelled `##piece`, a word longer than 200 characters or with no cover in the vocab
becoming `[UNK]`. Megatron then appends `[BOS]`, `[EOS]` (when missing) and `--vocab-extra-ids` sentinels
`<extra_id_0>, <extra_id_1>, ...` to the vocabulary; they are never produced from text (the brackets
split off as punctuation) and serve as ids for the BERT/T5 datasets.
"""

import itertools

from megatron.core.tokenizers.bert_basic_splitter import BertBasicSplitter
from megatron.core.tokenizers.megatron_tokenizer import DictVocabTokenizer
from megatron.core.tokenizers.piece_cache import PieceCache

# Google's `WordpieceTokenizer` default; `transformers` uses 100.
MAX_INPUT_CHARS_PER_WORD = 200
_REQUIRED_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")


def read_vocab_txt(vocab_file: str) -> dict[str, int]:
    """One token per line, id = line number; each line stripped of surrounding whitespace (as Google's)."""
    vocab = {}
    try:
        with open(vocab_file, encoding="utf-8") as file:
            for index, line in enumerate(file):
                vocab[line.strip()] = index
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"--vocab-file {vocab_file!r} is not a readable WordPiece vocab.txt: {error}") from error
    return vocab


def _clean_up_tokenization(text: str) -> str:
    """Megatron's `convert_tokens_to_string` clean-up of spaces before punctuation and contractions."""
    for spaced, joined in (
        (" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"), (" 'm", "'m"),
        (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"),
    ):
        text = text.replace(spaced, joined)
    return text


class BertWordPieceTokenizer(DictVocabTokenizer):
    """BERT WordPiece with Megatron-LM's extra tokens; `lower_case` selects the LowerCase/Case variant."""

    megatron_class_name = "_BertWordPieceTokenizer"

    def __init__(self, vocab_file: str, lower_case: bool = True, vocab_extra_ids: int = 0):
        super().__init__(vocab_file, lower_case=lower_case, vocab_extra_ids=vocab_extra_ids)
        if vocab_extra_ids < 0:
            raise ValueError(f"--vocab-extra-ids must be >= 0, got {vocab_extra_ids}")
        self._vocab = read_vocab_txt(vocab_file)
        missing = [token for token in _REQUIRED_TOKENS if token not in self._vocab]
        if missing:
            raise ValueError(f"--vocab-file {vocab_file!r} lacks the BERT special tokens {' '.join(missing)}")
        self._inv_vocab = {token_id: token for token, token_id in self._vocab.items()}
        self._splitter = BertBasicSplitter(lower_case)
        self._pieces = PieceCache(self._word_to_ids)
        self._unk_id = self._vocab["[UNK]"]

        # The tokens added here can never be WordPiece matches: their first character is punctuation,
        # which the splitter always cuts off as a word of its own.
        self._add_token("[BOS]")
        self._add_token("[EOS]")
        self._additional_special_tokens = [f"<extra_id_{i}>" for i in range(vocab_extra_ids)]
        for token in self._additional_special_tokens:
            self._add_token(token)

    def _add_token(self, token: str) -> None:
        # As Megatron: a new token gets id len(vocab), which equals the next free id only when the file
        # has no duplicate lines.
        if token not in self._vocab:
            self._inv_vocab[len(self._vocab)] = token
            self._vocab[token] = len(self._vocab)

    def _word_to_ids(self, word: str) -> tuple[int, ...]:
        """Greedy longest-match-first: take the longest vocab prefix, then continue with `##` pieces."""
        if len(word) > MAX_INPUT_CHARS_PER_WORD:
            return (self._unk_id,)
        ids, start = [], 0
        while start < len(word):
            for end in range(len(word), start, -1):
                piece = word[start:end] if start == 0 else "##" + word[start:end]
                piece_id = self._vocab.get(piece)
                if piece_id is not None:
                    break
            else:
                return (self._unk_id,)
            ids.append(piece_id)
            start = end
        return tuple(ids)

    def tokenize(self, text: str) -> list[int]:
        return list(itertools.chain.from_iterable(map(self._pieces.__getitem__, self._splitter.split(text))))

    def detokenize(self, ids) -> str:
        """Megatron's decode: tokens joined by spaces, `##` continuations glued, spacing cleaned up."""
        try:
            tokens = [self._inv_vocab[int(token_id)] for token_id in ids]
        except KeyError as error:
            raise ValueError(f"{type(self).__name__}: id {error.args[0]} is not in the vocabulary") from None
        return _clean_up_tokenization(" ".join(tokens).replace(" ##", "").strip())

    @property
    def cls(self) -> int:
        return self._vocab["[CLS]"]

    @property
    def sep(self) -> int:
        return self._vocab["[SEP]"]

    @property
    def pad(self) -> int:
        return self._vocab["[PAD]"]

    @property
    def mask(self) -> int:
        return self._vocab["[MASK]"]

    @property
    def bos(self) -> int:
        return self._vocab["[BOS]"]

    @property
    def eos(self) -> int:
        return self._vocab["[EOS]"]

    @property
    def eod(self) -> int:
        """`[EOS]`, as in Megatron-LM."""
        return self._vocab["[EOS]"]

    @property
    def bos_token(self) -> str:
        """The beginning-of-sequence token string."""
        return "[BOS]"

    @property
    def eos_token(self) -> str:
        """The end-of-sequence token string."""
        return "[EOS]"

    @property
    def additional_special_tokens(self) -> list[str]:
        """The `<extra_id_i>` sentinel strings."""
        return self._additional_special_tokens

    @property
    def additional_special_tokens_ids(self) -> list[int]:
        return [self._vocab[token] for token in self._additional_special_tokens]
