"""Run one rank's schedule for one step: a small loop that dispatches actions through a table.

The executor is bound to one action list (a training schedule, or the forward-only one that
evaluation runs); `run` keeps one step's bookkeeping in a `_Step` record: activations received
from the previous stage (inputs), outputs waiting to be sent or for their gradient, gradients
received from the next stage, receives posted but not yet waited for. In training, outputs
already sent downstream keep their autograd graph but not their data (Megatron's
deallocate-output trick), so what a stage holds alive is its stashed micro-batches' internal
activations only. A forward-only step runs under `torch.no_grad()` and lets go of each output
as soon as it is sent; it never touches `.grad`. `peak_stashed` (outputs held at once: in
training the micro-batches forwarded but not yet backwarded, the simulator's in-flight count)
and `freed_outputs` are exact counts, which is how the activation-memory bound is tested rather
than with allocator statistics.

Zero-bubble schedules split each backward: B runs it inside the chunk's
`WeightGradStore.deferring()`, so the layers that own their weight gradients (TP linears, the
vocab-parallel embedding: all matmul weights) compute only input gradients and queue the rest;
W computes that micro-batch's queued weight gradients (`compute_weight_grads(units=1)`), which
is when they reach the grad buffer and its buckets become ready for the DP reduction. Other
parameters (norms, position embeddings, biases added outside a TP linear) get theirs from
autograd in B. A micro-batch then counts as stashed until its W. A step that leaves a deferred
weight gradient behind raises.

Executors are cheap (no tensors are allocated until `run`): `for_schedule(kind, m)` gives a
sibling on the same chunks and communicator for another schedule or micro-batch count (the
evaluation step, a batch-size ramp-up).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch.autograd.variable import Variable

from megapipe.data.batch import TrainingBatch
from megapipe.layers.cross_entropy import context_parallel_masked_mean, masked_mean
from megapipe.layers.weight_grad import WeightGradStore
from megapipe.model.gpt import GPTModel
from megapipe.parallel.state import ParallelState
from megapipe.pipeline.p2p import P2PCommunicator, Posted
from megapipe.pipeline.schedules import P2P, Action, Comm, Compute, build_schedule
from megapipe.pipeline.trace import TraceRecorder

Key = tuple[int, int]  # (microbatch, local chunk)
Transfer = tuple[P2P, torch.Tensor]
BufferSpec = Callable[[P2P], tuple[tuple[int, ...], torch.dtype]]


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


@dataclass
class _Step:
    """Everything one `run` holds between actions; discarded when it returns."""

    get_batch: Callable[[int], TrainingBatch]
    sample_ids: Callable[[int], torch.Tensor] | None
    loss_scale: float
    trace: TraceRecorder | None
    inputs: dict[Key, torch.Tensor] = field(default_factory=dict)
    outputs: dict[Key, torch.Tensor] = field(default_factory=dict)
    output_grads: dict[Key, torch.Tensor] = field(default_factory=dict)
    receives: dict[tuple[str, int, int], Posted] = field(default_factory=dict)
    batches: dict[int, list] = field(default_factory=dict)  # micro-batch -> [batch, readers left]
    awaiting_w: list[Key] = field(default_factory=list)  # B done, W not yet, in B order
    losses: list[torch.Tensor] = field(default_factory=list)


class PipelineExecutor:
    """Executes `actions` on this rank's model chunks (chunk c is virtual stage c * p + rank).

    A list without backward computes (`build_schedule("forward-only", ...)`) runs forward only.
    A list with W computes (a zero-bubble schedule) defers weight gradients into one
    WeightGradStore per chunk (`weight_grad_stores`, attached to the chunk's layers; created
    and attached here when not given). post_ahead: what `for_schedule` builds its lists with.
    """

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
        batch_on_every_stage: bool = False,
        post_ahead: bool = False,
        weight_grad_stores: Sequence[WeightGradStore] | None = None,
        buffer_spec: BufferSpec | None = None,
    ) -> None:
        self.chunks = list(chunks)
        self.state = state
        self.actions = actions
        self.num_microbatches = num_microbatches
        self.activation_shape = activation_shape
        self.dtype = dtype
        self.comm = comm or P2PCommunicator(state)
        phases = {a.phase for a in actions if isinstance(a, Compute)}
        self.forward_only = "B" not in phases
        self.post_ahead = post_ahead
        self.weight_grad_stores = list(weight_grad_stores or [])
        if "W" in phases and not self.weight_grad_stores:
            self.weight_grad_stores = [WeightGradStore().attach(c) for c in self.chunks]
        self._split_backward = "W" in phases
        self.num_stages = state.pp.size * len(self.chunks)
        self.peak_stashed = 0
        self.freed_outputs = 0
        # Per-document attention masks (--reset-attention-mask) are needed by every stage;
        # otherwise only the first stage reads tokens and the last labels and loss mask.
        self.batch_on_every_stage = batch_on_every_stage
        # (shape, dtype) of what a receive fills, when stages exchange tensors of other shapes
        # than the GPT's activations (megapipe.pipeline.pipe.Pipe over any nn.Sequential).
        self.buffer_spec = buffer_spec
        # How many of this rank's chunks read each micro-batch (to read it once per step).
        self._batch_readers = sum(
            1 for c in range(len(self.chunks)) if self._reads_batch(self._stage(c))
        )
        self._compute = {"F": self._forward, "B": self._backward, "W": self._weight_grads}

    @property
    def defers_weight_grads(self) -> bool:
        """Whether weight gradients are computed after backward (a zero-bubble schedule's W)."""
        return self._split_backward

    def for_schedule(self, kind: str, num_microbatches: int) -> PipelineExecutor:
        """A sibling executor on the same chunks and communicator for schedule `kind` at
        `num_microbatches` (e.g. "forward-only" for evaluation, or a ramped-up batch)."""
        p, v, rank = self.state.pp.size, len(self.chunks), self.state.pp.rank
        return PipelineExecutor(
            self.chunks,
            self.state,
            build_schedule(kind, p, v, num_microbatches, rank, post_ahead=self.post_ahead),
            num_microbatches=num_microbatches,
            activation_shape=self.activation_shape,
            dtype=self.dtype,
            comm=self.comm,
            post_ahead=self.post_ahead,
            weight_grad_stores=self.weight_grad_stores,
            batch_on_every_stage=self.batch_on_every_stage,
            buffer_spec=self.buffer_spec,
        )

    def run(
        self,
        get_batch: Callable[[int], TrainingBatch],
        *,
        loss_scale: float = 1.0,
        trace: TraceRecorder | None = None,
        sample_ids: Callable[[int], torch.Tensor] | None = None,
    ) -> list[torch.Tensor]:
        """One step of the schedule; returns the last stage's per-micro-batch mean losses.

        Losses are detached and unscaled (not multiplied by `loss_scale` nor divided by the
        number of micro-batches); other stages return []. In training, each loss times
        loss_scale / num_microbatches is what backward starts from (fp16: the scaler's scale).
        trace: records every action's wall-clock start and end. sample_ids: micro-batch ->
        int64 [micro_batch] global sample indices, passed to every chunk's forward when given.
        """
        step = _Step(get_batch, sample_ids, loss_scale, trace)
        self.peak_stashed = self.freed_outputs = 0
        self.comm.connect(len(self.chunks))  # once: no step's transfer waits in a handshake
        with (
            torch.no_grad() if self.forward_only else contextlib.nullcontext(),
            self.comm.collectives_behind_queue(),
        ):
            for action in self.actions:
                if isinstance(action, Compute):
                    self._await_input(step, action)
                start = time.perf_counter()
                if isinstance(action, Comm):
                    self._post(step, action)
                else:
                    self._compute[action.phase](step, action)
                if trace is not None:
                    trace.record(action, start, time.perf_counter())
            for posted in step.receives.values():  # none in a valid schedule; never leave one
                self.comm.wait(posted)
            self.comm.drain()
        queued = sum(store.pending_units for store in self.weight_grad_stores)
        if step.outputs or step.output_grads or queued:
            raise RuntimeError(
                f"schedule left work behind: outputs {sorted(step.outputs)}, "
                f"gradients {sorted(step.output_grads)}, {queued} backward passes' deferred "
                "weight gradients (a W missing from the schedule)"
            )
        return step.losses

    def _stage(self, chunk: int) -> int:
        return chunk * self.state.pp.size + self.state.pp.rank

    def _reads_batch(self, stage: int) -> bool:
        return stage in (0, self.num_stages - 1) or self.batch_on_every_stage

    def _read_batch(self, step: _Step, microbatch: int) -> TrainingBatch:
        """Each micro-batch is read once per step, however many local chunks need it."""
        entry = step.batches.setdefault(microbatch, [None, self._batch_readers])
        if entry[0] is None:
            entry[0] = step.get_batch(microbatch)
        entry[1] -= 1
        if entry[1] == 0:
            del step.batches[microbatch]
        return entry[0]

    def _forward(self, step: _Step, compute: Compute) -> None:
        moment = "eval" if self.forward_only else "forward"  # for the watchdog and fault tests
        what = "forward of micro-batch {} (model chunk {})"
        self.comm.activity.enter(moment, what, compute.microbatch, compute.chunk)
        key = (compute.microbatch, compute.chunk)
        stage = self._stage(compute.chunk)
        first, last = stage == 0, stage == self.num_stages - 1
        batch = self._read_batch(step, compute.microbatch) if self._reads_batch(stage) else None
        kwargs = {
            "labels": batch.labels if last else None,
            "attention_mask": batch.attention_mask if batch is not None else None,
        }
        if step.sample_ids is not None:
            kwargs["sample_ids"] = step.sample_ids(compute.microbatch)
        if first:
            kwargs.update(tokens=batch.tokens, position_ids=batch.position_ids)
        else:  # training keeps the input until its gradient is sent back
            inputs = step.inputs
            kwargs["hidden_states"] = inputs.pop(key) if self.forward_only else inputs[key]
        out = self.chunks[compute.chunk](**kwargs)
        if last:
            if self.state.cp.size > 1:  # the mean over every CP rank's tokens
                mean, loss = context_parallel_masked_mean(out, batch.loss_mask, self.state.cp)
                step.losses.append(mean)
            else:
                loss = masked_mean(out, batch.loss_mask)
                step.losses.append(loss.detach())
            if self.forward_only:
                return
            out = loss * (step.loss_scale / self.num_microbatches)
        step.outputs[key] = out
        self.peak_stashed = max(self.peak_stashed, len(step.outputs) + len(step.awaiting_w))

    def _backward(self, step: _Step, compute: Compute) -> None:
        what = "backward of micro-batch {} (model chunk {})"
        self.comm.activity.enter("backward", what, compute.microbatch, compute.chunk)
        key = (compute.microbatch, compute.chunk)
        out = step.outputs.pop(key)
        deferring = contextlib.nullcontext()
        if self._split_backward:
            deferring = self.weight_grad_stores[compute.chunk].deferring()
            step.awaiting_w.append(key)
        with deferring:
            if self._stage(compute.chunk) == self.num_stages - 1:
                out.backward()
            else:
                _backward_through(out, step.output_grads.pop(key))

    def _weight_grads(self, step: _Step, compute: Compute) -> None:
        """W: the weight gradients B deferred for this micro-batch, into the grad buffer."""
        what = "weight gradients of micro-batch {} (model chunk {})"
        self.comm.activity.enter("weight-grad", what, compute.microbatch, compute.chunk)
        key = (compute.microbatch, compute.chunk)
        oldest = next((k for k in step.awaiting_w if k[1] == compute.chunk), None)
        if oldest != key:  # each chunk's store computes its queued backward passes in order
            raise RuntimeError(f"schedule runs {compute} but the oldest pending B is {oldest}")
        step.awaiting_w.remove(key)
        self.weight_grad_stores[compute.chunk].compute_weight_grads(units=1)

    def _free(self, tensor: torch.Tensor) -> None:
        self.freed_outputs += _free_data(tensor)

    def _transfer(self, step: _Step, op: P2P) -> Transfer:
        """The tensor `op` sends or receives into."""
        key = (op.microbatch, op.chunk)
        if op.op == "recv":
            shape, dtype = (
                self.buffer_spec(op) if self.buffer_spec else (self.activation_shape, self.dtype)
            )
            if self.buffer_spec is None and self.state.cp.size > 1:  # a CP rank's chunks
                shape = (shape[0] // self.state.cp.size, *shape[1:])
            buffer = torch.empty(shape, dtype=dtype, device=self.state.device)
            if op.phase == "B":
                step.output_grads[key] = buffer
            else:
                step.inputs[key] = buffer if self.forward_only else buffer.requires_grad_()
            return op, buffer
        if op.phase == "B":
            return op, step.inputs.pop(key).grad
        if self.forward_only:  # released now: the transport holds it until the send is done
            return op, step.outputs.pop(key)
        return op, step.outputs[key].detach()

    def _post(self, step: _Step, comm: Comm) -> None:
        posted = self.comm.post([self._transfer(step, op) for op in comm.ops])
        step.receives.update({(op.phase, op.microbatch, op.chunk): w for op, w in posted.items()})
        if not self.forward_only:  # the transport keeps a sent output's storage until it is done
            for op in comm.ops:
                if op.op == "send" and op.phase == "F":
                    self._free(step.outputs[(op.microbatch, op.chunk)])

    def _await_input(self, step: _Step, compute: Compute) -> None:
        """Wait for the receive `compute` needs, if any: a unit's forward runs while the
        gradient its backward needs is still on the way."""
        posted = step.receives.pop((compute.phase, compute.microbatch, compute.chunk), None)
        if posted is not None:
            start = time.perf_counter()
            self.comm.wait(posted)
            if step.trace is not None:
                step.trace.record(Comm((posted.op,)), start, time.perf_counter())
