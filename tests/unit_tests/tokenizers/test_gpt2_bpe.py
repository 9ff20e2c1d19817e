"""GPT2BPETokenizer against transformers' pure-Python GPT2Tokenizer (OpenAI's algorithm) and tokenizers."""

import random

import pytest
from tokenizers import ByteLevelBPETokenizer
from transformers import GPT2Tokenizer, GPT2TokenizerFast

from megatron.core.tokenizers import GPT2BPETokenizer
from tests.unit_tests.tokenizers.mixed_text import UNICODE_LINES


@pytest.fixture(scope="module")
def ours(gpt2_files):
    return GPT2BPETokenizer(*gpt2_files)


@pytest.fixture(scope="module")
def reference(gpt2_files):
    return GPT2Tokenizer(*gpt2_files)


def test_ids_equal_the_python_reference(ours, reference, documents):
    # transformers treats "<|endoftext|>" as a special token; Megatron does not (tested below).
    assert not any("<|endoftext|>" in document for document in documents)
    for document in documents:
        assert ours.tokenize(document) == reference.encode(document)
    whole = "\n\n".join(documents)
    assert ours.tokenize(whole) == reference.encode(whole)


def test_ids_equal_a_plain_tokenizers_byte_level_bpe(ours, gpt2_files, documents):
    plain = ByteLevelBPETokenizer.from_file(*gpt2_files, add_prefix_space=False)
    assert ours.tokenize_batch(documents) == [encoding.ids for encoding in plain.encode_batch(documents)]


def test_every_code_point_matches_the_reference(ours, reference):
    """Code points inside a word, alone and after a space; every 97th (all of them pass, but slowly)."""
    code_points = [c for c in range(1, 0x110000, 97) if not 0xD800 <= c <= 0xDFFF]
    text = "".join(f"a{chr(c)}b {chr(c)}\n" for c in code_points)
    assert ours.tokenize(text) == reference.encode(text)


def test_round_trip(ours, documents):
    for document in documents:
        assert ours.detokenize(ours.tokenize(document)) == document
    assert ours.detokenize(ours.tokenize("")) == ""


def test_batch_equals_one_by_one(ours, documents):
    assert ours.tokenize_batch(documents) == [ours.tokenize(document) for document in documents]


def test_endoftext_in_text_is_ordinary_text(ours, reference):
    text = "one document<|endoftext|>another"
    ids = ours.tokenize(text)
    assert ours.eod not in ids
    assert ids == reference.encode(text, split_special_tokens=True)
    assert ours.detokenize(ids) == text


def test_text_tokenizer_methods_are_megatron_main_s(ours, gpt2_files, documents):
    """tokens_to_ids, text_to_ids and ids_to_text (what the FIM dataset uses) as Megatron-LM main's
    GPT2BPETokenizer, which is Hugging Face's GPT-2 tokenizer, gives them."""
    hf = GPT2TokenizerFast(*gpt2_files)
    tokens = ["<fim_prefix>", "<|endoftext|>", "def", "Ġthe"]
    assert ours.tokens_to_ids(tokens) == hf.convert_tokens_to_ids(tokens)  # unknown: <|endoftext|>
    text = documents[0][:300] + "<|endoftext|>" + documents[1][:300]
    assert ours.text_to_ids(text) == hf(text).input_ids
    rng = random.Random(0)
    for ids in [ours.text_to_ids(text)] + [[rng.randrange(ours.vocab_size) for _ in range(8)] for _ in range(50)]:
        kept = [token for token in hf.convert_ids_to_tokens(ids) if token not in hf.all_special_tokens]
        assert ours.ids_to_text(ids, remove_special_tokens=True) == hf.convert_tokens_to_string(kept)


def test_detokenize_of_arbitrary_ids_replaces_broken_utf8_like_the_reference(ours, reference):
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(ours.vocab_size) for _ in range(rng.randint(1, 12))]
        assert ours.detokenize(ids) == reference.decode(ids, clean_up_tokenization_spaces=False)


def test_special_tokens_and_vocab(ours, gpt2_files):
    import json

    with open(gpt2_files[0], encoding="utf-8") as file:
        vocab = json.load(file)
    assert ours.vocab_size == len(vocab)
    assert ours.eod == ours.eos == vocab["<|endoftext|>"]
    assert ours.vocab == vocab
    assert all(ours.inv_vocab[i] == token for token, i in vocab.items())
    with pytest.raises(AttributeError, match="GPT2BPETokenizer has no attribute 'cls'"):
        ours.cls
    with pytest.raises(NotImplementedError):
        ours.mask
    assert getattr(ours, "pad", None) is None
    assert dict(ours.unique_identifiers) == {"class": "_GPT2BPETokenizer", "tokenizer_path": list(gpt2_files)}


def test_detokenize_rejects_unknown_ids(ours):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        ours.detokenize([ours.vocab_size])


def test_merges_file_read_like_megatron(tmp_path, gpt2_files, reference):
    """The first line is always the header and the last line is always dropped, as in Megatron-LM."""
    with open(gpt2_files[1], encoding="utf-8") as file:
        lines = file.read().split("\n")
    assert lines[0].startswith("#version") and lines[-1] == ""
    # Without the final newline Megatron drops the last merge; so do we.
    unterminated = tmp_path / "merges.txt"
    unterminated.write_text("\n".join(lines[:-1]), encoding="utf-8")
    shorter = tmp_path / "shorter.txt"
    shorter.write_text("\n".join(lines[:-2]) + "\n", encoding="utf-8")
    text = " ".join(UNICODE_LINES)
    assert GPT2BPETokenizer(gpt2_files[0], str(unterminated)).tokenize(text) == GPT2BPETokenizer(
        gpt2_files[0], str(shorter)
    ).tokenize(text)


def test_bad_files_name_the_flag(tmp_path, gpt2_files):
    broken = tmp_path / "vocab.json"
    broken.write_text("[1, 2]", encoding="utf-8")
    with pytest.raises(ValueError, match="--vocab-file .* token -> integer id"):
        GPT2BPETokenizer(str(broken), gpt2_files[1])
    no_eot = tmp_path / "no_eot.json"
    no_eot.write_text('{"a": 0}', encoding="utf-8")
    with pytest.raises(ValueError, match="no '<\\|endoftext\\|>' token"):
        GPT2BPETokenizer(str(no_eot), gpt2_files[1])
    mismatched = tmp_path / "small.json"
    mismatched.write_text('{"<|endoftext|>": 0, "a": 1}', encoding="utf-8")
    with pytest.raises(ValueError, match="do not belong together"):
        GPT2BPETokenizer(str(mismatched), gpt2_files[1])
    bad_merges = tmp_path / "merges.txt"
    bad_merges.write_text("#version: 0.2\na b c\n", encoding="utf-8")
    with pytest.raises(ValueError, match="line 2: expected two space-separated tokens"):
        GPT2BPETokenizer(gpt2_files[0], str(bad_merges))
