"""Index cache files: `{md5}-{Class}-{split}-{name}.npy` plus `...-description.txt`, as Megatron-LM names them.

A cache entry is complete only when every file exists. Each file is written to a temporary name in the
same directory, flushed to disk, then renamed into place (atomic on POSIX), and the description is
written last; a crash mid-write therefore leaves either no file or a complete one, never a truncated
array that a later run would load.
"""

import os

import numpy as np

from megatron.core.atomic_write import write_atomically


class IndexCache:
    """The cache files of one dataset: `directory/{base}-description.txt` and `{base}-{name}.npy`."""

    def __init__(self, directory: str, base: str, array_names: list[str]):
        self.directory = directory
        self.description_path = os.path.join(directory, f"{base}-description.txt")
        self.array_paths = {name: os.path.join(directory, f"{base}-{name}.npy") for name in array_names}

    def exists(self) -> bool:
        """True when every file of the entry is there (Megatron-LM's cache-hit rule)."""
        return all(os.path.isfile(path) for path in [self.description_path, *self.array_paths.values()])

    def load(self) -> dict[str, np.ndarray]:
        """The arrays, memory-mapped read-only."""
        return {name: np.load(path, allow_pickle=True, mmap_mode="r") for name, path in self.array_paths.items()}

    def save(self, arrays: dict[str, np.ndarray], description: str) -> None:
        """Writes every array, then the description, each atomically."""
        try:
            os.makedirs(self.directory, exist_ok=True)
            for name, path in self.array_paths.items():
                write_atomically(path, lambda stream, array=arrays[name]: np.save(stream, array, allow_pickle=True))
            write_atomically(self.description_path, lambda stream: stream.write(description.encode("utf-8")))
        except OSError as error:
            raise OSError(
                f"cannot write the dataset index cache in {self.directory}: {error}; give a writable "
                f"directory with --data-cache-path (path_to_cache)"
            ) from error
