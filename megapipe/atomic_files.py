"""Write files so that a crash never leaves a file that looks valid: temp name, fsync, rename.

Used for everything megapipe writes that a reader might pick up: datasets, index caches,
tokenizers, pipeline traces, timeline pictures, benchmark JSON.

Temp files live beside their destination (same filesystem, so the rename is atomic) under a hidden
name that no reader looks for: `.NAME.tmp-PID-RANDOM`.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
from collections.abc import Iterator
from pathlib import Path


def temp_path_for(final: str | os.PathLike) -> Path:
    """A fresh hidden temporary name in the directory of `final`."""
    final = Path(final)
    return final.with_name(f".{final.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")


def fsync_path(path: str | os.PathLike) -> None:
    """Flush a file's (or a directory's) contents to stable storage."""
    flags = os.O_RDONLY
    if Path(path).is_dir():
        flags |= getattr(os, "O_DIRECTORY", 0)
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    except OSError:  # some filesystems refuse fsync on directories; the rename still happened
        pass
    finally:
        os.close(fd)


def commit(temp: str | os.PathLike, final: str | os.PathLike) -> None:
    """fsync `temp`, rename it over `final`, then fsync the directory so the rename persists."""
    fsync_path(temp)
    os.replace(temp, final)
    fsync_path(Path(final).parent)


def discard(*paths: str | os.PathLike) -> None:
    """Remove temporary files, ignoring those already gone."""
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


@contextlib.contextmanager
def atomic_write(final: str | os.PathLike) -> Iterator[Path]:
    """Yield a temp path to write; on success it replaces `final`, on error it is removed."""
    temp = temp_path_for(final)
    try:
        yield temp
        commit(temp, final)
    except BaseException:
        discard(temp)
        raise


def write_json(path: str | os.PathLike, document: object, indent: int | None = 2) -> None:
    """`document` as JSON at `path` (parent directories created), atomically."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with atomic_write(path) as temp:
        temp.write_text(json.dumps(document, indent=indent) + "\n")
