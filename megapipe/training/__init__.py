"""The training loop and what it reports: Megatron's log lines, interval statistics."""

from megapipe.training.build import build_model_chunks_for
from megapipe.training.step import StepResult, train_step
from megapipe.training.train import train

__all__ = ["StepResult", "build_model_chunks_for", "train", "train_step"]
