"""DCP planners for `TensorShard`s: each piece a SHARD write item with its chunk and the
global size (as DCP builds them for ShardedTensor/DTensor), and load read items for the
requested regions from whatever chunks the checkpoint holds (DCP's resharding sweep).

Saving also writes byte entries (BYTE_IO items: Megatron-Core's `_extra_state` objects), each
from one rank; loading never reads them."""

from __future__ import annotations

import io
import math
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import create_default_global_save_plan
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from megapipe.checkpointing.errors import CheckpointError
from megapipe.checkpointing.shards import ShardedState


def _chunk(offsets: tuple[int, ...], sizes: torch.Size) -> ChunkStorageMetadata:
    return ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))


def _overlap(a: ChunkStorageMetadata, b: ChunkStorageMetadata) -> bool:
    return all(
        a.offsets[d] < b.offsets[d] + b.sizes[d] and b.offsets[d] < a.offsets[d] + a.sizes[d]
        for d in range(len(a.offsets))
    )


def _narrow(tensor: torch.Tensor, offsets: torch.Size, lengths: torch.Size) -> torch.Tensor:
    for dim, (start, length) in enumerate(zip(offsets, lengths)):
        if start != 0 or length != tensor.size(dim):
            tensor = tensor.narrow(dim, start, length)
    return tensor


def write_items(
    shards: ShardedState, objects: Mapping[str, bytes] | None = None
) -> list[WriteItem]:
    """One SHARD write item per non-empty piece, one BYTE_IO item per object."""
    items = [WriteItem(MetadataIndex(fqn), WriteItemType.BYTE_IO) for fqn in objects or {}]
    for fqn, pieces in shards.items():
        for piece in pieces:
            if piece.tensor.numel() == 0:
                continue
            items.append(
                WriteItem(
                    index=MetadataIndex(fqn, piece.offsets),
                    type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        chunk=_chunk(piece.offsets, piece.tensor.size()),
                        properties=TensorProperties.create_from_tensor(piece.tensor),
                        size=torch.Size(piece.global_shape),
                    ),
                )
            )
    return items


def check_byte_entries(all_plans: list[SavePlan], where: str) -> None:
    """Each byte entry is written by one rank, and no tensor has its name (checked before
    DCP builds the metadata, which would only assert)."""
    writers: dict[str, int] = {}  # byte entry -> the rank that writes it
    tensors = set()
    for rank, plan in enumerate(all_plans):
        for item in plan.items:
            if item.type != WriteItemType.BYTE_IO:
                tensors.add(item.index.fqn)
            elif writers.setdefault(item.index.fqn, rank) != rank:
                raise CheckpointError(
                    f"checkpoint {where}: entry {item.index.fqn} is written by rank "
                    f"{writers[item.index.fqn]} and rank {rank}"
                )
    both = sorted(tensors & set(writers))
    if both:
        raise CheckpointError(f"checkpoint {where}: {both[0]} is both bytes and a tensor")


def check_global_plan(all_plans: list[SavePlan], metadata: Metadata, where: str) -> None:
    """Every rank agrees on each tensor's global shape and dtype, and the pieces of all ranks
    tile each tensor exactly (no overlap, nothing missing)."""
    seen: dict[str, tuple[int, TensorWriteData]] = {}
    for rank, plan in enumerate(all_plans):
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                continue  # check_byte_entries
            data = item.tensor_data
            assert data is not None
            fqn = item.index.fqn
            first = seen.setdefault(fqn, (rank, data))
            if data.size != first[1].size:
                raise CheckpointError(
                    f"checkpoint {where}: tensor {fqn} has global shape "
                    f"{tuple(first[1].size)} on rank {first[0]}, {tuple(data.size)} on rank {rank}"
                )
            if data.properties.dtype != first[1].properties.dtype:
                raise CheckpointError(
                    f"checkpoint {where}: tensor {fqn} is {first[1].properties.dtype} on rank "
                    f"{first[0]}, {data.properties.dtype} on rank {rank}"
                )
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, BytesStorageMetadata):
            continue
        assert isinstance(md, TensorStorageMetadata)
        chunks = sorted(md.chunks, key=lambda c: tuple(c.offsets))
        for i, a in enumerate(chunks):
            for b in chunks[i + 1 :]:
                if len(a.offsets) and b.offsets[0] >= a.offsets[0] + a.sizes[0]:
                    break  # sorted by the first offset: no later chunk can overlap a
                if _overlap(a, b):
                    raise CheckpointError(
                        f"checkpoint {where}: tensor {fqn}: pieces at {tuple(a.offsets)} and "
                        f"{tuple(b.offsets)} overlap (two ranks saved the same region)"
                    )
        covered = sum(math.prod(c.sizes) for c in chunks)
        if covered != math.prod(md.size):
            raise CheckpointError(
                f"checkpoint {where}: tensor {fqn} of shape {tuple(md.size)}: the saved pieces "
                f"cover {covered} of {math.prod(md.size)} elements"
            )


class ShardSavePlanner(SavePlanner):
    """Writes this rank's TensorShards and byte `objects`; the coordinator checks that all
    ranks' pieces agree."""

    def __init__(
        self, shards: ShardedState, where: str, objects: Mapping[str, bytes] | None = None
    ) -> None:
        self._where = where
        self._objects = dict(objects or {})
        self._items = write_items(shards, self._objects)
        self._tensors = {
            (fqn, tuple(p.offsets)): p.tensor
            for fqn, pieces in shards.items()
            for p in pieces
            if p.tensor.numel()
        }
        if len(self._tensors) + len(self._objects) != len(self._items):
            raise CheckpointError(f"checkpoint {where}: two pieces of one tensor at one offset")

    def set_up_planner(
        self, state_dict: Any, storage_meta: Any = None, is_coordinator: bool = False
    ) -> None:
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> SavePlan:
        return SavePlan(list(self._items))

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        check_byte_entries(all_plans, self._where)
        plans, metadata = create_default_global_save_plan(all_plans)
        check_global_plan(plans, metadata, self._where)
        return plans, metadata

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        return new_plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        if write_item.type == WriteItemType.BYTE_IO:
            return io.BytesIO(self._objects[write_item.index.fqn])
        tensor = self._tensors[(write_item.index.fqn, tuple(write_item.index.offset))]
        tensor = tensor.detach().cpu()
        # torch.save writes a view's whole storage: store only the piece itself.
        if not tensor.is_contiguous() or tensor.untyped_storage().nbytes() != (
            tensor.numel() * tensor.element_size()
        ):
            tensor = tensor.clone(memory_format=torch.contiguous_format)
        return tensor


def read_items(shards: ShardedState, metadata: Metadata) -> list[ReadItem]:
    """DCP read items filling every requested piece (keys and shapes checked beforehand)."""
    items: list[ReadItem] = []
    for fqn, pieces in shards.items():
        md = metadata.state_dict_metadata[fqn]
        assert isinstance(md, TensorStorageMetadata)
        chunks = [_chunk(p.offsets, p.tensor.size()) for p in pieces]
        # dest_index.index is the piece's position in `pieces` (create_read_items' local_idx)
        items += create_read_items_for_chunk_list(fqn, md, chunks)
    return items


class ShardLoadPlanner(LoadPlanner):
    """Copies checkpoint regions into the destination TensorShards in place (dtype converted
    by `copy_`). Byte entries are refused: their payload would be a full `torch.load`."""

    def __init__(self, shards: ShardedState, items: list[ReadItem], where: str) -> None:
        self._shards = shards
        self._items = items
        self._where = where

    def set_up_planner(
        self, state_dict: Any, metadata: Any = None, is_coordinator: bool = False
    ) -> None:
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> LoadPlan:
        return LoadPlan(list(self._items))

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        return global_plan

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return central_plan

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        raise CheckpointError(
            f"checkpoint {self._where}: entry {read_item.dest_index.fqn} is pickled bytes, "
            "which this loader never unpickles"
        )

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        piece = self._shards[read_item.dest_index.fqn][read_item.dest_index.index]
        return _narrow(piece.tensor, read_item.dest_offsets, read_item.lengths)

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass  # resolve_tensor handed out a view of the destination: already written
