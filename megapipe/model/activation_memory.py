"""Activation memory of one transformer layer: measured, and the formula it must match.

Measured: the bytes of the distinct storages autograd saves for backward during a forward
(`torch.autograd.graph.saved_tensors_hooks`), parameters excluded: deterministic, unlike the
allocator's counters.

The formula, for one layer of micro-batch b, sequence s, hidden h, a heads, g query groups,
head size d, ffn size f, TP size t, in elements of the activation dtype (GeLU MLP, learned or
no positions; Korthikanti et al. 2022 count 34 sbh + 5 a s^2 b bytes at 16 bits with dropout
masks and an unfused softmax):

    replicated (without SP):  2 sbh (the two norms' inputs) + 2 sbh (the inputs of the
                              column-parallel QKV and fc1, gathered across TP)
    split over TP:            sb(a + 2g)d / t  (q, k, v: one fused QKV output)
                            + sbad / t         (SDPA's output, which its backward reads; the
                                                output projection's input is a view of it;
                                                ad = h unless --kv-channels says otherwise)
                            + 2 sbf / t        (the GeLU's input and fc2's input)
    small, in fp32:           a s b / t        (SDPA's log-sum-exp)
                            + 2 x 2 sb         (LayerNorm's mean and 1/std; RMSNorm: 1 sb each)

    with --qk-layernorm:      + sb(a + g)d / t (the q and k norms' outputs, which SDPA keeps)
                              + 2 x sb(a + g) / t in fp32 (their mean and 1/std; RMSNorm: 1)
    with hidden dropout:      + 2 sbh          (the two keep-masks, in the activation dtype)
    with attention dropout:   + a s^2 b / t x (4 bytes + 2 elements), + s^2 bytes, - the LSE
    from layout-invariant     (the sample-keyed masks need the unfused attention: its fp32
    masks                     probabilities, keep-mask and dropped probabilities, and the
                              causal mask, instead of SDPA). With the kernel's own dropout
                              (--attention-dropout-rng fused, CUDA's default) nothing: the
                              fused kernel keeps only its RNG seed and offset.

With a = g, f = 4h and no dropout that is sbh (4 + 12/t), against Korthikanti's
sbh (10 + 24/t + 5as/(ht)) bytes at 16 bits with masks; SDPA stores no s x s matrix.
Under sequence parallelism every term is split over TP: sbh 16/t.

    with GQA (1 < g < a):     + sbad / t       (q, copied out of the grouped QKV layout)
    with rope:                + sb(a + g)d / t (the rotated q and k, instead of GQA's copy)
                              + 2 s r x 4 bytes (fp32 cos and sin, r = the rotary dims; one
                                                cache slice shared by every layer)

Under context parallelism each rank holds s = S / CP tokens of every sequence, so every term
above is taken at S / CP (that is the point of CP: activations divide by CP), and:

    p2p (the ring)            nothing more (q, k, v, output and LSE as SDPA keeps them; the
                              K/V blocks in flight are freed as the ring moves on); rope's
                              cos and sin are indexed at the rank's positions per call: 4 s r
                              x 4 bytes
    all_gather                + 2 S b g d / t   (every rank's keys and values, gathered; the
                                                local q, not the whole QKV output, is kept
                                                where it is a copy: GQA, rope)
    a2a (Ulysses)             + sbad / t        (the output twice: head-split, and back)
                              + 16 S bytes      (two int64 orderings); the all-to-all's q, k,
                                                v replace the QKV output (the same bytes)
    attention dropout         CP always applies the layout-invariant masks, cut to the rank's
                              share (even where --attention-dropout-rng fused would leave a
                              one-rank run's dropout to the kernel):
                              p2p, all_gather: + b a s S / t bytes (the bool keep-mask of the
                                                rank's query rows)
                              a2a: the unfused attention over the rank's a / CP heads:
                                                b a s S / t x (4 bytes + 2 elements) + S^2
                                                bytes (the causal mask), no LSE, the output
                                                once, and with GQA K and V repeated to a heads
    selective core_attn       q, k, v and the projection's input (as without CP)

On a mixture-of-experts layer the MLP's terms (fc1's input, 2 sbf / t) are replaced by the
router's, the experts' and the combine's: `activation_memory_moe` (measured at 1 rank, TP2
and EP2 with each dispatcher).

Selective recomputation of core_attn keeps q, k, v (the recomputation's input) and the
projection's input: it drops SDPA's log-sum-exp only (SDPA holds no s x s matrix), or the
s x s terms of the unfused attention. Of mlp it keeps only the MLP's input (the second norm's
output) instead of fc1's, the GeLU's and fc2's inputs. Full recomputation keeps only the input
of each recomputed group of layers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from megapipe.config import ModelConfig, RecomputeConfig
from megapipe.model.activation_memory_moe import moe_activation_bytes


def saved_activation_bytes(
    forward: Callable[[], object], parameters: Iterable[torch.nn.Parameter]
) -> int:
    """Bytes of the distinct non-parameter storages autograd saves while `forward()` runs."""
    params = {p.untyped_storage().data_ptr() for p in parameters}
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        forward()
    return sum(storages.values())


def layer_activation_bytes(
    config: ModelConfig,
    micro_batch_size: int,
    tp: int = 1,
    *,
    sequence_parallel: bool = False,
    recompute: RecomputeConfig | None = None,
    dtype_bytes: int = 4,
    attention_dropout_fused: bool = False,
    cp: int = 1,
    cp_comm_type: str = "p2p",
    layer: int = 0,
    ep: int = 1,
    moe_dispatcher: str = "alltoall",
    moe_rows: int | None = None,
    moe_received: int | None = None,
) -> int:
    """The formula of the module docstring: bytes one layer keeps for backward on one rank.
    attention_dropout_fused: attention dropout runs inside SDPA / flash (no s x s terms);
    cp, cp_comm_type: context parallelism (each rank holds S / cp tokens of every sequence);
    layer: the global index (an MoE layer's MLP is `activation_memory_moe`'s), with its
    expert parallelism (ep, moe_dispatcher), its own kept assignments and the rows its
    experts received (moe_rows, moe_received; default: balanced routing)."""
    recompute = recompute or RecomputeConfig()
    s, b, h = config.seq_length // cp, micro_batch_size, config.hidden_size
    a, f = config.num_attention_heads, config.ffn_hidden_size
    sp = sequence_parallel and tp > 1
    local_s = s // tp if sp else s
    if recompute.full:
        return local_s * b * h * dtype_bytes  # the layer's input (a group of one layer)
    norm_stats = 2 if config.normalization == "LayerNorm" else 1
    norm = local_s * b * h * dtype_bytes + norm_stats * local_s * b * 4  # input + fp32 stats
    column_input = s * b * h // (tp if sp else 1) * dtype_bytes
    dropout = config.attention_dropout > 0
    unfused_a2a = dropout and cp > 1 and cp_comm_type == "a2a"
    qkv_out = _attention_inputs_and_output(
        config, b, tp, dtype_bytes, cp, cp_comm_type, unfused=unfused_a2a
    )
    core = a * s * b // tp * 4  # SDPA's (or the ring's) log-sum-exp
    full = config.seq_length
    if dropout and cp > 1:  # CP always applies explicit masks (the rank's share of them)
        if unfused_a2a:  # probabilities, the scaled keep-mask, the dropped ones; causal mask
            core = a // tp * s * full * b * (4 + 2 * dtype_bytes) + full * full
        else:  # the ring's (and gathered blocks') bool keep-mask of this rank's query rows
            core += a // tp * s * full * b
    elif dropout and not attention_dropout_fused:  # sample-keyed masks
        core = a * s * s * b // tp * (4 + 2 * dtype_bytes) + s * s
    if recompute.selective("core_attn"):
        core = 0
        if cp > 1:  # the recomputed attention keeps only its inputs: q, k and v
            qkv_out = _attention_inputs_and_output(config, b, tp, dtype_bytes, cp, "recompute")
    masks = 2 * local_s * b * h * dtype_bytes if config.hidden_dropout > 0 else 0
    attention = norm + column_input + qkv_out + core + masks
    mlp = column_input + 2 * s * b * f // tp * dtype_bytes
    if config.is_moe_layer(layer):
        mlp = moe_activation_bytes(config, s * b, b, tp, dtype_bytes, ep=ep,
                                   dispatcher=moe_dispatcher, rows=moe_rows,
                                   received=moe_received)  # fmt: skip
    if recompute.selective("mlp"):
        mlp = local_s * b * h * dtype_bytes  # the MLP's input, kept by the recomputation
    return attention + norm + mlp


def _attention_inputs_and_output(
    config: ModelConfig,
    b: int,
    tp: int,
    dtype_bytes: int,
    cp: int,
    comm_type: str,
    *,
    unfused: bool = False,
) -> int:
    """Bytes of what the core attention keeps of q, k, v and its output (the projection's
    input), on one rank holding s = S / cp tokens: the module docstring's q, k, v and output
    terms, by context-parallel comm type ("recompute": selective core_attn under CP)."""
    full = config.seq_length
    s = full // cp
    a, g, d = config.num_attention_heads, config.num_query_groups, config.head_dim
    unit = s * b * d // tp * dtype_bytes  # one head's worth over this rank's tokens
    qkv = (a + 2 * g) * unit  # the fused QKV output (q, k, v are views of it)
    q_copy = a * unit if g // tp > 1 and g < a else 0  # GQA: q copied out of the groups
    rope = config.position_embedding_type == "rope" and not config.qk_layernorm
    rotated = (a + g) * unit if rope else 0  # rope's rotated q and k
    tables = 0
    if rope:  # fp32 cos and sin: slices of the shared cache, or indexed per call under CP
        tables = (2 if cp == 1 else 4) * s * config.rotary_dim * 4
    out = a * unit  # the attention's output, which is also the projection's input
    if config.qk_layernorm:  # the q and k norms' outputs and fp32 statistics
        norm_stats = 2 if config.normalization == "LayerNorm" else 1
        out += s * b * (a + g) // tp * (d * dtype_bytes + norm_stats * 4)
    if cp == 1 or comm_type in ("p2p", "recompute"):
        kept = qkv + (rotated if rope else q_copy) + tables
        return kept + (a * unit if comm_type == "recompute" else out)
    gathered = 2 * g * full * b * d // tp * dtype_bytes  # every rank's keys and values
    if comm_type == "all_gather":
        # the local queries (a view of the QKV output, or a copy) and the gathered K and V
        if rope:
            queries = a * unit
        else:
            queries = qkv if g == a else q_copy or qkv
        return queries + gathered + out + tables
    if comm_type == "a2a":
        # q, k and v after the all-to-all (new tensors, the same bytes as this rank's share),
        # the output twice (in head-split form and after the all-to-all back) and the two
        # int64 orderings of the sequence
        if unfused:  # dropout: K and V repeated to every head (GQA); one output kept
            return (3 * a if g < a else a + 2 * g) * unit + out + tables + 2 * 8 * full
        return (a + 2 * g) * unit + 2 * out + tables + 2 * 8 * full
    raise ValueError(f"unknown context-parallel comm type {comm_type!r}")


class SavedTensorPeak:
    """Context manager: the peak bytes of saved-for-backward storages alive at once while it
    is active (parameters excluded), e.g. over a whole pipelined training step. A storage
    counts from the first saved tensor that holds it until the last one is released."""

    def __init__(self, parameters: Iterable[torch.nn.Parameter]) -> None:
        # FSDP2's sharded parameters are DTensors; its gathered copies, which layers save,
        # are Parameters too (`_pack` skips any Parameter)
        self._params = {
            getattr(p, "_local_tensor", p).untyped_storage().data_ptr() for p in parameters
        }
        self._holders: dict[int, int] = {}
        self._sizes: dict[int, int] = {}
        self.live = self.peak = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor) -> object:
        if isinstance(tensor, torch.nn.Parameter):
            return tensor
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in self._params:
            return tensor
        if self._holders.get(key, 0) == 0:
            self._sizes[key] = storage.nbytes()
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
        self._holders[key] = self._holders.get(key, 0) + 1
        return _Held(tensor, self, key)

    @staticmethod
    def _unpack(held: object) -> torch.Tensor:
        return held.tensor if isinstance(held, _Held) else held

    def _release(self, key: int) -> None:
        self._holders[key] -= 1
        if self._holders[key] == 0:
            self.live -= self._sizes.pop(key)
            del self._holders[key]

    def __enter__(self) -> SavedTensorPeak:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)


class _Held:
    """A saved tensor as autograd holds it; tells the counter when autograd lets it go."""

    __slots__ = ("tensor", "_counter", "_key")

    def __init__(self, tensor: torch.Tensor, counter: SavedTensorPeak, key: int) -> None:
        self.tensor, self._counter, self._key = tensor, counter, key

    def __del__(self) -> None:
        self._counter._release(self._key)
