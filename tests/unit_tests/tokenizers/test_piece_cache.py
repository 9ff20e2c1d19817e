"""PieceCache: computes each piece once, and empties itself when full."""

from megatron.core.tokenizers.piece_cache import PieceCache


def test_computes_once_and_empties_when_full():
    calls = []

    def encode(piece):
        calls.append(piece)
        return tuple(ord(c) for c in piece)

    cache = PieceCache(encode, max_pieces=2)
    assert cache["ab"] == (97, 98) and cache["ab"] == (97, 98) and calls == ["ab"]
    assert cache["c"] == (99,) and len(cache) == 2
    assert cache["d"] == (100,)  # full: emptied, then "d" stored
    assert dict(cache) == {"d": (100,)}
    assert cache["ab"] == (97, 98) and calls == ["ab", "c", "d", "ab"]
