"""Command-line plumbing shared by the tools: argument errors as one line, exit status 2.

argparse prints the whole usage block on a bad flag; our tools print a single line naming the flag or
file instead (`tool.py: error: ...`) and exit with status 2, before doing any work.
"""
from __future__ import annotations

import argparse
import json
import os
import sys


class UsageError(Exception):
    """Bad command-line input; the message names the flag or file to fix."""


class OneLineArgumentParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors raise UsageError instead of printing usage and exiting."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(message)


class ExitingArgumentParser(argparse.ArgumentParser):
    """An ArgumentParser for tools that parse and exit at once: a bad flag prints `error: ...` as one
    line on stderr and exits 2, without the usage block."""

    def error(self, message: str) -> None:  # type: ignore[override]
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)


def write_json(path: str, data: object) -> None:
    """Write a tool's JSON report atomically (a `.tmp` sibling, then a rename), creating its folder;
    values JSON cannot hold are written as their `str`."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(data, f, indent=1, default=str)
        f.write("\n")
    os.replace(path + ".tmp", path)
