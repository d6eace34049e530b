"""Evaluation on the validation and test splits: forward only, through the pipeline schedule.

Each evaluation reads `--eval-iters` global batches (at the full --global-batch-size, as
Megatron) from its split, through a forward-only executor on the training chunks switched to
eval mode (no dropout), under no_grad: no gradient, no gradient buffer and no optimizer state is
touched. The k-th evaluation of a split reads that split's samples
[k x eval_iters x global batch, (k + 1) x eval_iters x global batch), so successive validations
see new samples, as Megatron's validation iterator does. The loss is the mean of the micro-batch
mean losses over micro-batches, data-parallel ranks and eval iterations (the training loss's
definition), known on every rank.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from megapipe.model.te_layers import start_microbatches
from megapipe.parallel.state import ParallelState
from megapipe.pipeline.executor import PipelineExecutor
from megapipe.training.step import BatchSource, GlobalBatch, global_mean_loss

LOSS_NAME = "lm loss"


class Evaluator:
    """Runs evaluations of one split; remembers how many it ran (its offset into the split)."""

    def __init__(
        self,
        chunks: Sequence[torch.nn.Module],
        executor: PipelineExecutor,
        data: BatchSource,
        state: ParallelState,
        *,
        global_batch_size: int,
        micro_batch_size: int,
        eval_iters: int,
        after: Callable[[], None] | None = None,
    ) -> None:
        """`after`: called once each evaluation is done (FSDP2 ZeRO-2 frees the parameters a
        forward without backward left gathered)."""
        self.after = after
        self.chunks = list(chunks)
        self.executor = executor
        self.data = data
        self.state = state
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.eval_iters = eval_iters
        self.evaluations = 0

    def evaluate(self) -> dict[str, float]:
        """One evaluation: {"lm loss": mean loss}; the model is back in training mode after."""
        first = self.evaluations * self.eval_iters * self.global_batch_size
        self.evaluations += 1
        for chunk in self.chunks:
            chunk.eval()
        start_microbatches(self.chunks)  # TE: the weights changed since the last fp8 cast
        total = 0.0
        try:
            with torch.no_grad():
                for i in range(self.eval_iters):
                    batch = GlobalBatch(
                        first + i * self.global_batch_size,
                        self.global_batch_size,
                        self.micro_batch_size,
                        self.state,
                    )
                    losses = self.executor.run(batch.reader(self.data))
                    total += global_mean_loss(losses, self.state)
        finally:
            for chunk in self.chunks:
                chunk.train()
            if self.after is not None:
                self.after()
        return {LOSS_NAME: total / self.eval_iters}
