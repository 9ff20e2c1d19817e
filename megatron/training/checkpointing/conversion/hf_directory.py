"""A Hugging Face model directory, as `from_pretrained` reads it:

    config.json, generation_config.json
    model.safetensors                       or, above the shard size,
    model-00001-of-0000N.safetensors ...    + model.safetensors.index.json {"metadata", "weight_map"}
    tokenizer files                         copied as the training run named them

Every file is written crash-safely (megatron/core/atomic_write.py) and config.json last, so a directory
with a config.json is complete. No pickle `.bin` files are written; reading accepts safetensors only.
"""

import json
import os
import shutil

import torch

from megatron.core.atomic_write import write_atomically

SAFETENSORS_INDEX = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3  # transformers' own default shard size (5 GB)


def _write_json(path: str, content: dict) -> None:
    write_atomically(path, lambda stream: stream.write((json.dumps(content, indent=2) + "\n").encode()))


def _shards(state: dict, max_shard_bytes: int) -> list[dict]:
    """Consecutive groups of tensors, each at most `max_shard_bytes` (a larger single tensor gets its own)."""
    shards, current, size = [], {}, 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = tensor
        size += nbytes
    return shards + [current] if current else shards


def write_safetensors(save_dir: str, state: dict, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> list[str]:
    """Writes `state` as one model.safetensors or as shards with an index; returns the file names."""
    from safetensors.torch import save

    shards = _shards(state, max_shard_bytes)
    if len(shards) == 1:
        names = [SINGLE_FILE]
    else:
        names = [f"model-{index:05d}-of-{len(shards):05d}.safetensors" for index in range(1, len(shards) + 1)]
    for name, shard in zip(names, shards):
        payload = save({key: tensor.contiguous() for key, tensor in shard.items()}, metadata={"format": "pt"})
        write_atomically(os.path.join(save_dir, name), lambda stream, payload=payload: stream.write(payload))
    if len(shards) > 1:
        total = sum(tensor.numel() * tensor.element_size() for tensor in state.values())
        weight_map = {key: name for name, shard in zip(names, shards) for key in shard}
        _write_json(os.path.join(save_dir, SAFETENSORS_INDEX), {"metadata": {"total_size": total},
                                                                "weight_map": weight_map})
    return names


def _copier(source: str):
    def copy(stream) -> None:
        with open(source, "rb") as original:
            shutil.copyfileobj(original, stream)

    return copy


def _is_tokenizer_file(name: str) -> bool:
    """The files of a Hugging Face tokenizer (not the model's config.json or weights in the same folder)."""
    return name.startswith(("tokenizer", "vocab", "special_tokens_map", "added_tokens")) or name in (
        "merges.txt", "chat_template.jinja")


def copy_tokenizer_files(save_dir: str, files: dict[str, str]) -> list[str]:
    """Copies {source path: name in save_dir} (a source directory: its tokenizer files under their own
    names); returns the names written."""
    copied = []
    for source, name in files.items():
        pairs = ([(os.path.join(source, entry), entry) for entry in sorted(os.listdir(source))
                  if _is_tokenizer_file(entry)] if os.path.isdir(source) else [(source, name)])
        for path, target in pairs:
            if os.path.isfile(path):
                write_atomically(os.path.join(save_dir, target), _copier(path))
                copied.append(target)
    return copied


def write_hf_directory(save_dir: str, state: dict, config: dict, tokenizer_files: dict[str, str] | None = None,
                       tokenizer_config: dict | None = None,
                       max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> None:
    """Writes a complete Hugging Face model directory (config.json last)."""
    os.makedirs(save_dir, exist_ok=True)
    write_safetensors(save_dir, state, max_shard_bytes)
    copy_tokenizer_files(save_dir, tokenizer_files or {})
    if tokenizer_config is not None:
        _write_json(os.path.join(save_dir, "tokenizer_config.json"), tokenizer_config)
    generation = {key: config[key] for key in ("bos_token_id", "eos_token_id") if config.get(key) is not None}
    _write_json(os.path.join(save_dir, "generation_config.json"), generation)
    _write_json(os.path.join(save_dir, "config.json"), config)


def read_hf_directory(load_dir: str) -> tuple[dict, dict]:
    """(state dict, config.json) of a Hugging Face model directory (safetensors, single or sharded)."""
    from safetensors.torch import load_file

    config_path = os.path.join(load_dir, "config.json")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"--load-dir {load_dir} has no config.json: point it at a Hugging Face model "
                                "directory (a Hub snapshot or a save_pretrained output)")
    with open(config_path) as stream:
        config = json.load(stream)
    index_path = os.path.join(load_dir, SAFETENSORS_INDEX)
    if os.path.isfile(index_path):
        with open(index_path) as stream:
            files = sorted(set(json.load(stream)["weight_map"].values()))
    elif os.path.isfile(os.path.join(load_dir, SINGLE_FILE)):
        files = [SINGLE_FILE]
    else:
        raise FileNotFoundError(f"--load-dir {load_dir} has no {SINGLE_FILE} nor {SAFETENSORS_INDEX}; pickle "
                                "pytorch_model.bin weights are not read (re-save them with safe_serialization)")
    state: dict[str, torch.Tensor] = {}
    for name in files:
        state.update(load_file(os.path.join(load_dir, name)))
    return state, config
