"""A run's model, executor, optimizer and training data, stepped one iteration at a time.

What `train()` builds, without its loop (logging, evaluation, checkpoints, exit conditions):
for benchmarks that time the training step and for tests that need to look between steps.
Every iteration reads the next global batch of the fixed `--global-batch-size`.
"""

from __future__ import annotations

from dataclasses import dataclass

from megapipe.config import Configs
from megapipe.data.sources import build_batch_sources
from megapipe.distributed.optimizer import ShardedOptimizer
from megapipe.model.gpt import GPTModel
from megapipe.parallel.state import ParallelState
from megapipe.pipeline.executor import PipelineExecutor
from megapipe.training.step import BatchSource, GlobalBatch, StepResult, train_step
from megapipe.training.train import build_executor, build_model_chunks_for, build_optimizer


@dataclass
class Stepper:
    """One rank's share of a run, and how many iterations it has taken."""

    configs: Configs
    state: ParallelState
    chunks: list[GPTModel]
    executor: PipelineExecutor
    optimizer: ShardedOptimizer
    data: BatchSource
    iteration: int = 0

    @classmethod
    def build(cls, configs: Configs, state: ParallelState, *, train_samples: int = 0) -> Stepper:
        """Build as `train()` does: seeded chunks, the schedule's executor, grad buffers and
        the optimizer, the training split (`train_samples` for indexed data; mock data needs
        none)."""
        chunks = build_model_chunks_for(configs, state)
        executor = build_executor(chunks, configs, state)
        optimizer = build_optimizer(chunks, configs, state)
        sources = build_batch_sources(
            configs, train_samples=train_samples, valid_samples=0, test_samples=0
        )
        return cls(configs, state, chunks, executor, optimizer, sources.train)

    def step(self, lr: float | None = None) -> StepResult:
        """The next iteration at `lr` (default --lr, no schedule)."""
        training = self.configs.training
        size = training.global_batch_size
        batch = GlobalBatch(self.iteration * size, size, training.micro_batch_size, self.state)
        self.iteration += 1
        return train_step(
            self.chunks,
            self.optimizer,
            self.executor,
            self.data,
            batch,
            self.state,
            lr=training.lr if lr is None else lr,
            iteration=self.iteration,
        )
