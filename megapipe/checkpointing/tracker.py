"""Megatron's checkpoint directory names: `SAVE/iter_0000100` and
`SAVE/latest_checkpointed_iteration.txt`, the tracker replaced atomically and written only once
the iteration directory it names is in place; which iteration `--load`/`--ckpt-step` name; a
save into a folder an earlier run went further in (`point_tracker`).

A leaf: it imports no other checkpointing module but the errors, so flag validation can ask it
about a `--load` folder before anything is built."""

from __future__ import annotations

import contextlib
import glob
import os
import re

from megapipe.atomic_files import atomic_write, fsync_path
from megapipe.checkpointing.errors import CheckpointError
from megapipe.config import CheckpointConfig
from megapipe.errors import ConfigError

TRACKER_NAME = "latest_checkpointed_iteration.txt"


def iteration_dir(save: str, iteration: int) -> str:
    """`save/iter_0000100` for iteration 100 (Megatron's seven digits)."""
    if iteration < 0:
        raise ValueError(f"iteration {iteration} is negative")
    return os.path.join(save, f"iter_{iteration:07d}")


RELEASE = -1  # the tracker says `release`: a converted checkpoint in `release/`, weights only
RELEASE_NAME = "release"


def checkpoint_path(load: str, iteration: int) -> str:
    """The directory of `iteration` under `load`: `iter_NNNNNNN`, or `release` for RELEASE."""
    return (
        os.path.join(load, RELEASE_NAME) if iteration == RELEASE else iteration_dir(load, iteration)
    )


def tracker_path(directory: str) -> str:
    """Where the tracker of a `--save`/`--load` directory lives."""
    return os.path.join(directory, TRACKER_NAME)


def read_tracker(load: str) -> int | None:
    """The latest checkpointed iteration under `load` (RELEASE for Megatron's `release`); None
    when there is no tracker file."""
    path = tracker_path(load)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read().strip()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"tracker file {path}: cannot read it ({e})") from None
    if text == "release":
        return RELEASE
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


ITERATION_NAME = re.compile(r"iter_(\d{7})")


def saved_iterations(directory: str) -> list[int]:
    """The iterations with a complete `iter_NNNNNNN` directory under `directory`, ascending
    (a save's `.tmp-`/`.old-` siblings and anything else are not checkpoints)."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    found = (ITERATION_NAME.fullmatch(name) for name in names)
    return sorted(int(m[1]) for m in found if m and os.path.isdir(os.path.join(directory, m[0])))


def saved_listing(directory: str) -> str:
    """ "iterations saved there: 2, 4" (or that none are), for errors naming a missing one."""
    saved = saved_iterations(directory)
    if not saved:
        return "no iterations are saved there"
    return "iterations saved there: " + ", ".join(map(str, saved))


def checkpoint_to_load(checkpoint: CheckpointConfig) -> int | None:
    """The iteration --load (and --ckpt-step) name, or None for "start from scratch".

    ConfigError (one line) when the named checkpoint does not exist (--ckpt-step's lists the
    iterations that do), or none does and --exit-on-missing-checkpoint was given."""
    if checkpoint.load is None:
        return None
    if checkpoint.ckpt_step is not None:
        directory = iteration_dir(checkpoint.load, checkpoint.ckpt_step)
        if not os.path.isdir(directory):
            raise ConfigError(  # two pieces: the bad-input catalogue reads the first
                f"--ckpt-step {checkpoint.ckpt_step}: {directory} does not exist "
                + f"({saved_listing(checkpoint.load)})"
            )
        return checkpoint.ckpt_step
    try:
        iteration = read_tracker(checkpoint.load)
    except CheckpointError as error:
        raise ConfigError(f"--load: {error}") from None
    if iteration is None:
        if checkpoint.exit_on_missing_checkpoint:
            raise ConfigError(
                f"--load {checkpoint.load}: no checkpoint found (no "
                "latest_checkpointed_iteration.txt) and --exit-on-missing-checkpoint is set"
            )
        return None
    directory = checkpoint_path(checkpoint.load, iteration)
    if not os.path.isdir(directory):
        named = "release" if iteration == RELEASE else f"iteration {iteration}"
        raise ConfigError(
            f"--load {checkpoint.load}: latest_checkpointed_iteration.txt names {named}, "
            f"but {directory} does not exist"
        )
    return iteration


SUPERSEDED_SUFFIX = ".superseded"


def point_tracker(save: str, iteration: int) -> str | None:
    """After a save of `iteration`: write the tracker (as Megatron does, the iteration just
    saved, even when it is older than what it named), then move aside the iterations above it
    that an earlier run left in `save`. Returns the one-line warning naming them, or None.

    Why this choice: Megatron points the tracker at the latest *saved* iteration, so a resume
    (auto-resume, `--load` of this folder) continues this run, not an abandoned one; keeping
    the tracker at a newer stale iteration would silently resume the earlier run. But a newer
    `iter_N` beside an older tracker still looks valid (`--ckpt-step N`, the converters, a
    user's `ls`) and would be loaded as if it belonged to this run. Renaming each to
    `iter_N.superseded` (not deleting it: a --save folder given by mistake loses nothing)
    takes it out of every reader's sight; a second one of the same name gets `.superseded-2`."""
    write_tracker(save, iteration)
    newer = [i for i in saved_iterations(save) if i > iteration]
    for stale in newer:
        source = iteration_dir(save, stale)
        target, n = source + SUPERSEDED_SUFFIX, 1
        while os.path.exists(target):
            n += 1
            target = f"{source}{SUPERSEDED_SUFFIX}-{n}"
        os.rename(source, target)
    if not newer:
        return None
    fsync_path(save)
    names = ", ".join(os.path.basename(iteration_dir(save, i)) for i in newer)
    return (
        f"{save} held iterations newer than the {iteration} just saved, left by an earlier "
        f"run: {names}; moved aside as <name>{SUPERSEDED_SUFFIX} (the tracker names {iteration})"
    )
