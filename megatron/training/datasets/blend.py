"""Which datasets to blend, from `--data-path`/`--data-args-path` or the per-split flags (Megatron's
`get_blend_and_blend_per_split`)."""

import json

from megatron.core.datasets.blend import get_blend_from_list


def _read_list(path: str, flag: str) -> list[str]:
    try:
        with open(path) as stream:
            return stream.read().split()
    except OSError as error:
        raise ValueError(f"{flag} {path}: cannot read it ({error.strerror})") from None


def get_blend_and_blend_per_split(args):
    """(blend, blend_per_split): one blend split by `--split`, or one blend per split; None when unset."""
    if args.data_path is not None or args.data_args_path is not None:
        paths = _read_list(args.data_args_path, "--data-args-path") if args.data_args_path else args.data_path
        return get_blend_from_list(paths), None
    if args.per_split_data_args_path is not None:
        try:
            with open(args.per_split_data_args_path) as stream:
                per_split = json.load(stream)
        except (OSError, ValueError) as error:
            raise ValueError(f"--per-split-data-args-path {args.per_split_data_args_path}: {error}") from None
        missing = [split for split in ("train", "valid", "test") if split not in per_split]
        if missing:
            raise ValueError(
                f"--per-split-data-args-path {args.per_split_data_args_path}: missing keys {missing}; "
                f"expected a JSON object with train, valid and test"
            )
        lists = [per_split[s].split() if isinstance(per_split[s], str) else per_split[s] for s in ("train", "valid", "test")]
        return None, [get_blend_from_list(paths) for paths in lists]
    if any(p is not None for p in (args.train_data_path, args.valid_data_path, args.test_data_path)):
        return None, [get_blend_from_list(p) for p in (args.train_data_path, args.valid_data_path, args.test_data_path)]
    return None, None
