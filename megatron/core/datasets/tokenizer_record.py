"""Which tokenizer made a dataset: a sidecar `<prefix>.tokenizer` (JSON) next to `<prefix>.bin/.idx`.

    {"tokenizer_type": "GPT2BPETokenizer", "vocab_size": 8000,
     "vocabulary_files": {"vocab_file": "<sha256>", "merge_file": "<sha256>"}, "name": null}

tools/preprocess_data.py writes it; training compares it with its own tokenizer before the model is built
and refuses data whose ids come from another vocabulary (two tokenizers of 8000 ids each, a GPT-2 BPE and
a WordPiece, would otherwise train on each other's ids without an error). Datasets without the sidecar
(made by Megatron-LM, or before it existed) are accepted as they are.

Vocabulary files are recorded by role (the flag that names them: vocab_file, merge_file, tokenizer_model;
a Hugging Face directory's vocab.json, merges.txt, vocab.txt, tokenizer.model or tokenizer.json by theirs)
with the SHA-256 of their content. Two tokenizers share a vocabulary when the files of every role both have
are the same content (a moved or renamed copy is the same vocabulary; `GPT2BPETokenizer` with a `vocab.json`
and a Hugging Face directory holding that `vocab.json` agree), when both are the NullTokenizer of the same
size, or when both are the same Hugging Face hub id. When they have no role in common (a hub id against
local files), nothing can be told and the data is accepted.
"""

import hashlib
import json
import os

from megatron.core.atomic_write import write_atomically
from megatron.core.tokenizers.build import FILES_BY_TYPE

SUFFIX = ".tokenizer"
# The files of a Hugging Face tokenizer directory that define its ids, and their roles.
HF_VOCABULARY_FILES = {
    "tokenizer.json": "tokenizer_json", "vocab.json": "vocab_file", "merges.txt": "merge_file", "vocab.txt": "vocab_file",
    "tokenizer.model": "tokenizer_model", "spiece.model": "tokenizer_model",
}


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        while block := stream.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def tokenizer_fingerprint(args, vocab_size: int | None = None) -> dict:
    """The record of the tokenizer described by `args` (the tokenizer flags); `vocab_size` when known.

    Cheap: it hashes the vocabulary files (a few MB) and builds no tokenizer."""
    tokenizer_type = args.tokenizer_type
    paths, name = {}, None  # role -> path
    if tokenizer_type == "HuggingFaceTokenizer":
        model = args.tokenizer_model
        if os.path.isdir(model):
            paths = {role: os.path.join(model, file) for file, role in HF_VOCABULARY_FILES.items()}
        else:
            name = model
    else:
        paths = {attribute: getattr(args, attribute) for attribute in FILES_BY_TYPE.get(tokenizer_type, ())}
    if tokenizer_type == "NullTokenizer":
        vocab_size = args.vocab_size
    return {
        "tokenizer_type": tokenizer_type,
        "vocab_size": vocab_size,
        "vocabulary_files": {role: _sha256(path) for role, path in paths.items() if path and os.path.isfile(path)},
        "name": name,
    }


def record_path(prefix: str) -> str:
    return prefix + SUFFIX


def write_tokenizer_record(prefix: str, fingerprint: dict) -> None:
    """Writes the sidecar of the dataset `prefix` (crash-safe)."""
    text = json.dumps(fingerprint, indent=1, sort_keys=True) + "\n"
    write_atomically(record_path(prefix), lambda stream: stream.write(text.encode()))


def read_tokenizer_record(prefix: str) -> dict | None:
    """The sidecar of `prefix`, or None when there is none."""
    path = record_path(prefix)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as stream:
            record = json.load(stream)
    except ValueError as error:
        raise ValueError(f"{path}: not a readable tokenizer record ({error}); delete it to train on the dataset "
                         "without the tokenizer check") from None
    if not isinstance(record, dict) or "tokenizer_type" not in record:
        raise ValueError(f"{path}: not a tokenizer record (no 'tokenizer_type'); delete it to train on the dataset "
                         "without the tokenizer check")
    return record


def same_vocabulary(first: dict, second: dict) -> bool | None:
    """Whether two fingerprints name the same vocabulary (see the module docstring); None when unknown."""
    if "NullTokenizer" in (first["tokenizer_type"], second["tokenizer_type"]):
        return first["tokenizer_type"] == second["tokenizer_type"] and first["vocab_size"] == second["vocab_size"]
    files_a, files_b = first.get("vocabulary_files") or {}, second.get("vocabulary_files") or {}
    common = files_a.keys() & files_b.keys()
    if common:
        return all(files_a[role] == files_b[role] for role in common)
    if first.get("name") and second.get("name"):
        return first["name"] == second["name"]
    return None


def describe(fingerprint: dict) -> str:
    """'GPT2BPETokenizer (8000 ids; merge_file sha256 3f2a9c1d4e5f, vocab_file sha256 ...)', for messages."""
    details = [f"{fingerprint['vocab_size']} ids"] if fingerprint.get("vocab_size") is not None else []
    files = sorted((fingerprint.get("vocabulary_files") or {}).items())
    details += [f"{role} sha256 {digest[:12]}" for role, digest in files]
    if fingerprint.get("name"):
        details.append(f"hub id {fingerprint['name']}")
    return f"{fingerprint['tokenizer_type']}" + (f" ({'; '.join(details)})" if details else "")


def check_dataset_tokenizer(prefix: str, run_fingerprint: dict) -> None:
    """Raises ValueError when the sidecar of `prefix` records a tokenizer with another vocabulary."""
    record = read_tokenizer_record(prefix)
    if record is None or same_vocabulary(record, run_fingerprint) is not False:
        return
    raise ValueError(
        f"dataset {prefix} was tokenized with {describe(record)} (recorded in {record_path(prefix)}), but this run's "
        f"tokenizer is {describe(run_fingerprint)}: the token ids mean other words. Train with the tokenizer "
        "files the data was made with, or re-run tools/preprocess_data.py with this run's tokenizer"
    )
