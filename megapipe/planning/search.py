"""Enumerate layouts, reject the impossible ones with the reason, rank the rest.

A layout is rejected, as a whole sub-tree where the reason is shared, when the attention heads
or query groups do not divide by TP, a TP group would span two nodes (TP above, or not a
divisor of, the GPUs per node; unless allowed: its all-reduces would leave NVLink), the layers
do not divide by PP x VP, the global batch does not divide by micro-batch x DP, the schedule
cannot run it (`schedules.validate_schedule`'s message), the sequence does not split into
2 x CP chunks (or, for a2a, the heads per TP rank over CP), EP does not divide the experts or
DP x CP (a mixture of experts: EP ranks come from the DP x CP ranks), or its largest stage
needs more than `memory_fraction` of the GPU's memory; an MoE model is not searched with full
recomputation (its layers refuse it), nor with ZeRO-2/3 at EP = DP x CP, nor with a capacity factor
at CP > 1 (both refused at start-up). Context parallelism is searched by default only
for long sequences: CP sizes that leave each rank at least MIN_TOKENS_PER_CP_RANK tokens. The
rest are ranked by estimated step time, then memory. Data-parallel sharding (no_shard,
ZeRO-1/2/3) is searched only where DP x CP > 1: on one rank there is nothing to shard.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from megapipe.config import ModelConfig
from megapipe.errors import ConfigError
from megapipe.pipeline import schedules
from megapipe.planning.cluster import GIB, Cluster
from megapipe.planning.layout import FSDP_SHARDING, RECOMPUTE_MODES, SHARDING, Layout
from megapipe.planning.memory import LayoutMemory, layout_memory
from megapipe.planning.time_model import StepTime, TimeKnobs, step_time, within_node

MIN_TOKENS_PER_CP_RANK = 4096  # below this, CP's exchange outweighs what it saves (default)
CP_SIZES = (1, 2, 4, 8, 16, 32)


def default_expert_parallel(model: ModelConfig) -> tuple[int, ...]:
    """The EP sizes searched when none are given: every divisor of the expert count (1 for a
    dense model); each layout keeps those that divide its DP x CP."""
    return tuple(divisors(model.moe.num_experts)) if model.moe is not None else (1,)


def default_context_parallel(seq_length: int) -> tuple[int, ...]:
    """The CP sizes searched when none are given: 1, and those leaving each rank at least
    MIN_TOKENS_PER_CP_RANK tokens of a sequence."""
    return tuple(c for c in CP_SIZES if c == 1 or seq_length // c >= MIN_TOKENS_PER_CP_RANK)


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
    # CP sizes (None: default_context_parallel) and --cp-comm-type values to search
    context_parallel: tuple[int, ...] | None = None
    cp_comm_types: tuple[str, ...] = ("p2p",)
    # EP sizes (None: default_expert_parallel) and --moe-token-dispatcher-type values to search
    expert_parallel: tuple[int, ...] | None = None
    moe_dispatchers: tuple[str, ...] = ("alltoall",)


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
    if model.moe is not None and "full" in options.recompute:  # refused at start-up
        reject(Rejected("full", "MoE recompute", "MoE layers refuse full recomputation "
                        "(--recompute-granularity full)"))  # fmt: skip
        recompute = tuple(r for r in options.recompute if r != "full")
        options = dataclasses.replace(options, recompute=recompute)
        result.options = options
    for tp in divisors(world):
        if model.num_attention_heads % tp or model.num_query_groups % tp:
            what = "heads" if model.num_attention_heads % tp else "query groups"
            count = model.num_attention_heads if what == "heads" else model.num_query_groups
            reason = f"{what} ({count}) not divisible by TP ({tp})"
            reject(Rejected(f"TP{tp}", "heads % TP", reason))
            continue
        if not within_node(cluster, tp) and not options.allow_cross_node_tp:
            reject(Rejected(f"TP{tp}", "TP across nodes",
                            f"TP ({tp}) does not fit in or divide a node of "
                            f"{cluster.gpus_per_node} GPUs: its all-reduces would cross nodes "
                            "(--allow-cross-node-tp)"))  # fmt: skip
            continue
        for cp, comm_type in _context_parallel_for(model, options, world, tp, reject):
            _search_model_parallel(model, cluster, global_batch, options, result, tp, cp,
                                   comm_type)  # fmt: skip
    result.ranked.sort(key=lambda e: (e.time.total, e.memory.total))
    return result


def _context_parallel_for(
    model: ModelConfig, options: PlanOptions, world: int, tp: int, reject
) -> Iterator[tuple[int, str]]:
    """(CP size, comm type) pairs to search at this TP; the rest rejected with the reason."""
    sizes = options.context_parallel or default_context_parallel(model.seq_length)
    for cp in sizes:
        if (world // tp) % cp:
            reject(Rejected(f"TP{tp} CP{cp}", "world % TPxCP",
                            f"world ({world}) not divisible by TP x CP ({tp} x {cp})"))  # fmt: skip
            continue
        if model.seq_length % (2 * cp):
            reason = f"sequence ({model.seq_length}) not divisible by 2 x CP ({2 * cp})"
            reject(Rejected(f"TP{tp} CP{cp}", "seq % 2CP", reason))
            continue
        if cp > 1 and model.moe is not None and model.moe.moe_expert_capacity_factor:
            reject(Rejected(f"TP{tp} CP{cp}", "capacity with CP", "an expert's capacity is "
                            "taken over the whole micro-batch, which no CP rank holds "
                            "(--moe-expert-capacity-factor)"))  # fmt: skip
            continue
        for comm_type in options.cp_comm_types if cp > 1 else ("p2p",):
            heads, groups = model.num_attention_heads // tp, model.num_query_groups // tp
            if comm_type == "a2a" and (heads % cp or groups % cp):
                reject(Rejected(f"TP{tp} CP{cp} (a2a)", "heads % CP (a2a)",
                                f"heads ({heads}) and query groups ({groups}) per TP rank not "
                                f"divisible by CP ({cp})"))  # fmt: skip
                continue
            yield cp, comm_type


def _expert_parallel_for(
    model: ModelConfig, options: PlanOptions, where: str, reject
) -> list[tuple[int, str]]:
    """(EP size, dispatcher) pairs to search (EP 1: the local sort, no dispatcher to choose);
    sizes that do not divide the expert count rejected with the reason."""
    if model.moe is None:
        return [(1, "alltoall")]
    pairs = []
    for ep in options.expert_parallel or default_expert_parallel(model):
        if model.moe.num_experts % ep:
            reject(Rejected(f"{where} EP{ep}", "experts % EP",
                            f"experts ({model.moe.num_experts}) not divisible by EP "
                            f"({ep})"))  # fmt: skip
            continue
        pairs += [(ep, d) for d in (options.moe_dispatchers if ep > 1 else ("alltoall",))]
    return pairs


def _search_model_parallel(
    model: ModelConfig,
    cluster: Cluster,
    global_batch: int,
    options: PlanOptions,
    result: Plan,
    tp: int,
    cp: int,
    comm_type: str,
) -> None:
    """Every PP x VP x DP x micro-batch x recomputation x sharding layout at this TP and CP."""
    reject = result.rejected.append
    world = cluster.world_size
    cp_name = "" if cp == 1 else f" CP{cp}" + ("" if comm_type == "p2p" else f" ({comm_type})")
    experts = _expert_parallel_for(model, options, f"TP{tp}{cp_name}", reject)
    for pp in divisors(world // (tp * cp)):
        dp = world // (tp * cp * pp)
        fitting = [(ep, d) for ep, d in experts if (dp * cp) % ep == 0]
        for ep in sorted({ep for ep, _ in experts if (dp * cp) % ep}):
            reject(Rejected(f"TP{tp}{cp_name} PP{pp} DP{dp} EP{ep}", "DP x CP % EP",
                            f"DP x CP ({dp} x {cp}) not divisible by EP ({ep})"))  # fmt: skip
        sharded = [x for x in options.sharding if x in FSDP_SHARDING] if dp * cp > 1 else []
        for ep in sorted({ep for ep, _ in fitting if ep == dp * cp > 1}) if sharded else ():
            reject(Rejected(f"TP{tp}{cp_name} PP{pp} DP{dp} EP{ep} {'/'.join(sharded)}",
                            "ZeRO-2/3 with EP", "ZeRO-2/3 with EP = DP x CP: no two ranks "
                            "hold the same experts to shard them over"))  # fmt: skip
        for kind, vp in _schedules_for(options, pp):
            where = f"TP{tp}{cp_name} PP{pp}" + (f" VP{vp}" if vp > 1 else "")
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
                for ep, dispatcher in fitting:
                    for recompute in options.recompute:
                        # sharding over DP x CP: CP ranks hold the same parameters
                        for sharding in options.sharding if dp * cp > 1 else ("no_shard",):
                            if ep == dp * cp > 1 and sharding in FSDP_SHARDING:
                                continue  # rejected above
                            layout = Layout(tp, pp, dp, vp, mb, recompute, sharding, kind, cp,
                                            comm_type, ep, dispatcher)  # fmt: skip
                            entry = _evaluate(model, cluster, global_batch, options, layout)
                            if isinstance(entry, Rejected):
                                reject(entry)
                            else:
                                result.ranked.append(entry)
