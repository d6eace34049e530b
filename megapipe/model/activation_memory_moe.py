"""Activation memory of a mixture-of-experts MLP (model/moe.py), the part of
`activation_memory.layer_activation_bytes` that replaces the dense MLP's terms on an MoE layer.

Measured at 1 rank and TP2 with saved_tensors_hooks (tests/test_activation_memory_moe.py),
byte for byte: the saved storages still held when the forward returns (`SavedTensorPeak`'s
live bytes). Counting every storage ever saved would add two that autograd frees at once
(their nodes die with the outputs nobody uses): the aux loss's top-k indices (T k x 8) and
the probs drop policy's sort indices (T E x 8).

For T = s b tokens of a micro-batch, E experts, top-k, hidden h, expert ffn f, TP size t, N
expert rows (below), d bytes per element of the activation dtype:

    router       T h x 4            the router's fp32 input (a copy under bf16; in fp32 the
                                    norm's output itself)
                 + E h x 4          (bf16/fp16 only) the fp32 copy of the router's weight
                 + T k x 8          the top-k indices
                 + T k x 4          softmax over the k chosen (the default routing), or
                 + T E x 4          pre-softmax: the softmax over all experts; sigmoid: the
                                    sigmoids, + T k x 4 + T x 4 when k > 1 (the chosen
                                    probabilities and their sum, normalised)
    z-loss       + T E x 4 + T x 4  the logits and their log-sum-exp
    aux loss     + T E x 4 + E x 4  (aux_loss; seq_aux_loss: b E x 4 for the last) its
                                    scores over all experts and the shares f_i (sigmoid:
                                    + T x 4, the scores' normaliser)
    capacity     + T E              the bool keep-mask
    dispatch     N x 2 x 8          the (expert, token) index pairs (one int64 storage)
                 + N h d            the permuted rows, fc1's input (whole under TP)
    experts      N f / t x 2 d      fc1's output and the activation's (GeLU, squared ReLU);
                                    SwiGLU: N f / t x 4 d (fc1's [gate; up], silu(gate), the
                                    product)
                 + N x 8            with biases: each row's expert id
                 + E (fc1 + f) h / t d + E x 4   --moe-grouped-gemm (when torch's grouped_mm
                                    runs: strides in 16-byte multiples): the transposed
                                    weights it is given (contiguous copies) and the offsets
    combine      N d + 2 N h d      the rows' probabilities, the experts' output rows, and the
                                    weighted rows (index_add keeps its source: see below)
    shared       T fs / t x 2 d     the shared expert's hidden activations (x 4 d SwiGLU),
                 + T h d            its input, under bf16/fp16 only (in fp32 it is the
                                    router's input storage)

N, the rows the experts compute: T k dropless (however unbalanced: the total is exact); with
--moe-expert-capacity-factor F and capacity C = ceil(T k / E x F) the kept assignments,
at most min(T k, E C), which `expert_rows` takes from balanced routing (min(T k, E C)); with
--moe-pad-expert-input-to-capacity exactly E min(C, T). Pass the measured count for an
exact figure.

Two saved tensors are avoidable (model/moe*.py is not this module's to change): index_add
keeps its whole source (the weighted rows, N h d) for the shape of its gradient only; and
the grouped GEMM saves contiguous transposed copies of every expert's weights (E (fc1 + f) h
/ t d per layer and micro-batch, the size of the experts' parameters).

Expert parallelism (EP ranks, `model/moe_dispatch.py`; measured at EP2 with both dispatchers
for the rows each rank saw, modelled for balanced routing): a rank routes its own T tokens
(the router's terms as above) and its N own assignments; its E / EP experts compute the R rows
sent to them (balanced: R = N, each of the EP ranks sending N / EP to each).

    alltoall     the index pairs and the combine over the N own rows, the experts' terms
                 (permuted rows, hidden, biases) over R, + 2 R x 8 (the orders that regroup the
                 received rows by local expert and put the outputs back)
    allgather    every term over R (the gathered EP T tokens' assignments to this rank's
                 experts: index pairs, rows, hidden, combine); the gathered tokens and
                 probabilities are not kept (the collectives keep nothing, and indexing keeps
                 only its indices)
"""

from __future__ import annotations

import math

import torch.nn.functional as F

from megapipe.config import ModelConfig

DISPATCHERS = ("alltoall", "allgather")


def expert_rows(config: ModelConfig, tokens: int) -> int:
    """Rows one rank's experts compute for `tokens` tokens: T k dropless, else capped by
    capacity on balanced routing (the module docstring's N)."""
    moe = config.moe
    e, k = moe.num_experts, moe.moe_router_topk
    if moe.moe_expert_capacity_factor is None:
        return tokens * k
    capacity = math.ceil(tokens * k / e * moe.moe_expert_capacity_factor)
    if moe.moe_pad_expert_input_to_capacity:
        return e * min(capacity, tokens)
    return min(tokens * k, e * capacity)


def grouped_gemm_runs(config: ModelConfig, tp: int, dtype_bytes: int) -> bool:
    """Whether the experts run torch's grouped matmul (flag on, torch has it, and h, fc1 / t
    and f / t are multiples of 16 bytes), as model/moe_experts.Experts decides."""
    if not (config.moe.moe_grouped_gemm and hasattr(F, "grouped_mm")):
        return False
    f = config.moe_ffn_hidden_size
    fc1 = f * (2 if config.swiglu else 1)
    multiple = max(1, 16 // dtype_bytes)
    return all(dim % multiple == 0 for dim in (config.hidden_size, fc1 // tp, f // tp))


def router_bytes(config: ModelConfig, tokens: int, batch: int, dtype_bytes: int) -> int:
    """The router's saved bytes over `tokens` tokens (routing, z-loss, aux loss, capacity)."""
    moe, h = config.moe, config.hidden_size
    e, k = moe.num_experts, moe.moe_router_topk
    total = tokens * h * 4 + tokens * k * 8  # fp32 input, top-k indices
    if dtype_bytes != 4:
        total += e * h * 4  # the weight's fp32 copy
    if moe.moe_router_score_function == "sigmoid":
        total += tokens * e * 4 + (tokens * k * 4 + tokens * 4 if k > 1 else 0)
    elif moe.moe_router_pre_softmax:
        total += tokens * e * 4
    else:
        total += tokens * k * 4
    if moe.moe_z_loss_coeff:
        total += tokens * e * 4 + tokens * 4
    balancing = moe.moe_router_load_balancing_type
    if balancing != "none" and moe.moe_aux_loss_coeff > 0:
        shares = batch * e * 4 if balancing == "seq_aux_loss" else e * 4
        total += tokens * e * 4 + shares
        if moe.moe_router_score_function == "sigmoid":
            total += tokens * 4
    if moe.moe_expert_capacity_factor is not None:
        total += tokens * e  # the keep-mask
    return total


def moe_activation_bytes(
    config: ModelConfig,
    tokens: int,
    batch: int,
    tp: int = 1,
    dtype_bytes: int = 4,
    *,
    ep: int = 1,
    dispatcher: str = "alltoall",
    rows: int | None = None,
    received: int | None = None,
) -> int:
    """Bytes one MoE MLP keeps for backward on one rank, for its `tokens` tokens (s b) of
    `batch` sequences: the module docstring's terms. rows: this rank's kept assignments N
    (default: `expert_rows`, balanced routing); ep, dispatcher: expert parallelism, with
    `received` rows R at this rank's experts (default: N, balanced)."""
    if dispatcher not in DISPATCHERS:
        raise ValueError(f"unknown MoE dispatcher {dispatcher!r}")
    moe, h, d = config.moe, config.hidden_size, dtype_bytes
    e, f = moe.num_experts, config.moe_ffn_hidden_size
    own = expert_rows(config, tokens) if rows is None else rows
    at_experts = own if ep == 1 or received is None else received
    gathered = ep > 1 and dispatcher == "allgather"
    combined = at_experts if gathered else own  # rows the index pairs and combine cover
    total = router_bytes(config, tokens, batch, d)
    total += combined * 2 * 8 + at_experts * h * d  # index pairs, permuted rows
    if ep > 1 and dispatcher == "alltoall":
        total += 2 * at_experts * 8  # regrouping by local expert, and back
    activation = 4 if config.swiglu else 2
    total += at_experts * f // tp * activation * d
    if config.add_bias_linear:
        total += at_experts * 8
    if grouped_gemm_runs(config, tp, d):
        fc1 = f * (2 if config.swiglu else 1)
        local = e // ep  # this rank's experts
        total += local * (fc1 + f) * h // tp * d + local * 4
    total += combined * d + 2 * combined * h * d  # probabilities, output rows, weighted rows
    shared = moe.moe_shared_expert_intermediate_size
    if shared is not None:
        total += tokens * shared // tp * activation * d
        if d != 4:
            total += tokens * h * d
    return total
