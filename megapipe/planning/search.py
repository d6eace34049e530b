"""Enumerate layouts, reject the impossible ones with the reason, rank the rest.

A layout is rejected, as a whole sub-tree where the reason is shared, when the attention heads
or query groups do not divide by TP, a TP group would span two nodes (TP above, or not a
divisor of, the GPUs per node; unless allowed: its all-reduces would leave NVLink), the layers
do not divide by PP x VP, the global batch does not divide by micro-batch x DP, the schedule
cannot run it (`schedules.validate_schedule`'s message), or its largest stage needs more than
`memory_fraction` of the GPU's memory. The rest are ranked by
estimated step time, then memory. Data-parallel sharding (no_shard, ZeRO-1/2/3) is searched
only where DP > 1: at DP1 there is nothing to shard.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from megapipe.config import ModelConfig
from megapipe.errors import ConfigError
from megapipe.pipeline import schedules
from megapipe.planning.cluster import GIB, Cluster
from megapipe.planning.layout import RECOMPUTE_MODES, SHARDING, Layout
from megapipe.planning.memory import LayoutMemory, layout_memory
from megapipe.planning.time_model import StepTime, TimeKnobs, step_time, within_node


@dataclass(frozen=True)
class PlanOptions:
    """What to search over, and the assumptions of the estimates."""

    micro_batches: tuple[int, ...] = (1, 2, 4, 8)
    recompute: tuple[str, ...] = tuple(RECOMPUTE_MODES)
    # Layout.sharding values: plain DP, the distributed optimizer (ZeRO-1), ZeRO-2, ZeRO-3
    sharding: tuple[str, ...] = tuple(SHARDING)
    schedules: tuple[str, ...] | None = None  # None: every training kind SCHEDULE_KINDS has
    max_vp: int = 4
    allow_cross_node_tp: bool = False
    memory_fraction: float = 0.9  # of the GPU's memory, the rest for the CUDA context, NCCL, ...
    sequence_parallel: bool = False
    knobs: TimeKnobs = field(default_factory=TimeKnobs)


@dataclass(frozen=True)
class Evaluated:
    layout: Layout
    memory: LayoutMemory
    time: StepTime


@dataclass(frozen=True)
class Rejected:
    what: str  # the layout, or the part of it the reason concerns ("TP16")
    category: str  # a short key, for the summary
    reason: str
    layout: Layout | None = None  # when a whole layout was rejected
    memory_bytes: float | None = None  # what it needs, when rejected for memory


@dataclass
class Plan:
    model: ModelConfig
    cluster: Cluster
    global_batch: int
    options: PlanOptions
    ranked: list[Evaluated] = field(default_factory=list)
    rejected: list[Rejected] = field(default_factory=list)

    def position(self, match: Callable[[Layout], bool]) -> tuple[int, Evaluated] | None:
        """(1-based rank, entry) of the best layout `match` accepts, or None."""
        for i, entry in enumerate(self.ranked):
            if match(entry.layout):
                return i + 1, entry
        return None

    def rejected_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for r in self.rejected:
            counts[r.category] = counts.get(r.category, 0) + 1
        return counts


def divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def _training_kinds(options: PlanOptions) -> tuple[str, ...]:
    kinds = options.schedules or schedules.SCHEDULE_KINDS
    return tuple(k for k in kinds if k != "no-pipelining")


def _accepts(kind: str, p: int, v: int) -> bool:
    """Whether `kind` runs v chunks per rank at all (probed with a small, valid m)."""
    try:
        schedules.validate_schedule(kind, max(p, 2), v, 2 * max(p, 2))
    except ConfigError:
        return False
    return True


def _schedules_for(options: PlanOptions, p: int) -> Iterator[tuple[str, int]]:
    """(kind, vp) pairs worth trying at pipeline size p."""
    if p == 1:
        yield "1f1b", 1
        return
    for kind in _training_kinds(options):
        for v in range(1, options.max_vp + 1):
            if _accepts(kind, p, v):
                yield kind, v


def _evaluate(
    model: ModelConfig, cluster: Cluster, global_batch: int, options: PlanOptions, layout: Layout
) -> Evaluated | Rejected:
    """The estimates of one layout, or its rejection for memory."""
    memory = layout_memory(model, layout, global_batch,
                           half_precision=options.knobs.half_precision,
                           sequence_parallel=options.sequence_parallel)  # fmt: skip
    usable = cluster.memory_bytes * options.memory_fraction
    if memory.total > usable:
        return Rejected(layout.describe(), "memory",
                        f"needs {memory.total / GIB:.1f} GiB > {usable / GIB:.1f} GiB usable "
                        f"({options.memory_fraction:.0%} of "
                        f"{cluster.memory_bytes / GIB:.0f})", layout, memory.total)  # fmt: skip
    return Evaluated(layout, memory, step_time(model, layout, cluster, global_batch, options.knobs))


def plan(
    model: ModelConfig, cluster: Cluster, global_batch: int, options: PlanOptions = PlanOptions()
) -> Plan:
    """Every layout of `cluster.world_size` GPUs, ranked or rejected."""
    result = Plan(model, cluster, global_batch, options)
    reject = result.rejected.append
    world = cluster.world_size
    for tp in divisors(world):
        if model.num_attention_heads % tp or model.num_query_groups % tp:
            what = "heads" if model.num_attention_heads % tp else "query groups"
            count = model.num_attention_heads if what == "heads" else model.num_query_groups
            reject(
                Rejected(f"TP{tp}", "heads % TP", f"{what} ({count}) not divisible by TP ({tp})")
            )
            continue
        if not within_node(cluster, tp) and not options.allow_cross_node_tp:
            reject(Rejected(f"TP{tp}", "TP across nodes",
                            f"TP ({tp}) does not fit in or divide a node of "
                            f"{cluster.gpus_per_node} GPUs: its all-reduces would cross nodes "
                            "(--allow-cross-node-tp)"))  # fmt: skip
            continue
        for pp in divisors(world // tp):
            dp = world // (tp * pp)
            for kind, vp in _schedules_for(options, pp):
                where = f"TP{tp} PP{pp}" + (f" VP{vp}" if vp > 1 else "")
                if model.num_layers % (pp * vp):
                    reject(Rejected(f"{where} {kind}", "layers % PPxVP",
                                    f"layers ({model.num_layers}) not divisible by PP x VP "
                                    f"({pp} x {vp})"))  # fmt: skip
                    continue
                for mb in options.micro_batches:
                    if global_batch % (mb * dp):
                        reject(Rejected(f"{where} DP{dp} mb{mb}", "batch % mb x DP",
                                        f"global batch ({global_batch}) not divisible by "
                                        f"micro-batch x DP ({mb} x {dp})"))  # fmt: skip
                        continue
                    m = global_batch // (mb * dp)
                    try:
                        schedules.validate_schedule(kind, pp, vp, m)
                    except ConfigError as error:
                        reject(Rejected(f"{where} DP{dp} mb{mb} {kind}", "schedule", str(error)))
                        continue
                    for recompute in options.recompute:
                        for sharding in options.sharding if dp > 1 else ("no_shard",):
                            layout = Layout(tp, pp, dp, vp, mb, recompute, sharding, kind)
                            entry = _evaluate(model, cluster, global_batch, options, layout)
                            if isinstance(entry, Rejected):
                                reject(entry)
                            else:
                                result.ranked.append(entry)
    result.ranked.sort(key=lambda e: (e.time.total, e.memory.total))
    return result
