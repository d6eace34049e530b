"""The GPT dataset: splits, the three indices (against a transcription of megatron.core's
Python and C++), samples of seq_length + 1 tokens that tile the shuffled document stream, and
the .npy cache: keyed by every input, built once by rank 0 while the others wait."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from megapipe.data import gpt_dataset as gpt_dataset_module
from megapipe.data.errors import DataError
from megapipe.data.gpt_dataset import GPTDataset
from megapipe.data.gpt_index import build_gpt_indices, build_sample_index, num_epochs_needed
from megapipe.data.index_cache import BuildContext
from megapipe.data.indexed_builder import IndexedDatasetBuilder
from megapipe.data.indexed_dataset import IndexedDataset
from megapipe.data.splits import parse_split, split_matrix, split_range
from megapipe.testing import run_distributed


def reference_sample_index(sizes, document_index, seq_length) -> np.ndarray:
    """megatron.core's C++ build_sample_idx (drop last partial, one extra token), in Python."""
    num_samples = (int(sizes[document_index].sum()) - 1) // seq_length
    rows, position, offset = [(0, 0)], 0, 0
    while len(rows) <= num_samples:
        remaining = seq_length + 1
        while remaining != 0:
            length = int(sizes[document_index[position]]) - offset
            remaining -= length
            if remaining <= 0:
                offset += remaining + length - 1
                remaining = 0
            else:
                position += 1
                offset = 0
        rows.append((position, offset))
    return np.array(rows)


def reference_indices(sizes, documents, num_samples, seq_length, seed):
    """megatron.core's GPTDataset._build_document_sample_shuffle_indices, transcribed."""
    per_epoch = int(sizes[documents].sum())
    epochs, tokens = 1, per_epoch
    while tokens < num_samples * seq_length + 1:
        epochs, tokens = epochs + 1, tokens + per_epoch
    separate = False
    if epochs > 1:
        before_last = ((epochs - 1) * per_epoch - 1) // seq_length
        separate = num_samples - before_last < int(0.8 * ((per_epoch - 1) // seq_length))
    rng = np.random.RandomState(seed)

    def document_index(n_epochs):
        index = np.mgrid[0:n_epochs, 0 : len(documents)][1]
        index[:] = documents
        index = index.reshape(-1).astype(np.int32)
        rng.shuffle(index)
        return index

    if separate:
        doc_index = np.concatenate((document_index(epochs - 1), document_index(1)))
    else:
        doc_index = document_index(epochs)
    sample_index = reference_sample_index(sizes, doc_index, seq_length)
    total = len(sample_index) - 1
    first = np.arange(before_last if separate else total, dtype=np.uint32)
    rng.shuffle(first)
    if separate:
        last = np.arange(before_last, total, dtype=np.uint32)
        rng.shuffle(last)
        first = np.concatenate((first, last))
    return doc_index, sample_index, first


def test_sample_index_matches_the_cpp_loop() -> None:
    rng = np.random.default_rng(0)
    for _ in range(300):
        n = int(rng.integers(1, 30))
        sizes = rng.integers(0, 20, size=n).astype(np.int32)
        sizes[rng.integers(0, n, size=2)] = 0  # empty documents are skipped over
        if sizes.sum() < 2:
            continue
        doc_index = rng.permutation(np.tile(np.arange(n, dtype=np.int32), int(rng.integers(1, 4))))
        seq_length = int(rng.integers(2, 25))
        expected = reference_sample_index(sizes, doc_index, seq_length)
        actual = build_sample_index(sizes, doc_index, seq_length)
        assert actual.dtype == np.int32 and np.array_equal(actual, expected)


# 1118 tokens an epoch, 69 samples of 16: 1 and 40 need one epoch, 130 two (the last one
# shuffled with the rest), 149 and 1000 three and 15 (the short last epoch shuffled apart).
@pytest.mark.parametrize("num_samples", [1, 40, 130, 149, 1000])
def test_indices_match_megatron(num_samples: int) -> None:
    sizes = np.random.default_rng(1).integers(1, 60, size=50).astype(np.int32)
    documents = np.arange(5, 45, dtype=np.int32)  # a split in the middle
    indices = build_gpt_indices(sizes, documents, num_samples, 16, seed=1234)
    expected = reference_indices(sizes, documents, num_samples, 16, 1234)
    for actual, wanted in zip(
        (indices.document_index, indices.sample_index, indices.shuffle_index), expected
    ):
        assert actual.dtype == wanted.dtype or actual.dtype == np.int32
        assert np.array_equal(actual, wanted)
    assert indices.num_samples >= num_samples
    if num_samples in (149, 1000):  # the last epoch's samples come last, shuffled apart
        before_last = ((len(indices.document_index) - 40) * 1118 // 40 - 1) // 16
        assert sorted(indices.shuffle_index[before_last:]) == list(
            range(before_last, indices.num_samples)
        )


def test_number_of_epochs() -> None:
    assert num_epochs_needed(100, None, 10) == 1
    assert num_epochs_needed(100, 9, 11) == 1  # 9 * 11 + 1 = 100 tokens
    assert num_epochs_needed(100, 10, 10) == 2  # 101 tokens
    assert num_epochs_needed(100, 30, 10) == 4


def test_split_parsing_matches_megatron() -> None:
    assert parse_split("969, 30, 1") == pytest.approx([0.969, 0.03, 0.001])
    assert parse_split("98,2") == [0.98, 0.02, 0.0]
    assert split_matrix(parse_split("98,2")) == [(0.0, 0.98), (0.98, 1.0), None]
    ranges = [split_range(b, 1000) for b in split_matrix(parse_split("969,30,1"))]
    assert ranges == [(0, 969), (969, 999), (999, 1000)]
    for bad in ("", "1,2,3,4", "0,0,0", "a,b", "90;10x"):
        with pytest.raises(DataError, match="--split"):
            parse_split(bad)


def make_dataset(path: Path, lengths: list[int], eod: int = 0) -> IndexedDataset:
    """Documents whose tokens encode (document, position) so samples can be checked exactly."""
    with IndexedDatasetBuilder(path, np.int32) as builder:
        for d, n in enumerate(lengths):
            builder.add_item([eod if i == n - 1 else 1000 * (d + 1) + i for i in range(n)])
            builder.end_document()
    return IndexedDataset(path)


def test_samples_tile_the_shuffled_document_stream(tmp_path: Path) -> None:
    lengths = [5, 17, 1, 30, 8, 12, 3, 25, 9, 14]
    indexed = make_dataset(tmp_path / "d", lengths)
    ds = GPTDataset(indexed, (2, 9), 40, seq_length=10, seed=7)
    stream = np.concatenate([indexed[int(d)] for d in ds.indices.document_index])
    by_position = {int(s): i for i, s in enumerate(ds.indices.shuffle_index)}
    for sample in range(len(ds)):
        tokens = ds[by_position[sample]]
        assert tokens.dtype == np.int64 and tokens.shape == (11,)
        assert np.array_equal(tokens, stream[sample * 10 : sample * 10 + 11])  # overlap of one
    assert set(ds.indices.document_index.tolist()) == set(range(2, 9))  # only the split
    assert len(ds) >= 40
    with pytest.raises(IndexError):
        ds[len(ds)]


def test_empty_split_and_tiny_data_are_errors(tmp_path: Path) -> None:
    indexed = make_dataset(tmp_path / "d", [4, 4])
    with pytest.raises(DataError, match="the valid split holds no documents"):
        GPTDataset(indexed, (1, 1), 10, 8, 1, split="valid")
    with pytest.raises(DataError, match="hold 1 tokens"):
        GPTDataset(make_dataset(tmp_path / "one", [1]), (0, 1), 10, 8, 1)


def cache_files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir()) if directory.exists() else []


def test_cache_is_written_once_and_memory_mapped(tmp_path: Path) -> None:
    indexed = make_dataset(tmp_path / "d", [40, 50, 60, 70])
    cache = tmp_path / "cache"
    first = GPTDataset(indexed, (0, 4), 30, 16, 3, cache_dir=str(cache))
    names = cache_files(cache)
    assert len(names) == 4 and sum(n.endswith(".npy") for n in names) == 3
    description = json.loads((cache / next(n for n in names if n.endswith(".json"))).read_text())
    assert description["seq_length"] == 16 and description["num_samples"] == 30
    assert description["source"]["path"] == os.path.abspath(f"{tmp_path / 'd'}.idx")
    second = GPTDataset(indexed, (0, 4), 30, 16, 3, cache_dir=str(cache))
    assert isinstance(second.indices.sample_index, np.memmap)
    assert all(np.array_equal(first[i], second[i]) for i in range(len(first)))
    in_memory = GPTDataset(indexed, (0, 4), 30, 16, 3)
    assert np.array_equal(in_memory.indices.shuffle_index, second.indices.shuffle_index)
    assert cache_files(cache) == names


def test_cache_key_changes_with_every_input(tmp_path: Path) -> None:
    indexed = make_dataset(tmp_path / "d", [40, 50, 60, 70])
    cache = tmp_path / "cache"
    base = dict(document_range=(0, 4), num_samples=30, seq_length=16, seed=3)
    variants = [
        {},
        {"num_samples": 31},
        {"seq_length": 15},
        {"seed": 4},
        {"document_range": (1, 4)},
    ]
    for change in variants:
        GPTDataset(indexed, **{**base, **change}, cache_dir=str(cache))
    assert len(cache_files(cache)) == 4 * len(variants)
    os.utime(f"{tmp_path / 'd'}.idx", ns=(1, 1))  # a rewritten dataset (new mtime)
    GPTDataset(indexed, **base, cache_dir=str(cache))
    assert len(cache_files(cache)) == 4 * (len(variants) + 1)


def test_corrupt_cache_file_is_named(tmp_path: Path) -> None:
    indexed = make_dataset(tmp_path / "d", [40, 50])
    cache = tmp_path / "cache"
    GPTDataset(indexed, (0, 2), 5, 16, 3, cache_dir=str(cache))
    victim = next(p for p in cache.iterdir() if p.name.endswith("sample_index.npy"))
    victim.write_bytes(victim.read_bytes()[:20])
    with pytest.raises(DataError, match=f"{victim}: corrupt index cache file"):
        GPTDataset(indexed, (0, 2), 5, 16, 3, cache_dir=str(cache))


def _build_on_two_ranks(rank: int, world_size: int, prefix: str, cache: str) -> tuple[int, list]:
    calls = []
    original = gpt_dataset_module.build_gpt_indices

    def counting(*args, **kwargs):
        calls.append(rank)
        return original(*args, **kwargs)

    gpt_dataset_module.build_gpt_indices = counting
    ds = GPTDataset(
        IndexedDataset(prefix),
        (0, 4),
        30,
        16,
        3,
        cache_dir=cache,
        context=BuildContext.from_torch(),
    )
    return len(calls), ds[5].tolist()


def test_rank_zero_builds_while_the_others_wait(tmp_path: Path) -> None:
    make_dataset(tmp_path / "d", [40, 50, 60, 70])
    results = run_distributed(_build_on_two_ranks, 2, str(tmp_path / "d"), str(tmp_path / "c"))
    assert [calls for calls, _ in results] == [1, 0]
    assert results[0][1] == results[1][1]
    assert len(cache_files(tmp_path / "c")) == 4
