"""Which global samples a data-parallel rank reads for one micro-batch.

Iteration `it` consumes samples [it * gbs, (it + 1) * gbs). Data-parallel rank d owns the
contiguous slice [d * gbs / dp, (d + 1) * gbs / dp) of it and walks through its slice one
micro-batch at a time. Whatever the layout, the union over ranks and micro-batches is the same
global batch, which is what lets layouts with different DP sizes train identically.
"""

from __future__ import annotations


def micro_batch_range(
    iteration: int,
    micro_batch: int,
    *,
    global_batch_size: int,
    micro_batch_size: int,
    data_parallel_rank: int,
    data_parallel_size: int,
    first_sample: int | None = None,
) -> range:
    """Global sample indices of micro-batch `micro_batch` (0-based) of `iteration` (0-based).

    `first_sample` overrides where the iteration's global batch starts (`iteration x
    global_batch_size` when every batch has the same size; the consumed samples under a
    batch-size ramp-up, or an evaluation's offset into its split).
    """
    per_rank = global_batch_size // data_parallel_size
    if per_rank * data_parallel_size != global_batch_size or per_rank % micro_batch_size:
        raise ValueError(
            f"global batch {global_batch_size} does not split into micro-batches of "
            f"{micro_batch_size} over {data_parallel_size} data-parallel ranks"
        )
    if not 0 <= micro_batch < per_rank // micro_batch_size:
        raise IndexError(
            f"micro-batch {micro_batch} out of range 0..{per_rank // micro_batch_size - 1}"
        )
    if first_sample is None:
        first_sample = iteration * global_batch_size
    start = first_sample + data_parallel_rank * per_rank
    start += micro_batch * micro_batch_size
    return range(start, start + micro_batch_size)
