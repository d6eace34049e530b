"""Rotary position embeddings (RoPE), Megatron's non-interleaved "rotate half" form.

With --rotary-percent below 1 only the first `rotary_dim` dims of each head rotate (angles
computed over that dim, as Megatron-Core's), and the rest pass through unchanged.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from megapipe.kernels.rotary import rotary_reference


class RotaryEmbedding(torch.nn.Module):
    """cos/sin tables shaped [s, 1, 1, rotary_dim], built for `max_positions` positions.

    RoPE has no learned table, so `max_positions` (--max-position-embeddings) is only the
    table's first size: a longer sequence (Megatron lets --seq-length exceed it under rope)
    rebuilds the tables for its length, once.

    The tables stay fp32 in a bf16/fp16 model (`model.to(torch.bfloat16)` rebuilds them in
    fp32 rather than rounding them: a bf16 cos is off by up to 2^-9), and the rotation runs in
    fp32 (or x's dtype, if wider) with the result cast back to x's dtype, as the fused kernel
    does (`kernels.rotary.rotary_reference`, the plain-torch path): one rounding of the
    output instead of rounded tables, products and sum.
    """

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        base: int = 10000,
        kernel: Callable[..., torch.Tensor] | None = None,
        rotary_dim: int | None = None,
    ) -> None:
        """kernel: a fused rotary (x, cos, sin, offset) -> rotated x, or None for plain torch;
        rotary_dim: the leading dims of a head to rotate (None: all of `head_dim`). The
        tables are `rotary_dim` wide; a partial rotation runs the plain-torch path."""
        super().__init__()
        rotary_dim = head_dim if rotary_dim is None else rotary_dim
        if not 0 < rotary_dim <= head_dim or rotary_dim % 2:
            raise ValueError(f"rotary_dim {rotary_dim} must be even and in (0, {head_dim}]")
        self.head_dim, self.rotary_dim, self.base = head_dim, rotary_dim, base
        self.kernel = kernel if rotary_dim == head_dim else None  # kernels rotate whole heads
        cos, sin = self._tables(max_positions, torch.device("cpu"))
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def _tables(self, positions: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        exponents = torch.arange(0, self.rotary_dim, 2, dtype=torch.float64) / self.rotary_dim
        inv_freq = 1.0 / (self.base**exponents)
        angles = torch.outer(torch.arange(positions, dtype=torch.float64), inv_freq)
        angles = torch.cat([angles, angles], dim=-1)[:, None, None, :]
        return angles.cos().float().to(device), angles.sin().float().to(device)

    def _apply(
        self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True
    ) -> RotaryEmbedding:
        """`.to()`, `.cuda()`, `.half()`...: the tables follow the device, never below fp32."""
        super()._apply(fn, recurse)
        if self.cos.dtype in (torch.float16, torch.bfloat16):
            self.cos, self.sin = self._tables(self.cos.shape[0], self.cos.device)
        return self

    def forward(
        self, x: torch.Tensor, offset: int = 0, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Rotate x of shape [s, b, heads, head_dim] by the angles of positions
        offset..offset+s-1 (offset > 0: the new tokens of a generation step after a KV cache),
        or of `positions` ([s] global positions: a context-parallel rank's chunks)."""
        end = offset + x.shape[0] if positions is None else int(positions.max()) + 1
        if end > self.cos.shape[0]:
            self.cos, self.sin = self._tables(end, self.cos.device)
        cos, sin = self.cos, self.sin
        if positions is not None:  # the rows of these positions, used from offset 0
            index = positions.to(cos.device)
            cos, sin, offset = cos.index_select(0, index), sin.index_select(0, index), 0
        if self.kernel is not None:
            return self.kernel(x, cos, sin, offset)
        if self.rotary_dim < x.shape[-1]:
            rotated = rotary_reference(x[..., : self.rotary_dim], cos, sin, offset)
            return torch.cat([rotated, x[..., self.rotary_dim :]], dim=-1)
        return rotary_reference(x, cos, sin, offset)
