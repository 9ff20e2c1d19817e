"""BERT's "basic tokenization": text -> words and punctuation marks, before WordPiece.

Megatron-LM's `bert_tokenization.py` (Google's original BERT code) does, character by character in
Python:
1. clean: drop U+0000, U+FFFD and control characters (categories Cc, Cf, except tab/newline/CR), turn
   whitespace (space, tab, newline, CR, category Zs) into a space;
2. put spaces around CJK ideographs;
3. split on whitespace (`str.split`); with lower casing, each word -> `str.lower`, then NFD with the
   non-spacing marks (category Mn) removed;
4. cut each word before and after every punctuation character (categories P*, and all ASCII
   non-alphanumerics).
This module computes the same words with whole-string C operations (`str.translate`, `str.lower`,
`unicodedata.normalize`, `str.split`) over tables built once from `unicodedata`, so the result follows
the running Python's Unicode version exactly as the original does. Lower-casing the whole text at once
equals lower-casing word by word: the only context rule of `str.lower` (final sigma) never looks
across whitespace.

`transformers.BertTokenizer` differs from this original on purpose-built inputs only: it applies NFC
first, also drops unassigned and private-use characters (Cn, Co), lower-cases character by character
(no final sigma), and keeps its special tokens such as "[CLS]" whole.
"""

import functools
import re
import sys
import unicodedata

# CJK ideograph blocks, as listed in Google's `_is_chinese_char`.
_CJK_RANGES = (
    (0x4E00, 0x9FFF),
    (0x3400, 0x4DBF),
    (0x20000, 0x2A6DF),
    (0x2A700, 0x2B73F),
    (0x2B740, 0x2B81F),
    (0x2B820, 0x2CEAF),
    (0xF900, 0xFAFF),
    (0x2F800, 0x2FA1F),
)
_CJK_PATTERN = re.compile("([" + "".join(f"{chr(lo)}-{chr(hi)}" for lo, hi in _CJK_RANGES) + "])")


def _is_ascii_punctuation(codepoint: int) -> bool:
    return 33 <= codepoint <= 47 or 58 <= codepoint <= 64 or 91 <= codepoint <= 96 or 123 <= codepoint <= 126


@functools.cache
def _translation_tables() -> tuple[dict, dict, dict]:
    """(clean, strip marks, pad punctuation) as `str.translate` tables, from one pass over all code points."""
    clean, strip_marks, pad_punctuation = {0: None, 0xFFFD: None}, {}, {}
    for codepoint in range(sys.maxunicode + 1):
        char = chr(codepoint)
        category = unicodedata.category(char)
        if char in " \t\n\r" or category == "Zs":
            clean[codepoint] = " "
        elif category in ("Cc", "Cf"):
            clean[codepoint] = None
        elif category == "Mn":
            strip_marks[codepoint] = None
        if category[0] == "P" or _is_ascii_punctuation(codepoint):
            pad_punctuation[codepoint] = f" {char} "
    return clean, strip_marks, pad_punctuation


class BertBasicSplitter:
    """Splits text into the words that WordPiece then cuts into pieces (see the module docstring)."""

    def __init__(self, lower_case: bool):
        self.lower_case = lower_case
        clean, strip_marks, pad_punctuation = _translation_tables()
        self._clean = clean
        # The punctuation cut comes after lower-casing and mark stripping (NFD can produce punctuation,
        # e.g. U+1FEF -> "`"), so with lower casing it shares the second table with the mark stripping.
        self._strip_and_pad = {**strip_marks, **pad_punctuation}
        self._clean_and_pad = {**clean, **pad_punctuation}

    def split(self, text: str) -> list[str]:
        """Words and single punctuation characters of `text`, in order."""
        if not self.lower_case:
            return self._space_cjk(text.translate(self._clean_and_pad)).split()
        text = self._space_cjk(text.translate(self._clean)).lower()
        if not text.isascii():
            text = unicodedata.normalize("NFD", text)
        return text.translate(self._strip_and_pad).split()

    @staticmethod
    def _space_cjk(text: str) -> str:
        return text if text.isascii() else _CJK_PATTERN.sub(r" \1 ", text)
