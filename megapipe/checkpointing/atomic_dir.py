"""Publish a checkpoint directory atomically, with a checksum for every file in it.

A save writes into a sibling `<dir>.tmp-<token>`, fsyncs every file, records the size and
sha256 of each in `checksums.json`, fsyncs that and the directory, renames it to `<dir>` and
fsyncs the parent. A crash at any moment leaves either no `<dir>` or a complete one.
Re-saving an existing `<dir>` first moves the old one to `<dir>.old-<token>`; a crash between
the two renames leaves the old one there, and the next save of that name puts it back
(`clear_stale`) before starting. Readers verify the files they use against `checksums.json`.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import secrets
import shutil

from megapipe.atomic_files import fsync_path
from megapipe.checkpointing.errors import CheckpointError

CHECKSUMS_NAME = "checksums.json"
_CHUNK = 1 << 22


def new_temp_dir(directory: str) -> str:
    """A fresh temporary sibling name of `directory` (same filesystem, so rename is atomic)."""
    return f"{directory}.tmp-{os.getpid()}-{secrets.token_hex(4)}"


def clear_stale(directory: str) -> None:
    """Remove temp dirs of crashed saves of `directory`; restore a `.old-` copy that a crash
    between publish's two renames left without a replacement."""
    for path in glob.glob(glob.escape(directory) + ".tmp-*"):
        shutil.rmtree(path, ignore_errors=True)
    olds = sorted(glob.glob(glob.escape(directory) + ".old-*"))
    if olds and not os.path.exists(directory):
        os.replace(olds.pop(), directory)
        fsync_path(os.path.dirname(directory) or ".")
    for path in olds:
        shutil.rmtree(path, ignore_errors=True)


def file_digest(path: str) -> dict[str, int | str]:
    """`{"size": bytes, "sha256": hex}` of a file, read in 4 MiB chunks."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            h.update(block)
            size += len(block)
    return {"size": size, "sha256": h.hexdigest()}


def fsync_and_digest(directory: str, names: list[str]) -> dict[str, dict[str, int | str]]:
    """fsync each named file of `directory` and return its digest."""
    out = {}
    for name in names:
        path = os.path.join(directory, name)
        fsync_path(path)
        out[name] = file_digest(path)
    return out


def write_checksums(directory: str, digests: dict[str, dict[str, int | str]]) -> None:
    """Write `checksums.json` for `digests` into the (temporary) `directory` and fsync it.
    Every file present must be listed, so a stray partial file cannot sneak in."""
    present = set(os.listdir(directory)) - {CHECKSUMS_NAME}
    if present != set(digests):
        raise CheckpointError(
            f"checkpoint {directory}: files {sorted(present ^ set(digests))} are present but "
            "not checksummed, or checksummed but absent"
        )
    path = os.path.join(directory, CHECKSUMS_NAME)
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"algorithm": "sha256", "files": dict(sorted(digests.items()))}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def publish(temp: str, directory: str) -> None:
    """Rename the finished `temp` to `directory` (replacing an older one) durably."""
    parent = os.path.dirname(directory) or "."
    fsync_path(temp)
    old = None
    if os.path.exists(directory):
        old = f"{directory}.old-{secrets.token_hex(4)}"
        os.replace(directory, old)
    os.replace(temp, directory)
    fsync_path(parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def read_checksums(directory: str) -> dict[str, dict]:
    """The `files` table of `directory/checksums.json`; an error naming it when absent or bad."""
    path = os.path.join(directory, CHECKSUMS_NAME)
    try:
        with open(path, encoding="utf-8") as f:
            files = json.load(f)["files"]
        if not all(
            isinstance(v, dict)
            and isinstance(v.get("size"), int)
            and isinstance(v.get("sha256"), str)
            for v in files.values()
        ):
            raise ValueError("an entry lacks size or sha256")
    except FileNotFoundError:
        raise CheckpointError(
            f"checkpoint file {path}: missing (an incomplete save, or not a megapipe checkpoint)"
        ) from None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"checkpoint file {path}: malformed ({e})") from None
    return files


def verify_files(directory: str, names: list[str], table: dict[str, dict] | None = None) -> None:
    """Check each named file of `directory` against `checksums.json`: listed, present, the
    recorded size (a truncation), the recorded sha256 (a flipped bit)."""
    table = read_checksums(directory) if table is None else table
    for name in sorted(set(names)):
        path = os.path.join(directory, name)
        want = table.get(name)
        if want is None:
            raise CheckpointError(f"checkpoint file {path}: not listed in {CHECKSUMS_NAME}")
        try:
            size = os.path.getsize(path)
        except FileNotFoundError:
            raise CheckpointError(f"checkpoint file {path}: missing") from None
        if size != want["size"]:
            raise CheckpointError(
                f"checkpoint file {path}: {size} bytes, {want['size']} when saved (truncated?)"
            )
        got = file_digest(path)["sha256"]
        if got != want["sha256"]:
            raise CheckpointError(
                f"checkpoint file {path}: sha256 {got[:16]}... differs from the saved "
                f"{want['sha256'][:16]}... (corrupted)"
            )


def verify_directory(directory: str) -> None:
    """Verify every file `checksums.json` lists, and that no other file is present."""
    table = read_checksums(directory)
    verify_files(directory, list(table), table)
    extra = set(os.listdir(directory)) - set(table) - {CHECKSUMS_NAME}
    if extra:
        raise CheckpointError(f"checkpoint {directory}: unlisted files {sorted(extra)}")
