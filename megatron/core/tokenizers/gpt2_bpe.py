"""GPT-2 byte-level BPE (`--tokenizer-type GPT2BPETokenizer`) from `vocab.json` + `merges.txt`.

The algorithm is OpenAI's `encoder.py` (which Megatron-LM copies as `gpt2_tokenization.py`):
1. pre-split the text with `GPT2_PATTERN` (the `regex` module, as the original);
2. map each piece's UTF-8 bytes to printable characters (`bytes_to_unicode`);
3. merge adjacent symbols greedily, always the pair with the lowest rank in `merges.txt`.
Step 3 runs in the Rust `tokenizers` BPE model, once per distinct piece: a `PieceCache` answers
repeated pieces with a dict lookup. Single-threaded on the Python standard library (10 MB, on the GPU
host's CPU) this gives 2.8 MB/s cold and 3.9 MB/s warm, against 1.5 MB/s for the whole `tokenizers`
pipeline (`encode_batch_fast` with its ByteLevel pre-tokenizer, parallelism off as in preprocessing
workers) and 1.0 / 1.6 MB/s for Megatron-LM's Python code.

No special tokens: the text "<|endoftext|>" inside a document is tokenized as ordinary text, as in
Megatron-LM; only `eod` is the id of `<|endoftext|>`.
"""

import itertools
import json

import regex
from tokenizers import Tokenizer, decoders, models

from megatron.core.tokenizers.megatron_tokenizer import DictVocabTokenizer
from megatron.core.tokenizers.piece_cache import PieceCache

END_OF_TEXT = "<|endoftext|>"
GPT2_PATTERN = regex.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> character map: printable Latin-1 bytes map to themselves, the other 68 bytes to
    chr(256), chr(257), ... in byte order, so that every byte string becomes visible, space-free text."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [byte for byte in range(256) if byte not in printable]
    return {**{byte: chr(byte) for byte in printable}, **{byte: chr(256 + i) for i, byte in enumerate(others)}}


# For `str.translate` on a piece's UTF-8 bytes decoded as Latin-1 (one character per byte).
_BYTE_LEVEL_TABLE = bytes_to_unicode()


def read_vocab_json(vocab_file: str) -> dict[str, int]:
    """`vocab.json`: one JSON object mapping each byte-level token to its id."""
    try:
        with open(vocab_file, encoding="utf-8") as file:
            vocab = json.load(file)
    except (OSError, ValueError) as error:
        raise ValueError(f"--vocab-file {vocab_file!r} is not a readable GPT-2 vocab.json: {error}") from error
    if not isinstance(vocab, dict) or not all(isinstance(i, int) for i in vocab.values()):
        raise ValueError(f"--vocab-file {vocab_file!r} must hold one JSON object of token -> integer id")
    return vocab


def read_merges_txt(merge_file: str) -> list[tuple[str, str]]:
    """`merges.txt`: a `#version` header line, then one `left right` pair per line, by rank.

    Megatron-LM (and `transformers`) keep `read().split("\\n")[1:-1]`: the first line is taken to be the
    header and the last line to be the empty string after the final newline, whatever they hold. We do
    the same so that a file without a header or a final newline gives Megatron's ids, not different ones.
    """
    try:
        with open(merge_file, encoding="utf-8") as file:
            lines = file.read().split("\n")[1:-1]
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"--merge-file {merge_file!r} is not a readable merges.txt: {error}") from error
    merges = []
    for line_number, line in enumerate(lines, start=2):
        parts = line.split()
        if not parts:
            continue
        if len(parts) != 2:
            raise ValueError(
                f"--merge-file {merge_file!r} line {line_number}: expected two space-separated tokens, "
                f"got {line!r}"
            )
        merges.append((parts[0], parts[1]))
    return merges


class GPT2BPETokenizer(DictVocabTokenizer):
    """GPT-2 byte-level BPE; ids identical to OpenAI's and Megatron-LM's Python implementation."""

    megatron_class_name = "_GPT2BPETokenizer"

    def __init__(self, vocab_file: str, merge_file: str):
        super().__init__(vocab_file, merge_file)
        self._vocab = read_vocab_json(vocab_file)
        if END_OF_TEXT not in self._vocab:
            raise ValueError(
                f"--vocab-file {vocab_file!r} has no {END_OF_TEXT!r} token, which GPT2BPETokenizer uses as "
                "the end-of-document id"
            )
        try:
            model = models.BPE(self._vocab, read_merges_txt(merge_file))
        except Exception as error:  # the Rust binding raises a bare Exception for a merge of unknown tokens
            raise ValueError(
                f"--vocab-file {vocab_file!r} and --merge-file {merge_file!r} do not belong together: {error}"
            ) from error
        # No pre-tokenizer: the input of `_bpe` is always one byte-level piece.
        self._bpe = Tokenizer(model)
        self._bpe.decoder = decoders.ByteLevel()
        self._pieces = PieceCache(self._encode_piece)
        self._inv_vocab = {token_id: token for token, token_id in self._vocab.items()}
        self._eod_id = self._vocab[END_OF_TEXT]

    def _encode_piece(self, piece: str) -> tuple[int, ...]:
        byte_level = piece.encode("utf-8").decode("latin-1").translate(_BYTE_LEVEL_TABLE)
        return tuple(self._bpe.encode(byte_level, add_special_tokens=False).ids)

    def tokenize(self, text: str) -> list[int]:
        return list(itertools.chain.from_iterable(map(self._pieces.__getitem__, GPT2_PATTERN.findall(text))))

    def detokenize(self, ids) -> str:
        """Concatenates the tokens' bytes and decodes them as UTF-8, invalid bytes becoming U+FFFD."""
        ids = [int(token_id) for token_id in ids]
        unknown = [token_id for token_id in ids if token_id not in self._inv_vocab]
        if unknown:
            raise ValueError(f"GPT2BPETokenizer: ids {unknown[:5]} are outside the vocabulary of {self.vocab_size}")
        return self._bpe.decode(ids, skip_special_tokens=False)

    # Megatron-LM builds GPT2BPETokenizer as Hugging Face's GPT-2 tokenizer, whose one special token
    # `<|endoftext|>` is also its unknown token: these three follow it.
    def tokens_to_ids(self, tokens: list[str]) -> list[int]:
        return [self._vocab.get(token, self._eod_id) for token in tokens]

    def text_to_ids(self, text: str) -> list[int]:
        ids = []
        for index, piece in enumerate(text.split(END_OF_TEXT)):
            ids += ([self._eod_id] if index else []) + self.tokenize(piece)
        return ids

    def ids_to_text(self, ids, remove_special_tokens: bool = False) -> str:
        return self.detokenize([i for i in ids if not (remove_special_tokens and int(i) == self._eod_id)])

    @property
    def eod(self) -> int:
        return self._eod_id

    @property
    def eos(self) -> int:
        return self._eod_id
