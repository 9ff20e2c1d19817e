"""Crash-safe file writes: a file only ever appears under its final name complete.

The content goes to a temporary file in the same directory, is flushed to disk, and is renamed over the
final name (`os.replace` is atomic within one file system); the directory entry is then flushed too, so a
later file (a checkpoint tracker, say) can never name this one before it exists. A crash mid-write leaves
at most a stray `.<name>.*.tmp`, never a truncated file under the real name.
"""

import os
import tempfile


def _file_mode_from_umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def write_atomically(path, write) -> None:
    """Runs `write(binary file object)` on a temporary file next to `path`, then renames it to `path`."""
    directory, basename = os.path.split(os.path.abspath(path))
    descriptor, temporary = tempfile.mkstemp(dir=directory, prefix=f".{basename}.", suffix=".tmp")
    try:
        with os.fdopen(descriptor, "wb") as stream:
            write(stream)
            stream.flush()
            os.fsync(stream.fileno())
        # mkstemp makes owner-only files; give the mode a plain open() would, so that the other users of
        # a shared checkpoint or cache directory can read them.
        os.chmod(temporary, _file_mode_from_umask())
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.remove(temporary)
        raise
    directory_descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(directory_descriptor)
    finally:
        os.close(directory_descriptor)
