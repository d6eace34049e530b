"""The mixture-of-experts terms of the step time (time_model.py): the expert-parallel token
exchange, and what an MoE layer changes in TP's traffic.

Per MoE layer and micro-batch, with T = s / CP x b tokens on a rank, top-k, R = the rows its
experts compute (T k dropless; capacity-bounded on balanced routing,
`activation_memory_moe.expert_rows`), h, E experts, d bytes per element and EP ranks in a
group of TP x EP consecutive ranks (the EP ranks of a DP x CP group are TP apart), so over
NVLink when TP x EP fits in a node:

* alltoall (--moe-token-dispatcher-type alltoall): forward, an all-to-all of the rank's R rows
  (h each) to the experts' owners and one back; backward the same two again: 4 all-to-alls of
  (EP-1)/EP x R h d bytes, plus the small all-to-all of the per-expert counts before the first
  (its latency). Balanced routing: a rank sends (EP-1)/EP of its rows away and receives as many.
* allgather: forward, an all-gather of the EP group's tokens ((EP-1) T h d in), of their
  probabilities and routing map ((EP-1) T E x 5 bytes) and a reduce-scatter of the combined
  output ((EP-1) T h d); backward, the reduce-scatters of the tokens' and probabilities'
  gradients and the all-gather of the output's; at the cluster's shard-collective efficiency.
  It moves EP / k times the alltoall's bytes (less for EP < k) for fewer, larger collectives.

None is hidden behind compute (megapipe waits for each). Recomputation does not rerun them:
MoE layers refuse MLP and full recomputation, and selective recomputation is the attention
core's.

TP (experts split over TP like the dense MLP): the experts' output all-reduce moves R h d
bytes (k times the dense MLP's), and its backward twin reduces the rows' input gradient under
the experts' fc1 weight-gradient GEMM over R rows; a shared expert adds the dense MLP's pair.
"""

from __future__ import annotations

from dataclasses import dataclass

from megapipe.config import ModelConfig
from megapipe.model.activation_memory_moe import expert_rows
from megapipe.planning.cluster import Cluster
from megapipe.planning.layout import Layout

GB = 1e9


def ep_span(layout: Layout) -> int:
    """Consecutive global ranks one EP group spans: TP x EP (tp-ep-dp-pp)."""
    return layout.tp * layout.ep


def local_tokens(model: ModelConfig, layout: Layout) -> int:
    """T: the tokens of one micro-batch on one rank (s / CP x b)."""
    return model.seq_length // layout.cp * layout.micro_batch


def expert_parallel_seconds(
    model: ModelConfig, layout: Layout, cluster: Cluster, gbps: float, dtype_bytes: int
) -> float:
    """One MoE layer's exposed token exchange per micro-batch, forward and backward, over
    an EP group whose bandwidth is `gbps` (the module docstring's terms)."""
    ep = layout.ep
    if model.moe is None or ep == 1:
        return 0.0
    bandwidth = gbps * GB
    latency = cluster.collective_latency_us * 1e-6
    tokens, h = local_tokens(model, layout), model.hidden_size
    if layout.moe_dispatcher == "alltoall":
        moved = (ep - 1) / ep * expert_rows(model, tokens) * h * dtype_bytes
        return 4 * (moved / bandwidth + latency) + latency  # + the counts' all-to-all
    shard = bandwidth * cluster.shard_collective_efficiency
    routing = (ep - 1) * tokens * model.moe.num_experts
    rows = (ep - 1) * tokens * h * dtype_bytes
    forward = (2 * rows + routing * 5) / shard + 4 * latency
    backward = (2 * rows + routing * 4) / shard + 3 * latency
    return forward + backward


@dataclass(frozen=True)
class MoETensorParallel:
    """What one MoE layer's MLP moves over TP per micro-batch, for time_model's terms: the
    forward all-reduces' bytes, and each backward all-reduce's (bytes, weight-gradient
    FLOPs it hides under)."""

    forward: tuple[float, ...]
    backward: tuple[tuple[float, float], ...]


def moe_tensor_parallel(model: ModelConfig, layout: Layout, dtype_bytes: int) -> MoETensorParallel:
    """The experts' all-reduce of their R output rows (and input-gradient rows under fc1's
    weight-gradient GEMM), and the shared expert's pair as the dense MLP's."""
    tokens, h = local_tokens(model, layout), model.hidden_size
    rows = expert_rows(model, tokens)
    fc1 = model.moe_ffn_hidden_size * (2 if model.swiglu else 1)
    forward = [rows * h * dtype_bytes]
    backward = [(rows * h * dtype_bytes, 2 * rows * h * fc1 / layout.tp)]
    shared = model.moe.moe_shared_expert_intermediate_size
    if shared is not None:
        shared_fc1 = shared * (2 if model.swiglu else 1)
        forward.append(tokens * h * dtype_bytes)
        backward.append((tokens * h * dtype_bytes, 2 * tokens * h * shared_fc1 / layout.tp))
    return MoETensorParallel(tuple(forward), tuple(backward))
