"""Blends by weight in Megatron's greedy order (against a transcription of its C++), the
--data-path / --train-data-path readings, and the training dataset built from them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from megapipe.data.blending import (
    BlendedDataset,
    blending_indices,
    parse_blend,
    samples_per_dataset,
)
from megapipe.data.errors import DataError
from megapipe.data.gpt_builder import build_train_dataset
from megapipe.data.gpt_dataset import GPTDataset
from megapipe.data.indexed_builder import IndexedDatasetBuilder
from megapipe.data.indexed_dataset import IndexedDataset


def reference_blend(weights: list[float], size: int) -> tuple[list[int], list[int]]:
    """megatron.core helpers.cpp build_blending_indices, transcribed."""
    current = [0] * len(weights)
    datasets, samples = [], []
    for sample_idx in range(size):
        sample_idx_double = max(float(sample_idx), 1.0)
        max_error_index = 0
        max_error = weights[0] * sample_idx_double - float(current[0])
        for dataset_idx in range(1, len(weights)):
            error = weights[dataset_idx] * sample_idx_double - float(current[dataset_idx])
            if error > max_error:
                max_error, max_error_index = error, dataset_idx
        datasets.append(max_error_index)
        samples.append(current[max_error_index])
        current[max_error_index] += 1
    return datasets, samples


def test_blending_order_matches_megatron() -> None:
    rng = np.random.default_rng(0)
    cases = [[0.3, 0.7], [0.5, 0.5], [1.0], [0.0, 1.0], [1 / 3] * 3]
    cases += [list(w / w.sum()) for w in rng.random((5, 4))]
    for weights in cases:
        datasets, samples = blending_indices(weights, 997)
        assert datasets.dtype == np.int16 and samples.dtype == np.int64
        assert (datasets.tolist(), samples.tolist()) == reference_blend(weights, 997)
        counts = np.bincount(datasets, minlength=len(weights))
        assert np.all(np.abs(counts - np.array(weights) * 997) <= 1.0)  # error-minimising
    datasets, _ = blending_indices([0.3, 0.7], 10)
    assert datasets.tolist() == [1, 0, 1, 1, 0, 1, 1, 0, 1, 1]


def test_parse_blend_reads_megatron_data_paths() -> None:
    assert parse_blend(["A"]) == (["A"], None)
    assert parse_blend(["0.3", "A", "0.7", "B"]) == (["A", "B"], [0.3, 0.7])
    assert parse_blend(["0.3 A 0.7 B"]) == (["A", "B"], [0.3, 0.7])  # one quoted argument
    assert parse_blend(["A", "B"]) == (["A", "B"], None)
    assert parse_blend(["30", "A", "70", "B"]) == (["A", "B"], [30.0, 70.0])
    for bad, fragment in [
        ([], "at least one"),
        (["0.3", "A", "B"], "looks like a weight"),
        (["-1", "A", "2", "B"], "non-negative"),
        (["0", "A", "0", "B"], "zero"),
    ]:
        with pytest.raises(DataError, match=fragment):
            parse_blend(bad, "--data-path")


def test_samples_per_dataset_adds_megatron_surplus() -> None:
    assert samples_per_dataset([0.3, 0.7], 1000) == [300, 700]
    assert samples_per_dataset([0.3, 0.7], 1000, 0.005) == [302, 704]
    assert samples_per_dataset([1 / 3] * 3, 10) == [4, 4, 4]


def write(path: Path, documents: int, base: int) -> str:
    with IndexedDatasetBuilder(path, np.uint16) as builder:
        for d in range(documents):
            builder.add_item([base + (d * 7 + i) % 100 for i in range(20 + d % 13)] + [0])
            builder.end_document()
    return str(path)


def test_blended_dataset_reads_the_chosen_datasets(tmp_path: Path) -> None:
    a = GPTDataset(IndexedDataset(write(tmp_path / "a", 30, 1000)), (0, 30), 40, 8, 1)
    b = GPTDataset(IndexedDataset(write(tmp_path / "b", 30, 2000)), (0, 30), 90, 8, 1)
    blend = BlendedDataset([a, b], [0.3, 0.7], 100, cache_dir=str(tmp_path / "cache"))
    assert len(blend) == 100
    taken = [0, 0]
    for i in range(100):
        d = int(blend.dataset_index[i])
        assert np.array_equal(blend[i], (a, b)[d][taken[d]])
        taken[d] += 1
    assert taken == [30, 70] and len(list((tmp_path / "cache").iterdir())) == 3
    small = GPTDataset(IndexedDataset(write(tmp_path / "c", 3, 3000)), (0, 3), 5, 8, 1)
    assert len(small) < 70
    with pytest.raises(
        DataError, match=f"blend needs 70 samples of dataset 1 but it has {len(small)}"
    ):
        BlendedDataset([a, small], [0.3, 0.7], 100)


def test_train_dataset_from_data_path_flags(tmp_path: Path) -> None:
    a, b = write(tmp_path / "a", 100, 1000), write(tmp_path / "b", 60, 2000)
    common = dict(train_data_path=(), num_samples=50, seq_length=16, seed=5)
    single = build_train_dataset(data_path=[a], split="90,10,0", **common)
    assert isinstance(single, GPTDataset) and single.indices.document_index.max() < 90
    blend = build_train_dataset(data_path=["0.3", a, "0.7", b], split="969,30,1", **common)
    assert isinstance(blend, BlendedDataset) and len(blend) == 15 + 35
    assert [len(d) >= n for d, n in zip(blend.datasets, (16, 36))] == [True, True]
    assert np.bincount(blend.dataset_index).tolist() == [15, 35]
    whole = build_train_dataset(data_path=(), split="1,1,1", **{**common, "train_data_path": [b]})
    assert sorted(set(whole.indices.document_index.tolist())) == list(range(60))
    unweighted = build_train_dataset(data_path=[a, b], split="1", **common)
    lengths = [len(d) for d in unweighted.datasets]
    assert len(unweighted) == 50 and lengths[0] > lengths[1]  # one epoch each, by length
    with pytest.raises(DataError, match="fewer than the 100000 training needs"):
        build_train_dataset(data_path=[a, b], split="1", **{**common, "num_samples": 100000})
    with pytest.raises(DataError, match="leaves nothing for training"):
        build_train_dataset(data_path=[a], split="0,1,0", **common)
    with pytest.raises(DataError, match="training split holds 0 of 100 documents"):
        build_train_dataset(data_path=[a], split="1,999,0", **common)
