"""The gradient norm's sum of squares: exact to float64 within fp32 summation error, and
without a full-size temporary (the optimizer passes whole merged gradient runs)."""

import math

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from megapipe.distributed import grad_norm
from megapipe.distributed.grad_norm import sum_of_squares


def test_sliced_squares_match_float64_across_slice_boundaries(monkeypatch) -> None:
    monkeypatch.setattr(grad_norm, "SQUARE_SLICE", 1000)
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(2500, generator=g), torch.randn(7, 3, generator=g), torch.randn(1000)]
    expected = sum(float((t.double() ** 2).sum()) for t in tensors)
    got = float(sum_of_squares(tensors, torch.device("cpu")))
    assert got == pytest.approx(expected, rel=1e-6)
    half = [t.bfloat16() for t in tensors]  # squared in fp32, slice by slice
    expected_half = sum(float((t.double() ** 2).sum()) for t in half)
    got_half = float(sum_of_squares(half, torch.device("cpu")))
    assert got_half == pytest.approx(expected_half, rel=1e-6)
    assert sum_of_squares([], torch.device("cpu")).dtype == torch.float64


def test_no_temporary_larger_than_a_slice() -> None:
    """A 4M-entry gradient (16 MiB) is squared in 4 MiB slices: no 16 MiB allocation."""
    grad = torch.randn(1 << 22)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        total = sum_of_squares([grad], torch.device("cpu"))
    largest = max(e.cpu_memory_usage for e in prof.events() if e.name == "aten::mul")
    assert largest <= grad_norm.SQUARE_SLICE * 4 < grad.numel() * 4
    assert math.isclose(float(total), float((grad.double() ** 2).sum()), rel_tol=1e-6)
