"""The three indices behind a GPT dataset, built with vectorised numpy (no C++ helper).

- document index: the split's documents repeated for enough epochs and shuffled, int32;
- sample index: [num_samples + 1, 2] (position in the document index, token offset) where each
  sample starts; sample i spans its start to the next one's start inclusive, so samples are
  `seq_length + 1` tokens that overlap by one and cross document boundaries;
- shuffle index: a permutation of the samples.

The arrays equal megatron.core's (same numpy RandomState calls in the same order, and a sample
index equal to its C++ `build_sample_idx` with drop_last_partial_sequence and the extra token),
so a cache built here serves Megatron and vice versa. A sample starting at global token
g = i * seq_length of the concatenated epochs lies in the document whose token range holds g:
one `searchsorted` over the cumulative document lengths finds all of them at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from megapipe.data.errors import DataError

# Megatron separates the last epoch's shuffle when it would supply under 80% of an epoch.
SEPARATE_LAST_EPOCH_THRESHOLD = 0.80


@dataclass(frozen=True)
class GPTIndices:
    document_index: np.ndarray
    sample_index: np.ndarray
    shuffle_index: np.ndarray

    @property
    def num_samples(self) -> int:
        return self.sample_index.shape[0] - 1


def num_epochs_needed(tokens_per_epoch: int, num_samples: int | None, seq_length: int) -> int:
    """Epochs whose tokens cover num_samples * seq_length + 1 (1 when num_samples is None)."""
    if num_samples is None:
        return 1
    needed = num_samples * seq_length + 1
    return max(1, -(-needed // tokens_per_epoch))


def _separate_final_epoch(
    tokens_per_epoch: int, num_epochs: int, num_samples: int, seq_length: int
) -> tuple[bool, int]:
    """(whether the last epoch is shuffled apart, samples before the last epoch)."""
    if num_epochs == 1:
        return False, 0
    before_last = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length
    from_last = num_samples - before_last
    per_epoch = (tokens_per_epoch - 1) // seq_length
    assert 0 <= from_last <= per_epoch + 1, (from_last, per_epoch)
    return from_last < int(SEPARATE_LAST_EPOCH_THRESHOLD * per_epoch), before_last


def build_document_index(
    documents: np.ndarray, num_epochs: int, rng: np.random.RandomState, separate_last: bool
) -> np.ndarray:
    """`documents` tiled num_epochs times, shuffled (the last epoch apart if separate_last)."""
    if separate_last and num_epochs > 1:
        first = build_document_index(documents, num_epochs - 1, rng, False)
        last = build_document_index(documents, 1, rng, False)
        return np.concatenate((first, last))
    index = np.tile(np.asarray(documents, dtype=np.int32), num_epochs)
    rng.shuffle(index)
    return index


def build_sample_index(
    sequence_lengths: np.ndarray, document_index: np.ndarray, seq_length: int
) -> np.ndarray:
    """Where each sample starts: rows (position in document_index, offset in that document)."""
    lengths = np.asarray(sequence_lengths)[document_index].astype(np.int64)
    starts = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=starts[1:])
    total = int(starts[-1])
    num_samples = (total - 1) // seq_length
    widest = max(len(document_index), int(lengths.max(initial=0)))
    dtype = np.int32 if widest <= np.iinfo(np.int32).max else np.int64
    index = np.zeros((num_samples + 1, 2), dtype=dtype)
    positions = np.arange(1, num_samples + 1, dtype=np.int64) * seq_length
    documents = np.searchsorted(starts, positions, side="right") - 1
    index[1:, 0] = documents
    index[1:, 1] = positions - starts[documents]
    return index


def build_shuffle_index(
    num_samples: int, total_size: int, rng: np.random.RandomState
) -> np.ndarray:
    """A permutation of [0, num_samples) followed by one of [num_samples, total_size)."""
    dtype = np.uint32 if total_size < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(num_samples, dtype=dtype)
    rng.shuffle(first)
    if num_samples == total_size:
        return first
    last = np.arange(num_samples, total_size, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate((first, last))


def build_gpt_indices(
    sequence_lengths: np.ndarray,
    documents: np.ndarray,
    num_samples: int | None,
    seq_length: int,
    seed: int,
) -> GPTIndices:
    """All three indices for `num_samples` samples (one epoch's worth when None)."""
    if seq_length < 2:
        raise DataError(f"--seq-length must be at least 2 for GPT samples, got {seq_length}")
    tokens_per_epoch = int(np.asarray(sequence_lengths)[documents].sum(dtype=np.int64))
    if tokens_per_epoch < 2:
        raise DataError(
            f"the {len(documents)} documents hold {tokens_per_epoch} tokens; a GPT sample "
            "needs at least 2"
        )
    num_epochs = num_epochs_needed(tokens_per_epoch, num_samples, seq_length)
    separate, before_last = False, 0
    if num_samples is not None:
        separate, before_last = _separate_final_epoch(
            tokens_per_epoch, num_epochs, num_samples, seq_length
        )
    rng = np.random.RandomState(seed)
    document_index = build_document_index(documents, num_epochs, rng, separate)
    sample_index = build_sample_index(sequence_lengths, document_index, seq_length)
    total = sample_index.shape[0] - 1
    shuffle_index = build_shuffle_index(before_last if separate else total, total, rng)
    return GPTIndices(document_index, sample_index, shuffle_index)
