"""The gradient norm's sum of squares: exact to float64 within fp32 summation error, and
without a full-size temporary (the optimizer passes whole merged gradient runs). The device
path (`by_dot=False`, what CUDA runs) is one `torch._foreach_norm` per dtype, checked against
`torch.nn.utils.clip_grad_norm_` as the independent reference, with its op count fixed
whatever the tensors' size (it was two ops per 1M-entry slice)."""

import math

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from megapipe.distributed import grad_norm
from megapipe.distributed.grad_norm import sum_of_squares
from tests.helpers import OpCounter


@pytest.mark.parametrize("by_dot", [True, False], ids=["dot", "foreach"])
def test_sliced_sums_match_float64_across_slice_boundaries(monkeypatch, by_dot: bool) -> None:
    monkeypatch.setattr(grad_norm, "DOT_SLICE", 1000)
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(2500, generator=g), torch.randn(7, 3, generator=g), torch.randn(1000)]
    expected = sum(float((t.double() ** 2).sum()) for t in tensors)
    got = float(sum_of_squares(tensors, torch.device("cpu"), by_dot=by_dot))
    assert got == pytest.approx(expected, rel=1e-6)
    half = [t.bfloat16() for t in tensors]  # squared in fp32
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


@pytest.mark.parametrize("by_dot", [True, False], ids=["dot", "foreach"])
def test_no_temporary_larger_than_a_slice(by_dot: bool) -> None:
    """A 4M-entry gradient (16 MiB): no allocation of its size (dots allocate nothing of a
    slice's size; the foreach norm nothing but its per-chunk sums)."""
    grad = torch.randn(1 << 22)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        total = sum_of_squares([grad], torch.device("cpu"), by_dot=by_dot)
    largest = max(e.cpu_memory_usage for e in prof.events())
    assert largest < grad_norm.DOT_SLICE * 4 < grad.numel() * 4
    exact = float((grad.double() ** 2).sum())
    # the CPU's fp32 norm kernel (the foreach path on CPU) is 2e-4 off float64 at this size:
    # why the CPU path uses dots; CUDA's kernel adds 65,536-entry chunk sums instead
    assert math.isclose(float(total), exact, rel_tol=1e-6 if by_dot else 5e-4)


def _model_grads(seed: int, dtype: torch.dtype) -> tuple[torch.nn.Module, list[torch.Tensor]]:
    """A model with a few large parameters (8.4 M entries) and random gradients."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(2048, 1536), torch.nn.Linear(1536, 2048), torch.nn.Linear(2048, 1024)
    ).to(dtype)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-2
    return model, [p.grad for p in model.parameters()]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_device_path_is_one_foreach_norm_and_equals_clip_grad_norm(dtype) -> None:
    model, grads = _model_grads(0, dtype)
    with OpCounter() as counted:
        total = sum_of_squares(grads, torch.device("cpu"), by_dot=False)
    kernels = {op: n for op, n in counted.counts.items() if op != "detach"}  # detach: a view
    # one norm call for all six tensors, then stack, cast, square and sum the six norms;
    # the sliced path ran a mul and a sum per 1M-entry slice: 22 here, ~2,500 at 1.3B
    assert kernels == {"_foreach_norm": 1, "stack": 1, "_to_copy": 1, "mul": 1, "sum": 1}
    reference = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1e9)
    # clip_grad_norm_ returns a bf16 norm for bf16 gradients (one rounding: 2^-8 relative);
    # ours stays fp32 there, as the float64 bound below shows
    rel = 1e-6 if dtype == torch.float32 else 2**-8
    assert math.sqrt(float(total)) == pytest.approx(float(reference), rel=rel)
    exact = math.sqrt(sum(float((g.double() ** 2).sum()) for g in grads))
    assert math.sqrt(float(total)) == pytest.approx(exact, rel=2e-4)  # the CPU's fp32 norm
    mixed = [g.float() if i % 2 else g for i, g in enumerate(grads)]  # two dtype groups
    mixed = sum_of_squares(mixed, torch.device("cpu"), by_dot=False)
    assert float(mixed) == pytest.approx(float(total), rel=2e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_device_path_on_cuda_is_close_to_float64_without_a_full_size_temporary() -> None:
    grad = torch.randn(1 << 26, device="cuda") * 3 + 0.5  # 64 M entries, 256 MiB
    exact = float((grad.double() ** 2).sum())
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    total = sum_of_squares([grad, grad[:1000].bfloat16()], grad.device)
    peak = torch.cuda.max_memory_allocated() - before
    assert total.device == grad.device and peak < (1 << 20)
    half = float((grad[:1000].bfloat16().double() ** 2).sum())
    assert float(total) == pytest.approx(exact + half, rel=1e-6)
