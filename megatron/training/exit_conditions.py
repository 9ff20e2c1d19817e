"""When to save and stop, checked after every iteration in Megatron-LM's order (`checkpoint_and_decide_exit`):

1. `--exit-signal-handler`: the signal (`--exit-signal`, SIGTERM by default) reached any rank -> save, exit;
2. `--save-interval`: save;
3. `--exit-duration-in-mins`: time since start (max over ranks) exceeded -> save unless just saved, exit;
4. `--exit-interval`: iteration is a multiple -> save unless just saved, exit.

Every decision is all-reduced, so all ranks take the same branch (a rank that exits alone would hang the
others in their next collective).
"""

import signal
import time

import torch
import torch.distributed as dist

from megatron.core.parallel_state import collective_device
from megatron.training.console import print_rank_0


class ExitConditions:
    """The decisions of the module docstring for one run; `device` holds the tensors of its collectives (the
    current GPU under NCCL, else the CPU)."""

    def __init__(self, args, start_time: float | None = None, device=None):
        self.args = args
        self.device = device if device is not None else collective_device()
        self.start_time = time.time() if start_time is None else start_time
        self.signal_received = False
        if args.exit_signal_handler:
            signal_number = args.exit_signal if isinstance(args.exit_signal, int) else getattr(signal, str(args.exit_signal))
            signal.signal(signal_number, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        self.signal_received = True

    def _any_rank(self, flag: bool) -> bool:
        value = torch.tensor([int(flag)], dtype=torch.int32, device=self.device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return bool(value.item())

    def checkpoint_and_decide_exit(self, iteration: int, save, before_exit=None) -> int | None:
        """Saves with `save()` when due; returns the exit code when training must stop, else None.
        `before_exit()`, when given, runs before the exit is announced (the deferred console line)."""
        announce = before_exit or (lambda: None)
        args = self.args
        if args.exit_signal_handler and self._any_rank(self.signal_received):
            if args.save:
                save()
            name = getattr(args.exit_signal, "name", args.exit_signal)  # SIGTERM, not its number
            announce()
            print_rank_0(f"exiting program after receiving signal {name} at iteration {iteration}")
            return 0

        saved = False
        if args.save and args.save_interval and iteration % args.save_interval == 0:
            save()
            saved = True

        if args.exit_duration_in_mins:
            minutes = torch.tensor([(time.time() - self.start_time) / 60.0], dtype=torch.float64, device=self.device)
            dist.all_reduce(minutes, op=dist.ReduceOp.MAX)
            if minutes.item() > args.exit_duration_in_mins:
                if args.save and not saved:
                    save()
                announce()
                print_rank_0(f"exiting program after {minutes.item():.1f} minutes at iteration {iteration}")
                return 0

        if args.exit_interval and iteration % args.exit_interval == 0:
            if args.save and not saved:
                save()
            announce()
            print_rank_0(f"exiting program at iteration {iteration}")
            return 0
        return None
