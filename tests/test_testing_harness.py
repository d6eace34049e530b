"""The multi-rank harness itself: results in rank order, failures and hangs surface quickly;
and test support (megapipe.testing) stays out of the runtime's imports."""

import ast
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megapipe.testing import DistributedTestError, run_distributed


def _sum_of_ranks(rank, world):
    x = torch.tensor([float(rank)])
    dist.all_reduce(x)
    return rank, torch.get_num_threads(), x.item()


def _rank_two_raises(rank, world):
    if rank == 2:
        raise ValueError("deliberate failure on rank two")
    dist.barrier()
    return rank


def _rank_zero_hangs(rank, world):
    if rank == 0:
        time.sleep(60)
    return rank


def test_results_come_back_in_rank_order_with_one_thread():
    results = run_distributed(_sum_of_ranks, 4)
    assert results == [(r, 1, 6.0) for r in range(4)]


def test_failing_rank_traceback_is_in_the_error():
    start = time.monotonic()
    with pytest.raises(DistributedTestError) as err:
        run_distributed(_rank_two_raises, 4, timeout=30)
    assert "rank 2" in str(err.value)
    assert "deliberate failure on rank two" in str(err.value)
    assert time.monotonic() - start < 20


def test_a_hanging_rank_fails_after_the_timeout():
    start = time.monotonic()
    with pytest.raises(DistributedTestError, match="rank 0 timed out"):
        run_distributed(_rank_zero_hangs, 2, timeout=2)
    assert time.monotonic() - start < 10


def _imports(root: Path, relative: Path) -> set[str]:
    """The modules a file under root imports, absolute, at any depth (lazy imports included)."""
    package = ".".join(relative.with_suffix("").parts[:-1])
    names: set[str] = set()
    for node in ast.walk(ast.parse((root / relative).read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            module = ".".join(filter(None, [base, node.module or ""]))
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)
    return names


def test_the_runtime_never_imports_test_support_and_kernels_never_import_the_model():
    """megapipe.testing (harness, parity, reference GPT, kernel cases) is for tests, tools and
    benchmarks; kernel inputs built from model code made kernels <-> model a cycle."""
    root = Path(__file__).resolve().parents[1]
    offenders = []
    for path in sorted((root / "megapipe").rglob("*.py")):
        relative = path.relative_to(root)
        if relative.parts[1] == "testing":
            continue
        imports = _imports(root, relative)
        if any(n == "megapipe.testing" or n.startswith("megapipe.testing.") for n in imports):
            offenders.append(f"{relative} imports megapipe.testing")
        if relative.parts[1] == "kernels" and any(n.startswith("megapipe.model") for n in imports):
            offenders.append(f"{relative} imports megapipe.model")
    assert offenders == []
