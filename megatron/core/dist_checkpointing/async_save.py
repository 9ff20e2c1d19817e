"""Background checkpoint writes (`--async-save`).

`save(..., async_sharded_save=True)` copies the tensors to be written (so that training may change the
live ones) and hands the writing to a thread; the collectives DCP needs while writing run over a
gloo group of their own, so they never interleave with training's. Whoever started the save calls
`finalize()` on every rank before the next save and before exiting: it waits for the thread, raises
the writer's error if there was one, then runs the finalize callbacks (the training loop's makes the
checkpoint "latest"). A process that dies first leaves the checkpoint unfinalised, never "latest".
"""

import threading
from typing import Callable, List


class AsyncSaveRequest:
    """A checkpoint being written by a background thread running `write`."""

    def __init__(self, write: Callable[[], None]):
        self._write = write
        self._error = None
        self._finalize_fns: List[Callable[[], None]] = []
        # A daemon: an exit that skips finalize() abandons the write instead of hanging on it.
        self._thread = threading.Thread(target=self._run, name="async-checkpoint-save", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._write()
        except BaseException as error:  # re-raised on the training thread by finalize()
            self._error = error

    def add_finalize_fn(self, fn: Callable[[], None]) -> None:
        """Runs `fn` in `finalize()`, after the write has succeeded."""
        self._finalize_fns.append(fn)

    def is_done(self) -> bool:
        """True once the thread has finished writing (or failed)."""
        return not self._thread.is_alive()

    def finalize(self) -> None:
        """Waits for the write, raises its error, then runs the finalize callbacks in order."""
        self._thread.join()
        if self._error is not None:
            raise RuntimeError(f"the background checkpoint save failed: {self._error}") from self._error
        for fn in self._finalize_fns:
            fn()
