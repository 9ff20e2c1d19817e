"""Small vocabularies trained once per test session with the reference libraries themselves."""

import base64
import io
import json
import os

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from tests.unit_tests.tokenizers.mixed_text import mixed_documents, python_sources


@pytest.fixture(scope="session")
def documents() -> list[str]:
    return mixed_documents()


@pytest.fixture(scope="session")
def training_texts(documents) -> list[str]:
    return documents + [python_sources(400_000)]


@pytest.fixture(scope="session")
def gpt2_files(tmp_path_factory, training_texts) -> tuple[str, str]:
    """(vocab.json, merges.txt) of a 2000-token byte-level BPE, `<|endoftext|>` included."""
    directory = str(tmp_path_factory.mktemp("gpt2"))
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=2000, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(training_texts, trainer)
    tokenizer.model.save(directory)
    return os.path.join(directory, "vocab.json"), os.path.join(directory, "merges.txt")


def _train_wordpiece(directory: str, texts: list[str], lowercase: bool) -> str:
    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=lowercase)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    trainer = trainers.WordPieceTrainer(
        vocab_size=3000, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"], show_progress=False
    )
    tokenizer.train_from_iterator(texts, trainer)
    tokenizer.model.save(directory)
    return os.path.join(directory, "vocab.txt")


@pytest.fixture(scope="session")
def wordpiece_vocab_lower(tmp_path_factory, training_texts) -> str:
    return _train_wordpiece(str(tmp_path_factory.mktemp("wordpiece_lower")), training_texts, lowercase=True)


@pytest.fixture(scope="session")
def wordpiece_vocab_cased(tmp_path_factory, training_texts) -> str:
    return _train_wordpiece(str(tmp_path_factory.mktemp("wordpiece_cased")), training_texts, lowercase=False)


@pytest.fixture(scope="session")
def sentencepiece_model(tmp_path_factory, documents) -> str:
    """A 600-piece BPE SentencePiece model (unk 0, bos 1, eos 2, no pad)."""
    import sentencepiece

    path = str(tmp_path_factory.mktemp("sentencepiece") / "tokenizer.model")
    lines = [line for document in documents for line in document.splitlines() if line.strip()]
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=model, vocab_size=600, model_type="bpe",
        character_coverage=1.0, minloglevel=2,
    )
    with open(path, "wb") as file:
        file.write(model.getvalue())
    return path


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (OpenAI encoder.py)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1)
    )
    chars = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars)))


@pytest.fixture(scope="session")
def tiktoken_ranks(gpt2_files) -> dict[bytes, int]:
    """BPE ranks for tiktoken: the 256 bytes, then each GPT-2 merge result in merge order."""
    byte_of = {char: byte for byte, char in bytes_to_unicode().items()}
    ranks = {bytes([byte]): byte for byte in range(256)}
    with open(gpt2_files[1], encoding="utf-8") as file:
        for line in file.read().split("\n")[1:]:
            if line:
                left, right = line.split()
                token = bytes(byte_of[char] for char in left + right)
                ranks.setdefault(token, len(ranks))
    return ranks


@pytest.fixture(scope="session")
def tiktoken_file(tmp_path_factory, tiktoken_ranks) -> str:
    """Megatron's JSON rank file for `tiktoken_ranks`."""
    path = str(tmp_path_factory.mktemp("tiktoken") / "tokenizer.json")
    entries = [
        {"rank": rank, "token_bytes": base64.b64encode(token).decode("ascii"), "token_str": token.decode("utf-8", "replace")}
        for token, rank in sorted(tiktoken_ranks.items(), key=lambda item: item[1])
    ]
    with open(path, "w", encoding="utf-8") as file:
        json.dump(entries, file)
    return path
