"""How an MoE layer's tokens reach their experts and come back: Megatron's token dispatchers.

Every dispatcher takes a micro-batch's tokens [T, h] with the router's probabilities and map
[T, E] (global expert ids) and an `experts(rows, counts)` callable that runs this rank's local
experts on rows grouped by local expert (counts[e] rows each), and returns [T, h]: each token's
sum of probability x expert output over the experts it was routed to (nothing for a dropped
assignment: the token passes through the residual only).

- `local` (expert parallelism 1): the assignments sorted by expert, run, added back.
- `alltoall` (--moe-token-dispatcher-type alltoall): each rank sends the rows for the experts of
  EP rank j to rank j in one all-to-all (after a small all-to-all of the per-expert counts, which
  the host reads to size the exchange, as Megatron-Core does), regroups what it received
  (source rank-major) by local expert, runs them, and sends the outputs back the same way; the
  weighting by probability happens at the token's own rank. Traffic: the rank's T x k rows.
- `allgather` (--moe-token-dispatcher-type allgather): every rank gathers the EP group's tokens,
  probabilities and map, runs its local experts on the assignments they got, weights them, and
  a reduce-scatter sums every rank's part of each token back to its owner. Traffic: EP x T rows.

Both give the one-rank numbers (only the order of fp32 sums differs). Autograd goes through
the collectives' adjoints (`parallel/mappings.py`): the all-to-all's backward is the reverse
all-to-all, the all-gather's a reduce-scatter and the reduce-scatter's an all-gather.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from megapipe.parallel.mappings import (
    all_gather_along,
    all_to_all_rows,
    exchange_rows,
    gather_from_sequence_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from megapipe.parallel.state import Group

ExpertsFn = Callable[[torch.Tensor, list[int]], torch.Tensor]


@dataclass(frozen=True)
class DispatchPlan:
    """The assignments of one micro-batch, grouped by expert (tokens in order within one):
    row r goes to expert `expert_index[r]` from token `token_index[r]`; counts[e] rows each."""

    token_index: torch.Tensor
    expert_index: torch.Tensor
    counts: list[int]

    @classmethod
    def of(cls, routing_map: torch.Tensor) -> DispatchPlan:
        """From the routing map [T, E] (bool)."""
        expert_index, token_index = routing_map.t().nonzero(as_tuple=True)
        return cls(token_index, expert_index, routing_map.sum(dim=0).tolist())

    def permute(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [T, h] -> the rows the experts get [assignments, h]."""
        return tokens[self.token_index]

    def combine(self, rows: torch.Tensor, probs: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """sum over each token's rows of probability x expert output -> [T, h]."""
        weights = probs[self.token_index, self.expert_index].to(rows.dtype).unsqueeze(-1)
        out = rows.new_zeros((num_tokens, rows.shape[1]))
        return out.index_add(0, self.token_index, rows * weights)


def dispatch_local(
    tokens: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor, experts: ExpertsFn
) -> torch.Tensor:
    """Every expert on this rank: sort, run, weight and add back."""
    plan = DispatchPlan.of(routing_map)
    rows = experts(plan.permute(tokens), plan.counts)
    return plan.combine(rows, probs, tokens.shape[0])


def dispatch_alltoall(
    tokens: torch.Tensor,
    probs: torch.Tensor,
    routing_map: torch.Tensor,
    experts: ExpertsFn,
    ep: Group,
) -> torch.Tensor:
    """Rows to the experts' EP ranks and back by all-to-all (see the module docstring)."""
    plan = DispatchPlan.of(routing_map)
    num_experts = routing_map.shape[1]
    local = num_experts // ep.size
    counts = torch.tensor(plan.counts, dtype=torch.int64, device=tokens.device)
    # received[s, e]: rows source rank s sends to this rank's local expert e
    received = exchange_rows(counts, [local] * ep.size, [local] * ep.size, ep).view(ep.size, -1)
    received_counts = received.tolist()  # the host's one read: it sizes the exchange
    send = [sum(plan.counts[j * local : (j + 1) * local]) for j in range(ep.size)]
    receive = [sum(row) for row in received_counts]
    rows = all_to_all_rows(plan.permute(tokens), send, receive, ep)
    # source-major -> expert-major: a stable sort of each row's (local expert, source) key
    chunk_sizes = received.reshape(-1)  # chunk (s, e) at s * local + e, in arrival order
    sources = torch.arange(ep.size, device=tokens.device).repeat_interleave(local)
    chunk_keys = torch.arange(local, device=tokens.device).repeat(ep.size) * ep.size + sources
    order = torch.sort(chunk_keys.repeat_interleave(chunk_sizes), stable=True).indices
    per_expert = [sum(row[e] for row in received_counts) for e in range(local)]
    out = experts(rows[order], per_expert)
    back = torch.empty_like(order)
    back[order] = torch.arange(order.numel(), device=tokens.device)
    returned = all_to_all_rows(out[back], receive, send, ep)
    return plan.combine(returned, probs, tokens.shape[0])


def dispatch_allgather(
    tokens: torch.Tensor,
    probs: torch.Tensor,
    routing_map: torch.Tensor,
    experts: ExpertsFn,
    ep: Group,
) -> torch.Tensor:
    """The EP group's tokens gathered on every rank; each runs its experts' share, and a
    reduce-scatter returns every token's sum to its owner (see the module docstring)."""
    num_tokens, num_experts = routing_map.shape
    local = num_experts // ep.size
    lo = ep.rank * local
    # every rank's local experts take gradients for every gathered token: the sum over ranks
    # is each token's gradient (reduce-scatter in the gather's backward)
    all_tokens = gather_from_sequence_parallel_region(tokens, ep)
    all_probs = gather_from_sequence_parallel_region(probs, ep)
    all_map = all_gather_along(routing_map.to(torch.uint8), 0, ep)  # gloo has no bool
    mine = all_map[:, lo : lo + local].bool()
    plan = DispatchPlan.of(mine)
    rows = experts(plan.permute(all_tokens), plan.counts)
    partial = plan.combine(rows, all_probs[:, lo : lo + local], num_tokens * ep.size)
    return reduce_scatter_to_sequence_parallel_region(partial, ep)


def dispatch(
    kind: str,
    tokens: torch.Tensor,
    probs: torch.Tensor,
    routing_map: torch.Tensor,
    experts: ExpertsFn,
    ep: Group,
) -> torch.Tensor:
    """Route `tokens` through `experts` by the dispatcher `kind` (alltoall or allgather); at one
    EP rank both are the local sort."""
    if ep.size == 1:
        return dispatch_local(tokens, probs, routing_map, experts)
    if kind == "alltoall":
        return dispatch_alltoall(tokens, probs, routing_map, experts, ep)
    return dispatch_allgather(tokens, probs, routing_map, experts, ep)
