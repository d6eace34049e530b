"""Synthetic GPT samples for smoke runs and parity tests (`--mock-data`).

Sample i depends only on the seed and i, never on the rank reading it or the batch it lands
in, so every TP/PP/DP layout trains on the same global batches. Each sample is a counting
sequence `start, start + 1, start + 2, ...` (mod vocab) from a random start, as Megatron's
mock dataset also emits counting sequences: a pattern a tiny model learns within a few steps
makes "the loss goes down" a meaningful check, where uniform random tokens would not.
"""

from __future__ import annotations

import hashlib

import torch

from megapipe.data.batch import TrainingBatch, to_device


def sample_seed(seed: int, index: int, split: str = "train") -> int:
    """A stable 63-bit seed for one sample (independent of Python's hash randomisation).

    The valid and test splits salt it with their name, so their samples differ from train's.
    """
    salt = "" if split == "train" else f"{split}/"
    digest = hashlib.sha256(f"mock-gpt/{salt}{seed}/{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


class MockGPTDataset:
    """An endless indexable source of `seq_length + 1`-token samples with ids < vocab_size."""

    def __init__(self, vocab_size: int, seq_length: int, seed: int, split: str = "train") -> None:
        if vocab_size <= 0 or seq_length <= 0:
            raise ValueError(
                f"vocab_size ({vocab_size}) and seq_length ({seq_length}) must be positive"
            )
        self.vocab_size = vocab_size
        self.seq_length = seq_length
        self.seed = seed
        self.split = split

    def sample(self, index: int) -> torch.Tensor:
        """Global sample `index`: int64 token ids, shape [seq_length + 1]."""
        if index < 0:
            raise IndexError(f"sample index must be non-negative, got {index}")
        generator = torch.Generator().manual_seed(sample_seed(self.seed, index, self.split))
        start = torch.randint(self.vocab_size, (), generator=generator)
        return (start + torch.arange(self.seq_length + 1)) % self.vocab_size

    def batch(self, indices: range, device: torch.device | str = "cpu") -> TrainingBatch:
        """The samples `indices`, split into inputs `[:-1]` and next-token labels `[1:]`, on
        `device` (the loss mask built there)."""
        tokens = torch.stack([self.sample(i) for i in indices])
        return TrainingBatch(
            tokens=to_device(tokens[:, :-1].contiguous(), device),
            labels=to_device(tokens[:, 1:].contiguous(), device),
            loss_mask=torch.ones(len(indices), self.seq_length, device=device),
        )
