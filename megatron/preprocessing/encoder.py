"""What one preprocessing worker does with one `Task`: parse, check, split, tokenize.

Every problem with a line becomes a `BadLine` record returned to the parent (never an exception out of a
worker): malformed JSON, a value that is not an object, a missing key, a value that is not text, bytes that
are not UTF-8, a tokenizer failure. A line with a problem is dropped for every key, so the outputs of
several `--json-keys` stay aligned document by document. A line whose every key tokenizes to nothing is
dropped as empty (Megatron would write a zero-length document).
"""

import json
import os
import signal
from dataclasses import dataclass, field

import numpy as np


@dataclass
class EncoderConfig:
    tokenizer_args: object  # the argparse Namespace `build_tokenizer` takes
    json_keys: list[str]
    append_eod: bool
    dtype: np.dtype
    split_sentences: bool = False
    keep_newlines: bool = False
    lang: str = "english"


@dataclass
class KeyOutput:
    """Encoded documents of one key: all tokens, per-sequence lengths, sequences per document."""

    tokens: np.ndarray
    sequence_lengths: np.ndarray
    sequences_per_document: np.ndarray


@dataclass
class TaskResult:
    lines: int = 0  # lines in the task, blank ones included (for absolute line numbers)
    text_bytes: int = 0
    documents: int = 0
    tokens: int = 0
    blank_lines: int = 0
    bad_lines: list = field(default_factory=list)  # (line index within the task, kind, detail)
    outputs: dict = field(default_factory=dict)  # key -> KeyOutput


_state = {}


def init_worker(config: EncoderConfig) -> None:
    """Pool initializer: one tokenizer (and sentence splitter) per worker process.

    Workers ignore SIGINT: Ctrl-C reaches the whole process group, and a worker that died of it would lose
    its task's result, so the parent's pool.join() would wait for it for ever. The parent alone stops, and
    its workers finish their tasks in flight and exit."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Each worker is one core; a tokenizer backed by the Rust `tokenizers` library (HuggingFaceTokenizer)
    # must not start a thread pool of its own in every worker.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    os.environ["RAYON_NUM_THREADS"] = "1"
    from megatron.core.tokenizers import build_tokenizer

    _state["config"] = config
    _state["tokenizer"] = build_tokenizer(config.tokenizer_args)
    if config.split_sentences:
        from .sentences import build_sentence_splitter

        _state["split"] = build_sentence_splitter(config.lang, config.keep_newlines)


def _parse(raw: bytes, keys: list[str]):
    """-> (texts by key, each a list of str pieces) or (None, kind, detail)."""
    try:
        # utf-8-sig drops a byte order mark, which editors put at the start of a file and JSON does not allow.
        line = raw.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        return None, "invalid UTF-8", f"byte {error.start}: {raw[error.start:error.start + 4]!r}"
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        return None, "malformed JSON", f"{error.msg} at column {error.colno}"
    if not isinstance(record, dict):
        return None, "not a JSON object", f"found {type(record).__name__}"
    texts = {}
    for key in keys:
        if key not in record:
            return None, "missing key", f"no {key!r} (keys: {sorted(record)[:8]})"
        value = record[key]
        # A list of strings is taken as a document already split into sentences.
        if isinstance(value, str):
            texts[key] = [value]
        elif isinstance(value, list) and all(isinstance(v, str) for v in value):
            texts[key] = value
        else:
            return None, "not text", f"{key!r} is {type(value).__name__}, expected a string"
    return texts, None, None


def encode_task(task) -> TaskResult:
    config: EncoderConfig = _state["config"]
    tokenizer = _state["tokenizer"]
    split = _state.get("split")
    data = task.read()
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    result = TaskResult(lines=len(lines), text_bytes=len(data))

    # Pass 1: parse every line; gather the pieces to tokenize for each key.
    documents = []  # (line index, {key: [piece, ...]})
    for index, raw in enumerate(lines):
        if not raw.strip():
            result.blank_lines += 1
            continue
        texts, kind, detail = _parse(raw, config.json_keys)
        if texts is None:
            result.bad_lines.append((index, kind, detail))
            continue
        if split is not None:
            texts = {key: [s for piece in pieces for s in split(piece)] for key, pieces in texts.items()}
        documents.append((index, texts))

    # Pass 2: tokenize each key's pieces in one call (back ends with a batch API use it).
    ids_by_key = {}
    for key in config.json_keys:
        pieces = [piece for _, texts in documents for piece in texts[key]]
        try:
            ids_by_key[key] = tokenizer.tokenize_batch(pieces)
        except Exception:
            ids_by_key[key] = None  # find the failing line(s) one by one below
    if any(ids is None for ids in ids_by_key.values()):
        documents, ids_by_key = _tokenize_one_by_one(documents, tokenizer, config.json_keys, result)

    _assemble(documents, ids_by_key, config, tokenizer, result)
    return result


def _tokenize_one_by_one(documents, tokenizer, keys, result):
    kept, ids_by_key = [], {key: [] for key in keys}
    for index, texts in documents:
        try:
            encoded = {key: [tokenizer.tokenize(piece) for piece in texts[key]] for key in keys}
        except Exception as error:
            result.bad_lines.append((index, "tokenizer error", f"{type(error).__name__}: {error}"))
            continue
        kept.append((index, texts))
        for key in keys:
            ids_by_key[key].extend(encoded[key])
    return kept, ids_by_key


def _assemble(documents, ids_by_key, config, tokenizer, result) -> None:
    """Drops empty sentences and empty documents, appends EOD, packs each key into flat arrays."""
    eod = tokenizer.eod if config.append_eod else None
    cursor = {key: 0 for key in config.json_keys}
    per_key = {key: ([], [], []) for key in config.json_keys}  # token arrays, lengths, sequence counts
    for index, texts in documents:
        encoded = {}
        for key in config.json_keys:
            start = cursor[key]
            cursor[key] += len(texts[key])
            encoded[key] = [ids for ids in ids_by_key[key][start : cursor[key]] if len(ids) > 0]
        if not any(encoded.values()):
            result.bad_lines.append((index, "empty document", "no tokens in " + ", ".join(config.json_keys)))
            continue
        result.documents += 1
        for key, sentences in encoded.items():
            tokens, lengths, counts = per_key[key]
            lengths_here = [len(ids) for ids in sentences]
            if eod is not None and sentences:
                sentences = sentences[:-1] + [list(sentences[-1]) + [eod]]
                lengths_here[-1] += 1
            for ids in sentences:
                tokens.append(np.asarray(ids, dtype=config.dtype))
            lengths.extend(lengths_here)
            counts.append(len(sentences))
            result.tokens += sum(lengths_here)
    for key, (tokens, lengths, counts) in per_key.items():
        result.outputs[key] = KeyOutput(
            tokens=np.concatenate(tokens) if tokens else np.empty(0, config.dtype),
            sequence_lengths=np.asarray(lengths, dtype=np.int32),
            sequences_per_document=np.asarray(counts, dtype=np.int64),
        )
