"""`--config FILE`: a YAML mapping of flag values, expanded into flags in front of the command line.

Keys are flag names (with dashes or underscores: `lr`, `micro-batch-size`, `pipeline_schedule`); the file's
flags are placed *before* the command line, so a flag given on the command line wins. An on/off flag set in
the file cannot be switched off again on the command line. A key that names no flag is an error naming the
key and the file, and output paths in a file stay below the run directory.
"""
from __future__ import annotations

import argparse
import os
from typing import Sequence

from megatron_pp.training.flags import _OneLineParser

class ConfigFileError(ValueError):
    """Problems with a --config file, one line each (`lines`)."""

    def __init__(self, lines: list[str]) -> None:
        super().__init__("; ".join(lines))
        self.lines = lines


# Flags that name something the run writes. A config file is data that travels between people and
# clusters, so its output paths stay below the run directory; the command line (the operator) may point
# anywhere.
OUTPUT_PATH_FLAGS = ("save", "metrics_file", "trace_file", "tensorboard_dir", "wandb_save_dir", "cache_dir")


def _escapes_run_directory(path: str) -> bool:
    return os.path.isabs(path) or path.startswith("~") or ".." in path.replace("\\", "/").split("/")


def config_file_arguments(parser: argparse.ArgumentParser, path: str) -> list[str]:
    """The flags equivalent to the YAML mapping in `path` (see the module docstring)."""
    import yaml

    try:
        with open(path) as f:
            values = yaml.safe_load(f)
    except OSError as exc:
        raise ConfigFileError([f"--config {path}: {exc.strerror}"]) from None
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        at = f" at line {where.line + 1}" if where is not None else ""
        raise ConfigFileError([f"--config {path}: not valid YAML{at}"]) from None
    if values is None:
        return []
    if not isinstance(values, dict):
        raise ConfigFileError([f"--config {path}: expected a mapping of flag names to values, "
                               f"got a {type(values).__name__}"])
    # argparse keeps no public table of its actions; `_actions` has been stable since Python 2.7.
    actions = {option: action for action in parser._actions for option in action.option_strings}
    tokens: list[str] = []
    errors: list[str] = []
    for key, value in values.items():
        option = "--" + str(key).replace("_", "-")
        action = actions.get(option)
        if action is None or option in ("--config", "--help"):
            errors.append(f"--config {path}: unknown key {key!r} (there is no flag {option})")
            continue
        if value is None:
            continue
        if action.dest in OUTPUT_PATH_FLAGS and isinstance(value, str) and _escapes_run_directory(value):
            errors.append(f"--config {path}: {key} {value!r} points outside the run directory (absolute, '~' or '..'); "
                          f"a config file may only name outputs below the directory the job starts in; give "
                          f"{option} on the command line to write elsewhere")
            continue
        if action.nargs == 0:  # on/off flags
            if not isinstance(value, bool):
                errors.append(f"--config {path}: {key} must be true or false, got {value!r}")
            elif value:
                tokens.append(option)
            elif isinstance(action, argparse.BooleanOptionalAction):
                tokens.append("--no-" + option[2:])
        elif isinstance(value, list):
            if action.nargs not in ("*", "+"):
                errors.append(f"--config {path}: {key} takes one value, got a list")
            else:
                tokens += [option, *map(str, value)]
        elif isinstance(value, dict):
            errors.append(f"--config {path}: {key} takes a value, got a mapping")
        else:
            tokens += [option, str(value)]
    if errors:
        raise ConfigFileError(errors)
    return tokens


def expand_config_file(parser: argparse.ArgumentParser, argv: Sequence[str]) -> list[str]:
    """`argv` with the flags of its `--config FILE` (if any) put in front, so the command line wins."""
    pre = _OneLineParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--config", default=None)
    known, _ = pre.parse_known_args(argv)
    if known.config is None:
        return list(argv)
    return config_file_arguments(parser, known.config) + list(argv)
