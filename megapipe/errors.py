"""The error a bad setting raises, in a module of its own so that every layer can raise it
without importing the configs (and the configs stay pure data), and how the command-line
programs turn the intended errors into one line (`--debug` adds the traceback)."""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Sequence


class ConfigError(ValueError):
    """An impossible or inconsistent setting. The message names the flags and their values."""


def flag(name: str) -> str:
    """The command-line flag for a config field name: `hidden_size` -> `--hidden-size`."""
    return "--" + name.replace("_", "-")


DEBUG_FLAG = "--debug"
DEBUG_ENV = "MEGAPIPE_DEBUG"


def split_debug(argv: Sequence[str]) -> tuple[list[str], bool]:
    """`argv` without `--debug`, and whether tracebacks were asked for (`--debug`, or the
    environment variable MEGAPIPE_DEBUG=1, which also reaches ranks a launcher starts)."""
    rest = [arg for arg in argv if arg != DEBUG_FLAG]
    return rest, len(rest) != len(argv) or os.environ.get(DEBUG_ENV, "") not in ("", "0")


def error_line(prog: str, error: BaseException, debug: bool = False) -> str:
    """`prog: error: <the one-line message>`; with `debug`, the traceback is printed to
    stderr first (the line stays last, so it is what a user reads)."""
    if debug:
        traceback.print_exception(error, file=sys.stderr)
    return f"{prog}: error: {error}"
