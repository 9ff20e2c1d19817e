"""Tokenizers on a SentencePiece `.model` file (`--tokenizer-model`), as Megatron-LM's legacy classes.

- `SentencePieceTokenizer`: adds `<CLS> <SEP> <EOD> <MASK>`, the model's pad/bos/eos pieces (or `<PAD>`,
  `<BOS>`, `<EOS>` when the model has none) and `--vocab-extra-ids` sentinels, and recognises all of
  these special tokens when they appear literally in the text (NeMo's algorithm); `eod` = `<EOD>`.
- `GPTSentencePieceTokenizer`: the plain model; `eod` = the model's eos.
- `Llama2Tokenizer`: the plain model, with `tokenize(text, bos=True, eos=False)`.
The `sentencepiece` package is imported only when one of them is built.
"""

from megatron.core.tokenizers.megatron_tokenizer import DictVocabTokenizer
from megatron.core.tokenizers.optional_import import import_optional


class _SentencePieceModel(DictVocabTokenizer):
    """Loads the model and exposes its pieces as the vocabulary."""

    def __init__(self, model_file: str, **options):
        super().__init__(model_file, **options)
        sentencepiece = import_optional("sentencepiece", type(self).__name__)
        try:
            self._model = sentencepiece.SentencePieceProcessor(model_file=model_file)
        except (OSError, RuntimeError) as error:
            raise ValueError(f"--tokenizer-model {model_file!r} is not a SentencePiece model: {error}") from error
        self._inv_vocab = {i: self._model.id_to_piece(i) for i in range(len(self._model))}
        self._vocab = {piece: i for i, piece in self._inv_vocab.items()}

    def _model_special(self, name: str, token_id: int) -> int:
        """An id the model defines (pad/bos/eos are -1 in a model trained without them)."""
        if token_id < 0:
            self._missing(name, " (the SentencePiece model defines none)")
        return token_id


class SentencePieceTokenizer(_SentencePieceModel):
    """SentencePiece with Megatron's special tokens appended to the vocabulary (BERT/T5 style)."""

    megatron_class_name = "_SentencePieceTokenizer"

    def __init__(self, model_file: str, vocab_extra_ids: int = 0):
        super().__init__(model_file, vocab_extra_ids=vocab_extra_ids)
        if vocab_extra_ids < 0:
            raise ValueError(f"--vocab-extra-ids must be >= 0, got {vocab_extra_ids}")
        # Insertion order matters: `tokenize` breaks ties between specials found at the same position by it.
        self._special_tokens: dict[str, int] = {}
        self._cls_id = self._add_special_token("<CLS>")
        self._sep_id = self._add_special_token("<SEP>")
        self._eod_id = self._add_special_token("<EOD>")
        self._mask_id = self._add_special_token("<MASK>")
        self._pad_id = self._add_special_token(self._piece_or(self._model.pad_id(), "<PAD>"))
        self._bos_id = self._add_special_token(self._piece_or(self._model.bos_id(), "<BOS>"))
        self._eos_id = self._add_special_token(self._piece_or(self._model.eos_id(), "<EOS>"))
        self._sentinels = [f"<extra_id_{i}>" for i in range(vocab_extra_ids)]
        for token in self._sentinels:
            self._add_special_token(token)
        self._inv_special_tokens = {token_id: token for token, token_id in self._special_tokens.items()}

    def _piece_or(self, token_id: int, fallback: str) -> str:
        return self._model.id_to_piece(token_id) if 0 <= token_id < len(self._model) else fallback

    def _add_special_token(self, token: str) -> int:
        if token not in self._vocab:
            self._inv_vocab[len(self._vocab)] = token
            self._vocab[token] = len(self._vocab)
        self._special_tokens[token] = self._vocab[token]
        return self._vocab[token]

    def tokenize(self, text: str) -> list[int]:
        """Encodes the text between special tokens with the model; each special token is one id.

        Repeatedly finds the earliest occurrence of any special token (the first registered wins a tie).
        """
        ids, start = [], 0
        while True:
            found = {}
            for token in self._special_tokens:
                position = text.find(token, start)
                if position >= 0:
                    found[token] = position
            if not found:
                break
            token = min(found, key=found.get)
            ids.extend(self._model.encode_as_ids(text[start : found[token]]))
            ids.append(self._special_tokens[token])
            start = found[token] + len(token)
        ids.extend(self._model.encode_as_ids(text[start:]))
        return ids

    def detokenize(self, ids) -> str:
        """Decodes the runs between special tokens; a special token is written with a space on each side."""
        ids = [int(token_id) for token_id in ids]
        text, run_start = "", 0
        for index, token_id in enumerate(ids):
            if token_id in self._inv_special_tokens:
                text += self._model.decode_ids(ids[run_start:index]) + " "
                text += self._inv_special_tokens[token_id] + " "
                run_start = index + 1
        return text + self._model.decode_ids(ids[run_start:])

    @property
    def cls(self) -> int:
        return self._cls_id

    @property
    def sep(self) -> int:
        return self._sep_id

    @property
    def pad(self) -> int:
        return self._pad_id

    @property
    def bos(self) -> int:
        return self._bos_id

    @property
    def eod(self) -> int:
        return self._eod_id

    @property
    def eos(self) -> int:
        return self._eos_id

    @property
    def mask(self) -> int:
        return self._mask_id

    @property
    def additional_special_tokens_ids(self) -> list[int]:
        return [self._vocab[token] for token in self._sentinels]


class GPTSentencePieceTokenizer(_SentencePieceModel):
    """The SentencePiece model as it is; end of document = the model's eos."""

    megatron_class_name = "_GPTSentencePieceTokenizer"

    def __init__(self, model_file: str):
        super().__init__(model_file, vocab_extra_ids=0)

    def tokenize(self, text: str) -> list[int]:
        return self._model.encode_as_ids(text)

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        return self._model.encode_as_ids(list(texts))

    def detokenize(self, ids) -> str:
        return self._model.decode_ids([int(token_id) for token_id in ids])

    @property
    def pad(self) -> int:
        return self._model_special("pad", self._model.pad_id())

    @property
    def bos(self) -> int:
        return self._model_special("bos", self._model.bos_id())

    @property
    def eos(self) -> int:
        return self._model_special("eos", self._model.eos_id())

    @property
    def eod(self) -> int:
        return self._model_special("eod", self._model.eos_id())


class Llama2Tokenizer(GPTSentencePieceTokenizer):
    """Llama-2's SentencePiece model; `tokenize` prepends BOS by default (text completion)."""

    megatron_class_name = "_Llama2Tokenizer"

    def tokenize(self, text: str, bos: bool = True, eos: bool = False) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"Llama2Tokenizer.tokenize takes a str, got {type(text).__name__}")
        return self._with_bos_eos(self._model.encode_as_ids(text), bos, eos)

    def tokenize_batch(self, texts: list[str], bos: bool = True, eos: bool = False) -> list[list[int]]:
        return [self._with_bos_eos(ids, bos, eos) for ids in self._model.encode_as_ids(list(texts))]

    def _with_bos_eos(self, ids: list[int], bos: bool, eos: bool) -> list[int]:
        return ([self.bos] if bos else []) + ids + ([self.eos] if eos else [])
