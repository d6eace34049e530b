"""Lines that several ranks print at once reach a shared stdout whole: one write per line.

`print` writes a line's text and its newline separately; unbuffered (PYTHONUNBUFFERED=1)
each is its own write, and another rank's line can land between them. The multi-process test
runs two real processes on one pipe, unbuffered, each printing many lines at once."""

from __future__ import annotations

import io
import subprocess
import sys
import textwrap

import pytest

from megapipe.console import print_line


class _Writes(io.StringIO):
    def __init__(self) -> None:
        super().__init__()
        self.writes: list[str] = []

    def write(self, text: str) -> int:
        self.writes.append(text)
        return super().write(text)


def test_a_line_is_one_write() -> None:
    stream = _Writes()
    print_line(
        " > number of parameters on (tensor, pipeline) model parallel rank (1, 0): 7", stream
    )
    assert stream.writes == [
        " > number of parameters on (tensor, pipeline) model parallel rank (1, 0): 7\n"
    ]


@pytest.mark.slow
def test_two_unbuffered_processes_on_one_pipe_keep_their_lines_whole() -> None:
    script = textwrap.dedent(
        """
        import sys
        from megapipe.console import print_line
        rank = sys.argv[1]
        for i in range(3000):
            print_line(f"rank {rank} line {i} " + "x" * 60)
        """
    )
    procs = " & ".join(f"{sys.executable} -u -c '{script}' {rank}" for rank in (0, 1))
    out = subprocess.run(
        f"({procs} & wait)", shell=True, capture_output=True, text=True, timeout=120
    ).stdout.splitlines()
    assert len(out) == 6000
    assert all(line.startswith("rank ") and line.endswith("x" * 60) for line in out)
    assert sorted(out) == sorted(
        f"rank {r} line {i} " + "x" * 60 for r in (0, 1) for i in range(3000)
    )
