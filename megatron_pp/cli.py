"""Command-line plumbing shared by the tools: argument errors as one line, exit status 2.

argparse prints the whole usage block on a bad flag; our tools print a single line naming the flag or
file instead (`tool.py: error: ...`) and exit with status 2, before doing any work.
"""
from __future__ import annotations

import argparse


class UsageError(Exception):
    """Bad command-line input; the message names the flag or file to fix."""


class OneLineArgumentParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors raise UsageError instead of printing usage and exiting."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(message)
