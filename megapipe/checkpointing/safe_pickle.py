"""Read DCP's `.metadata` without running code from the file.

torch's `FileSystemReader.read_metadata` calls plain `pickle.load`, so a `.metadata` from an
untrusted place can execute anything through `__reduce__`. `load_dcp_metadata` unpickles with an
allow-list instead: DCP's metadata dataclasses and the few torch values they hold (dtypes,
layouts, memory formats, `torch.Size`), found by listing the globals of the pickle stream torch
2.13 writes (`pickletools`). Tensor payloads are already read with `torch.load(weights_only=True)`
by DCP; byte entries are never read (our load planner refuses them).
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import re
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from megapipe.checkpointing.errors import CheckpointError
from megapipe.errors import MegapipeError

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_ALLOWED: frozenset[tuple[str, str]] = frozenset(
    {
        (_DCP_METADATA, name)
        for name in (
            "Metadata",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "MetadataIndex",
            "StorageMeta",
            "_MEM_FORMAT_ENCODING",
        )
    }
    | {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    }
    | {  # Metadata.all_local_plans, which Megatron-Core's torch_dist writer fills
        ("torch.distributed.checkpoint.planner", name)
        for name in ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData")
    }
    | {
        ("torch.serialization", "_get_layout"),  # looks a name up among torch's layouts only
        ("torch", "Size"),
        ("pathlib", "PosixPath"),  # StorageMeta.checkpoint_id
        ("pathlib", "PurePosixPath"),
        ("pathlib", "WindowsPath"),
        ("pathlib", "PureWindowsPath"),
        ("collections", "OrderedDict"),
    }
)
_TORCH_VALUE_TYPES = (torch.dtype, torch.layout, torch.memory_format)


class UnsafePickleError(MegapipeError, pickle.UnpicklingError):
    """The stream names a global outside the allow-list."""


def _printable(text: str) -> str:
    """`text` with control characters escaped (`\\n`, `\\x00`), so a name or detail taken from a
    damaged file cannot break the one-line error it is quoted in."""
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)


class _RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), _TORCH_VALUE_TYPES):
            return getattr(torch, name)  # torch.float32, torch.strided, ...: values, not code
        raise UnsafePickleError(_printable(f"{module}.{name}"))

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafePickleError(_printable(f"persistent id {pid!r}"))


def restricted_loads(data: bytes) -> Any:
    """Unpickle `data`, allowing only DCP metadata classes; raises UnsafePickleError otherwise."""
    return _RestrictedUnpickler(io.BytesIO(data)).load()


def load_dcp_metadata(path: str | os.PathLike) -> Metadata:
    """DCP's checkpoint `Metadata` from `path`, read with the allow-list unpickler."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise CheckpointError(f"checkpoint file {path}: cannot read it ({e.strerror})") from None
    try:
        metadata = restricted_loads(data)
    except UnsafePickleError as e:
        raise CheckpointError(
            f"checkpoint file {path}: refused to unpickle {e} (not a DCP metadata type; "
            "the file may carry code)"
        ) from None
    except Exception as e:  # truncated or garbage stream
        raise CheckpointError(
            f"checkpoint file {path}: not a readable DCP metadata file "
            f"({type(e).__name__}: {_printable(str(e))})"
        ) from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(
            f"checkpoint file {path}: holds a {type(metadata).__name__}, not DCP Metadata"
        )
    return metadata


_TORCH_BOILERPLATE = ("Weights only load failed", "Please file an issue", "Check the documentation")


def allowing(allowed: Sequence[type]) -> contextlib.AbstractContextManager:
    """torch's `safe_globals` for the classes of `allowed` not already allowed process-wide:
    its exit removes what it was given, also a class another library registered before
    (Megatron-Core registers `argparse.Namespace` on import, and its loads rely on it)."""
    registered = torch.serialization.get_safe_globals()
    return torch.serialization.safe_globals([c for c in allowed if c not in registered])


def safe_torch_load(
    path: str | os.PathLike, allowed: Sequence[type] = (), *, mmap: bool = False
) -> Any:
    """`torch.load(path, weights_only=True)` (plus the `allowed` classes), every failure one
    CheckpointError line: missing, refused (naming the global a pickled object needs: code),
    or unreadable (truncated or corrupted). torch's own message would advise retrying with
    weights_only=False, which is exactly what must not be done with an untrusted file.
    `mmap`: map the tensors' storages instead of reading them (only the pages used are read:
    a caller that wants the small entries of a large file); zip-format files only."""
    try:
        with allowing(allowed), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # e.g. "pickle protocol 22" from a damaged file
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file {path}: missing") from None
    except OSError as e:
        raise CheckpointError(f"checkpoint file {path}: cannot read it ({e.strerror})") from None
    except pickle.UnpicklingError as e:
        refused = re.search(r"GLOBAL ([\w.]+)", str(e))
        if refused:
            raise CheckpointError(
                f"checkpoint file {path}: refused by weights_only loading: it needs "
                f"{_printable(refused[1])}, which is not a tensor or plain python type "
                "(the file may carry code)"
            ) from None
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        detail = next((x for x in lines if not x.startswith(_TORCH_BOILERPLATE)), "")
        raise CheckpointError(
            f"checkpoint file {path}: not a readable torch file (corrupted pickle stream"
            + (f": {_printable(detail)})" if detail else ")")
        ) from None
    except Exception as e:  # a truncated zip archive, an empty file
        first = str(e).split(". ")[0].strip() or type(e).__name__
        raise CheckpointError(
            f"checkpoint file {path}: not a readable torch file (truncated or corrupted: "
            f"{_printable(first)})"
        ) from None


class SafeFileSystemReader(FileSystemReader):
    """DCP's FileSystemReader with `read_metadata` through `load_dcp_metadata`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = load_dcp_metadata(self._get_metadata_path(kwargs.get("rank")))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
