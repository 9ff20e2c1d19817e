"""Megatron's named wall-clock timers, gathered over ranks for the log and TensorBoard.

    timers = Timers(log_level=1, log_option="minmax")
    timers("forward-backward", log_level=1).start(barrier=False)
    ...
    timers("forward-backward").stop()
    timers.log(["forward-backward"], normalizer=log_interval)

prints, on the last rank,

    (min, max) time across ranks (ms):
        forward-backward ...............................: (215.31, 216.02)

A timer asked for with a level above `log_level` is a no-op. On a GPU the clock reads wait for the
device (`torch.cuda.synchronize`), so a timer measures the work and not just its launch.
"""

import time
from contextlib import contextmanager
from typing import List, Optional

import torch
import torch.distributed as dist

from megatron.core.datasets.rank_logging import global_rank

LOG_OPTIONS = ("max", "minmax", "all")
MAX_LOG_LEVEL = 2


def _synchronize_device() -> None:
    # Only when CUDA is in use: a CPU run on a GPU machine must not create a CUDA context.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


class DummyTimer:
    """Stands in for a timer above the configured log level: start/stop do nothing."""

    name = "dummy timer"

    def start(self, barrier: bool = False, synchronize: bool = True) -> None:
        return None

    def stop(self, barrier: bool = False, synchronize: bool = True) -> None:
        return None

    def reset(self) -> None:
        return None

    def elapsed(self, reset: bool = True, barrier: bool = False, synchronize: bool = True) -> float:
        raise RuntimeError("a timer above --timing-log-level measures nothing: raise the level to read it")

    def active_time(self) -> float:
        raise RuntimeError("a timer above --timing-log-level measures nothing: raise the level to read it")


class Timer:
    """Accumulates wall-clock seconds between `start` and `stop` until `reset`."""

    def __init__(self, name: str):
        self.name = name
        self._elapsed = 0.0
        self._active_time = 0.0
        self._started = False
        self._barrier_group = None  # None: the default (world) group
        self._start_time = time.time()

    def set_barrier_group(self, barrier_group) -> None:
        """Group whose ranks `start(barrier=True)`/`stop(barrier=True)` wait for."""
        self._barrier_group = barrier_group

    def _barrier(self, barrier: bool) -> None:
        if barrier and dist.is_initialized():
            dist.barrier(group=self._barrier_group)

    def start(self, barrier: bool = False, synchronize: bool = True) -> None:
        """`synchronize=False`: read the clock without waiting for the device (the caller knows what has
        finished: an event it waited for)."""
        if self._started:
            raise RuntimeError(f"timer {self.name!r} has already been started")
        self._barrier(barrier)
        if synchronize:
            _synchronize_device()
        self._start_time = time.time()
        self._started = True

    def stop(self, barrier: bool = False, synchronize: bool = True) -> None:
        if not self._started:
            raise RuntimeError(f"timer {self.name!r} is not started")
        self._barrier(barrier)
        if synchronize:
            _synchronize_device()
        elapsed = time.time() - self._start_time
        self._elapsed += elapsed
        self._active_time += elapsed
        self._started = False

    def reset(self) -> None:
        """Clears the accumulated time (not `active_time`)."""
        self._elapsed = 0.0
        self._started = False

    def elapsed(self, reset: bool = True, barrier: bool = False, synchronize: bool = True) -> float:
        """Seconds accumulated so far (a running timer keeps running); `reset` clears them."""
        running = self._started
        if running:
            self.stop(barrier=barrier, synchronize=synchronize)
        elapsed = self._elapsed
        if reset:
            self.reset()
        if running:
            self.start(barrier=barrier, synchronize=synchronize)
        return elapsed

    def active_time(self) -> float:
        """Seconds this timer has run since it was created, resets included."""
        return self._active_time


@contextmanager
def timed(timers: Optional["Timers"], name: str, log_level: int = 1, barrier: bool = False):
    """Times the block with `timers(name, log_level)`; does nothing when `timers` is None."""
    if timers is None:
        yield
        return
    timers(name, log_level=log_level).start(barrier=barrier)
    yield
    timers(name).stop()


class Timers:
    """A set of named timers; `log_level` (0-2) enables those of that level or below."""

    def __init__(self, log_level: int, log_option: str):
        if log_option not in LOG_OPTIONS:
            raise ValueError(
                f"timing log option (--timing-log-option) {log_option!r} is not one of {', '.join(LOG_OPTIONS)}"
            )
        if not 0 <= log_level <= MAX_LOG_LEVEL:
            raise ValueError(f"timing log level (--timing-log-level) must be 0, 1 or 2, got {log_level}")
        self._log_level = log_level
        self._log_option = log_option
        self._timers = {}
        self._log_levels = {}
        self._dummy_timer = DummyTimer()

    def __call__(self, name: str, log_level: Optional[int] = None):
        """The timer `name`, created on first use with `log_level` (default 2)."""
        if name in self._timers:
            if log_level is not None and log_level != self._log_levels[name]:
                raise ValueError(
                    f"timer {name!r} was created with log level {self._log_levels[name]}, now asked with {log_level}"
                )
            return self._timers[name]
        if log_level is None:
            log_level = MAX_LOG_LEVEL
        if not 0 <= log_level <= MAX_LOG_LEVEL:
            raise ValueError(f"timer log level must be 0..{MAX_LOG_LEVEL}, got {log_level} for {name!r}")
        if log_level > self._log_level:
            return self._dummy_timer
        self._timers[name] = Timer(name)
        self._log_levels[name] = log_level
        return self._timers[name]

    def _elapsed_all_ranks(self, names: List[str], reset: bool, barrier: bool) -> torch.Tensor:
        """[world_size, len(names)] seconds; 0 where a rank has no such timer. Every rank must call this."""
        if barrier and dist.is_initialized():
            dist.barrier()
        world_size = dist.get_world_size() if dist.is_initialized() else 1
        on_gpu = dist.is_initialized() and dist.get_backend() == "nccl"
        device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else torch.device("cpu")
        local = torch.tensor(
            [self._timers[name].elapsed(reset=reset) if name in self._timers else 0.0 for name in names],
            dtype=torch.float,
            device=device,
        )
        if world_size == 1:
            return local.unsqueeze(0)
        gathered = [torch.empty_like(local) for _ in range(world_size)]
        dist.all_gather(gathered, local)
        return torch.stack(gathered)

    def _min_max_seconds(self, names: List[str], reset: bool, barrier: bool, normalizer: float) -> dict:
        """name -> (min, max) over the ranks that ran the timer, divided by `normalizer`."""
        times = self._elapsed_all_ranks(names, reset, barrier).t().tolist()
        result = {}
        for name, per_rank in zip(names, times):
            ran = [seconds for seconds in per_rank if seconds > 0.0]
            if ran:
                result[name] = (min(ran) / normalizer, max(ran) / normalizer)
        return result

    def get_all_timers_string(
        self, names: Optional[List[str]] = None, normalizer: float = 1.0, reset: bool = True, barrier: bool = False
    ) -> Optional[str]:
        """The report `log` prints (times in ms divided by `normalizer`), or None if nothing was timed."""
        if normalizer <= 0.0:
            raise ValueError(f"normalizer must be positive, got {normalizer}")
        names = list(self._timers) if names is None else list(names)
        if self._log_option == "all":
            times = self._elapsed_all_ranks(names, reset, barrier)
            lines = []
            for index, name in enumerate(names):
                ranks = [(rank, seconds) for rank, seconds in enumerate(times[:, index].tolist()) if seconds > 0]
                if ranks:
                    lines.append(f"  {name}:")
                    lines.extend(f"     rank {rank:2d}: {seconds * 1000.0 / normalizer:.2f}" for rank, seconds in ranks)
            return "times across ranks (ms):\n" + "\n".join(lines) if lines else None

        min_max = self._min_max_seconds(names, reset, barrier, normalizer / 1000.0)
        if not min_max:
            return None
        if self._log_option == "max":
            lines = [f"    {(name + ' ').ljust(48, '.')}: {high:.2f}" for name, (low, high) in min_max.items()]
            return "max time across ranks (ms):\n" + "\n".join(lines)
        lines = [f"    {(name + ' ').ljust(48, '.')}: ({low:.2f}, {high:.2f})" for name, (low, high) in min_max.items()]
        return "(min, max) time across ranks (ms):\n" + "\n".join(lines)

    def log(
        self,
        names: List[str],
        rank: Optional[int] = None,
        normalizer: float = 1.0,
        reset: bool = True,
        barrier: bool = False,
    ) -> None:
        """Prints the report on `rank` (default: the last rank); every rank must call it."""
        report = self.get_all_timers_string(names, normalizer, reset, barrier)
        if rank is None:
            rank = dist.get_world_size() - 1 if dist.is_initialized() else 0
        if report is not None and rank == global_rank():
            print(report, flush=True)

    def write(
        self,
        names: List[str],
        writer,
        iteration: int,
        normalizer: float = 1.0,
        reset: bool = True,
        barrier: bool = False,
    ) -> None:
        """Writes `<name>-time` (max over ranks, seconds / `normalizer`) to a TensorBoard or W&B writer."""
        if normalizer <= 0.0:
            raise ValueError(f"normalizer must be positive, got {normalizer}")
        min_max = self._min_max_seconds(names, reset, barrier, normalizer)
        if writer is None:
            return
        for name, (_, high) in min_max.items():
            if hasattr(writer, "add_scalar"):
                writer.add_scalar(name + "-time", high, iteration)
            else:
                writer.log({name + "-time": high}, iteration)
