"""Training data: indexed datasets (.bin/.idx), tokenizers, GPT samples, blends, batches.

Names are imported lazily so that tools which only read or write datasets do not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "MockGPTDataset": "megapipe.data.mock",
    "TrainingBatch": "megapipe.data.batch",
    "micro_batch_range": "megapipe.data.sampler",
    "IndexedDataset": "megapipe.data.indexed_dataset",
    "IndexedDatasetBuilder": "megapipe.data.indexed_builder",
    "DataError": "megapipe.data.errors",
    "IndexedDatasetError": "megapipe.data.errors",
    "TokenizerError": "megapipe.data.errors",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'megapipe.data' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
