"""Gradient buffers: layout, accumulation, bucket reduction overlapped with backward."""

import pytest
import torch

from megapipe.distributed.grad_buffer import GradBuffer
from megapipe.parallel.state import Group, ParallelState
from megapipe.testing import run_distributed


def _params(*sizes):
    return [torch.nn.Parameter(torch.full((n,), float(i + 1))) for i, n in enumerate(sizes)]


def test_layout_buckets_padding_and_solo_parameters():
    a, b, c, d = _params(5, 7, 30, 11)
    dp4 = Group((0, 1, 2, 3), 0)
    buffer = GradBuffer([a, b, c, d], dp4, num_microbatches=1, bucket_size=12, shard=True, solo=[b])
    # b alone first; then reverse order d, c (bucket full), a; every bucket padded to a
    # multiple of DP x SHARD_ALIGNMENT = 4 x 128, so that each rank's shard starts aligned
    assert [(bk.start, bk.end, [p.numel() for p in bk.params]) for bk in buffer.buckets] == [
        (0, 512, [7]),
        (512, 1024, [11, 30]),
        (1024, 1536, [5]),
    ]
    assert buffer.shard_ranges() == [(0, 128), (512, 640), (1024, 1152)]
    for p, value in ((a, 1.0), (b, 2.0), (c, 3.0), (d, 4.0)):
        assert torch.all(p == value)  # data moved into the flat buffer unchanged
        assert p.data.data_ptr() == buffer.param_data[p.buffer_offset :].data_ptr()
        assert p.main_grad.data_ptr() == buffer.grad_data[p.buffer_offset :].data_ptr()


def test_hooks_accumulate_micro_batches_into_main_grad_and_free_grad():
    (w,) = _params(4)
    buffer = GradBuffer([w], ParallelState.single().dp, num_microbatches=3)
    for k in range(3):
        (w * (k + 1)).sum().backward()
        assert w.grad is None
    buffer.finish_grad_sync()
    assert torch.equal(w.main_grad, torch.full((4,), 6.0))
    buffer.reset()
    assert torch.equal(w.main_grad, torch.zeros(4))


def _overlap(rank, world, overlap, shard):
    dp = ParallelState.build().dp
    params = _params(200, 300, 260, 100)  # every rank's shard of every bucket holds gradients
    buffer = GradBuffer(
        params, dp, num_microbatches=2, bucket_size=256, overlap=overlap, shard=shard
    )
    for microbatch in range(2):
        sum(((rank + 1) * (microbatch + 1) * p * p).sum() for p in params).backward()
        if microbatch == 0:
            started_after_first = buffer.started_before_finish
    started_in_backward = buffer.started_before_finish
    buffer.finish_grad_sync()
    # d/dp sum_k (r+1)(k+1) p^2 = 2 p (r+1) * 3, averaged over ranks r
    expected = [2 * p.detach() * 3 * sum(r + 1 for r in range(world)) / world for p in params]
    errors = []
    for lo, hi in buffer.shard_ranges():
        for p, e in zip(params, expected):
            s, t = max(lo, p.buffer_offset), min(hi, p.buffer_offset + p.numel())
            if s < t:
                got = buffer.grad_data[s:t]
                want = e.view(-1)[s - p.buffer_offset : t - p.buffer_offset]
                errors.append(float((got - want).abs().max()))
    return started_after_first, started_in_backward, len(buffer.buckets), max(errors)


@pytest.mark.parametrize("shard", [False, True])
@pytest.mark.parametrize("overlap", [False, True])
def test_buckets_reduce_during_the_last_micro_batch_backward_only_with_overlap(overlap, shard):
    for after_first, in_backward, buckets, error in run_distributed(_overlap, 2, overlap, shard):
        assert error < 1e-6
        assert buckets >= 3
        assert after_first == 0  # never before the last micro-batch
        assert in_backward == (buckets if overlap else 0)
