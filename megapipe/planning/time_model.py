"""Estimated step time of a layout: compute, pipeline bubble, TP / PP / DP communication.

Assumptions (stated, each a knob or a line here):

* Compute: training/flops.py's FLOPs (Megatron's formula: matmuls only, 3 passes, causal
  attention halved), plus what recomputation runs again (full: every layer's forward;
  selective: the attention core's), divided over TP, at `matmul_efficiency` x peak. The
  slowest pipeline stage sets the pace (the last one also computes the logits).
* Bubble: schedule_model.bubble_fraction x the per-micro-batch time (compute + TP) of the
  stages that fill and drain the pipeline around the slowest one: the faster of the first and
  last stage (for equal stages this is the closed form; where the last stage's logits make it
  the slowest, its idle time is the first stages' forwards and backwards, not its own).
* TP: per layer and micro-batch 2 all-reduces of s b h activations forward (+2 with full
  recomputation) and 2 backward (sequence parallelism's reduce-scatter + all-gather move the
  same bytes), plus one at the embedding and, on the last stage, one at the output layer and
  the vocabulary-parallel cross-entropy's all-gather (a few floats per token: its latency);
  a ring all-reduce over t ranks takes 2 (t-1)/t x bytes / bandwidth; NVLink when the TP group
  lies in a node. The backward ones reduce a column-parallel linear's input gradient (QKV,
  FC1, the logits) while its weight gradient is computed (megapipe's TP linear, Megatron's
  async all-reduce): only what exceeds that matmul is on the critical path
  (`tp_weight_grad_overlap`, on by default). `tp_overlap` of what is left hides behind other
  compute (0 by default).
* PP: 2 (v m + p - 1) sends of s b h activations on the critical path (each forward and
  backward waits for one; the fill adds p - 1), each split over the TP ranks (Megatron's
  scatter/gather: every TP rank sends 1/t over its own link); inter-node bandwidth once the
  world is larger than a node. Not overlapped (megapipe posts and waits per unit).
* DP, by sharding strategy (Layout.sharding), ring collectives over d ranks moving (d-1)/d x
  the full tensor's bytes each (an all-reduce twice that), NVLink when TP x DP fits in a node;
  gradients reduced in fp32 (4 bytes), parameters gathered in the training dtype (g = 2 bf16,
  4 fp32), as distributed/fsdp.py's MixedPrecisionPolicy and the distributed optimizer do:
  - no_shard: the gradients all-reduced once per step, 2 (d-1)/d x 4 bytes a parameter;
  - optim (ZeRO-1): reduce-scattered once per step and the updated parameters all-gathered
    once, (d-1)/d x (4 + g);
  - optim_grads (ZeRO-2): every micro-batch gathers each layer's parameters for its forward
    (kept to the backward) and reduce-scatters its gradients, m (d-1)/d x (g + 4);
  - optim_grads_params (ZeRO-3): every micro-batch gathers them for the forward and again for
    the backward, and reduce-scatters, m (d-1)/d x (2 g + 4).
  ZeRO-2/3's per-micro-batch collectives are part of each micro-batch's work on a stage, so
  they also lengthen the pipeline bubble. Each FSDP group (every transformer layer, and the
  chunk holding the embedding or the output layer) is one collective. ZeRO-2 under a pipeline
  gathers less when a layer's next forward comes before its backward (parameters still
  gathered): m gathers is an upper bound there.
  FSDP2 also copies around each collective (`fsdp_copy_seconds`): an all-gather's shard into
  its flat buffer and the gathered buffer out to the parameters, a reduce-scatter's gradients
  in and the shard out; each byte read and written once at the cluster's `memory_gbps` (left
  out when it is None). On GPUs this is small against the transfers; on a CPU it is a large
  part of ZeRO-3's cost (benchmarks/RESULTS.md, issue 23).
  Reduce-scatters and all-gathers run at the cluster's `shard_collective_efficiency` of that
  bandwidth (1 assumed on NCCL; gloo's reached 0.41-0.68 of its all-reduce's, measured).
  Overlap: `dp_overlap` of the gradient reductions (no_shard and ZeRO-1: the whole once-per-
  step term, as before) hides behind the backward (0 by default: off unless
  --overlap-grad-reduce); `param_gather_overlap` of ZeRO-2/3's all-gathers hides behind the
  layers' compute (FSDP2's prefetch, --overlap-param-gather; 0 by default, which is what gloo
  on a CPU gives); what ZeRO-2/3 hide per micro-batch is at most that micro-batch's compute.
* CP (context parallelism, Layout.cp ranks per sequence, in a group of TP x CP consecutive
  ranks): each rank holds S / CP tokens, so compute, TP's and PP's activations divide by CP
  and gradients reduce over DP x CP (its bandwidth that of TP x CP x DP ranks). Per layer and
  micro-batch, with k = the local keys and values (2 S/CP b g d / t elements):
  - p2p (the ring): CP - 1 steps forward each passing k to the next rank; backward CP - 1
    passes of k and CP passes of the fp32 dK/dV accumulator. Each step's transfer runs under
    that step's block attention (the rank's share of the attention core, core / (t CP^2)
    forward and twice that backward; `cp_overlap`): only what exceeds it is exposed; the
    accumulator's last hop home overlaps nothing;
  - all_gather: an all-gather of K and V forward, a reduce-scatter of dK and dV backward,
    (CP - 1) k each, not overlapped;
  - a2a: all-to-alls of q, k, v and the output forward and again backward, (CP - 1)/CP of
    the local bytes each, not overlapped.
  Recomputation (full, or selective of the attention core) runs the forward's share again.
* MoE (expert_time.py): compute is the active parameters' FLOPs (router, top-k experts,
  shared expert; balanced routing gives every EP rank T k rows); each MoE layer adds the
  expert-parallel token exchange ("EP comm": alltoall's 4 all-to-alls or allgather's gathers
  and reduce-scatters, over NVLink when TP x EP fits a node), its experts' TP all-reduces
  carry R = T k rows instead of T; expert gradients reduce (and, sharded, gather) over the
  expert-DP ranks DP x CP / EP, dense ones over DP x CP.
* Latency: every collective and send above also costs the cluster's `collective_latency_us`
  (TP: each all-reduce; PP: each send; DP: each bucket's collective, two with the distributed
  optimizer; ZeRO-2/3: each FSDP group's collectives, per micro-batch). Small for large
  models on GPUs (0.6% of a 1.3B TP2 DP8 step on 2 DGX A100s);
  on a CPU with gloo it is most of TP's cost.
* Left out: the optimizer step and other memory-bound work (norms, softmax, GeLU), the tied
  embedding's all-reduce between the first and last stage, data loading, kernel launches.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from megapipe.config import ModelConfig
from megapipe.distributed.grad_buffer import DEFAULT_BUCKET_SIZE
from megapipe.pipeline.partition import partition_layers
from megapipe.pipeline.stage_memory import stage_expert_parameters, stage_parameters
from megapipe.planning.cluster import Cluster
from megapipe.planning.expert_time import ep_span, expert_parallel_seconds, moe_tensor_parallel
from megapipe.planning.layout import Layout
from megapipe.planning.schedule_model import bubble_fraction
from megapipe.training.flops import flops_per_iteration

GB = 1e9


@dataclass(frozen=True)
class TimeKnobs:
    """The overlap fractions and precision the estimate assumes."""

    tp_overlap: float = 0.0
    dp_overlap: float = 0.0
    # ZeRO-2/3: the fraction of the per-micro-batch all-gathers hidden behind compute (FSDP2's
    # prefetch of the next layer's parameters); 0: each layer waits for its gather
    param_gather_overlap: float = 0.0
    # the backward TP all-reduces run under their linears' weight-gradient matmuls (megapipe's
    # TP linear, --tp-comm-overlap's default; Megatron-LM from late 2021: async all-reduce)
    tp_weight_grad_overlap: bool = True
    # the ring's (--cp-comm-type p2p) transfers run under the block attention of each step
    cp_overlap: bool = True
    half_precision: bool = True  # bf16/fp16 activations and parameters (else fp32)
    pp_scatter_gather: bool = True

    @property
    def dtype_bytes(self) -> int:
        return 2 if self.half_precision else 4


@dataclass(frozen=True)
class StepTime:
    """Seconds of one step on the slowest stage, by term."""

    compute: float
    bubble: float
    tp_comm: float
    pp_comm: float
    dp_comm: float
    bubble_fraction: float
    flops: int  # model FLOPs of the iteration (Megatron's count, no recomputation)
    world_size: int
    dp_gather: float = 0.0  # the parameter all-gathers' part of dp_comm (ZeRO-1/2/3)
    cp_comm: float = 0.0  # context parallelism's exposed K/V exchange
    ep_comm: float = 0.0  # expert parallelism's token exchange (MoE layers)

    @property
    def total(self) -> float:
        return (self.compute + self.bubble + self.tp_comm + self.pp_comm + self.dp_comm
                + self.cp_comm + self.ep_comm)  # fmt: skip

    @property
    def tflops_per_gpu(self) -> float:
        """Model TFLOP/s per GPU, as the log line's throughput field counts it."""
        return self.flops / (self.total * self.world_size * 1e12)

    def terms(self) -> dict[str, float]:
        terms = {"compute": self.compute, "bubble": self.bubble, "TP comm": self.tp_comm,
                 "PP comm": self.pp_comm, "DP comm": self.dp_comm}  # fmt: skip
        if self.cp_comm:
            terms["CP comm"] = self.cp_comm
        if self.ep_comm:
            terms["EP comm"] = self.ep_comm
        return terms


@functools.lru_cache(maxsize=1024)
def _forward_flops(model: ModelConfig, micro_batch: int, padded_vocab: int) -> tuple[int, ...]:
    """(one layer's, the logits', one layer's attention core's) forward FLOPs per micro-batch,
    all from flops_per_iteration: the layer is the difference of 1 and 0 layers, the core the
    part quadratic in the sequence (F(2s) - 2 F(s) = 2 x the s^2 terms)."""

    def forward(**changes: int) -> int:
        config = dataclasses.replace(model, **changes)
        return flops_per_iteration(config, micro_batch, padded_vocab_size=padded_vocab) // 3

    def layer(seq: int) -> int:
        return forward(num_layers=1, seq_length=seq) - forward(num_layers=0, seq_length=seq)

    s = model.seq_length
    return layer(s), forward(num_layers=0), (layer(2 * s) - 2 * layer(s)) // 2


def ring_all_reduce_seconds(nbytes: float, ranks: int, gbps: float) -> float:
    """A ring all-reduce of `nbytes` over `ranks`: 2 (ranks-1)/ranks x bytes / bandwidth."""
    return 2 * (ranks - 1) / ranks * nbytes / (gbps * GB) if ranks > 1 else 0.0


def within_node(cluster: Cluster, span: int) -> bool:
    """Whether every group of `span` consecutive ranks lies in one node (ranks fill nodes in
    order, TP fastest, then DP, then PP)."""
    return span <= cluster.gpus_per_node and cluster.gpus_per_node % span == 0


def _bandwidth(cluster: Cluster, span: int) -> float:
    return cluster.intra_node_gbps if within_node(cluster, span) else cluster.inter_node_gbps


def ep_bandwidth(cluster: Cluster, layout: Layout) -> float:
    return _bandwidth(cluster, ep_span(layout))


def tp_bandwidth(cluster: Cluster, layout: Layout) -> float:
    return _bandwidth(cluster, layout.tp)


def cp_bandwidth(cluster: Cluster, layout: Layout) -> float:
    return _bandwidth(cluster, layout.tp * layout.cp)


def dp_bandwidth(cluster: Cluster, layout: Layout) -> float:
    return _bandwidth(cluster, layout.tp * layout.cp * layout.dp)


def pp_bandwidth(cluster: Cluster, layout: Layout) -> float:
    return _bandwidth(cluster, layout.world_size)


@dataclass(frozen=True)
class DataParallelTime:
    """One stage's exposed DP communication: once per step (no_shard, ZeRO-1) and per
    micro-batch (ZeRO-2/3), with the all-gathers' part of each."""

    once: float = 0.0
    once_gather: float = 0.0
    per_microbatch: float = 0.0
    gather_per_microbatch: float = 0.0


def ring_shard_seconds(nbytes: float, ranks: int, gbps: float) -> float:
    """A ring reduce-scatter or all-gather of a tensor of `nbytes` (whole, not the shard)
    over `ranks`: (ranks-1)/ranks x bytes / bandwidth."""
    return (ranks - 1) / ranks * nbytes / (gbps * GB) if ranks > 1 else 0.0


def fsdp_copy_seconds(
    params: int, d: int, gathers: int, dtype_bytes: int, memory_gbps: float | None
) -> float:
    """FSDP2's copies per micro-batch for `params` parameters sharded over `d` ranks:
    `gathers` all-gathers (copy-in of the shard, copy-out of the whole, in the training dtype)
    and one reduce-scatter (copy-in of the whole fp32 gradient, copy-out of the shard), each
    byte read and written once."""
    if memory_gbps is None or d == 1:
        return 0.0
    moved = gathers * params * dtype_bytes * (1 + 1 / d) + params * 4 * (1 + 1 / d)
    return 2 * moved / (memory_gbps * GB)


def data_parallel_seconds(
    layout: Layout,
    cluster: Cluster,
    knobs: TimeKnobs,
    params: int,
    groups: int,
    compute_per_microbatch: float,
    ranks: int | None = None,
) -> DataParallelTime:
    """The DP term of the module docstring for a stage of `params` parameters (one TP rank's)
    in `groups` FSDP groups, whose micro-batch computes for `compute_per_microbatch` s,
    reduced over `ranks` (default DP x CP; expert parameters: the expert-DP ranks)."""
    d, g = ranks or layout.dp * layout.cp, knobs.dtype_bytes  # gradients reduce over DP x CP
    if d == 1 or params == 0:
        return DataParallelTime()
    gbps = dp_bandwidth(cluster, layout)
    shard_gbps = gbps * cluster.shard_collective_efficiency  # reduce-scatters, all-gathers
    latency = cluster.collective_latency_us * 1e-6
    if layout.fsdp:
        gathers = 2 if layout.sharding == "optim_grads_params" else 1
        gather = gathers * (ring_shard_seconds(params * g, d, shard_gbps) + groups * latency)
        reduce = ring_shard_seconds(params * 4, d, shard_gbps) + groups * latency
        copies = fsdp_copy_seconds(params, d, gathers, g, cluster.memory_gbps)  # never hidden
        hidden = gather * knobs.param_gather_overlap + reduce * knobs.dp_overlap
        hidden = min(hidden, compute_per_microbatch)
        exposed_gather = gather * (1 - knobs.param_gather_overlap)
        return DataParallelTime(
            per_microbatch=gather + reduce - hidden + copies,
            gather_per_microbatch=min(exposed_gather, gather + reduce - hidden),
        )
    buckets = -(-params // DEFAULT_BUCKET_SIZE)
    if layout.distributed_optimizer:  # a reduce-scatter and an all-gather per bucket
        gather = ring_shard_seconds(params * g, d, shard_gbps) + buckets * latency
        reduce = ring_shard_seconds(params * 4, d, shard_gbps) + buckets * latency
    else:
        gather, reduce = 0.0, ring_all_reduce_seconds(params * 4, d, gbps) + buckets * latency
    keep = 1 - knobs.dp_overlap
    return DataParallelTime(once=(gather + reduce) * keep, once_gather=gather * keep)


def context_parallel_seconds(
    model: ModelConfig,
    layout: Layout,
    cluster: Cluster,
    knobs: TimeKnobs,
    core_seconds: float,
) -> float:
    """The CP term of the module docstring: one layer's exposed K/V exchange per micro-batch
    (forward and backward, and the forward's again under recomputation), given the seconds of
    the whole attention core's forward on one TP rank without CP (`core_seconds`)."""
    c, t = layout.cp, layout.tp
    if c == 1:
        return 0.0
    gbps = cp_bandwidth(cluster, layout) * GB
    latency = cluster.collective_latency_us * 1e-6
    local = model.seq_length // c * layout.micro_batch * model.head_dim // t
    kv = 2 * local * model.num_query_groups * knobs.dtype_bytes  # this rank's K and V
    if layout.cp_comm_type == "p2p":
        block = core_seconds / (c * c)  # one step's share of the rank's attention core
        hide = 1.0 if knobs.cp_overlap else 0.0
        send = kv / gbps + latency
        grads = 2 * local * model.num_query_groups * 4 / gbps + latency  # fp32 dK, dV
        forward = (c - 1) * max(0.0, send - hide * block)
        backward = (c - 1) * max(0.0, send + grads - hide * 2 * block) + grads
    elif layout.cp_comm_type == "all_gather":
        forward = backward = (c - 1) * kv / gbps + 2 * latency  # K and V, each a collective
    else:  # a2a: q, k, v and the output, forward and backward
        heads = 2 * (model.num_attention_heads + model.num_query_groups)
        moved = (c - 1) / c * local * heads * knobs.dtype_bytes
        forward = backward = moved / gbps + 4 * latency
    again = forward if layout.recompute in ("full", "selective") else 0.0
    return forward + backward + again


def step_time(
    model: ModelConfig,
    layout: Layout,
    cluster: Cluster,
    global_batch: int,
    knobs: TimeKnobs = TimeKnobs(),
) -> StepTime:
    """The estimate of the module docstring for one training step."""
    t, p, v, b = layout.tp, layout.pp, layout.vp, layout.micro_batch
    c = layout.cp  # each CP rank computes and moves S / CP tokens of every sequence
    m = layout.num_microbatches(global_batch)
    vocab = model.padded_vocab_size(t)
    layer_fwd, logits_fwd, core_fwd = _forward_flops(_dense(model), b, vocab)
    moe_fwd = _forward_flops(_all_moe(model), b, vocab)[0] if model.moe else 0
    recompute = {"none": 0, "selective": core_fwd, "full": layer_fwd}[layout.recompute]
    moe_recompute = {"none": 0, "selective": core_fwd, "full": moe_fwd}[layout.recompute]
    rate = cluster.peak_tflops * 1e12 * cluster.matmul_efficiency
    activation = model.seq_length // c * b * model.hidden_size * knobs.dtype_bytes
    latency = cluster.collective_latency_us * 1e-6

    def fixed_cost(ranks: int, collectives: int = 1) -> float:
        """The latency of `collectives` collectives over `ranks` (none on one rank)."""
        return collectives * latency if ranks > 1 else 0.0

    all_reduce = ring_all_reduce_seconds(activation, t, tp_bandwidth(cluster, layout))
    all_reduce += fixed_cost(t)
    forward_all_reduces = 2 + (2 if layout.recompute == "full" else 0)  # per layer

    def behind_weight_grad(out_features: int) -> float:
        """A backward all-reduce's time beyond the weight-gradient matmul it overlaps: that of
        a column-parallel linear with `out_features` (before the TP split)."""
        if not knobs.tp_weight_grad_overlap:
            return all_reduce
        weight_grad = 2 * model.seq_length // c * b * model.hidden_size * out_features / t / rate
        return max(0.0, all_reduce - weight_grad)

    qkv = (model.num_attention_heads + 2 * model.num_query_groups) * model.head_dim
    fc1 = model.ffn_hidden_size * (2 if model.swiglu else 1)
    per_layer = forward_all_reduces * all_reduce + behind_weight_grad(qkv) + behind_weight_grad(fc1)
    per_moe_layer = 0.0
    if model.moe is not None and t > 1:  # the attention's pair, and the experts' (R rows)
        tp_gbps = tp_bandwidth(cluster, layout)

        def reduce(nbytes: float) -> float:
            return ring_all_reduce_seconds(nbytes, t, tp_gbps) + fixed_cost(t)

        moe_tp = moe_tensor_parallel(model, layout, knobs.dtype_bytes)
        per_moe_layer = forward_all_reduces // 2 * all_reduce + behind_weight_grad(qkv)
        per_moe_layer += sum(reduce(nbytes) for nbytes in moe_tp.forward)
        for nbytes, flops in moe_tp.backward:
            hidden = flops / rate if knobs.tp_weight_grad_overlap else 0.0
            per_moe_layer += max(0.0, reduce(nbytes) - hidden)
    output_layer = behind_weight_grad(vocab) + fixed_cost(t)  # + the CE all-gather
    ring = context_parallel_seconds(model, layout, cluster, knobs, core_fwd / t / rate)
    exchange = expert_parallel_seconds(
        model, layout, cluster, ep_bandwidth(cluster, layout), knobs.dtype_bytes
    )
    stage_map = partition_layers(model, p, v)
    stages = []
    for rank in sorted({0, p - 1}):
        indices = [i for chunk in stage_map.layers[rank] for i in chunk]
        layers = len(indices)
        moe_layers = sum(1 for i in indices if model.is_moe_layer(i))
        dense_layers = layers - moe_layers
        first, last = rank == 0, rank == p - 1
        flops = dense_layers * (3 * layer_fwd + recompute) + (3 * logits_fwd if last else 0)
        flops += moe_layers * (3 * moe_fwd + moe_recompute)
        compute = flops / (t * c) / rate
        tp = dense_layers * per_layer + moe_layers * per_moe_layer
        tp += first * all_reduce + last * output_layer
        tp *= 1 - knobs.tp_overlap
        cp = layers * ring  # the CP exchange of the stage's layers
        ep = moe_layers * exchange  # the EP token exchange of its MoE layers
        params = stage_parameters(model, indices, first, last, t, layout.ep)
        experts = stage_expert_parameters(model, indices, t, layout.ep)
        roots = int(first) + int(last) - int(first and last and v == 1)  # embedding, head
        dense = data_parallel_seconds(layout, cluster, knobs, params - experts, layers + roots,
                                      compute)  # fmt: skip
        expert = data_parallel_seconds(layout, cluster, knobs, experts, moe_layers, compute,
                                       ranks=layout.expert_dp)  # fmt: skip
        dp = _sum(dense, expert)
        stages.append((compute + tp + cp + ep + dp.per_microbatch, compute, tp, cp, dp, ep))
    _, compute, tp, cp, dp, ep = max(stages, key=lambda s: s[0])
    filling = min(s[0] for s in stages)
    once = max(s[4].once for s in stages)
    gather = max(s[4].once_gather for s in stages) + m * dp.gather_per_microbatch
    beta = bubble_fraction(layout.schedule, p, v, m)
    p2p = activation / (t if knobs.pp_scatter_gather else 1) / (pp_bandwidth(cluster, layout) * GB)
    p2p += fixed_cost(p)
    pp = 2 * (v * m + p - 1) * p2p if p > 1 else 0.0
    return StepTime(
        compute=m * compute,
        bubble=beta * m * filling,
        tp_comm=m * tp,
        pp_comm=pp,
        dp_comm=m * dp.per_microbatch + once,
        bubble_fraction=beta,
        flops=flops_per_iteration(model, global_batch, padded_vocab_size=vocab),
        world_size=layout.world_size,
        dp_gather=gather,
        cp_comm=m * cp,
        ep_comm=m * ep,
    )


def _dense(model: ModelConfig) -> ModelConfig:
    """The model with every layer dense (its dense layers' FLOPs)."""
    return model if model.moe is None else dataclasses.replace(model, moe=None)


def _all_moe(model: ModelConfig) -> ModelConfig:
    """The model with every layer an MoE (its MoE layers' FLOPs)."""
    return dataclasses.replace(model, moe=dataclasses.replace(model.moe, moe_layer_freq=1))


def _sum(a: DataParallelTime, b: DataParallelTime) -> DataParallelTime:
    """Dense and expert parameters' DP terms together."""
    return DataParallelTime(a.once + b.once, a.once_gather + b.once_gather,
                            a.per_microbatch + b.per_microbatch,
                            a.gather_per_microbatch + b.gather_per_microbatch)  # fmt: skip
