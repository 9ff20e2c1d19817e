"""`--config-file FILE.yaml`: command-line flags written as a YAML mapping.

Keys are flag names with or without the dashes turned into underscores (`hidden-size`, `hidden_size`), or
a flag's dest (`untie_embeddings_and_output_weights`, `masked_softmax_fusion`). Values are typed like the
command line: strings go through the flag's `type`, nargs flags take a list (or one scalar), on/off flags
take a boolean - `true` under a flag name means "the flag is given", under a dest it is the dest's value.
Flags on the command line override the file.
"""

import argparse
import difflib
import os

CONFIG_FILE_FLAG = "--config-file"


def add_config_file_arg(parser: argparse.ArgumentParser) -> None:
    """Adds `--config-file` (used both by the real parser, for --help, and by the pre-parser)."""
    parser.add_argument(CONFIG_FILE_FLAG, type=str, default=None,
                        help="YAML file of flags (keys are flag names); command-line flags override it.")


def find_config_file(argv: list) -> str | None:
    """The `--config-file` value of `argv`, or None."""
    pre_parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    add_config_file_arg(pre_parser)
    known, _ = pre_parser.parse_known_args(argv)
    return known.config_file


def _key_index(parser: argparse.ArgumentParser) -> dict:
    """Maps every accepted key spelling to (action, names_a_flag)."""
    by_key = {}
    for action in parser._actions:
        if not action.option_strings or action.dest in ("help", "config_file"):
            continue
        by_key.setdefault(action.dest.replace("_", "-"), (action, False))
    for action in parser._actions:
        if action.dest in ("help", "config_file"):
            continue
        for option in action.option_strings:
            by_key[option.lstrip("-").replace("_", "-")] = (action, True)
    return by_key


def _is_switch(action: argparse.Action) -> bool:
    return action.nargs == 0


def _convert_scalar(action: argparse.Action, value):
    """Types one YAML value like the command line would: through the flag's `type`, then its choices."""
    if isinstance(value, bool):
        raise ValueError("expects a value, not true/false (only on/off flags take booleans)")
    if not isinstance(value, str):
        value = str(value)
    if action.type is not None:
        value = action.type(value)
    if action.choices is not None and value not in action.choices:
        raise ValueError(f"{value!r} is not one of {list(action.choices)}")
    return value


def _convert(action: argparse.Action, names_a_flag: bool, value):
    if value is None:
        return None
    if _is_switch(action):
        if not isinstance(value, bool):
            raise ValueError("expects true or false")
        given = value if names_a_flag else value == action.const
        return action.const if given else action.default
    if action.nargs in ("*", "+") or isinstance(action.nargs, int):
        values = value if isinstance(value, list) else [value]
        if action.nargs == "+" and not values:
            raise ValueError("expects at least one value")
        return [_convert_scalar(action, item) for item in values]
    if isinstance(value, (list, dict)):
        raise ValueError("expects a single value, not a list")
    return _convert_scalar(action, value)


def read_config_file(path: str, parser: argparse.ArgumentParser) -> dict:
    """Reads `path` into {dest: value}; raises one ValueError listing every bad key or value."""
    if not os.path.isfile(path):
        raise ValueError(f"{CONFIG_FILE_FLAG} {path}: no such file")
    import yaml  # imported here: runs without a config file need no YAML parser

    with open(path) as stream:
        try:
            content = yaml.safe_load(stream)
        except yaml.YAMLError as error:
            raise ValueError(f"{CONFIG_FILE_FLAG} {path}: not valid YAML: {error}") from error
    if content is None:
        return {}
    if not isinstance(content, dict):
        raise ValueError(f"{CONFIG_FILE_FLAG} {path}: expected a mapping of flag names to values, "
                         f"got {type(content).__name__}")
    by_key = _key_index(parser)
    values, problems = {}, []
    for key, value in content.items():
        normalized = str(key).lstrip("-").replace("_", "-")
        if normalized not in by_key:
            close = difflib.get_close_matches(normalized, by_key, n=1)
            hint = f"; did you mean '{close[0]}' ({by_key[close[0]][0].option_strings[0]})?" if close else ""
            problems.append(f"unknown key '{key}'{hint}")
            continue
        action, names_a_flag = by_key[normalized]
        if action.dest in values:
            problems.append(f"key '{key}' sets {action.dest} a second time")
            continue
        try:
            values[action.dest] = _convert(action, names_a_flag, value)
        except (TypeError, ValueError) as error:
            problems.append(f"key '{key}' (flag {action.option_strings[0]}): {error}")
    if problems:
        raise ValueError(f"{CONFIG_FILE_FLAG} {path}:\n  " + "\n  ".join(problems))
    return values
