"""`python -m megatron <command>`; today: `doctor` (see megatron/doctor.py)."""

import sys

COMMANDS = {"doctor": "megatron.doctor"}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        from megatron.training.errors import report_error

        what = f"unknown command {argv[0]!r}" if argv else "no command given"
        report_error(f"{what}; usage: python -m megatron {{{','.join(COMMANDS)}}} [args]")
        return 2
    import importlib

    return importlib.import_module(COMMANDS[argv[0]]).main(argv[1:])


if __name__ == "__main__":
    from megatron.training.errors import run_entry_point

    run_entry_point(main)
