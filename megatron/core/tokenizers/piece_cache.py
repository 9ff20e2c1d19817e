"""A bounded memo of piece -> token ids, shared by the GPT-2 and BERT tokenizers."""

from collections.abc import Callable

# About 50 MB of small tuples; per worker process in preprocessing.
DEFAULT_MAX_PIECES = 1 << 18


class PieceCache(dict):
    """`cache[piece]` returns the ids of `piece`, computing them once with `encode_piece`.

    Text is Zipf-distributed: a small set of pieces (words, punctuation, indentation runs) makes up most
    of any corpus, so a dict lookup answers nearly every piece. When the cache reaches `max_pieces` it
    is emptied rather than evicted entry by entry; the frequent pieces come back within a few documents.
    """

    def __init__(self, encode_piece: Callable[[str], tuple[int, ...]], max_pieces: int = DEFAULT_MAX_PIECES):
        super().__init__()
        self._encode_piece = encode_piece
        self._max_pieces = max_pieces

    def __missing__(self, piece: str) -> tuple[int, ...]:
        if len(self) >= self._max_pieces:
            self.clear()
        ids = self[piece] = self._encode_piece(piece)
        return ids
