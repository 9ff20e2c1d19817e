"""The SentencePiece family against the plain `sentencepiece` processor and Megatron's id layout."""

import sys

import pytest
import sentencepiece

from megatron.core.tokenizers import GPTSentencePieceTokenizer, Llama2Tokenizer, SentencePieceTokenizer


@pytest.fixture(scope="module")
def processor(sentencepiece_model):
    return sentencepiece.SentencePieceProcessor(model_file=sentencepiece_model)


def test_gpt_sentencepiece_is_the_plain_model(sentencepiece_model, processor, documents):
    tokenizer = GPTSentencePieceTokenizer(sentencepiece_model)
    assert [tokenizer.tokenize(d) for d in documents] == [processor.encode_as_ids(d) for d in documents]
    assert tokenizer.tokenize_batch(documents) == [processor.encode_as_ids(d) for d in documents]
    ids = tokenizer.tokenize(documents[1])
    assert tokenizer.detokenize(ids) == processor.decode_ids(ids)
    assert tokenizer.vocab_size == len(processor) == 600
    assert (tokenizer.bos, tokenizer.eos, tokenizer.eod) == (1, 2, 2)
    assert tokenizer.vocab["<unk>"] == 0 and tokenizer.inv_vocab[2] == "</s>"
    for name in ("pad", "cls", "sep", "mask", "additional_special_tokens_ids"):
        assert getattr(tokenizer, name, None) is None, name
    with pytest.raises(AttributeError, match="GPTSentencePieceTokenizer has no attribute 'pad'"):
        tokenizer.pad
    assert dict(tokenizer.unique_identifiers) == {
        "class": "_GPTSentencePieceTokenizer", "tokenizer_path": [sentencepiece_model], "vocab_extra_ids": "0",
    }


def test_llama2_prepends_bos(sentencepiece_model, processor, documents):
    tokenizer = Llama2Tokenizer(sentencepiece_model)
    text = documents[1]
    assert tokenizer.tokenize(text) == [1] + processor.encode_as_ids(text)
    assert tokenizer.tokenize(text, bos=False, eos=True) == processor.encode_as_ids(text) + [2]
    assert tokenizer.tokenize_batch(documents[:3]) == [[1] + processor.encode_as_ids(d) for d in documents[:3]]
    assert tokenizer.eod == 2
    assert tokenizer.unique_identifiers["class"] == "_Llama2Tokenizer"
    with pytest.raises(TypeError, match="takes a str"):
        tokenizer.tokenize([1, 2])


def test_sentencepiece_tokenizer_id_layout(sentencepiece_model):
    """Megatron appends <CLS> <SEP> <EOD> <MASK>, then <PAD> (the model has none), then the sentinels."""
    tokenizer = SentencePieceTokenizer(sentencepiece_model, vocab_extra_ids=2)
    n = 600
    assert (tokenizer.cls, tokenizer.sep, tokenizer.eod, tokenizer.mask, tokenizer.pad) == (n, n + 1, n + 2, n + 3, n + 4)
    assert (tokenizer.bos, tokenizer.eos) == (1, 2)  # the model's <s> and </s>
    assert tokenizer.additional_special_tokens_ids == [n + 5, n + 6]
    assert tokenizer.vocab_size == n + 7
    assert tokenizer.vocab["<extra_id_1>"] == n + 6 and tokenizer.inv_vocab[n + 4] == "<PAD>"
    assert dict(tokenizer.unique_identifiers) == {
        "class": "_SentencePieceTokenizer", "tokenizer_path": [sentencepiece_model], "vocab_extra_ids": "2",
    }


def test_sentencepiece_tokenizer_recognises_special_tokens_in_text(sentencepiece_model, processor):
    tokenizer = SentencePieceTokenizer(sentencepiece_model, vocab_extra_ids=1)
    n = 600
    text = "def f(x):<SEP>return x<extra_id_0> and </s>tail<EOD>"
    expected = (
        processor.encode_as_ids("def f(x):") + [n + 1] + processor.encode_as_ids("return x") + [n + 5]
        + processor.encode_as_ids(" and ") + [2] + processor.encode_as_ids("tail") + [n + 2]
    )
    assert tokenizer.tokenize(text) == expected
    assert tokenizer.tokenize_batch([text, "plain"]) == [expected, processor.encode_as_ids("plain")]
    # Megatron's detokenize writes each special token with a space on both sides.
    assert tokenizer.detokenize(processor.encode_as_ids("ab") + [n + 1] + processor.encode_as_ids("cd")) == (
        processor.decode_ids(processor.encode_as_ids("ab")) + " <SEP> " + "cd"
    )


def test_sentencepiece_tokenizer_without_specials_is_the_plain_model(sentencepiece_model, processor, documents):
    tokenizer = SentencePieceTokenizer(sentencepiece_model)
    for document in documents[:30]:
        assert tokenizer.tokenize(document) == processor.encode_as_ids(document)


def test_bad_model_file_and_missing_package(tmp_path, monkeypatch):
    not_a_model = tmp_path / "tokenizer.model"
    not_a_model.write_bytes(b"not a protobuf")
    with pytest.raises(ValueError, match="--tokenizer-model .* is not a SentencePiece model"):
        GPTSentencePieceTokenizer(str(not_a_model))
    monkeypatch.setitem(sys.modules, "sentencepiece", None)
    with pytest.raises(ImportError, match="Llama2Tokenizer needs the `sentencepiece` package.*pip install sentencepiece"):
        Llama2Tokenizer(str(not_a_model))
