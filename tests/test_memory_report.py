"""The per-rank memory line: CPU RSS against the kernel's own /proc/self/status numbers."""

from __future__ import annotations

import re

import pytest
import torch

from megapipe.training.memory_report import memory_report_line

CPU_LINE = re.compile(
    r"^\[Rank 3\] \(after 1 iterations\) memory \(MB\) \| RSS: ([0-9.]+) \| max RSS: ([0-9.]+)$"
)


def _status_mib(field: str) -> float:
    """VmRSS / VmHWM from /proc/self/status (kB), read independently of statm and getrusage."""
    with open("/proc/self/status") as status:
        for row in status:
            if row.startswith(field + ":"):
                return int(row.split()[1]) / 1024.0
    raise AssertionError(f"{field} missing from /proc/self/status")


def test_cpu_line_reports_resident_set_size_as_the_kernel_does() -> None:
    ballast = torch.ones(64 * 1024 * 1024 // 4)  # 64 MiB touched, so RSS is clearly above it
    before = _status_mib("VmRSS")
    match = CPU_LINE.match(memory_report_line(3, 1, torch.device("cpu")))
    after = _status_mib("VmRSS")
    assert match, memory_report_line(3, 1, torch.device("cpu"))
    rss, max_rss = float(match.group(1)), float(match.group(2))
    assert min(before, after) - 2.0 <= rss <= max(before, after) + 2.0
    assert rss >= 64.0
    assert max_rss == pytest.approx(_status_mib("VmHWM"), abs=2.0)
    assert max_rss >= rss - 1.0
    del ballast


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_line_reports_the_allocator_counters() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    block = torch.empty(32 * 1024 * 1024, dtype=torch.uint8, device=device)  # 32 MiB
    line = memory_report_line(0, 2, device)
    fields = dict(
        part.split(": ") for part in line.split(" | ")[1:]
    )  # allocated, max allocated, reserved, max reserved
    assert line.startswith("[Rank 0] (after 2 iterations) memory (MB) | allocated: ")
    assert float(fields["allocated"]) == pytest.approx((base + 32 * 1024 * 1024) / 2**20)
    assert float(fields["max allocated"]) >= float(fields["allocated"])
    assert float(fields["reserved"]) >= float(fields["allocated"])
    assert float(fields["max reserved"]) >= float(fields["reserved"])
    del block
