"""The keys and values a generation run has computed so far, per layer this rank holds.

Prefill writes the prompt's keys and values once; each later step writes one position and
attends over everything cached. Under tensor parallelism each rank caches only its own query
groups ([b, groups/tp, max_length, head_dim] per layer), so the cache splits as the weights do.
"""

from __future__ import annotations

import torch


class KVCache:
    """Preallocated key/value buffers for a batch of `batch` sequences of at most `max_length`.

    `offset` is the number of positions cached so far: the next forward's tokens sit at
    positions offset.. (rotary angles and learned positions follow it). Buffers are allocated
    at a layer's first `update`, with that layer's dtype, device and number of groups.
    """

    def __init__(self, batch: int, max_length: int) -> None:
        self.batch, self.max_length = batch, max_length
        self.offset = 0
        self._keys: dict[int, torch.Tensor] = {}
        self._values: dict[int, torch.Tensor] = {}

    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new positions' k, v ([b, groups, s, head_dim]) of global layer `layer` at
        offset..offset+s; returns the keys and values of positions 0..offset+s-1 (views)."""
        b, groups, s, dim = k.shape
        end = self.offset + s
        if b != self.batch or end > self.max_length:
            raise ValueError(
                f"KV cache holds {self.batch} sequences of {self.max_length} positions; "
                f"got {b} sequences up to position {end}"
            )
        if layer not in self._keys:
            shape = (self.batch, groups, self.max_length, dim)
            self._keys[layer] = k.new_empty(shape)
            self._values[layer] = v.new_empty(shape)
        keys, values = self._keys[layer], self._values[layer]
        keys[:, :, self.offset : end] = k
        values[:, :, self.offset : end] = v
        return keys[:, :, :end], values[:, :, :end]

    def advance(self, positions: int) -> None:
        """Mark `positions` more positions as cached (after every layer of a step has run)."""
        self.offset += positions
