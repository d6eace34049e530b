"""Run one rank's schedule for one training step: a small loop that dispatches actions.

The executor owns the per-step bookkeeping the schedule implies: activations received from the
previous stage (inputs), outputs waiting for their gradient, gradients received from the next
stage. Outputs already sent downstream keep their autograd graph but not their data (Megatron's
deallocate-output trick), so what a stage holds alive is its stashed micro-batches' internal
activations only. `peak_stashed` (micro-batches forwarded but not yet backwarded, the
simulator's in-flight count) and `freed_outputs` are exact counts, which is how the
activation-memory bound is tested rather than with allocator statistics.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch.autograd.variable import Variable

from megapipe.data.batch import TrainingBatch
from megapipe.layers.cross_entropy import masked_mean
from megapipe.model.gpt import GPTModel
from megapipe.parallel.state import ParallelState
from megapipe.pipeline.p2p import P2PCommunicator
from megapipe.pipeline.schedules import P2P, Action, Comm, Compute
from megapipe.pipeline.trace import TraceRecorder

Key = tuple[int, int]  # (microbatch, local chunk)


def _free_data(tensor: torch.Tensor) -> bool:
    """Drop a sent output's storage but keep its grad_fn, so backward can still run through it."""
    if tensor._base is not None:  # a view shares storage that something else may need
        return False
    tensor.data = torch.empty((1,), dtype=tensor.dtype, device=tensor.device)
    return True


def _backward_through(output: torch.Tensor, grad: torch.Tensor) -> None:
    """output.backward(grad) without the shape check that a freed output would fail."""
    Variable._execution_engine.run_backward(
        tensors=(output,),
        grad_tensors=(grad,),
        keep_graph=False,
        create_graph=False,
        inputs=(),
        allow_unreachable=True,
        accumulate_grad=True,
    )


class PipelineExecutor:
    """Executes `actions` on this rank's model chunks (chunk c is virtual stage c * p + rank)."""

    def __init__(
        self,
        chunks: Sequence[GPTModel],
        state: ParallelState,
        actions: list[Action],
        *,
        num_microbatches: int,
        activation_shape: tuple[int, ...],
        dtype: torch.dtype = torch.float32,
        comm: P2PCommunicator | None = None,
        trace: TraceRecorder | None = None,
        batch_on_every_stage: bool = False,
    ) -> None:
        self.chunks = list(chunks)
        self.state = state
        self.actions = actions
        self.num_microbatches = num_microbatches
        self.activation_shape = activation_shape
        self.dtype = dtype
        self.comm = comm or P2PCommunicator(state.pp)
        self.trace = trace
        self.num_stages = state.pp.size * len(self.chunks)
        self.peak_stashed = 0
        self.freed_outputs = 0
        self.loss_scale = 1.0  # fp16: the loss scaler's current scale
        # Per-document attention masks (--reset-attention-mask) are needed by every stage;
        # otherwise only the first stage reads tokens and the last labels and loss mask.
        self.batch_on_every_stage = batch_on_every_stage
        # How many of this rank's chunks read each micro-batch (to read it once per step).
        self._batch_readers = sum(
            1 for c in range(len(self.chunks)) if self._reads_batch(self._stage(c))
        )

    def _free(self, tensor: torch.Tensor) -> None:
        self.freed_outputs += _free_data(tensor)

    def _stage(self, chunk: int) -> int:
        return chunk * self.state.pp.size + self.state.pp.rank

    def _reads_batch(self, stage: int) -> bool:
        return stage in (0, self.num_stages - 1) or self.batch_on_every_stage

    def run(self, get_batch: Callable[[int], TrainingBatch]) -> list[torch.Tensor]:
        """One step's forwards and backwards; returns the last stage's micro-batch losses."""
        inputs: dict[Key, torch.Tensor] = {}
        outputs: dict[Key, torch.Tensor] = {}
        output_grads: dict[Key, torch.Tensor] = {}
        losses: list[torch.Tensor] = []
        self.peak_stashed = self.freed_outputs = 0
        batches: dict[int, list] = {}  # micro-batch -> [batch, readers still to come]

        def read_batch(microbatch: int) -> TrainingBatch:
            """Each micro-batch is read once per step, however many local chunks need it."""
            entry = batches.setdefault(microbatch, [None, self._batch_readers])
            if entry[0] is None:
                entry[0] = get_batch(microbatch)
            entry[1] -= 1
            if entry[1] == 0:
                del batches[microbatch]
            return entry[0]

        def forward(step: Compute) -> None:
            key = (step.microbatch, step.chunk)
            stage = self._stage(step.chunk)
            model = self.chunks[step.chunk]
            first, last = stage == 0, stage == self.num_stages - 1
            batch = read_batch(step.microbatch) if self._reads_batch(stage) else None
            mask = batch.attention_mask if batch is not None else None
            if first:
                out = model(
                    tokens=batch.tokens,
                    position_ids=batch.position_ids,
                    labels=batch.labels if last else None,
                    attention_mask=mask,
                )
            else:
                labels = batch.labels if last else None
                out = model(hidden_states=inputs[key], labels=labels, attention_mask=mask)
            if last:
                loss = masked_mean(out, batch.loss_mask)
                losses.append(loss.detach())
                out = loss * (self.loss_scale / self.num_microbatches)
            outputs[key] = out
            self.peak_stashed = max(self.peak_stashed, len(outputs))

        def backward(step: Compute) -> None:
            key = (step.microbatch, step.chunk)
            out = outputs.pop(key)
            if self._stage(step.chunk) == self.num_stages - 1:
                out.backward()
            else:
                _backward_through(out, output_grads.pop(key))

        def transfer(op: P2P) -> tuple[P2P, torch.Tensor, Callable[[], None] | None]:
            key = (op.microbatch, op.chunk)
            if op.op == "recv":
                buffer = torch.empty(
                    self.activation_shape, dtype=self.dtype, device=self.state.device
                )
                if op.phase == "F":
                    inputs[key] = buffer.requires_grad_()
                else:
                    output_grads[key] = buffer
                return op, buffer, None
            if op.phase == "F":
                out = outputs[key]
                return op, out.detach(), lambda: self._free(out)
            grad = inputs.pop(key).grad
            return op, grad, None

        # Receives posted but not yet waited for, by the compute that needs them: a unit's
        # forward runs while the gradient its backward needs is still on the way.
        receives: dict[tuple[str, int, int], tuple[P2P, dist.Work]] = {}

        def await_input(step: Compute) -> None:
            posted = receives.pop((step.phase, step.microbatch, step.chunk), None)
            if posted is not None:
                start = time.perf_counter()
                self.comm.wait(*posted)
                if self.trace is not None:
                    self.trace.record(Comm((posted[0],)), start, time.perf_counter())

        for action in self.actions:
            if isinstance(action, Compute):
                await_input(action)
            start = time.perf_counter()
            if isinstance(action, Comm):
                posted = self.comm.post([transfer(op) for op in action.ops])
                receives.update(
                    {(op.phase, op.microbatch, op.chunk): (op, w) for op, w in posted.items()}
                )
            elif action.phase == "F":
                forward(action)
            else:
                backward(action)
            if self.trace is not None:
                self.trace.record(action, start, time.perf_counter())
        for op, work in receives.values():  # none in a valid schedule; never leave one posted
            self.comm.wait(op, work)
        self.comm.drain()
        if outputs or output_grads:
            raise RuntimeError(
                f"schedule left work behind: outputs {sorted(outputs)}, "
                f"gradients {sorted(output_grads)}"
            )
        return losses
