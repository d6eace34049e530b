"""The one currency of checkpointing: a rank's pieces of logical (global) tensors.

A logical tensor is named globally (`decoder.layers.self_attention.linear_qkv.weight`, the same
for every layout) and has a global shape. Each rank contributes or receives rectangular pieces
of it: `TensorShard(tensor, offsets, global_shape)` says that `tensor` is the region
[offsets, offsets + tensor.shape) of the logical tensor. Saving writes the pieces; loading
fills the pieces a rank asks for (any other split of the same logical tensor), which is all
that resharding between layouts needs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ShardedState = dict[str, list["TensorShard"]]  # logical name -> this rank's pieces of it


@dataclass(frozen=True)
class TensorShard:
    """`tensor` holds the region [offsets, offsets + tensor.shape) of a logical tensor of
    `global_shape`. For loading, `tensor` is the destination (a view that is written in place)."""

    tensor: torch.Tensor
    offsets: tuple[int, ...]
    global_shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if not (len(self.offsets) == len(self.global_shape) == self.tensor.dim()):
            raise ValueError(
                f"shard of rank {self.tensor.dim()} with offsets {self.offsets} and global shape "
                f"{self.global_shape}: the ranks differ"
            )
        for offset, size, total in zip(self.offsets, self.tensor.shape, self.global_shape):
            if offset < 0 or offset + size > total:
                raise ValueError(
                    f"shard {tuple(self.tensor.shape)} at {self.offsets} exceeds the global "
                    f"shape {self.global_shape}"
                )
