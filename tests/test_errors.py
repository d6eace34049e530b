"""One error base: every exception class megapipe defines derives from MegapipeError (and keeps
its builtin base), and the command-line programs turn any of them into one line and the class's
exit status (`--debug` adds the traceback)."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import megapipe
from megapipe.data.errors import DataError, IndexedDatasetError
from megapipe.errors import ConfigError, MegapipeError, PipelineCommError, RankFailure, run_cli

REPO = Path(__file__).resolve().parent.parent


def megapipe_exception_classes() -> list[type[BaseException]]:
    """Every exception class defined in a module of the megapipe package."""
    found = []
    for info in pkgutil.walk_packages(megapipe.__path__, "megapipe."):
        module = importlib.import_module(info.name)
        for obj in vars(module).values():
            if (
                inspect.isclass(obj)
                and issubclass(obj, BaseException)
                and obj.__module__ == module.__name__
            ):
                found.append(obj)
    return found


def test_every_megapipe_exception_derives_from_megapipe_error() -> None:
    classes = megapipe_exception_classes()
    assert len(classes) >= 20  # the walk reached the package (21 when this was written)
    outside = [
        f"{c.__module__}.{c.__qualname__}" for c in classes if not issubclass(c, MegapipeError)
    ]
    assert not outside, f"derive these from megapipe.errors.MegapipeError too: {outside}"
    assert all(isinstance(c.exit_status, int) and c.exit_status > 0 for c in classes)


def test_the_builtin_bases_stay() -> None:
    assert issubclass(ConfigError, ValueError) and issubclass(DataError, ValueError)
    assert issubclass(RankFailure, RuntimeError) and issubclass(PipelineCommError, RuntimeError)
    # the old homes of the communication errors still name them
    from megapipe.activity import RankFailure as from_activity
    from megapipe.pipeline.p2p import PipelineCommError as from_p2p

    assert from_activity is RankFailure and from_p2p is PipelineCommError


class _Busy(MegapipeError):
    exit_status = 75


@pytest.mark.parametrize(
    "error, status", [(ConfigError("bad"), 2), (DataError("bad"), 1), (_Busy("bad"), 75)]
)
def test_run_cli_exits_with_the_class_status_and_one_line(error, status, capsys) -> None:
    def main(argv: list[str]) -> int:
        assert "--debug" not in argv
        raise error

    for debug in ([], ["--debug"]):
        assert run_cli("tool.py", main, ["--x", *debug]) == status
        lines = capsys.readouterr().err.strip().splitlines()
        assert lines[-1] == "tool.py: error: bad"
        assert len(lines) == 1 if not debug else lines[0].startswith("Traceback")
    assert run_cli("tool.py", main, [], status=3) == 3  # a tool with one documented status
    assert capsys.readouterr().err == "tool.py: error: bad\n"


def test_an_error_said_already_is_not_said_twice(capsys) -> None:
    """A rank's last words go out where the failure is caught (before the cleanup that the
    launcher's SIGTERM may cut short); run_cli then only sets the status."""

    def main(argv: list[str]) -> int:
        failure = RankFailure("rank 0 (...), iteration 4, step: in all-reduce: a peer failed")
        failure.said = True
        raise failure

    assert run_cli("tool.py", main, []) == 1
    assert capsys.readouterr().err == ""
    assert run_cli("tool.py", main, ["--debug"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("Traceback") and "tool.py: error" not in err


def test_run_cli_lets_other_errors_through_and_reports_ctrl_c(capsys) -> None:
    def broken(argv: list[str]) -> int:
        raise ValueError("a bug: the traceback is wanted")

    with pytest.raises(ValueError):
        run_cli("tool.py", broken, [])

    def interrupted(argv: list[str]) -> int:
        raise KeyboardInterrupt

    assert run_cli("tool.py", interrupted, []) == 130
    assert capsys.readouterr().err == "tool.py: interrupted\n"


def test_a_tool_error_exits_with_the_class_status_and_one_line(tmp_path: Path) -> None:
    """tools/merge_datasets.py on a damaged index: IndexedDatasetError's status, one line."""
    (tmp_path / "a.bin").write_bytes(b"")
    (tmp_path / "a.idx").write_bytes(b"not an index")
    done = subprocess.run(
        [sys.executable, str(REPO / "tools" / "merge_datasets.py"), "--input", str(tmp_path),
         "--output-prefix", str(tmp_path / "out" / "merged")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == IndexedDatasetError.exit_status == 1, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("merge_datasets.py: error: "), done.stderr
