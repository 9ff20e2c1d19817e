"""`python -m megatron <command>`; today: `doctor` (see megatron/doctor.py)."""

import sys

COMMANDS = {"doctor": "megatron.doctor"}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        print(f"usage: python -m megatron {{{','.join(COMMANDS)}}} [args]", file=sys.stderr)
        return 2
    import importlib

    return importlib.import_module(COMMANDS[argv[0]]).main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
