"""HuggingFaceTokenizer on a Llama-style tokenizer directory saved in the test (BOS added per text)."""

import pytest
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

from megatron.core.tokenizers import HuggingFaceTokenizer
from megatron.core.tokenizers.gpt2_bpe import read_merges_txt, read_vocab_json


@pytest.fixture(scope="module")
def plain(gpt2_files) -> Tokenizer:
    """The byte-level BPE without any special-token handling: the ids a document's text should get."""
    tokenizer = Tokenizer(models.BPE.from_file(*gpt2_files))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory, gpt2_files) -> str:
    """`save_pretrained` output of a fast tokenizer with BOS `<s>` (id 2000) and EOS `<|endoftext|>` (id 0)."""
    tokenizer = Tokenizer(models.BPE(read_vocab_json(gpt2_files[0]), read_merges_txt(gpt2_files[1])))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<s>"])
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 2000)])
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="<|endoftext|>")
    directory = str(tmp_path_factory.mktemp("hf_tokenizer"))
    fast.save_pretrained(directory)
    return directory


def test_ids_with_and_without_special_tokens(tokenizer_dir, plain, documents):
    with_bos = HuggingFaceTokenizer(tokenizer_dir)
    without = HuggingFaceTokenizer(tokenizer_dir, include_special_tokens=False)
    for document in documents[:40]:
        ids = plain.encode(document).ids
        assert with_bos.tokenize(document) == [2000] + ids
        assert without.tokenize(document) == ids
    assert with_bos.tokenize_batch(documents[:5]) == [[2000] + plain.encode(d).ids for d in documents[:5]]
    assert without.tokenize_batch(documents[:5]) == [plain.encode(d).ids for d in documents[:5]]


def test_special_tokens_and_vocab(tokenizer_dir):
    tokenizer = HuggingFaceTokenizer(tokenizer_dir)
    assert tokenizer.vocab_size == 2001
    assert (tokenizer.eod, tokenizer.eos, tokenizer.bos) == (0, 0, 2000)
    assert tokenizer.vocab["<s>"] == 2000 and tokenizer.inv_vocab[0] == "<|endoftext|>"
    with pytest.raises(AttributeError, match="HuggingFaceTokenizer has no attribute 'pad'.*defines no pad_token_id"):
        tokenizer.pad
    assert tokenizer.detokenize(tokenizer.tokenize("round trip")) == "<s>round trip"
    assert dict(tokenizer.unique_identifiers) == {"class": "_HuggingFaceTokenizer", "tokenizer_path": [tokenizer_dir]}


def test_tokenizer_special_tokens_get_ids_after_the_vocabulary(tokenizer_dir):
    """--tokenizer-special-tokens: each new token is one id after the vocabulary, never split by the BPE."""
    tokenizer = HuggingFaceTokenizer(tokenizer_dir, include_special_tokens=False,
                                     additional_special_tokens=["<tool>", "<s>"])
    assert tokenizer.vocab_size == 2002 and tokenizer.vocab["<tool>"] == 2001 and tokenizer.vocab["<s>"] == 2000
    assert tokenizer.tokenize("<tool>")[-1:] == [2001] and len(tokenizer.tokenize("<tool>")) == 1


def test_bad_locations_explain_what_is_expected(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="is not a directory; expected a local directory holding the tokenizer files"):
        HuggingFaceTokenizer(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="could not load a tokenizer from this directory"):
        HuggingFaceTokenizer(str(tmp_path))

    def unreachable_hub(*args, **kwargs):
        raise OSError("We couldn't connect to 'https://huggingface.co' to load the files")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", unreachable_hub)
    with pytest.raises(ValueError, match="is not a local directory, and loading it as a Hugging Face Hub id failed"):
        HuggingFaceTokenizer("some-org/some-tokenizer")


def test_text_tokenizer_methods(tokenizer_dir, plain):
    """tokens_to_ids, text_to_ids, ids_to_text (what the FIM dataset uses), as Megatron-LM's: the special tokens
    kept or dropped, a special-token string in the text read as that token."""
    tokenizer = HuggingFaceTokenizer(tokenizer_dir, include_special_tokens=False)
    assert tokenizer.tokens_to_ids(["<s>", "<|endoftext|>"]) == [2000, 0]
    ids = tokenizer.text_to_ids("a b<s>c")
    assert ids == plain.encode("a b").ids + [2000] + plain.encode("c").ids
    assert tokenizer.ids_to_text(ids) == "a b<s>c" and tokenizer.ids_to_text(ids, remove_special_tokens=True) == "a bc"
    assert HuggingFaceTokenizer(tokenizer_dir).text_to_ids("c") == [2000] + plain.encode("c").ids
