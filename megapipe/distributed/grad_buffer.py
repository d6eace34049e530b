"""Contiguous gradient (and parameter) buffers with buckets reduced over data parallelism.

Each model chunk gets one `GradBuffer`: every parameter's fp32 gradient (`param.main_grad`) and
its data are views into two flat buffers laid out the same way, split into buckets of about
`bucket_size` elements, in reverse parameter order (roughly the order backward produces them).

Every gradient enters through one call, `accumulate(param, ...)`, which adds it into `main_grad`
and counts it toward its bucket. Layers that own their backward (TP linears, the embedding;
`layers/weight_grad.py`) call it themselves, once per claiming layer and micro-batch, and
give autograd nothing for their parameters: no gradient of theirs depends on an autograd hook.
Every other parameter (norms, row-parallel biases, position embeddings) gets its gradient from
autograd, and a post-accumulate-grad hook hands it to `accumulate` and frees `param.grad`.
A gradient arriving for a bucket whose reduction has started, or a reduction while a deferred
weight gradient is still queued, raises instead of losing a contribution.

Synchronisation per bucket, over the group that holds one model replica's parameters (the
data-parallel group; with context parallelism, DP x CP: `ParallelState.dp_cp`), pre-scaled by
1 over its size (an average; "DP" below is that group's size):
* plain data parallelism: all-reduce; every rank then holds the whole averaged gradient;
* distributed optimizer (ZeRO-1): reduce-scatter (with hybrid sharding, inside this rank's
  instance, then an all-reduce of the shard over the other instances); each rank holds its
  1/DP shard of every bucket
  (buckets are padded to a multiple of DP x SHARD_ALIGNMENT elements, so that every shard of
  every bucket starts at a multiple of SHARD_ALIGNMENT, for any DP size: 3, 6 and 12 as well
  as powers of two), steps only that shard, and the parameters are
  all-gathered afterwards (`all_gather_params`); with --overlap-param-gather those
  all-gathers run asynchronously and each bucket is waited for (`wait_params`) just before
  the next forward first reads it (ShardedOptimizer.overlap_param_gather_with).
`solo` parameters get a bucket of their own at the start of the buffer: the tied word embedding
of the first and last pipeline stage, whose gradients are summed over the embedding group after
the DP reduction, must be sharded identically on both stages for that sum to be right.
With `overlap`, a bucket's collective starts asynchronously as soon as each of its parameters
has accumulated all micro-batches' gradients, i.e. during the last micro-batch's backward, and
`finish_grad_sync` waits for it; without it, all buckets are reduced in `finish_grad_sync`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megapipe.activity import Activity
from megapipe.kernels.weight_grad_gemm import accumulate_weight_grad
from megapipe.layers.weight_grad import pending_weight_grads, rows_to_grad, weight_grad_claims
from megapipe.parallel.mappings import all_gather_single, reduce_scatter_single
from megapipe.parallel.state import Group

DEFAULT_BUCKET_SIZE = 40_000_000  # elements, Megatron-LM's default for --ddp-bucket-size
# Elements: 256 bytes of a bf16 parameter shard, 512 of an fp32 gradient shard. Buckets of a
# multiple of DP x 128 are also multiples of Megatron-LM's lcm(DP, 128), for NCCL's bandwidth;
# the padding is at most DP x 128 - 1 elements a bucket (8191 of 40M at DP=64).
SHARD_ALIGNMENT = 128


@dataclass
class Bucket:
    """A contiguous run of parameters [start, end) of the buffer, reduced by one collective."""

    params: list[torch.nn.Parameter]
    start: int
    end: int
    pending: set[int] = field(default_factory=set)  # ids of params still accumulating
    started: bool = False
    work: dist.Work | None = None
    scattered: torch.Tensor | None = None  # reduce-scatter output until copied into place
    gathering: tuple[dist.Work, torch.Tensor] | None = None  # async parameter all-gather

    def shard_range(self, dp: Group) -> tuple[int, int]:
        """This DP rank's [start, end) of the bucket, in buffer coordinates."""
        size = (self.end - self.start) // dp.size
        return self.start + dp.rank * size, self.start + (dp.rank + 1) * size


class GradBuffer:
    """The gradients and parameters of one model chunk, in flat bucketed buffers."""

    def __init__(
        self,
        params: list[torch.nn.Parameter],
        dp: Group,
        *,
        num_microbatches: int,
        bucket_size: int | None = None,
        overlap: bool = False,
        shard: bool = False,
        solo: list[torch.nn.Parameter] | None = None,
        activity: Activity | None = None,
        replicas: Group | None = None,
        group_name: str = "data-parallel group",
        average_over: int | None = None,
    ) -> None:
        """`dp`: the group the gradients are averaged over (DP, or DP x CP). `replicas`: hybrid
        sharding (--num-distributed-optimizer-instances with the distributed optimizer): `dp`
        is this rank's instance, the shards are all-reduced over `replicas` (the same shard in
        every other instance) after the reduce-scatter. `group_name`: how the watchdog's
        messages name `dp`. `average_over`: what the summed gradient is divided by when that
        is not the group's size: MoE experts are reduced over their expert-data-parallel group
        but, holding every EP rank's tokens' contributions already, divided by DP x CP."""
        self.dp = dp
        self.group_name = group_name
        self.replicas = replicas if replicas is not None and replicas.size > 1 else None
        self.average_over = average_over or dp.size * (self.replicas.size if self.replicas else 1)
        self.activity = activity or Activity()  # what this rank waits in (watchdog, faults)
        self.num_microbatches = num_microbatches
        self.overlap = overlap
        self.shard = shard
        self.params = [p for p in params if p.requires_grad]
        bucket_size = bucket_size or DEFAULT_BUCKET_SIZE
        pad_to = dp.size * SHARD_ALIGNMENT if shard and dp.size > 1 else 1

        offsets: dict[int, int] = {}
        self.buckets: list[Bucket] = []
        current: list[torch.nn.Parameter] = []
        start = offset = 0
        solo_ids = {id(p) for p in solo or []}
        self._solo_buckets = sum(1 for p in self.params if id(p) in solo_ids)
        for param in (p for p in self.params if id(p) in solo_ids):
            offsets[id(param)] = start
            offset = -(-(start + param.numel()) // pad_to) * pad_to
            self.buckets.append(Bucket([param], start, offset))
            start = offset
        for param in (p for p in reversed(self.params) if id(p) not in solo_ids):
            offsets[id(param)] = offset
            offset += param.numel()
            current.append(param)
            if offset - start >= bucket_size:
                offset = -(-offset // pad_to) * pad_to
                self.buckets.append(Bucket(current, start, offset))
                current, start = [], offset
        if current:
            offset = -(-offset // pad_to) * pad_to
            self.buckets.append(Bucket(current, start, offset))
        self.numel = offset

        device = self.params[0].device if self.params else torch.device("cpu")
        dtype = self.params[0].dtype if self.params else torch.float32
        self.grad_data = torch.zeros(self.numel, dtype=torch.float32, device=device)
        self.param_data = torch.zeros(self.numel, dtype=dtype, device=device)
        self._bucket_of: dict[int, Bucket] = {}
        self._accumulated: dict[int, int] = {}
        # accumulate() calls per micro-batch: one per claiming layer, else autograd's one
        self._per_microbatch = {id(p): max(1, weight_grad_claims(p)) for p in self.params}
        for bucket in self.buckets:
            for param in bucket.params:
                lo = offsets[id(param)]
                view = self.param_data[lo : lo + param.numel()].view_as(param)
                view.copy_(param.data)
                param.data = view
                param.main_grad = self.grad_data[lo : lo + param.numel()].view_as(param)
                param.buffer_offset = lo
                param.grad_buffer = self
                self._bucket_of[id(param)] = bucket
                param.register_post_accumulate_grad_hook(self._on_grad)
        self.reset()

    def expect_microbatches(self, num_microbatches: int) -> None:
        """The next step accumulates this many micro-batches (a batch-size ramp-up changes it):
        with overlap, a bucket's reduction starts once each of its gradients arrived that often."""
        self.num_microbatches = num_microbatches

    def reset(self) -> None:
        """Zero the gradients and rearm every bucket for the next step."""
        self.grad_data.zero_()
        self._accumulated = {id(p): 0 for p in self.params}
        self.started_before_finish = 0  # buckets whose reduction overlapped backward
        self._finishing = False
        for bucket in self.buckets:
            bucket.pending = {id(p) for p in bucket.params}
            bucket.started = False
            bucket.work = bucket.scattered = None

    def _on_grad(self, param: torch.nn.Parameter) -> None:
        """Autograd accumulated a gradient into `param.grad`: move it into main_grad."""
        grad, param.grad = param.grad, None
        if grad is None:  # a claiming layer delivered it through accumulate() already
            return
        if weight_grad_claims(param):
            raise RuntimeError(
                f"a parameter of shape {tuple(param.shape)} whose gradient its layers deliver "
                "themselves also got one from autograd: it is used outside the layers that "
                "claim it (layers/weight_grad.py)"
            )
        self.accumulate(param, grad)

    def accumulate(
        self,
        param: torch.nn.Parameter,
        grad: torch.Tensor | None = None,
        *,
        factors: tuple[torch.Tensor, torch.Tensor] | None = None,
        rows: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """Add one micro-batch's gradient of `param` into its fp32 main_grad and count it.

        grad: the gradient; or factors (grad_output [n, out], input [n, in]) of a linear
        weight's gradient, multiplied into main_grad by a GEMM in the factors' dtype with an
        fp32 sum (kernels/weight_grad_gemm.py: Megatron's --gradient-accumulation-fusion where
        the device allows); or rows (index [n], values [n, h]) of an embedding's gradient,
        values[i] added to row index[i]: a half-precision model's straight into main_grad, so
        repeated tokens are summed in fp32 (an fp32 model's into a temporary first, the sum as
        it always was). With overlap, the bucket's reduction starts once each of its parameters
        has had all of this step's contributions.
        """
        key = id(param)
        bucket = self._bucket_of[key]
        if bucket.started:
            raise RuntimeError(
                f"a gradient of a parameter of shape {tuple(param.shape)} arrived after its "
                "bucket's reduction started (deferred weight gradients must be computed before "
                "finish_grad_sync)"
            )
        main = param.main_grad
        if factors is not None:  # main_grad has the weight's shape [out, in]
            accumulate_weight_grad(main, *factors)
        elif rows is not None:
            index, values = rows
            if values.dtype == main.dtype:
                main.add_(rows_to_grad(param, index, values))
            else:
                main.index_add_(0, index, values.to(main.dtype))
        else:
            main.add_(grad)
        count = self._accumulated[key] + 1
        self._accumulated[key] = count
        if self.overlap and count == self.num_microbatches * self._per_microbatch[key]:
            bucket.pending.discard(key)
            if not bucket.pending:
                self._start(bucket)

    def _start(self, bucket: Bucket) -> None:
        bucket.started = True
        self.started_before_finish += not self._finishing
        data = self.grad_data[bucket.start : bucket.end]
        if self.average_over != 1:
            data.div_(self.average_over)
        if self.dp.size == 1:
            return
        if self.shard:
            bucket.scattered = torch.empty_like(data[: data.numel() // self.dp.size])
            bucket.work = reduce_scatter_single(
                bucket.scattered, data, group=self.dp.pg, async_op=True
            )
        else:
            bucket.work = dist.all_reduce(data, group=self.dp.pg, async_op=True)

    def finish_grad_sync(self) -> None:
        """Start what has not started, wait for every bucket, put shards in place."""
        queued = sum(pending_weight_grads(p) for p in self.params)
        if queued:
            raise RuntimeError(
                f"{queued} deferred weight gradients of this buffer's parameters are still "
                "queued: call WeightGradStore.compute_weight_grads() before finish_grad_sync"
            )
        self._finishing = True
        for index, bucket in enumerate(self.buckets):
            if not bucket.started:
                self._start(bucket)
            if bucket.work is not None:
                kind = "reduce-scatter" if self.shard else "all-reduce"
                what = "{} of gradient bucket {} over the {} (ranks {})"
                ranks = list(self.dp.ranks)
                self.activity.enter("grad-reduce", what, kind, index, self.group_name, ranks)
                bucket.work.wait()
                bucket.work = None
            if bucket.scattered is not None and self.replicas is not None:
                what = "all-reduce of gradient bucket {}'s shard over its replicas (ranks {})"
                self.activity.enter("grad-reduce", what, index, list(self.replicas.ranks))
                dist.all_reduce(bucket.scattered, group=self.replicas.pg)
            if bucket.scattered is not None:
                lo, hi = bucket.shard_range(self.dp)
                self.grad_data[lo:hi].copy_(bucket.scattered)
                bucket.scattered = None

    def shard_ranges(self) -> list[tuple[int, int]]:
        """The [start, end) buffer ranges this rank's optimizer owns."""
        if not self.shard or self.dp.size == 1:
            return [(0, self.numel)] if self.numel else []
        return [bucket.shard_range(self.dp) for bucket in self.buckets]

    def all_gather_params(self, *, async_op: bool = False) -> None:
        """After a sharded step: every rank receives every other rank's updated shard.

        With `async_op` (--overlap-param-gather) the all-gathers are only started, the
        first-needed bucket first (the solo embedding, then the first layers'); whoever reads a
        bucket's parameters waits for it first: `wait_params` (the forward pre-hooks that
        ShardedOptimizer.overlap_param_gather_with installs) or `finish_param_sync` (all).
        """
        what = "the optimizer step (all-gather of the updated parameters over ranks {})"
        self.activity.enter("optimizer", what, list(self.dp.ranks))
        if not self.shard or self.dp.size == 1:
            return
        self.finish_param_sync()  # a gather still running would overwrite the new shard
        solo, rest = self.buckets[: self._solo_buckets], self.buckets[self._solo_buckets :]
        for bucket in [*solo, *reversed(rest)] if async_op else self.buckets:
            lo, hi = bucket.shard_range(self.dp)
            mine = self.param_data[lo:hi].clone()
            out = self.param_data[bucket.start : bucket.end]
            work = all_gather_single(out, mine, group=self.dp.pg, async_op=async_op)
            if async_op:
                bucket.gathering = (work, mine)

    def bucket_of(self, param: torch.nn.Parameter) -> Bucket:
        return self._bucket_of[id(param)]

    def wait_params(self, bucket: Bucket) -> None:
        """Wait for `bucket`'s parameter all-gather, if one is in flight."""
        if bucket.gathering is not None:
            what = "the all-gather of parameter bucket {} over the {} ({})"
            index = next(i for i, b in enumerate(self.buckets) if b is bucket)
            ranks = list(self.dp.ranks)
            self.activity.enter("param-gather", what, index, self.group_name, ranks)
            bucket.gathering[0].wait()
            bucket.gathering = None

    def finish_param_sync(self) -> None:
        """Wait for every parameter all-gather still in flight (before reading parameters
        outside a forward: a checkpoint save, the next optimizer step)."""
        for bucket in self.buckets:
            self.wait_params(bucket)
