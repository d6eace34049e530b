"""The gradient norm's sum of squares: exact to float64 within fp32 summation error, and
without a full-size temporary (the optimizer passes whole merged gradient runs)."""

import math

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from megapipe.distributed import grad_norm
from megapipe.distributed.grad_norm import sum_of_squares


@pytest.mark.parametrize("by_dot", [True, False], ids=["dot", "square"])
def test_sliced_sums_match_float64_across_slice_boundaries(monkeypatch, by_dot: bool) -> None:
    monkeypatch.setattr(grad_norm, "DOT_SLICE", 1000)
    monkeypatch.setattr(grad_norm, "SQUARE_SLICE", 1000)
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(2500, generator=g), torch.randn(7, 3, generator=g), torch.randn(1000)]
    expected = sum(float((t.double() ** 2).sum()) for t in tensors)
    got = float(sum_of_squares(tensors, torch.device("cpu"), by_dot=by_dot))
    assert got == pytest.approx(expected, rel=1e-6)
    half = [t.bfloat16() for t in tensors]  # squared in fp32, slice by slice
    expected_half = sum(float((t.double() ** 2).sum()) for t in half)
    got_half = float(sum_of_squares(half, torch.device("cpu"), by_dot=by_dot))
    assert got_half == pytest.approx(expected_half, rel=1e-6)
    assert sum_of_squares([], torch.device("cpu")).dtype == torch.float64
    bad = [torch.tensor([1.0, float("nan")]), torch.ones(3)]  # a NaN reaches the norm
    assert math.isnan(float(sum_of_squares(bad, torch.device("cpu"), by_dot=by_dot)))


def test_close_to_float64_at_a_models_size() -> None:
    """Half a million entries (this benchmark model's gradient) in the default CPU slices:
    as close to float64 as the parity tests need (1e-5 on losses)."""
    grad = torch.randn(530_000, generator=torch.Generator().manual_seed(1)) * 3 + 0.5
    exact = float((grad.double() ** 2).sum())
    assert float(sum_of_squares([grad], torch.device("cpu"))) == pytest.approx(exact, rel=3e-7)


@pytest.mark.parametrize("by_dot", [True, False], ids=["dot", "square"])
def test_no_temporary_larger_than_a_slice(by_dot: bool) -> None:
    """A 4M-entry gradient (16 MiB) is summed slice by slice: no allocation of 16 MiB (the
    squares of a slice are at most 4 MiB; dots allocate nothing of a slice's size)."""
    grad = torch.randn(1 << 22)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        total = sum_of_squares([grad], torch.device("cpu"), by_dot=by_dot)
    largest = max(e.cpu_memory_usage for e in prof.events())
    assert largest <= grad_norm.SQUARE_SLICE * 4 < grad.numel() * 4
    if by_dot:
        assert largest < grad_norm.DOT_SLICE * 4
    assert math.isclose(float(total), float((grad.double() ** 2).sum()), rel_tol=1e-6)
