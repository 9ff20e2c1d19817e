"""Checkpoint integrity manifests (Megatron-Core's `integrity.json`, `--verify-integrity`).

    save:  {"algorithm": "sha256", "files": {file name: SHA-256 hex digest}} of every file of the checkpoint
           directory, written by rank 0 once every rank has finished writing
    load:  rank 0 hashes the files again; a missing manifest, a missing file or a different digest stops the
           load on every rank, naming the files
"""

import hashlib
import json
import os

import torch.distributed as dist

INTEGRITY_FILENAME = "integrity.json"
_ALGORITHM = "sha256"
_CHUNK = 1 << 20


def _digest(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for chunk in iter(lambda: file.read(_CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def save_integrity_manifest(checkpoint_dir: str) -> None:
    """Writes the manifest of `checkpoint_dir` (call on one rank, after every rank has written)."""
    files = {name: _digest(os.path.join(checkpoint_dir, name)) for name in sorted(os.listdir(checkpoint_dir))
             if name != INTEGRITY_FILENAME and os.path.isfile(os.path.join(checkpoint_dir, name))}
    with open(os.path.join(checkpoint_dir, INTEGRITY_FILENAME), "w") as file:
        json.dump({"algorithm": _ALGORITHM, "files": files}, file, indent=2)


def integrity_problems(checkpoint_dir: str) -> list[str]:
    """What does not match the manifest of `checkpoint_dir` (one process)."""
    path = os.path.join(checkpoint_dir, INTEGRITY_FILENAME)
    if not os.path.isfile(path):
        return [f"{path} does not exist: the checkpoint was not saved with --verify-integrity"]
    with open(path) as file:
        manifest = json.load(file)
    if manifest.get("algorithm", _ALGORITHM) != _ALGORITHM:
        return [f"{path} uses the hash {manifest['algorithm']!r}; only {_ALGORITHM} is known"]
    problems = []
    for name, expected in manifest["files"].items():
        try:
            actual = _digest(os.path.join(checkpoint_dir, name))
        except OSError as error:
            problems.append(f"{name}: missing or unreadable ({error})")
            continue
        if actual != expected:
            problems.append(f"{name}: SHA-256 {actual[:16]}... differs from the manifest's {expected[:16]}...")
    return problems


def verify_integrity_manifest(checkpoint_dir: str) -> None:
    """Raises ValueError on every rank when the files of `checkpoint_dir` do not match its manifest (rank 0
    hashes them; collective when torch.distributed is initialised)."""
    distributed = dist.is_initialized() and dist.get_world_size() > 1
    problems = [integrity_problems(checkpoint_dir) if not distributed or dist.get_rank() == 0 else None]
    if distributed:
        dist.broadcast_object_list(problems, src=0)
    if problems[0]:
        raise ValueError(f"checkpoint {checkpoint_dir} failed its integrity check (--verify-integrity):\n  - "
                         + "\n  - ".join(problems[0]))
