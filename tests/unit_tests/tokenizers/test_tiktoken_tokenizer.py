"""TikTokenizer against `tiktoken` used directly on the same ranks, with Megatron's id layout."""

import base64
import json

import pytest
import tiktoken

from megatron.core.tokenizers import TikTokenizer

# Megatron-LM's patterns, copied from megatron/training/tokenizer/tokenizer.py.
MEGATRON_V1 = r"[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"
MEGATRON_V2 = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|"
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|"
    r"\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@pytest.mark.parametrize("pattern, regex", [("v1", MEGATRON_V1), ("v2", MEGATRON_V2)], ids=["v1", "v2"])
def test_ids_are_tiktoken_ranks_shifted_past_the_specials(pattern, regex, tiktoken_file, tiktoken_ranks, documents):
    reference = tiktoken.Encoding(name="reference", pat_str=regex, mergeable_ranks=tiktoken_ranks, special_tokens={})
    vocab_size = 1000 + len(tiktoken_ranks)
    ours = TikTokenizer(tiktoken_file, pattern=pattern, vocab_size=vocab_size)
    for document in documents:
        assert ours.tokenize(document) == [rank + 1000 for rank in reference.encode_ordinary(document)]
        assert ours.detokenize(ours.tokenize(document)) == document
    assert ours.tokenize_batch(documents[:4]) == [ours.tokenize(d) for d in documents[:4]]
    assert ours.unique_identifiers["pattern"] == regex


def test_special_token_layout(tiktoken_file, tiktoken_ranks):
    ours = TikTokenizer(tiktoken_file, pattern="v2", vocab_size=1000 + len(tiktoken_ranks))
    assert (ours.unk, ours.bos, ours.eos, ours.eod) == (0, 1, 2, 2)
    assert ours.vocab["<SPECIAL_3>"] == 3 and ours.vocab["<SPECIAL_999>"] == 999
    assert ours.vocab[b"a"] == 1000 + ord("a")
    assert ours.inv_vocab[1000 + 256] == next(token for token, rank in tiktoken_ranks.items() if rank == 256)
    assert ours.vocab_size == len(ours.vocab) == 1000 + len(tiktoken_ranks)
    # Special tokens are never produced from text; a bos/eos can be asked for.
    assert ours.tokenize("</s><s>") == [1000 + b for b in b"</s><s>"]
    assert ours.tokenize("a", bos=True, eos=True) == [1, 1000 + ord("a"), 2]
    assert ours.additional_special_tokens_ids == []
    with pytest.raises(AttributeError, match="has no attribute 'pad' \\(add <pad> to --tokenizer-special-tokens\\)"):
        ours.pad


def test_custom_special_tokens_and_truncation(tiktoken_file):
    ours = TikTokenizer(
        tiktoken_file, pattern="v1", vocab_size=20 + 300, num_special_tokens=20,
        special_tokens=["<unk>", "<s>", "</s>", "<pad>", "<mask>"],
    )
    assert (ours.pad, ours.mask, ours.vocab["<SPECIAL_5>"]) == (3, 4, 5)
    assert ours.additional_special_tokens_ids == [3, 4]
    # Only the first vocab_size - num_special ranks are kept.
    assert max(ours.inv_vocab) == 319
    assert all(token_id < 320 for token_id in ours.tokenize("def function_name(argument): return value"))
    assert dict(ours.unique_identifiers) == {
        "class": "CustomTikTokenizer", "tokenizer_path": [tiktoken_file], "pattern": MEGATRON_V1,
        "vocab_size": "320", "num_special_tokens": "20",
        "special_tokens": "['<unk>', '<s>', '</s>', '<pad>', '<mask>']",
    }


def test_invalid_configurations(tmp_path, tiktoken_file, tiktoken_ranks):
    with pytest.raises(ValueError, match="--tiktoken-pattern must be v1 or v2"):
        TikTokenizer(tiktoken_file, pattern="v3")
    # The default vocabulary of 2**17 ids needs 2**17 - 1000 ranks.
    with pytest.raises(ValueError, match=f"needs 130072 BPE ranks, but .* has {len(tiktoken_ranks)}"):
        TikTokenizer(tiktoken_file, pattern="v2", vocab_size=None)
    with pytest.raises(ValueError, match="must include"):
        TikTokenizer(tiktoken_file, pattern="v2", vocab_size=1300, special_tokens=["<unk>", "<s>"])
    with pytest.raises(ValueError, match="is less than the 3 special tokens"):
        TikTokenizer(tiktoken_file, pattern="v2", vocab_size=1300, num_special_tokens=2)
    entries = [{"rank": i, "token_bytes": base64.b64encode(bytes([i])).decode(), "token_str": ""} for i in range(256)]
    entries[5]["rank"] = 6
    bad = tmp_path / "ranks.json"
    bad.write_text(json.dumps(entries), encoding="utf-8")
    with pytest.raises(ValueError, match="entry 5 has rank 6"):
        TikTokenizer(str(bad), pattern="v2", vocab_size=10 + 256, num_special_tokens=10)
    with pytest.raises(ValueError, match="expects a .json rank file"):
        TikTokenizer(str(tmp_path / "tokenizer.model"), pattern="v2")
