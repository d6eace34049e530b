"""Megatron's GPT dataset: `seq_length + 1`-token samples over one split of an indexed dataset.

Samples concatenate the split's documents in a shuffled order, over as many epochs as the
requested number of samples needs, and cross document boundaries (the preprocessing's eod
tokens mark them). Sample i of the dataset is sample shuffle_index[i] of that stream.
"""

from __future__ import annotations

import numpy as np

from megapipe.data.errors import DataError
from megapipe.data.gpt_index import GPTIndices, build_gpt_indices
from megapipe.data.index_cache import BuildContext, cached_arrays, source_fingerprint
from megapipe.data.indexed_dataset import IndexedDataset

INDEX_NAMES = ("document_index", "sample_index", "shuffle_index")


class GPTDataset:
    """`len(ds)` samples; `ds[i]` is an int64 array of seq_length + 1 token ids."""

    def __init__(
        self,
        indexed: IndexedDataset,
        document_range: tuple[int, int],
        num_samples: int | None,
        seq_length: int,
        seed: int,
        *,
        split: str = "train",
        cache_dir: str | None = None,
        context: BuildContext | None = None,
    ) -> None:
        begin, end = document_range
        if not 0 <= begin < end <= len(indexed):
            raise DataError(
                f"{indexed.path_prefix}: the {split} split holds no documents (range "
                f"[{begin}, {end}) of {len(indexed)}); check --split"
            )
        self.indexed, self.seq_length, self.split = indexed, seq_length, split
        documents = np.arange(begin, end, dtype=np.int32)
        self.description = {
            "class": "GPTDataset",
            "format": 1,
            "source": source_fingerprint(indexed.idx_path),
            "split": split,
            "document_range": [begin, end],
            "num_samples": num_samples,
            "seq_length": seq_length,
            "seed": seed,
            "add_extra_token": True,
        }

        def build() -> dict[str, np.ndarray]:
            indices = build_gpt_indices(
                indexed.sequence_lengths, documents, num_samples, seq_length, seed
            )
            return {name: getattr(indices, name) for name in INDEX_NAMES}

        arrays = cached_arrays(
            cache_dir, "GPTDataset", self.description, INDEX_NAMES, build, context or BuildContext()
        )
        self.indices = GPTIndices(**arrays)
        if num_samples is not None and len(self) < num_samples:
            raise DataError(f"{indexed.path_prefix}: built {len(self)} < {num_samples} samples")

    def __len__(self) -> int:
        return self.indices.num_samples

    def __getitem__(self, index: int) -> np.ndarray:
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} out of range 0..{len(self) - 1}")
        document_index = self.indices.document_index
        sample = int(self.indices.shuffle_index[index])
        first, first_offset = (int(x) for x in self.indices.sample_index[sample])
        last, last_offset = (int(x) for x in self.indices.sample_index[sample + 1])
        get = self.indexed.get
        if first == last:
            parts = [get(int(document_index[first]), first_offset, last_offset - first_offset + 1)]
        else:
            parts = [get(int(document_index[first]), first_offset)]
            parts += [get(int(document_index[i])) for i in range(first + 1, last)]
            parts.append(get(int(document_index[last]), 0, last_offset + 1))
        tokens = np.concatenate(parts).astype(np.int64)
        assert tokens.size == self.seq_length + 1, (index, tokens.size)
        return tokens
