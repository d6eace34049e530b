"""Where the weight gradients of layers that own their backward go, now or later.

The TP linear layers and the vocabulary-parallel embedding compute their weight gradients in
their own autograd Functions instead of handing them to autograd. Such a parameter is
*claimed* (`claim_weight_grad`, when the layer is built): each claiming layer delivers exactly
one gradient per micro-batch, which is how a GradBuffer knows that a parameter's gradient is
complete (and its bucket's reduction can start) without any autograd hook firing.
`deliver_weight_grad` puts one gradient where it belongs:

* a GradBuffer owns the parameter (`param.grad_buffer`): `GradBuffer.accumulate` adds it
  straight into the fp32 `main_grad`; a linear weight passes the factors of its gradient
  (grad_output, input), multiplied into `main_grad` by a GEMM in the parameters' dtype with
  an fp32 sum (kernels/weight_grad_gemm.py, Megatron's --gradient-accumulation-fusion), and
  the embedding the rows of its gradient (ids, output gradient), added into `main_grad` by id
  (in fp32). Autograd gets None for the parameter;
* no buffer (a plain model: tests, evaluation, generation): returned to autograd, which
  accumulates it into `param.grad` as for any parameter (outside backward: added to `.grad`).

`WeightGradStore` defers them: inside `store.deferring()`, a claiming layer's backward computes
only its input gradient and queues what its weight gradient needs; `compute_weight_grads()`
computes and delivers the queued gradients later, wherever a schedule puts them (zero-bubble's W).
A GradBuffer refuses to reduce while a gradient of one of its parameters is still queued.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable, Iterator, Sequence

import torch

WeightGradFn = Callable[[bool], tuple[torch.Tensor | None, ...]]


def claim_weight_grad(param: torch.nn.Parameter) -> None:
    """Declare that one more layer delivers `param`'s gradient itself, once per micro-batch."""
    param.weight_grad_claims = weight_grad_claims(param) + 1


def weight_grad_claims(param: torch.nn.Parameter) -> int:
    """How many layers deliver `param`'s gradient themselves (0: autograd does)."""
    return getattr(param, "weight_grad_claims", 0)


def pending_weight_grads(param: torch.nn.Parameter) -> int:
    """Gradients of `param` queued in a WeightGradStore and not yet computed."""
    return getattr(param, "pending_weight_grads", 0)


def deliver_weight_grad(
    param: torch.nn.Parameter,
    grad: torch.Tensor | None = None,
    *,
    factors: tuple[torch.Tensor, torch.Tensor] | None = None,
    rows: tuple[torch.Tensor, torch.Tensor] | None = None,
    in_backward: bool,
) -> torch.Tensor | None:
    """Hand one micro-batch's gradient of `param` to its grad buffer, or to autograd.

    grad: the gradient itself; or factors (grad_output [n, out], input [n, in]) of a linear
    weight's gradient grad_output^T @ input; or rows (index [n], values [n, h]) of an
    embedding's gradient (`rows_to_grad`). Returns what the autograd Function must return
    for `param` (None once a buffer took it, or when called outside backward).
    """
    buffer = getattr(param, "grad_buffer", None)
    if buffer is not None:
        buffer.accumulate(param, grad, factors=factors, rows=rows)
        return None
    if factors is not None:
        grad_output, inputs = factors
        grad = grad_output.t().mm(inputs)
    elif rows is not None:
        grad = rows_to_grad(param, *rows)
    if in_backward:
        return grad
    with torch.no_grad():
        if param.grad is None:
            param.grad = grad
        else:
            param.grad.add_(grad)
    return None


def rows_to_grad(
    param: torch.nn.Parameter, index: torch.Tensor, values: torch.Tensor
) -> torch.Tensor:
    """A gradient of `param`'s shape and dtype whose row index[i] sums values[i] (a lookup's)."""
    grad = torch.zeros_like(param, memory_format=torch.contiguous_format)
    return grad.index_add_(0, index, values)


class WeightGradStore:
    """A queue of deferred weight gradients, in units of one backward pass each.

    `attach(model)` routes every claiming layer of `model` through the store (before its
    forward); backward passes run inside `deferring()` then compute input gradients only, and
    `compute_weight_grads()` computes the weight gradients, oldest unit first, each unit in the
    order its backward queued them, so the result is bit-identical to computing them at once.
    """

    def __init__(self) -> None:
        self._units: deque[list[tuple[WeightGradFn, Sequence[torch.nn.Parameter]]]] = deque()
        self._open: list | None = None

    def attach(self, module: torch.nn.Module) -> WeightGradStore:
        """Let every layer of `module` that computes its own weight gradients defer them here.

        A layer defers into one store: attaching a second store to it raises (its layers would
        otherwise stop deferring into the first one silently, and a zero-bubble schedule
        driven by that one would compute every weight gradient in B)."""
        layers = [m for m in module.modules() if hasattr(m, "weight_grad_store")]
        if not layers:
            raise ValueError(f"{type(module).__name__} has no layer that owns its weight gradients")
        taken = [m for m in layers if m.weight_grad_store not in (None, self)]
        if taken:
            raise ValueError(
                f"{len(taken)} layer(s) of this {type(module).__name__} already defer their weight "
                "gradients into another WeightGradStore; share that store (e.g. "
                "PipelineExecutor(..., weight_grad_stores=other.weight_grad_stores)) instead of "
                "attaching a new one"
            )
        for layer in layers:
            layer.weight_grad_store = self
        return self

    @contextlib.contextmanager
    def deferring(self) -> Iterator[WeightGradStore]:
        """Backward passes inside queue their weight gradients, as one unit."""
        if self._open is not None:
            raise RuntimeError("WeightGradStore.deferring() is already active")
        self._open = []
        try:
            yield self
        finally:
            unit, self._open = self._open, None
            self._units.append(unit)  # even empty: one unit per backward pass, W pairs with it

    @property
    def is_deferring(self) -> bool:
        return self._open is not None

    @property
    def pending_units(self) -> int:
        """Units queued and not yet computed."""
        return len(self._units)

    def defer(self, compute: WeightGradFn, params: Sequence[torch.nn.Parameter]) -> None:
        """Queue `compute(in_backward=False)`, which delivers the gradients of `params`."""
        if self._open is None:
            raise RuntimeError("WeightGradStore.defer() outside deferring()")
        for param in params:
            param.pending_weight_grads = pending_weight_grads(param) + 1
        self._open.append((compute, params))

    def compute_weight_grads(self, units: int | None = None) -> int:
        """Compute and deliver the oldest `units` queued units (all by default); returns how
        many were computed. Collective under sequence parallelism: every TP rank calls it alike.
        """
        count = 0
        with torch.no_grad():
            while self._units and (units is None or count < units):
                for compute, params in self._units.popleft():
                    compute(False)
                    for param in params:
                        param.pending_weight_grads -= 1
                count += 1
        return count
