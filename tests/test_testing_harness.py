"""The multi-rank harness itself: results in rank order, failures and hangs surface quickly;
and test support (megapipe.testing) stays out of the runtime's imports."""

import time

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
