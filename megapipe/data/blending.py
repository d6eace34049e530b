"""Blend datasets by weight (`--data-path 0.3 A 0.7 B`) in Megatron's greedy order.

Sample t of the blend comes from the dataset whose share so far lags its weight the most:
argmax_d (w_d * max(t, 1) - taken_d), ties to the lowest index, exactly as megatron.core's
`build_blending_indices` computes it (same double-precision arithmetic), so a blend reads the
same samples in the same order as Megatron's. The loop is sequential by nature; it runs once
and is cached with the other indices.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from megapipe.data.errors import DataError
from megapipe.data.index_cache import BuildContext, cached_arrays
from megapipe.data.splits import normalize

# Each weighted dataset is built with 0.5% more samples than its share, as megatron.core does.
SURPLUS = 0.005


def parse_blend(
    words: Sequence[str], flag: str = "--data-path"
) -> tuple[list[str], list[float] | None]:
    """`0.3 A 0.7 B` -> ([A, B], [0.3, 0.7]); `A B` -> ([A, B], None) (Megatron's reading)."""
    words = [w for word in words for w in word.split()]
    if not words:
        raise DataError(f"{flag} needs at least one dataset prefix")
    weights: list[float | None] = []
    if len(words) % 2 == 0:
        for word in words[0::2]:
            try:
                weights.append(float(word))
            except ValueError:
                weights.append(None)
    if weights and all(w is not None for w in weights):
        prefixes = list(words[1::2])
        if any(not math.isfinite(w) or w < 0 for w in weights):
            raise DataError(f"{flag}: weights must be finite and non-negative, got {weights}")
        if sum(weights) <= 0:
            raise DataError(f"{flag}: the weights sum to zero")
        return prefixes, [float(w) for w in weights]
    for word in words:
        try:
            float(word)
        except ValueError:
            continue
        raise DataError(
            f"{flag}: {word!r} looks like a weight, but weights must come one before each "
            "prefix (e.g. 0.3 A 0.7 B)"
        )
    return words, None


def samples_per_dataset(weights: Sequence[float], size: int, surplus: float = 0.0) -> list[int]:
    """Megatron's per-dataset sample counts: ceil(ceil(size * w) * (1 + surplus))."""
    return [int(math.ceil(math.ceil(size * w) * (1 + surplus))) for w in weights]


def blending_indices(weights: Sequence[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset of each sample int16, index of the sample within that dataset int64)."""
    count = len(weights)
    dataset_index = np.zeros(size, dtype=np.int16)
    sample_index = np.zeros(size, dtype=np.int64)
    if count == 1:
        sample_index[:] = np.arange(size)
        return dataset_index, sample_index
    w = [float(x) for x in weights]
    taken = [0] * count
    chosen_list = [0] * size
    within_list = [0] * size
    for t in range(size):
        scale = float(max(t, 1))
        best, best_error = 0, w[0] * scale - taken[0]
        for d in range(1, count):
            error = w[d] * scale - taken[d]
            if error > best_error:
                best, best_error = d, error
        chosen_list[t] = best
        within_list[t] = taken[best]
        taken[best] += 1
    dataset_index[:] = chosen_list
    sample_index[:] = within_list
    return dataset_index, sample_index


class BlendedDataset:
    """`size` samples drawn from `datasets` in proportion to `weights`."""

    def __init__(
        self,
        datasets: Sequence,
        weights: Sequence[float],
        size: int,
        *,
        cache_dir: str | None = None,
        context: BuildContext | None = None,
    ) -> None:
        if len(datasets) != len(weights) or not datasets or len(datasets) > 32767:
            raise DataError(f"a blend needs 1..32767 datasets, one weight each ({len(weights)})")
        self.datasets = list(datasets)
        self.weights = normalize(list(weights))
        self.size = size
        description = {
            "class": "BlendedDataset",
            "format": 1,
            "datasets": [getattr(d, "description", repr(d)) for d in self.datasets],
            "weights": self.weights,
            "size": size,
        }

        def build() -> dict[str, np.ndarray]:
            dataset_index, sample_index = blending_indices(self.weights, size)
            return {"dataset_index": dataset_index, "dataset_sample_index": sample_index}

        names = ("dataset_index", "dataset_sample_index")
        context = context or BuildContext()
        arrays = cached_arrays(cache_dir, "BlendedDataset", description, names, build, context)
        self.dataset_index = arrays["dataset_index"]
        self.dataset_sample_index = arrays["dataset_sample_index"]
        for d, dataset in enumerate(self.datasets):
            used = self.dataset_sample_index[self.dataset_index == d]
            if used.size and int(used.max()) >= len(dataset):
                raise DataError(
                    f"blend needs {int(used.max()) + 1} samples of dataset {d} but it has "
                    f"{len(dataset)}"
                )

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> np.ndarray:
        if not 0 <= index < self.size:
            raise IndexError(f"sample {index} out of range 0..{self.size - 1}")
        dataset = int(self.dataset_index[index])
        return self.datasets[dataset][int(self.dataset_sample_index[index])]
