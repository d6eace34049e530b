"""No host stalls in the step: a fixed handful of host syncs per iteration, batches read one
micro-batch ahead, masks built where the tokens are.

On a GPU, every `.item()`, `bool(tensor)` or `nonzero` makes the host wait for the device to
catch up, and a batch copied from pageable memory waits too; both leave the GPU idle between
kernels. The CPU cannot show the idle time, but it can count the operations that would cause
it: `_local_scalar_dense` (what `.item()`, `float()`, `int()` and `bool()` of a tensor run),
`is_nonzero`, `nonzero` and their kind, recorded by a dispatch mode around whole training
runs. Runs of 2 and 4 iterations, and of 2 and 4 micro-batches, separate what each step costs
from start-up and show that nothing is paid per micro-batch.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megapipe.data.gpt_batches import GPTBatchSource
from megapipe.data.masks import MaskOptions
from megapipe.data.mock import MockGPTDataset
from megapipe.testing import run_distributed, train_with_flags
from megapipe.training.step import ReadAhead
from tests.helpers import OpCounter

SYNCING = {"_local_scalar_dense", "is_nonzero", "nonzero", "masked_select", "unique", "equal"}
BASE = [
    "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
    "--seq-length", "16", "--mock-data", "--eval-iters", "0", "--vocab-size", "200",
    "--micro-batch-size", "1", "--lr", "3e-3", "--attention-dropout", "0",
    "--hidden-dropout", "0", "--log-interval", "1", "--clip-grad", "0.5",
]  # fmt: skip
MAX_SYNCS_PER_STEP = 2  # the step's loss (for the log line) and the grad norm (for clipping)


def _count_syncs(rank: int, world: int, iters: int, microbatches: int, extra: list[str]):
    dp = world // 2 if "--pipeline-model-parallel-size" in extra else world
    gbs = microbatches * dp
    argv = BASE + ["--train-iters", str(iters), "--global-batch-size", str(gbs)] + extra
    with OpCounter() as counter:
        train_with_flags(rank, world, argv)
    return sum(counter.counts[name] for name in SYNCING)


@pytest.mark.parametrize(
    "world,extra",
    [
        (1, []),
        (
            4,
            [
                "--pipeline-model-parallel-size",
                "2",
                "--use-distributed-optimizer",
                "--overlap-grad-reduce",
                "--emulate-nccl-p2p-order",
            ],
        ),
    ],  # fmt: skip
    ids=["1-rank", "pp2-dp2-distopt-overlap"],
)
def test_a_step_syncs_the_host_a_fixed_handful_of_times_whatever_the_micro_batches(world, extra):
    def syncs(iters: int, microbatches: int) -> list[int]:
        return run_distributed(_count_syncs, world, iters, microbatches, extra)

    base, longer, wider = syncs(2, 2), syncs(4, 2), syncs(2, 4)
    for rank in range(world):
        per_step = (longer[rank] - base[rank]) / 2
        assert 0 < per_step <= MAX_SYNCS_PER_STEP, (rank, base, longer)
        assert wider[rank] == base[rank], (rank, base, wider)  # none per micro-batch


def test_read_ahead_reads_the_next_micro_batch_once_and_returns_each_its_own():
    data = MockGPTDataset(vocab_size=50, seq_length=8, seed=3)
    reads: list[int] = []

    def read(i: int):
        reads.append(i)
        return data.batch(range(2 * i, 2 * i + 2))

    ahead = ReadAhead(read, 3)
    got = [ahead(i) for i in range(3)]
    assert reads == [0, 1, 2]  # micro-batch 1 was read while 0 was handed out
    for i, batch in enumerate(got):
        assert torch.equal(batch.tokens, data.batch(range(2 * i, 2 * i + 2)).tokens)
    reads.clear()
    first = ReadAhead(read, 2)
    first(0)
    assert reads == [0, 1]
    first(1)
    assert reads == [0, 1]  # the last one was already there; nothing beyond the step is read


def test_masks_and_positions_are_built_on_the_batch_device():
    class Samples:
        def __len__(self) -> int:
            return 8

        def __getitem__(self, index: int) -> np.ndarray:
            return np.array([1, 2, 0, 3, 4, 0, 5, 6, 7]) + index % 2  # eod 0 twice

    options = MaskOptions(eod=0, eod_mask_loss=True, reset_position_ids=True,
                          reset_attention_mask=True)  # fmt: skip
    source = GPTBatchSource(Samples(), 50, options)
    # the meta device holds no data: anything computed on the host and then copied would be
    # a host tensor first; everything here is created on the batch's device
    on_meta = source.batch(range(2, 4), device="meta")
    for tensor in (on_meta.tokens, on_meta.labels, on_meta.loss_mask, on_meta.position_ids,
                   on_meta.attention_mask):  # fmt: skip
        assert tensor.device.type == "meta"
    on_cpu = source.batch(range(2, 4))
    assert on_cpu.attention_mask.shape == on_meta.attention_mask.shape == (2, 1, 8, 8)
    assert on_cpu.position_ids[0].tolist() == [0, 1, 2, 0, 1, 2, 0, 1]
    mock = MockGPTDataset(vocab_size=50, seq_length=8, seed=3).batch(range(2), device="meta")
    assert mock.loss_mask.device.type == "meta" and mock.tokens.device.type == "meta"
