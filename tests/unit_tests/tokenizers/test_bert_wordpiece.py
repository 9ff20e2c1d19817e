"""BertWordPieceTokenizer against transformers' pure-Python BERT tokenizer and hand-worked examples.

The reference is the slow `BertTokenizer`'s `BasicTokenizer` + `WordpieceTokenizer` (transformers' port
of Google's code, which Megatron-LM also copies), called directly: the `BertTokenizer.tokenize` layer
above them keeps "[CLS]"-like strings whole and lower-cases character by character, which Megatron does
not. transformers' port also applies NFC first, drops unassigned/private-use characters and cuts words
at 100 characters (Google: 200), so it is fed NFC text without Cn/Co characters and given the 200
limit; those differences are checked on hand-worked examples instead.
"""

import unicodedata

import pytest
from transformers import BertTokenizer

from megatron.core.tokenizers import BertWordPieceTokenizer
from megatron.core.tokenizers.bert_basic_splitter import BertBasicSplitter


def _reference(vocab_file: str, lower_case: bool):
    bert = BertTokenizer(vocab_file, do_lower_case=lower_case)
    bert.wordpiece_tokenizer.max_input_chars_per_word = 200

    def reference_ids(text: str) -> list[int]:
        words = bert.basic_tokenizer.tokenize(text)
        return bert.convert_tokens_to_ids([p for word in words for p in bert.wordpiece_tokenizer.tokenize(word)])

    return reference_ids


@pytest.fixture(scope="module", params=[True, False], ids=["lower", "cased"])
def pair(request, wordpiece_vocab_lower, wordpiece_vocab_cased):
    vocab_file = wordpiece_vocab_lower if request.param else wordpiece_vocab_cased
    return BertWordPieceTokenizer(vocab_file, lower_case=request.param), _reference(vocab_file, request.param)


def test_ids_equal_the_python_reference(pair, documents):
    ours, reference = pair
    for document in documents:
        document = unicodedata.normalize("NFC", document)
        assert ours.tokenize(document) == reference(document)
    greek = "ΟΔΟΣ ΣΑΣ Σ ΑΣ."
    assert ours.tokenize(greek) == reference(greek)
    assert ours.tokenize_batch(documents[:5]) == [ours.tokenize(document) for document in documents[:5]]


def test_code_points_equal_the_python_reference(pair):
    """Every 61st assigned code point, inside and around words (NFC-stable snippets only)."""
    ours, reference = pair
    snippets = []
    for code_point in range(0x21, 0x110000, 61):
        char = chr(code_point)
        if unicodedata.category(char) in ("Cn", "Co", "Cs"):
            continue
        snippet = f"A{char}b {char}{char} 1{char}\n"
        if unicodedata.normalize("NFC", snippet) == snippet:
            snippets.append(snippet)
    text = "".join(snippets)
    assert ours.tokenize(text) == reference(text)


def test_hand_worked_vocabulary(tmp_path):
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "un", "##aff", "##able", "hello",
                                ",", ".", "it", "'", "s", "##s"]) + "\n", encoding="utf-8")
    tokenizer = BertWordPieceTokenizer(str(vocab), lower_case=True, vocab_extra_ids=3)
    # Google's docstring example: "unaffable" -> un ##aff ##able; "HELLO" lower-cased; "xyz" has no cover.
    assert tokenizer.tokenize("Unaffable, HELLO. xyz it's") == [5, 6, 7, 9, 8, 10, 1, 11, 12, 13]
    assert tokenizer.detokenize([5, 6, 7, 9, 8, 10, 11, 12, 13]) == "unaffable, hello. it's"
    assert tokenizer.detokenize([8, 14]) == "hellos"
    # Megatron's additions: [BOS] = 15, [EOS] = 16, then the T5 sentinels.
    assert tokenizer.pad == 0
    assert (tokenizer.cls, tokenizer.sep, tokenizer.mask) == (2, 3, 4)
    assert (tokenizer.bos, tokenizer.eos, tokenizer.eod) == (15, 16, 16)
    assert tokenizer.additional_special_tokens == ["<extra_id_0>", "<extra_id_1>", "<extra_id_2>"]
    assert tokenizer.additional_special_tokens_ids == [17, 18, 19]
    assert tokenizer.vocab_size == 20
    assert tokenizer.inv_vocab[19] == "<extra_id_2>"
    # Added tokens are never produced from text: their brackets are punctuation.
    assert tokenizer.tokenize("[EOS] <extra_id_0>") == [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]
    assert dict(tokenizer.unique_identifiers) == {
        "class": "_BertWordPieceTokenizer", "tokenizer_path": [str(vocab)], "lower_case": "True",
        "vocab_extra_ids": "3",
    }


def test_existing_bos_eos_are_reused(tmp_path):
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\n[EOS]\n[BOS]\n", encoding="utf-8")
    tokenizer = BertWordPieceTokenizer(str(vocab), lower_case=False)
    assert (tokenizer.bos, tokenizer.eos, tokenizer.vocab_size) == (6, 5, 7)


def test_missing_special_tokens_are_named(tmp_path):
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("[PAD]\n[UNK]\nhello\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"lacks the BERT special tokens \[CLS\] \[SEP\] \[MASK\]"):
        BertWordPieceTokenizer(str(vocab))


@pytest.mark.parametrize(
    "lower_case, text, words",
    [
        # Megatron/Google apply no NFC: a decomposed accent stays a separate mark when cased ...
        (False, "cafe\u0301 x", ["cafe\u0301", "x"]),
        # ... and is stripped with the other marks when lower-casing.
        (True, "CAFE\u0301 Ça", ["cafe", "ca"]),
        # str.lower() gives the final sigma.
        (True, "ΟΔΟΣ ΣΑΣ", ["οδος", "σας"]),
        # Only Cc/Cf are removed: private-use and unassigned characters stay (transformers drops them).
        (False, "a\ue000b a\u0378b", ["a\ue000b", "a\u0378b"]),
        # Zero-width space (Cf) vanishes; no-break space (Zs) separates; CJK ideographs stand alone.
        (False, "zero\u200bwidth no\u00a0break 中文ok", ["zerowidth", "no", "break", "中", "文", "ok"]),
        # Punctuation, including non-ASCII and ASCII symbols that are not Unicode punctuation ($ ^ `).
        (False, "a$b^c`d«e»f…g", ["a", "$", "b", "^", "c", "`", "d", "«", "e", "»", "f", "…", "g"]),
        # NFD can create punctuation: U+1FEF (GREEK VARIA) decomposes to "`".
        (True, "x\u1fefy", ["x", "`", "y"]),
        (False, "[CLS] text", ["[", "CLS", "]", "text"]),
    ],
)
def test_basic_splitting_hand_worked(lower_case, text, words):
    assert BertBasicSplitter(lower_case).split(text) == words


def test_long_words(wordpiece_vocab_lower):
    tokenizer = BertWordPieceTokenizer(wordpiece_vocab_lower)
    unk = tokenizer.vocab["[UNK]"]
    assert unk not in tokenizer.tokenize("a" * 200)
    assert tokenizer.tokenize("a" * 201) == [unk]


def test_detokenize_rejects_unknown_ids(wordpiece_vocab_lower):
    tokenizer = BertWordPieceTokenizer(wordpiece_vocab_lower)
    with pytest.raises(ValueError, match="not in the vocabulary"):
        tokenizer.detokenize([tokenizer.vocab_size])
