"""Cache dataset indices as .npy files under --data-cache-path, built once, then memory-mapped.

Files are named `{key}-{kind}-{name}.npy`, where the key hashes a description of every input
that changes the arrays (dataset path, size and modification time of its .idx, split, number
of samples, sequence length, seed, ...), so a changed input never reuses a stale cache.
Global rank 0 builds missing files (temp name, fsync, rename; the description last, as the
commit mark) while the other ranks wait at a barrier, then every rank memory-maps them.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from megapipe.atomic_files import atomic_write
from megapipe.data.errors import DataError


@dataclass(frozen=True)
class BuildContext:
    """Which rank builds shared cache files, and how the others wait for it."""

    rank: int = 0
    barrier: Callable[[], None] | None = None

    @classmethod
    def from_torch(cls) -> BuildContext:
        """Global rank and a barrier over all ranks when torch.distributed is initialised."""
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return cls(dist.get_rank(), dist.barrier)
        return cls()


def cache_key(description: dict) -> str:
    encoded = json.dumps(description, sort_keys=True).encode()
    return hashlib.sha256(encoded).hexdigest()[:32]


def source_fingerprint(path: str) -> dict:
    """What identifies a version of an input file: its absolute path, size and mtime."""
    stat = os.stat(path)
    return {"path": os.path.abspath(path), "bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns}


class _Files:
    def __init__(self, cache_dir: str, kind: str, description: dict, names: Sequence[str]):
        self.stem = os.path.join(cache_dir, f"{cache_key(description)}-{kind}")
        self.description_path = f"{self.stem}-description.json"
        self.arrays = {name: f"{self.stem}-{name}.npy" for name in names}
        self.expected = json.dumps(description, sort_keys=True, indent=1)

    def complete(self) -> bool:
        try:
            with open(self.description_path, encoding="utf-8") as file:
                if file.read() != self.expected:
                    return False
        except (OSError, UnicodeDecodeError):
            return False
        return all(os.path.isfile(path) for path in self.arrays.values())

    def save(self, arrays: dict[str, np.ndarray]) -> None:
        for name, path in self.arrays.items():
            with atomic_write(path) as temp, open(temp, "wb") as file:
                np.save(file, np.ascontiguousarray(arrays[name]), allow_pickle=False)
        with atomic_write(self.description_path) as temp:
            temp.write_text(self.expected, encoding="utf-8")

    def load(self) -> dict[str, np.ndarray]:
        arrays = {}
        for name, path in self.arrays.items():
            try:
                arrays[name] = np.load(path, mmap_mode="r", allow_pickle=False)
            except (OSError, ValueError) as error:
                raise DataError(
                    f"{path}: corrupt index cache file ({error}); delete it to rebuild"
                ) from None
        return arrays


def cached_arrays(
    cache_dir: str | None,
    kind: str,
    description: dict,
    names: Sequence[str],
    build: Callable[[], dict[str, np.ndarray]],
    context: BuildContext,
) -> dict[str, np.ndarray]:
    """The arrays `build` returns, from the cache when it holds them (memory-mapped).

    Without a cache directory every rank builds in memory. Every rank must call this with the
    same arguments in the same order (it contains one barrier when a barrier is given).
    """
    if cache_dir is None:
        return build()
    files = _Files(cache_dir, kind, description, names)
    failure: BaseException | None = None
    if context.rank == 0 and not files.complete():
        try:
            os.makedirs(cache_dir, exist_ok=True)
            files.save(build())
        except OSError as error:
            failure = DataError(f"--data-cache-path {cache_dir}: cannot write: {error}")
        except Exception as error:  # still reach the barrier, or the other ranks would hang
            failure = error
    if context.barrier is not None:
        context.barrier()
    if failure is not None:
        raise failure
    if not files.complete():
        raise DataError(
            f"{files.description_path}: missing after rank 0 built the index cache (rank 0 "
            "failed, or --data-cache-path is not on a filesystem every rank shares)"
        )
    return files.load()
