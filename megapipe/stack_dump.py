"""Every thread's stack on a signal, for a rank that seems hung (`kill -USR2 PID`).

A rank waiting in a collective or a transfer tells where without a debugger or py-spy:
`pretrain_gpt.py` installs it on every rank, and tools/gpu_check.sh sends the signal to every
rank of a run that has not finished in time. torch-free, so that it costs nothing to import.
"""

from __future__ import annotations

import faulthandler
import signal
import sys

STACK_DUMP_SIGNAL = signal.SIGUSR2


def install_stack_dump() -> None:
    """Print every thread's stack to the process's stderr on STACK_DUMP_SIGNAL, and go on
    (--exit-signal SIGUSR2 takes the signal over). sys.stderr may be a stream without a file
    (a capturing harness), so the process's own is used; without one, nothing is installed."""
    stderr = sys.__stderr__
    if stderr is not None:
        faulthandler.register(STACK_DUMP_SIGNAL, file=stderr, all_threads=True)
