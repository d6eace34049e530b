"""megapipe's errors, in a module of its own at the bottom of the import graph so that every
layer can raise them without importing the configs (which stay pure data): `MegapipeError`, the
base of every error megapipe defines, with the exit status a command-line program ends with;
the errors of bad settings and of failed communication; and how the command-line programs turn
them into one line (`--debug` adds the traceback)."""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable, Sequence

from megapipe.console import say


class MegapipeError(Exception):
    """The base of every error megapipe defines: an intended failure whose message is the one
    line a user reads. `exit_status` is what a command-line program exits with when it ends
    the run (`run_cli`); each class keeps its builtin base too (`except ValueError` works)."""

    exit_status: int = 1
    said: bool = False  # its line is on stderr already (a rank's last words): run_cli is silent


class ConfigError(MegapipeError, ValueError):
    """An impossible or inconsistent setting. The message names the flags and their values."""

    exit_status = 2  # a usage error, as argparse's


class RankFailure(MegapipeError, RuntimeError):
    """A collective or transfer failed (a peer died or timed out): says where this rank was."""


class PipelineCommError(MegapipeError, RuntimeError):
    """A transfer with a neighbouring stage failed or timed out."""


class ContextParallelCommError(MegapipeError, RuntimeError):
    """A transfer of the context-parallel ring (K/V or dK/dV) failed or timed out; the message
    names the step and the CP peer with its global rank."""


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


INTERRUPTED_STATUS = 130  # 128 + SIGINT, as a shell reports Ctrl-C


def run_cli(
    prog: str,
    main: Callable[[list[str]], int],
    argv: Sequence[str] | None = None,
    *,
    status: int | None = None,
    also: tuple[type[BaseException], ...] = (),
    interrupted: str = "interrupted",
) -> int:
    """Run a command-line program's `main(argv)` (argv without `--debug`) and return its exit
    status. A `MegapipeError` (or one of `also`, e.g. OSError for a tool that writes files)
    becomes one line on stderr, `prog: error: ...` (the traceback above it with `--debug`),
    and the error's `exit_status` (1 for `also`), or `status` where the program documents one
    status for every error; Ctrl-C one line and status 130."""
    argv, debug = split_debug(sys.argv[1:] if argv is None else argv)
    try:
        return main(argv)
    except (MegapipeError, *also) as error:
        if not getattr(error, "said", False):
            say(error_line(prog, error, debug))
        elif debug:
            traceback.print_exception(error, file=sys.stderr)
        if status is not None:
            return status
        return error.exit_status if isinstance(error, MegapipeError) else 1
    except KeyboardInterrupt:
        say(f"{prog}: {interrupted}")
        return INTERRUPTED_STATUS
