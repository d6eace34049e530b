"""Megatron's checkpoint directory names: `SAVE/iter_0000100` and
`SAVE/latest_checkpointed_iteration.txt`, the tracker replaced atomically and written only once
the iteration directory it names is in place."""

from __future__ import annotations

import contextlib
import glob
import os

from megapipe.atomic_files import atomic_write
from megapipe.checkpointing.errors import CheckpointError

TRACKER_NAME = "latest_checkpointed_iteration.txt"


def iteration_dir(save: str, iteration: int) -> str:
    """`save/iter_0000100` for iteration 100 (Megatron's seven digits)."""
    if iteration < 0:
        raise ValueError(f"iteration {iteration} is negative")
    return os.path.join(save, f"iter_{iteration:07d}")


def tracker_path(directory: str) -> str:
    """Where the tracker of a `--save`/`--load` directory lives."""
    return os.path.join(directory, TRACKER_NAME)


def read_tracker(load: str) -> int | None:
    """The latest checkpointed iteration under `load`; None when there is no tracker file."""
    path = tracker_path(load)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read().strip()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"tracker file {path}: cannot read it ({e})") from None
    if text == "release":
        raise CheckpointError(
            f"tracker file {path}: says 'release' (a Megatron release checkpoint), which this "
            "reader does not load; pass the iteration directory's checkpoint instead"
        )
    if not text.isdigit():
        raise CheckpointError(f"tracker file {path}: holds {text[:40]!r}, not an iteration number")
    return int(text)


def write_tracker(save: str, iteration: int) -> None:
    """Record `iteration` as the latest: atomic replace (temp, fsync, rename, fsync the dir).
    Refuses when `save/iter_N` is not there yet, so the tracker never points at nothing."""
    target = iteration_dir(save, iteration)
    if not os.path.isdir(target):
        raise CheckpointError(
            f"tracker file {tracker_path(save)}: refusing to point at iteration {iteration}: "
            f"{target} does not exist"
        )
    for stale in glob.glob(os.path.join(glob.escape(save), f".{TRACKER_NAME}.tmp-*")):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(stale)  # left by a process killed while writing the tracker
    with atomic_write(tracker_path(save)) as temp, open(temp, "w", encoding="utf-8") as f:
        f.write(f"{iteration}\n")
        f.flush()
        os.fsync(f.fileno())
