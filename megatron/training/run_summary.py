"""The last line of a run: what it trained, how long it took, where its result is and where it started.

    run summary: trained 10 iterations (0 -> 10), 20,480 tokens in 0:00:12; started from scratch;
                 last checkpoint: ckpt/iter_0000010

(one line). "Started from" is what `load_checkpoint` loaded in this run (it calls
`record_loaded_checkpoint`), so a `--load` that held no checkpoint reads "started from scratch (--load
DIR holds no checkpoint)". The last checkpoint is the one `latest_checkpointed_iteration.txt` names once the
run is over, if this run wrote it.
"""

import os
import time

from megatron.training.checkpointing.layout import get_checkpoint_name, get_checkpoint_tracker_filename

_loaded = {}  # the checkpoint load_checkpoint read last in this process


def record_loaded_checkpoint(directory: str, iteration: int, consumed_samples: int, weights_only: bool) -> None:
    """Called by `load_checkpoint`: the checkpoint directory (iter_N or release) it read, the iteration and
    consumed samples the run continues from, and whether only the weights were taken (--finetune, release)."""
    _loaded.clear()
    _loaded.update(directory=directory, iteration=iteration, consumed_samples=consumed_samples,
                   weights_only=weights_only, time=time.time())


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def _started_from(args, start_time: float) -> str:
    if _loaded and _loaded["time"] >= start_time:
        if _loaded["weights_only"]:
            return f"started from the weights of {_loaded['directory']}"
        return f"started from checkpoint {_loaded['directory']} (iteration {_loaded['iteration']})"
    if args.load is not None:
        return f"started from scratch (--load {args.load} holds no checkpoint)"
    return "started from scratch"


def _last_checkpoint(args, start_time: float) -> str:
    if args.save is None:
        return "none (no --save)"
    tracker = get_checkpoint_tracker_filename(args.save)
    if not os.path.isfile(tracker) or os.path.getmtime(tracker) < start_time:
        return f"none saved by this run in {args.save}"
    with open(tracker) as stream:
        saved = stream.read().strip()
    release = saved == "release"
    return get_checkpoint_name(args.save, 0 if release else int(saved), release=release, return_base_dir=True)


def run_summary(args, start_time: float) -> str:
    """The summary line of the run that began at `start_time` (time.time()) with `args`."""
    first = _loaded["iteration"] if _loaded and _loaded["time"] >= start_time else 0
    first_samples = _loaded["consumed_samples"] if _loaded and _loaded["time"] >= start_time else 0
    last = getattr(args, "curr_iteration", None)
    last = first if last is None else last
    tokens = (args.consumed_train_samples - first_samples) * args.seq_length
    return (f"run summary: trained {last - first} iterations ({first} -> {last}), {tokens:,} tokens in "
            f"{_duration(time.time() - start_time)}; {_started_from(args, start_time)}; last checkpoint: "
            f"{_last_checkpoint(args, start_time)}")


def print_run_summary(args, start_time: float) -> None:
    """Prints the summary on global rank 0."""
    if getattr(args, "rank", 0) == 0:
        print(run_summary(args, start_time), flush=True)
