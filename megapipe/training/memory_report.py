"""Megatron's per-rank memory line, `[Rank N] (after K iterations) memory (MB) | ...`.

On CUDA it reports the caching allocator's counters as Megatron's `report_memory` does. On the
CPU there is no allocator to ask, so it reports the process's resident set size instead: the
current RSS from /proc/self/statm (resident pages x page size) and the peak from
getrusage's ru_maxrss. Megatron prints it from data-parallel rank 0 only; the caller decides.
"""

from __future__ import annotations

import os
import resource
import sys

import torch

_MB = 1024.0 * 1024.0


def resident_set_bytes() -> int | None:
    """This process's current resident set size in bytes, or None where /proc is absent."""
    try:
        with open("/proc/self/statm") as statm:
            resident_pages = int(statm.read().split()[1])
    except (OSError, IndexError, ValueError):
        return None
    return resident_pages * os.sysconf("SC_PAGE_SIZE")


def peak_resident_set_bytes() -> int:
    """The process's peak resident set size in bytes (ru_maxrss: KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def memory_report_line(rank: int, iterations: int, device: torch.device) -> str:
    """The memory report of global rank `rank` after `iterations` iterations, in MiB."""
    line = f"[Rank {rank}] (after {iterations} iterations) memory (MB)"
    if device.type == "cuda":
        line += f" | allocated: {torch.cuda.memory_allocated(device) / _MB}"
        line += f" | max allocated: {torch.cuda.max_memory_allocated(device) / _MB}"
        line += f" | reserved: {torch.cuda.memory_reserved(device) / _MB}"
        line += f" | max reserved: {torch.cuda.max_memory_reserved(device) / _MB}"
        return line
    rss = resident_set_bytes()
    peak = peak_resident_set_bytes()
    if rss is not None:
        line += f" | RSS: {rss / _MB}"
        peak = max(peak, rss)  # statm and getrusage count pages differently; keep peak >= now
    line += f" | max RSS: {peak / _MB}"
    return line


def memory_scalars(device: torch.device) -> dict[str, float]:
    """--log-memory-to-tensorboard's scalars (bytes; counts for the allocation count).

    CUDA: Megatron's four names from torch.cuda.memory_stats. CPU: no allocator to ask, so
    the process's current and peak resident set size under names of their own
    (`mem-rss-bytes`, `mem-max-rss-bytes`), never passed off as the allocator's figures.
    """
    if device.type == "cuda":
        stats = torch.cuda.memory_stats(device)
        return {
            "mem-reserved-bytes": stats.get("reserved_bytes.all.current", 0),
            "mem-allocated-bytes": stats.get("allocated_bytes.all.current", 0),
            "mem-max-allocated-bytes": stats.get("allocated_bytes.all.peak", 0),
            "mem-allocated-count": stats.get("allocation.all.current", 0),
        }
    rss = resident_set_bytes()
    peak = peak_resident_set_bytes()
    scalars = {} if rss is None else {"mem-rss-bytes": rss}
    scalars["mem-max-rss-bytes"] = max(peak, rss or 0)
    return scalars
