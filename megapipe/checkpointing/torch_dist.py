"""The `torch_dist` checkpoint format (Megatron-Core's default) on torch.distributed.checkpoint.

A directory holds DCP's `.metadata` and `__<rank>_0.distcp` files (every logical tensor under
its global name and global shape, each rank's pieces in its own file, and byte entries such as
Megatron-Core's `_extra_state`, written but never read), `common.pt` (the non-sharded state,
loaded with `weights_only=True` and `megatron_args.COMMON_PT_GLOBALS`, Megatron-LM's `args`
Namespace), Megatron-Core's `metadata.json`, and
megapipe's `checksums.json` (size and sha256 of every file, verified before anything is read).

Every function that takes `group` is collective over it; `group=None` means this process alone
(no collectives). Errors are agreed across the group before anyone raises, so every rank
raises the same one-line CheckpointError and none is left waiting in a collective.
"""

from __future__ import annotations

import io
import json
import math
import os
import shutil
import warnings
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from megapipe.checkpointing import atomic_dir
from megapipe.checkpointing.agreement import agree, attempt, gather, one_line
from megapipe.checkpointing.dcp_planners import ShardLoadPlanner, ShardSavePlanner, read_items
from megapipe.checkpointing.errors import CheckpointError
from megapipe.checkpointing.megatron_args import COMMON_PT_GLOBALS
from megapipe.checkpointing.safe_pickle import (
    SafeFileSystemReader,
    allowing,
    load_dcp_metadata,
    safe_torch_load,
)
from megapipe.checkpointing.shards import ShardedState

METADATA_JSON = {
    "sharded_backend": "torch_dist",
    "sharded_backend_version": 1,
    "common_backend": "torch",
    "common_backend_version": 1,
}
DCP_METADATA = ".metadata"
COMMON = "common.pt"
METADATA_JSON_NAME = "metadata.json"

T = TypeVar("T")
DtypeConversions = dict[str, tuple[torch.dtype, torch.dtype]]  # name -> (checkpoint, model)
# (requested pieces, the checkpoint's global shapes, directory) -> the pieces to read
Fit = Callable[[ShardedState, dict[str, tuple[int, ...]], str], ShardedState]


# --- agreement over the group -------------------------------------------------------------


def _dcp_call(fn: Callable[[], T], where: str) -> T:
    """Run a DCP collective; its CheckpointException (a BaseException, multi-line) reaches
    every rank alike and becomes one line."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            return fn()
        except CheckpointError:
            raise
        except (Exception, dcp.CheckpointException) as e:
            raise CheckpointError(one_line(e, where)) from None


# --- save ---------------------------------------------------------------------------------


def _common_bytes(common: dict | None, where: str) -> bytes:
    """`common` serialised, after proving it loads back under weights_only=True."""
    buffer = io.BytesIO()
    torch.save({} if common is None else common, buffer)
    try:
        with allowing(COMMON_PT_GLOBALS):
            torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    except Exception as e:
        raise CheckpointError(
            f"checkpoint {where}: common state holds a type that weights_only loading refuses "
            f"({str(e).splitlines()[-1] if str(e) else type(e).__name__}); store plain python "
            "types and tensors"
        ) from None
    return buffer.getvalue()


def _write_synced(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def save_sharded(
    directory: str,
    shards: ShardedState,
    common: dict | None,
    *,
    group: dist.ProcessGroup | None,
    coordinator: bool,
    objects: dict[str, bytes] | None = None,
) -> None:
    """Write `shards` (this rank's pieces), `objects` (this rank's byte entries: each written
    by one rank only) and `common` (written by the coordinator) as a `torch_dist` checkpoint
    at `directory`, atomically. Collective over `group`; exactly one rank passes
    coordinator=True. Pieces of different ranks must tile each tensor exactly."""
    directory = os.path.abspath(directory)
    rank = 0 if group is None else dist.get_rank(group)

    def prepare() -> tuple[str, bytes]:
        common_data = _common_bytes(common, directory)
        os.makedirs(os.path.dirname(directory), exist_ok=True)
        atomic_dir.clear_stale(directory)
        temp = atomic_dir.new_temp_dir(directory)
        os.mkdir(temp)
        return temp, common_data

    prepared, error = attempt(prepare, directory) if coordinator else (None, None)
    offers = gather((coordinator, prepared[0] if prepared else None, error), group)
    agree(next((e for _, _, e in offers if e), None), group)
    coordinators = [r for r, (c, _, _) in enumerate(offers) if c]
    if len(coordinators) != 1:
        if prepared is not None:
            shutil.rmtree(prepared[0], ignore_errors=True)
        raise CheckpointError(
            f"checkpoint {directory}: {len(coordinators)} ranks say they are the coordinator "
            f"({coordinators}); exactly one must"
        )
    temp = offers[coordinators[0]][1]
    try:
        writer = dcp.FileSystemWriter(
            temp, single_file_per_rank=True, sync_files=True, overwrite=False
        )
        _dcp_call(
            lambda: dcp.save(
                {},
                storage_writer=writer,
                planner=ShardSavePlanner(shards, directory, objects),
                process_group=group,
                no_dist=group is None,
            ),
            directory,
        )
        # Each rank fsyncs and hashes its own files; the coordinator adds its own and publishes.
        mine, error = attempt(
            lambda: atomic_dir.fsync_and_digest(
                temp, sorted(n for n in os.listdir(temp) if n.startswith(f"__{rank}_"))
            ),
            directory,
        )
        digests = gather((mine, error), group)
        agree(next((e for _, e in digests if e), None), group)

        def finish() -> None:
            assert prepared is not None
            _write_synced(os.path.join(temp, COMMON), prepared[1])
            _write_synced(
                os.path.join(temp, METADATA_JSON_NAME), json.dumps(METADATA_JSON).encode()
            )
            table = atomic_dir.fsync_and_digest(temp, [DCP_METADATA, COMMON, METADATA_JSON_NAME])
            for part, _ in digests:
                table.update(part)
            atomic_dir.write_checksums(temp, table)
            atomic_dir.publish(temp, directory)

        _, error = attempt(finish, directory) if coordinator else (None, None)
        agree(error, group)  # also the barrier: nobody returns before `directory` is in place
    except BaseException:
        if coordinator:
            shutil.rmtree(temp, ignore_errors=True)
        raise


# --- load ---------------------------------------------------------------------------------


def _verify(directory: str, names: list[str], require_checksums: bool) -> None:
    if not require_checksums and not os.path.exists(
        os.path.join(directory, atomic_dir.CHECKSUMS_NAME)
    ):
        return  # e.g. a Megatron-Core checkpoint: safe unpickling still applies
    atomic_dir.verify_files(directory, names)


def _check_directory(directory: str) -> None:
    if not os.path.isdir(directory):
        raise CheckpointError(f"checkpoint {directory}: no such directory")
    path = os.path.join(directory, METADATA_JSON_NAME)
    if os.path.exists(path):
        try:
            with open(path, encoding="utf-8") as f:
                backend = json.load(f).get("sharded_backend")
        except (OSError, ValueError, AttributeError) as e:
            raise CheckpointError(f"checkpoint file {path}: malformed ({e})") from None
        if backend != "torch_dist":
            raise CheckpointError(
                f"checkpoint file {path}: sharded_backend is {backend!r}, not 'torch_dist'"
            )


def read_metadata(directory: str, *, require_checksums: bool = True) -> Metadata:
    """DCP's metadata of `directory`, checksum-verified and read with the allow-list."""
    _check_directory(directory)
    _verify(directory, [DCP_METADATA], require_checksums)
    return load_dcp_metadata(os.path.join(directory, DCP_METADATA))


def sharded_keys(directory: str, *, require_checksums: bool = True) -> dict[str, tuple[int, ...]]:
    """Global shape of every tensor the checkpoint holds (read safely, not collective)."""
    metadata = read_metadata(directory, require_checksums=require_checksums)
    return {
        k: tuple(md.size)
        for k, md in metadata.state_dict_metadata.items()
        if isinstance(md, TensorStorageMetadata)
    }


def _plan_load(
    directory: str, shards: ShardedState, require_checksums: bool, fit: Fit | None
) -> tuple[list, DtypeConversions, ShardedState]:
    """Check every requested piece (after `fit`) against the checkpoint, verify the files it
    will read."""
    metadata = read_metadata(directory, require_checksums=require_checksums)
    held = metadata.state_dict_metadata
    if fit is not None:
        shapes = {
            k: tuple(md.size) for k, md in held.items() if isinstance(md, TensorStorageMetadata)
        }
        shards = fit(shards, shapes, directory)
    conversions: DtypeConversions = {}
    for fqn, pieces in shards.items():
        md = held.get(fqn)
        if md is None:
            raise CheckpointError(
                f"checkpoint {directory}: tensor {fqn} is missing ({len(held)} entries there)"
            )
        if not isinstance(md, TensorStorageMetadata):
            raise CheckpointError(f"checkpoint {directory}: entry {fqn} is bytes, not a tensor")
        for piece in pieces:
            if tuple(md.size) != tuple(piece.global_shape):
                raise CheckpointError(
                    f"checkpoint {directory}: tensor {fqn} has global shape {tuple(md.size)} "
                    f"in the checkpoint, {tuple(piece.global_shape)} in this model"
                )
            if piece.tensor.dtype != md.properties.dtype:
                conversions[fqn] = (md.properties.dtype, piece.tensor.dtype)
    items = read_items(shards, metadata)
    filled: dict[tuple[str, int], int] = {}
    files = {DCP_METADATA}
    for item in items:
        key = (item.dest_index.fqn, item.dest_index.index)
        filled[key] = filled.get(key, 0) + math.prod(item.lengths)
        info = metadata.storage_data.get(item.storage_index)
        if info is None:
            raise CheckpointError(
                f"checkpoint {directory}: no storage entry for {item.storage_index.fqn} at "
                f"{tuple(item.storage_index.offset)} in {DCP_METADATA}"
            )
        files.add(info.relative_path)
    for fqn, pieces in shards.items():
        for index, piece in enumerate(pieces):
            if filled.get((fqn, index), 0) != piece.tensor.numel():
                raise CheckpointError(
                    f"checkpoint {directory}: tensor {fqn}: the checkpoint holds "
                    f"{filled.get((fqn, index), 0)} of the {piece.tensor.numel()} elements of "
                    f"the piece at {piece.offsets}"
                )
    _verify(directory, sorted(files), require_checksums)
    return items, conversions, shards


def load_sharded(
    directory: str,
    shards: ShardedState,
    *,
    group: dist.ProcessGroup | None,
    require_checksums: bool = True,
    fit: Fit | None = None,
) -> DtypeConversions:
    """Fill every destination TensorShard of `shards` in place from the checkpoint, whatever
    split it was saved with. Collective over `group` (each rank asks for its own pieces).
    `fit` adjusts the requested pieces to the checkpoint's global shapes first (e.g.
    `layout_free.fit_vocabulary`: any vocabulary padding), its errors agreed like the rest.
    Returns the tensors whose dtype was converted: name -> (checkpoint dtype, model dtype)."""
    directory = os.path.abspath(directory)
    planned, error = attempt(
        lambda: _plan_load(directory, shards, require_checksums, fit), directory
    )
    agree(error, group)
    assert planned is not None
    items, conversions, shards = planned
    _dcp_call(
        lambda: dcp.load(
            {},
            storage_reader=SafeFileSystemReader(directory),
            planner=ShardLoadPlanner(shards, items, directory),
            process_group=group,
            no_dist=group is None,
        ),
        directory,
    )
    return conversions


def load_common(directory: str, *, require_checksums: bool = True) -> dict:
    """The non-sharded state, checksum-verified and loaded with weights_only=True."""
    directory = os.path.abspath(directory)
    _check_directory(directory)
    path = os.path.join(directory, COMMON)
    _verify(directory, [COMMON], require_checksums)
    common = safe_torch_load(path, COMMON_PT_GLOBALS)
    if not isinstance(common, dict):
        raise CheckpointError(
            f"checkpoint file {path}: holds a {type(common).__name__}, not a dict"
        )
    return common


def verify_checkpoint(directory: str) -> None:
    """Every file of the checkpoint against checksums.json (for tools and tests)."""
    _check_directory(os.path.abspath(directory))
    atomic_dir.verify_directory(os.path.abspath(directory))
