"""Where a rank's local tensor data lies in the global (logical) tensor, for any number of
dimensions: the tensor-parallel split of one dimension (with SwiGLU-style strides) and, for
expert parameters, the expert-parallel split of dimension 0 (the global expert id).

A rank's tensor (or a flat range of it: the distributed optimizer's and FSDP2's pieces) is cut
into `Region`s, each a run of its flat data that is one rectangular block of the global
tensor, so it can be viewed (not copied) as a piece for saving or as a destination for
loading. A dimension maps to the global one in runs: an expert-parallel dimension 0 is offset
by `ep_rank x local size`; a TP dimension of stride s is s blocks, each shifted by
`tp_rank x block`; the other dimensions map as they are. Trailing dimensions that map whole in
one run are kept whole; where one does not (a strided TP dimension below the leading one:
experts' fc1 [E, gate; up, h]), the dimensions above it are cut into single indices.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from megapipe.layers.param_meta import ParamMeta


@dataclass(frozen=True)
class Region:
    """A contiguous run [flat_start, flat_start + numel) of a local tensor's flat data that is
    the rectangular block `shape` at `offsets` of the (unstacked) global tensor."""

    flat_start: int
    shape: tuple[int, ...]
    offsets: tuple[int, ...]


@dataclass(frozen=True)
class _Placement:
    meta: ParamMeta
    local_shape: tuple[int, ...]
    tp_rank: int
    tp_size: int
    ep_rank: int
    ep_size: int
    real_rows: int  # dimension 0's global extent that counts (vocabulary padding dropped)

    def runs(self, dim: int, start: int, count: int) -> Iterator[tuple[int, int, int]]:
        """Local indices [start, start + count) of `dim` as globally contiguous runs:
        (local start, global start, count), rows past `real_rows` left out."""
        meta, local = self.meta, self.local_shape[dim]
        split = dim == meta.tp_dim and self.tp_size > 1
        base = 0
        if dim == 0 and meta.expert_parallel and self.ep_size > 1:
            # contiguous blocks of experts per EP rank (TP, if it splits them too, within one)
            base = self.ep_rank * local * (self.tp_size if split else 1)
        if split:
            block = local // meta.tp_stride  # local entries per stride block
            full_block = block * self.tp_size
            pieces = []
            while count > 0:
                b, within = divmod(start, block)
                n = min(count, block - within)
                pieces.append((start, b * full_block + self.tp_rank * block + within, n))
                start, count = start + n, count - n
        else:
            pieces = [(start, start, count)]
        for lo, glo, n in pieces:
            glo += base
            if dim == 0:
                n = min(n, self.real_rows - glo)
            if n > 0:
                yield lo, glo, n

    def whole(self, dim: int) -> tuple[int, int] | None:
        """(global start, extent) when the whole local `dim` is one global run, else None."""
        found = list(self.runs(dim, 0, self.local_shape[dim]))
        if len(found) == 1 and found[0][2] == self.local_shape[dim]:
            return found[0][1], found[0][2]
        return None


def regions(
    meta: ParamMeta,
    tp_rank: int,
    tp_size: int,
    local_shape: Sequence[int],
    lo: int,
    hi: int,
    *,
    real_rows_only: bool = False,
    ep_rank: int = 0,
    ep_size: int = 1,
) -> list[Region]:
    """The global blocks that the flat range [lo, hi) of a rank's local tensor covers (of the
    padded global tensor; with `real_rows_only`, without its vocabulary padding rows)."""
    shape = tuple(int(s) for s in local_shape)
    if len(shape) != len(meta.full_shape):
        raise ValueError(f"local shape {shape} does not match the global {meta.full_shape}")
    if not shape:
        return [Region(0, (), ())] if lo < hi else []
    real_rows = meta.full_shape[0]
    if real_rows_only and meta.init_rows is not None:
        real_rows = meta.init_rows
    place = _Placement(meta, shape, tp_rank, tp_size, ep_rank, ep_size, real_rows)
    # tails[d]: the global (start, extent) of every dimension after d, when each maps whole
    tails: list[list[tuple[int, int]] | None] = [None] * len(shape)
    tail: list[tuple[int, int]] | None = []
    for d in range(len(shape) - 1, -1, -1):
        tails[d] = tail
        whole = place.whole(d) if tail is not None else None
        tail = None if whole is None else [whole, *tail]  # type: ignore[list-item]
    out: list[Region] = []
    _cover(place, tails, 0, 0, lo, hi, (), out)
    return out


def _cover(
    place: _Placement,
    tails: list[list[tuple[int, int]] | None],
    dim: int,
    flat_base: int,
    lo: int,
    hi: int,
    prefix: tuple[int, ...],
    out: list[Region],
) -> None:
    """Regions of the flat range [lo, hi) (relative to `flat_base`) of the sub-tensor at
    global indices `prefix` of the dimensions before `dim`."""
    shape = place.local_shape
    inner = math.prod(shape[dim + 1 :])
    if lo >= hi or inner == 0:
        return
    first, last = lo // inner, (hi - 1) // inner
    tail = tails[dim]
    if tail is None:  # a dimension below does not map whole: one index of `dim` at a time
        for i in range(first, last + 1):
            start = i * inner
            _index(place, tails, dim, flat_base, i, max(lo, start), min(hi, start + inner),
                   prefix, out)  # fmt: skip
        return
    if first == last and (lo % inner or hi - lo < inner):  # within one index of `dim`
        _index(place, tails, dim, flat_base, first, lo, hi, prefix, out)
        return
    whole_from, whole_to = first, last + 1
    if lo % inner:  # a partial first index
        _index(place, tails, dim, flat_base, first, lo, (first + 1) * inner, prefix, out)
        whole_from += 1
    if hi % inner:  # a partial last index
        whole_to -= 1
    for local, g, n in place.runs(dim, whole_from, whole_to - whole_from):
        out.append(
            Region(
                flat_base + local * inner,
                (*(1,) * len(prefix), n, *(extent for _, extent in tail)),
                (*prefix, g, *(start for start, _ in tail)),
            )
        )
    if hi % inner:
        _index(place, tails, dim, flat_base, last, last * inner, hi, prefix, out)


def _index(
    place: _Placement,
    tails: list[list[tuple[int, int]] | None],
    dim: int,
    flat_base: int,
    i: int,
    lo: int,
    hi: int,
    prefix: tuple[int, ...],
    out: list[Region],
) -> None:
    """The part [lo, hi) of index `i` of `dim` (a padding row: nothing)."""
    start = i * math.prod(place.local_shape[dim + 1 :])
    for _, g, _ in place.runs(dim, i, 1):
        _cover(place, tails, dim + 1, flat_base + start, lo - start, hi - start, (*prefix, g), out)
