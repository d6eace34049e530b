"""Layout-invariant dropout: each mask is a function of the logical model, never of the layout.

Why: parity with dropout on. A TP=2 x PP=2 x DP=2 run must train exactly as the single-rank run
does, so every dropout mask must depend only on

    (seed, global sample index, layer number, dropout site, element position in the LOGICAL,
     unsharded tensor)

and never on the TP/PP/DP layout, the rank, the micro-batch slot that carries the sample or how
many draws came before. Per-rank random streams (`parallel/random.py`) cannot give that: their
state depends on everything the rank drew earlier, and a TP rank's stream differs from the
single rank's.

How: for each sample of the micro-batch, the full logical mask of one site is drawn from a fresh
generator seeded by a stable hash of (seed, sample, layer, site), and the rank keeps its shard:
the slice of heads it owns for attention probabilities ([heads, s, s] per sample), its sequence
shard for hidden activations under sequence parallelism ([s, h] per sample), or all of it where
the activation is replicated across TP ranks (which keeps the replicas identical).

Cost: every rank draws the whole logical mask of each sample it processes and discards what it
does not own (TP-1 of TP shares of the attention-probability mask), one generator per (sample,
layer, site). A counter-based RNG (Philox keyed by the same tuple, drawn at the element offsets
of the shard only) could cut that to the shard later. Masks are drawn with the activation's
device generator, so they are layout-invariant on one device type; CPU and CUDA masks differ.

On CUDA, attention dropout skips these masks by default (--attention-dropout-rng fused: SDPA
draws its own from the tensor-parallel stream, `model/attention_backends.py`); hidden and
embedding dropout keep them.
"""

from __future__ import annotations

import hashlib

import torch

from megapipe.data.context_parallel_split import chunk_positions

EMBEDDING_LAYER = -1  # the embedding dropout is keyed as if it were layer -1
SITES = ("embedding", "attention_probs", "attention_output", "mlp_output")


def mask_seed(seed: int, sample: int, layer: int, site: str) -> int:
    """A stable 63-bit seed for one (sample, layer, site) mask (no Python hash randomisation)."""
    if site not in SITES:
        raise ValueError(f"unknown dropout site {site!r}; expected one of {', '.join(SITES)}")
    digest = hashlib.sha256(f"dropout/{seed}/{sample}/{layer}/{site}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def logical_keep_mask(
    seed: int,
    sample: int,
    layer: int,
    site: str,
    shape: tuple[int, ...],
    p: float,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """The whole logical keep-mask (bool, True = kept with probability 1 - p) of one sample."""
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability must be in [0, 1), got {p}")
    device = torch.device(device)
    generator = torch.Generator(device=device).manual_seed(mask_seed(seed, sample, layer, site))
    return torch.rand(shape, generator=generator, device=device) >= p


class LogicalDropout:
    """Dropout for one micro-batch on one rank, from the global sample ids it carries.

    sample_ids: int64 [micro_batch], the global indices of the micro-batch's samples.
    tp_rank / tp_size: this rank's place in its TP group (which heads and, under sequence
    parallelism, which sequence shard it holds).
    """

    def __init__(
        self,
        seed: int,
        sample_ids: torch.Tensor,
        *,
        tp_rank: int = 0,
        tp_size: int = 1,
        sequence_parallel: bool = False,
        cp_rank: int = 0,
        cp_size: int = 1,
    ) -> None:
        if sample_ids.dim() != 1:
            raise ValueError(f"sample_ids must be 1-D [micro_batch], got {tuple(sample_ids.shape)}")
        self.seed = seed
        self.samples = [int(i) for i in sample_ids.tolist()]
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.sequence_parallel = sequence_parallel and tp_size > 1
        self.cp_rank, self.cp_size = cp_rank, cp_size  # context parallelism: which positions

    def _check_batch(self, size: int, what: str) -> None:
        if size != len(self.samples):
            raise ValueError(
                f"{what} has micro-batch {size} but {len(self.samples)} sample ids were given"
            )

    def hidden_keep_mask(
        self, shape: tuple[int, int, int], p: float, layer: int, site: str, device
    ) -> torch.Tensor:
        """Keep-mask for this rank's [s_local, b, h] activation (its sequence shard under SP).

        Under context parallelism the rank's sequence is its CP chunks (global positions
        `chunk_positions`), of which SP keeps the TP rank's share: the mask is the whole
        sequence's, at those positions."""
        s_local, b, h = shape
        self._check_batch(b, "hidden activation")
        s_cp = s_local * self.tp_size if self.sequence_parallel else s_local
        start = self.tp_rank * s_local if self.sequence_parallel else 0
        rows = slice(start, start + s_local)
        if self.cp_size > 1:
            held = chunk_positions(s_cp * self.cp_size, self.cp_size, self.cp_rank)
            rows = held[start : start + s_local].to(device)
        per_sample = [
            logical_keep_mask(self.seed, i, layer, site, (s_cp * self.cp_size, h), p, device)[rows]
            for i in self.samples
        ]
        return torch.stack(per_sample, dim=1)

    def attention_keep_mask(
        self, shape: tuple[int, int, int, int], p: float, layer: int, device
    ) -> torch.Tensor:
        """Keep-mask for this rank's attention probabilities [b, heads_local, s_q, s_k]."""
        b, local_heads, s_q, s_k = shape
        self._check_batch(b, "attention probabilities")
        heads = local_heads * self.tp_size  # TP ranks hold contiguous blocks of heads
        start = self.tp_rank * local_heads
        per_sample = [
            logical_keep_mask(self.seed, i, layer, "attention_probs", (heads, s_q, s_k), p, device)[
                start : start + local_heads
            ]
            for i in self.samples
        ]
        return torch.stack(per_sample)

    def hidden(self, x: torch.Tensor, p: float, layer: int, site: str) -> torch.Tensor:
        """Dropout (scaled by 1 / (1 - p)) of a [s_local, b, h] activation."""
        if p == 0.0:
            return x
        keep = self.hidden_keep_mask(tuple(x.shape), p, layer, site, x.device)
        return x * keep.to(x.dtype).mul_(1.0 / (1.0 - p))

    def attention_probs(self, probs: torch.Tensor, p: float, layer: int) -> torch.Tensor:
        """Dropout (scaled by 1 / (1 - p)) of attention probabilities [b, heads_local, s, s]."""
        if p == 0.0:
            return probs
        keep = self.attention_keep_mask(tuple(probs.shape), p, layer, probs.device)
        return probs * keep.to(probs.dtype).mul_(1.0 / (1.0 - p))
