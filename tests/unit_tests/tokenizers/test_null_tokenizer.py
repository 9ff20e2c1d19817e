"""NullTokenizer with current Megatron-LM's semantics (vocab N, eod N-1, pad -1)."""

import pytest

from megatron.core.tokenizers import NullTokenizer


def test_parses_integers_and_uses_the_last_id_as_eod():
    tokenizer = NullTokenizer(50257)
    assert tokenizer.tokenize("12 7\n401\t 0  ") == [12, 7, 401, 0]
    assert tokenizer.detokenize([12, 7, 401]) == "12 7 401"
    assert (tokenizer.vocab_size, tokenizer.eod, tokenizer.eos, tokenizer.pad) == (50257, 50256, 50256, -1)
    assert tokenizer.tokenize_batch(["1 2", "", "3"]) == [[1, 2], [], [3]]


def test_eod_and_pad_flags():
    tokenizer = NullTokenizer(1000, eod_id=0, pad_id=999)
    assert (tokenizer.eod, tokenizer.pad, tokenizer.vocab_size) == (0, 999, 1000)
    assert dict(tokenizer.unique_identifiers) == {
        "class": "_NullTokenizer", "tokenizer_path": [None], "vocab_size": "1000", "eod_id": "0", "pad_id": "999",
    }


def test_bad_input_is_named():
    tokenizer = NullTokenizer(100)
    with pytest.raises(ValueError, match="whitespace-separated integers.*'x'"):
        tokenizer.tokenize("1 x 3")
    with pytest.raises(ValueError, match=r"ids \[100, -1\] are outside the vocabulary \[0, 100\)"):
        tokenizer.tokenize("5 100 -1")
    with pytest.raises(ValueError, match="--null-tokenizer-eod-id 100 is outside"):
        NullTokenizer(100, eod_id=100)
    with pytest.raises(ValueError, match="--null-tokenizer-pad-id -2 must be -1"):
        NullTokenizer(100, pad_id=-2)
    with pytest.raises(ValueError, match="--vocab-size >= 1"):
        NullTokenizer(0)
    for name in ("vocab", "inv_vocab", "cls", "mask", "bos"):
        with pytest.raises(AttributeError, match=f"NullTokenizer has no attribute '{name}'"):
            getattr(tokenizer, name)
