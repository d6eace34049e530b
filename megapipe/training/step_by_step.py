"""A built run stepped by hand, one iteration at a time, without the training loop.

`build_run` builds it as for `train()` (quietly, without the loop's logging, evaluation,
checkpoints and exit conditions): for benchmarks that time the training step and for tests that
need to look between steps. Every iteration reads the next global batch of the fixed
`--global-batch-size`, at a constant learning rate. (One iteration itself is `step.train_step`.)
"""

from __future__ import annotations

from dataclasses import dataclass

from megapipe.config import Configs
from megapipe.distributed.optimizer import ShardedOptimizer
from megapipe.model.gpt import GPTModel
from megapipe.parallel.state import ParallelState
from megapipe.pipeline.executor import PipelineExecutor
from megapipe.training.build import SampleCounts, build_run
from megapipe.training.step import BatchSource, GlobalBatch, StepResult, train_step


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
        """Build as `train()` does (`build_run`): seeded chunks, the schedule's executor, grad
        buffers and the optimizer, the training split (`train_samples` for indexed data; mock
        data needs none)."""
        run = build_run(configs, state, samples=SampleCounts(train_samples, 0, 0), announce=False)
        return cls(configs, state, run.chunks, run.executor, run.optimizer, run.data.train)

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
