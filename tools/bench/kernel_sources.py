"""Which Python lines launched the kernels of a trace: time and count per call stack.

    python tools/bench/kernel_sources.py TRACE.json.gz 'FillFunctor'          # kernels whose name matches
    python tools/bench/kernel_sources.py TRACE.json.gz 'aten::fill_' --cpu-ops  # CPU ops instead (CPU runs)

TRACE is a `torch.profiler` Chrome trace written with the Python call stacks, e.g. by
`pretrain_gpt.py --profile --use-pytorch-profiler --pytorch-profiler-collect-callstack`. A kernel is tied to
its launch (the CUDA runtime call with the same correlation id) and the launch to the Python functions whose
intervals contain it on the same thread; each distinct stack (innermost --depth frames of our code) gets the
kernels' total time and count. With --cpu-ops the pattern matches CPU op names, each op's own stack.
"""

import argparse
import bisect
import collections
import gzip
import json
import re

LAUNCH_CATEGORIES = ("cuda_runtime", "cuda_driver")
KERNEL_CATEGORIES = ("kernel", "gpu_memset", "gpu_memcpy")


def load_events(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as trace:
        return json.load(trace).get("traceEvents", [])


class _ThreadFrames:
    """The python_function events of one thread, nested: each frame's parent (the innermost frame containing
    it) is found once, so that the stack at a moment costs a binary search and a walk up, not a scan."""

    def __init__(self, frames: list[dict]):
        self.frames = sorted(frames, key=lambda event: (event["ts"], -event["dur"]))  # outer first at a tie
        self.starts = [frame["ts"] for frame in self.frames]
        self.parents, open_frames = [], []
        for index, frame in enumerate(self.frames):
            while open_frames and not self._contains(open_frames[-1], frame["ts"]):
                open_frames.pop()
            self.parents.append(open_frames[-1] if open_frames else None)
            open_frames.append(index)

    def _contains(self, index: int, timestamp: float) -> bool:
        frame = self.frames[index]
        return frame["ts"] <= timestamp <= frame["ts"] + frame["dur"]

    def stack_at(self, timestamp: float, depth: int) -> tuple:
        """The innermost `depth` frames containing `timestamp` (of the repository's code where it shows)."""
        index = bisect.bisect_right(self.starts, timestamp) - 1
        while index is not None and index >= 0 and not self._contains(index, timestamp):
            index = self.parents[index]
        enclosing = []
        while index is not None and index >= 0:
            enclosing.append(self.frames[index]["name"])
            index = self.parents[index]
        enclosing.reverse()
        ours = [name for name in enclosing if "megatron/" in name or "pretrain_" in name] or enclosing
        return tuple(ours[-depth:])


def _frames_by_thread(events: list[dict]) -> dict:
    """tid -> the thread's python_function events (`_ThreadFrames`)."""
    frames = collections.defaultdict(list)
    for event in events:
        if event.get("ph") == "X" and event.get("cat") == "python_function":
            frames[event["tid"]].append(event)
    return {thread: _ThreadFrames(events) for thread, events in frames.items()}


def kernel_sources(events: list[dict], pattern: str, depth: int = 4, cpu_ops: bool = False) -> list:
    """[(total us, count, stack)] of the matching kernels (or CPU ops), the largest first."""
    matcher = re.compile(pattern)
    frames = _frames_by_thread(events)
    if cpu_ops:
        anchors = [(event["tid"], event["ts"], event["dur"]) for event in events
                   if event.get("ph") == "X" and event.get("cat") == "cpu_op" and matcher.search(event["name"])]
    else:
        launches = {event["args"]["correlation"]: event for event in events
                    if event.get("cat") in LAUNCH_CATEGORIES and "correlation" in event.get("args", {})}
        anchors = []
        for event in events:
            if event.get("cat") in KERNEL_CATEGORIES and matcher.search(event.get("name", "")):
                launch = launches.get(event.get("args", {}).get("correlation"))
                if launch is not None:
                    anchors.append((launch["tid"], launch["ts"], event["dur"]))
    totals = collections.defaultdict(lambda: [0.0, 0])
    for thread, timestamp, duration in anchors:
        total = totals[frames[thread].stack_at(timestamp, depth) if thread in frames else ()]
        total[0] += duration
        total[1] += 1
    return sorted(((total, count, stack) for stack, (total, count) in totals.items()), reverse=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("trace", help="torch.profiler Chrome trace (.json or .json.gz), with call stacks")
    parser.add_argument("pattern", help="regular expression matched against kernel (or CPU op) names")
    parser.add_argument("--depth", type=int, default=4, help="innermost Python frames per stack")
    parser.add_argument("--cpu-ops", action="store_true", help="match CPU ops instead of kernels")
    parser.add_argument("--top", type=int, default=15, help="stacks printed")
    args = parser.parse_args()
    rows = kernel_sources(load_events(args.trace), args.pattern, args.depth, args.cpu_ops)
    if not rows:
        print(f"nothing matches {args.pattern!r} with a launch and a Python stack (was the trace written with "
              "--pytorch-profiler-collect-callstack?)")
    for total, count, stack in rows[:args.top]:
        frames = stack or ("(no Python frame)",)
        print(f"{total / 1e3:9.3f} ms {count:6d}x  " + "\n                        ".join(frames))


if __name__ == "__main__":
    main()
