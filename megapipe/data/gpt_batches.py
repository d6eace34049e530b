"""Turn global sample indices into training micro-batches from a GPT (or blended) dataset.

Stateless: a batch depends only on the sample indices, so each data-parallel rank reads its own
slice of every global batch (megapipe.data.sampler), the ranks of one tensor-parallel group
read identical batches without any broadcast, and a run resumed at iteration k (consumed
samples k x global batch) reads exactly the samples an uninterrupted run reads there.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch

from megapipe.data.batch import TrainingBatch, to_device
from megapipe.data.errors import DataError
from megapipe.data.masks import (
    MaskOptions,
    attention_mask,
    document_segments,
    loss_mask,
    position_ids,
)


class SampleDataset(Protocol):
    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> np.ndarray: ...


class GPTBatchSource:
    """Micro-batches of tokens, next-token labels, loss mask, and the optional position ids
    and attention mask that --reset-position-ids and --reset-attention-mask ask for."""

    def __init__(
        self, dataset: SampleDataset, vocab_size: int, masks: MaskOptions, split: str = "train"
    ) -> None:
        self.dataset = dataset
        self.vocab_size = vocab_size
        self.masks = masks
        self.split = split  # which split the samples are (named in errors)

    def samples(self, indices: Sequence[int]) -> torch.Tensor:
        """[len(indices), seq_length + 1] int64 token ids."""
        rows = []
        for index in indices:
            if not 0 <= index < len(self.dataset):
                raise DataError(
                    f"{self.split} sample {index} is beyond the {len(self.dataset)} {self.split} "
                    "samples built for this run (more iterations than the dataset was built for?)"
                )
            rows.append(self.dataset[index])
        tokens = torch.from_numpy(np.stack(rows))
        high = int(tokens.max())
        if high >= self.vocab_size or int(tokens.min()) < 0:
            raise DataError(
                f"samples {indices[0]}..{indices[-1]} hold token id {high}, outside the "
                f"tokenizer's vocabulary of {self.vocab_size}: was the dataset preprocessed "
                "with another tokenizer?"
            )
        return tokens

    def batch(self, indices: range, device: torch.device | str = "cpu") -> TrainingBatch:
        """The samples `indices` on `device`: tokens and labels copied there (`to_device`), the
        masks and positions built there from the tokens (no [b, 1, s, s] host mask to copy)."""
        text = self.samples(indices)
        tokens = to_device(text[:, :-1].contiguous(), device)
        labels = to_device(text[:, 1:].contiguous(), device)
        options = self.masks
        positions = position_ids(tokens, options) if options.reset_position_ids else None
        mask = None
        if options.reset_attention_mask and options.document_ids:  # CP: [b, s] document ids
            mask = document_segments(tokens, options.eod)
        elif options.reset_attention_mask:
            mask = attention_mask(tokens, options)
        return TrainingBatch(tokens, labels, loss_mask(tokens, options), positions, mask)
