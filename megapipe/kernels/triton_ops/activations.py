"""Activation pieces shared by the Triton kernels (fp32 in, fp32 out)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def sigmoid_pair(t):
    """(sigmoid(t), 1 - sigmoid(t)), each to full relative precision, from one exp that
    cannot overflow."""
    e = tl.exp(-tl.abs(t))
    r = 1.0 / (1.0 + e)
    return tl.where(t >= 0, r, e * r), tl.where(t >= 0, e * r, r)
