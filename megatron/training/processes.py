"""A process told apart from a later one that reuses its pid: (pid, start time)."""


def process_start(pid: int) -> int | None:
    """The start time of process `pid` in clock ticks since boot (Linux /proc), or None (no such process, or
    no /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as stream:
            return int(stream.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None
