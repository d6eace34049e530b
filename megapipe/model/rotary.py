"""Rotary position embeddings (RoPE), Megatron's non-interleaved "rotate half" form."""

from __future__ import annotations

import torch


class RotaryEmbedding(torch.nn.Module):
    """cos/sin tables for positions [0, max_positions), shaped [s, 1, 1, head_dim]."""

    def __init__(self, head_dim: int, max_positions: int, base: int = 10000) -> None:
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv_freq)
        angles = torch.cat([angles, angles], dim=-1)[:, None, None, :]
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Rotate x of shape [s, b, heads, head_dim] by the angles of positions 0..s-1."""
        s = x.shape[0]
        cos, sin = self.cos[:s].to(x.dtype), self.sin[:s].to(x.dtype)
        first, second = x.chunk(2, dim=-1)
        return x * cos + torch.cat([-second, first], dim=-1) * sin
