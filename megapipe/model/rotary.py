"""Rotary position embeddings (RoPE), Megatron's non-interleaved "rotate half" form."""

from __future__ import annotations

from collections.abc import Callable

import torch


class RotaryEmbedding(torch.nn.Module):
    """cos/sin tables shaped [s, 1, 1, head_dim], built for `max_positions` positions.

    RoPE has no learned table, so `max_positions` (--max-position-embeddings) is only the
    table's first size: a longer sequence (Megatron lets --seq-length exceed it under rope)
    rebuilds the tables for its length, once.
    """

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        base: int = 10000,
        kernel: Callable[..., torch.Tensor] | None = None,
    ) -> None:
        """kernel: a fused rotary (x, cos, sin, offset) -> rotated x, or None for plain torch."""
        super().__init__()
        self.head_dim, self.base, self.kernel = head_dim, base, kernel
        cos, sin = self._tables(max_positions, torch.device("cpu"))
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def _tables(self, positions: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.float64) / self.head_dim
        inv_freq = 1.0 / (self.base**exponents)
        angles = torch.outer(torch.arange(positions, dtype=torch.float64), inv_freq)
        angles = torch.cat([angles, angles], dim=-1)[:, None, None, :]
        return angles.cos().float().to(device), angles.sin().float().to(device)

    def forward(self, x: torch.Tensor, offset: int = 0) -> torch.Tensor:
        """Rotate x of shape [s, b, heads, head_dim] by the angles of positions
        offset..offset+s-1 (offset > 0: the new tokens of a generation step after a KV cache)."""
        end = offset + x.shape[0]
        if end > self.cos.shape[0]:
            self.cos, self.sin = self._tables(end, self.cos.device)
        if self.kernel is not None:
            return self.kernel(x, self.cos, self.sin, offset)
        cos, sin = self.cos[offset:end].to(x.dtype), self.sin[offset:end].to(x.dtype)
        first, second = x.chunk(2, dim=-1)
        return x * cos + torch.cat([-second, first], dim=-1) * sin
