"""Training data: which global samples a rank reads, and the datasets that produce them."""

from megapipe.data.mock import MockGPTDataset, TrainingBatch
from megapipe.data.sampler import micro_batch_range

__all__ = ["MockGPTDataset", "TrainingBatch", "micro_batch_range"]
