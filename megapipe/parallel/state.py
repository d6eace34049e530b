"""Process groups for 3D parallelism, held in one object that is passed to whoever needs it.

Rank layout (Megatron's default "tp-cp-dp-pp" order): TP is the fastest-varying index, then
CP (context parallelism), then DP, then PP, so
`rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))`; with CP 1 this is Megatron's
"tp-dp-pp". The ranks of one TP group are adjacent (one node, NVLink); pipeline stages are
outermost. Each kind's groups are listed as Megatron-Core's `RankGenerator.get_ranks` lists them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megapipe.errors import ConfigError
from megapipe.parallel.initialize import default_group_timeout

GROUP_KINDS = ("world", "tp", "pp", "dp", "model_parallel", "embedding")
# every ParallelState group field: GROUP_KINDS, then context, hybrid and expert parallelism's
ALL_GROUP_KINDS = (*GROUP_KINDS, "cp", "dp_cp", "dp_inner", "dp_outer", "ep", "expert_dp")


@dataclass(frozen=True)
class Group:
    """One process group as seen from one rank: its members, our index, and the torch group.

    `pg` is None for a group of one, so collectives over it are skipped without needing an
    initialised torch.distributed (single-rank models run with no process group at all).
    """

    ranks: tuple[int, ...]
    rank: int
    pg: dist.ProcessGroup | None = None

    @property
    def size(self) -> int:
        return len(self.ranks)

    @classmethod
    def single(cls, global_rank: int = 0) -> Group:
        return cls((global_rank,), 0)


def _coordinates(
    world_size: int, tp: int, pp: int, cp: int = 1
) -> tuple[int, Callable[[int, int, int, int], int]]:
    """(dp, rank(t, c, d, p)) for the tp-cp-dp-pp order; ConfigError when the sizes do not fit."""
    if tp <= 0 or pp <= 0 or cp <= 0 or world_size % (tp * cp * pp) != 0:
        context = f" x --context-parallel-size ({cp})" if cp != 1 else ""
        raise ConfigError(
            f"world size ({world_size}) is not divisible by --tensor-model-parallel-size ({tp})"
            f"{context} x --pipeline-model-parallel-size ({pp})"
        )
    dp = world_size // (tp * cp * pp)

    def rank(t: int, c: int, d: int, p: int) -> int:
        return t + tp * (c + cp * (d + dp * p))

    return dp, rank


def rank_layout(world_size: int, tp: int, pp: int, cp: int = 1) -> dict[str, list[list[int]]]:
    """All groups of each kind, as lists of global ranks, for a world of `world_size`.

    Pure and deterministic: every rank computes the same lists, in the same order, which is what
    `torch.distributed.new_group` requires. With context parallelism (`cp` > 1) the DP groups
    hold the ranks of one CP index (Megatron's "dp"); the CP groups and the DP x CP groups are
    `context_parallel_layout`'s.
    """
    dp, rank = _coordinates(world_size, tp, pp, cp)
    T, C, D, P = range(tp), range(cp), range(dp), range(pp)
    groups: dict[str, list[list[int]]] = {
        "world": [list(range(world_size))],
        "tp": [[rank(t, c, d, p) for t in T] for p in P for d in D for c in C],
        "dp": [[rank(t, c, d, p) for d in D] for p in P for c in C for t in T],
        "pp": [[rank(t, c, d, p) for p in P] for d in D for c in C for t in T],
        "model_parallel": [[rank(t, c, d, p) for p in P for t in T] for d in D for c in C],
    }
    # Tied input/output embeddings live on the first and last stage; their grads meet here.
    groups["embedding"] = [sorted({g[0], g[-1]}) for g in groups["pp"]]
    return groups


def context_parallel_layout(
    world_size: int, tp: int, pp: int, cp: int
) -> dict[str, list[list[int]]]:
    """The context-parallel groups of the tp-cp-dp-pp layout: `cp`, the ranks that hold one
    sequence's parts, and `dp_cp`, the ranks that hold one model replica's parameters (DP x CP,
    CP fastest): gradients are reduced, and the distributed optimizer shards, over `dp_cp`."""
    dp, rank = _coordinates(world_size, tp, pp, cp)
    T, C, D, P = range(tp), range(cp), range(dp), range(pp)
    return {
        "cp": [[rank(t, c, d, p) for c in C] for p in P for d in D for t in T],
        "dp_cp": [[rank(t, c, d, p) for d in D for c in C] for p in P for t in T],
    }


def expert_parallel_layout(dp_cp_groups: list[list[int]], ep: int) -> dict[str, list[list[int]]]:
    """The expert groups, taken from each DP x CP group (Megatron's expert layout "tp-ep-dp-pp"
    with the experts' TP equal to the dense TP): `ep`, `ep` consecutive ranks of one DP x CP
    group, which hold different experts and exchange tokens; `expert_dp`, the ranks at the same
    place in each EP group, which hold the same experts and reduce their gradients."""
    if ep <= 0 or any(len(g) % ep for g in dp_cp_groups):
        size = len(dp_cp_groups[0])
        raise ConfigError(
            f"--expert-model-parallel-size ({ep}) does not divide data-parallel x "
            f"context-parallel size ({size})"
        )
    groups: dict[str, list[list[int]]] = {"ep": [], "expert_dp": []}
    for ranks in dp_cp_groups:
        groups["ep"] += [ranks[i : i + ep] for i in range(0, len(ranks), ep)]
        groups["expert_dp"] += [ranks[j::ep] for j in range(ep)]
    return groups


def hybrid_layout(dp_groups: list[list[int]], instances: int) -> dict[str, list[list[int]]]:
    """Each DP group split for hybrid sharding: `dp_inner`, `instances` groups of consecutive
    DP ranks; `dp_outer`, the ranks at the same index of each inner group."""
    if instances <= 0 or any(len(g) % instances for g in dp_groups):
        raise ConfigError(
            f"--num-distributed-optimizer-instances ({instances}) does not divide the "
            f"data-parallel size ({len(dp_groups[0])})"
        )
    inner, outer = [], []
    for ranks in dp_groups:
        size = len(ranks) // instances
        inner += [ranks[i * size : (i + 1) * size] for i in range(instances)]
        outer += [ranks[j::size] for j in range(size)]
    return {"dp_inner": inner, "dp_outer": outer}


def group_layout(
    world_size: int,
    tp: int,
    pp: int,
    cp: int = 1,
    data_parallel_instances: int = 1,
    ep: int = 1,
) -> dict[str, list[list[int]]]:
    """Every process group a job of these sizes creates, by kind (GROUP_KINDS, then "cp" and
    "dp_cp" with CP > 1, "dp_inner" and "dp_outer" with hybrid sharding, "ep" and "expert_dp"
    with EP > 1), in the order `ParallelState.build` creates them (every rank the same)."""
    layout = rank_layout(world_size, tp, pp, cp)
    groups = {kind: layout[kind] for kind in GROUP_KINDS}
    replica_groups = layout["dp"]  # where parameters are sharded: DP, or DP x CP
    if cp > 1:
        context = context_parallel_layout(world_size, tp, pp, cp)
        groups.update(context)
        replica_groups = context["dp_cp"]
    if data_parallel_instances > 1:
        groups.update(hybrid_layout(replica_groups, data_parallel_instances))
    if ep > 1:
        dp_cp_groups = context_parallel_layout(world_size, tp, pp, cp)["dp_cp"]
        groups.update(expert_parallel_layout(dp_cp_groups, ep))
    return groups


def communicators_of(rank: int, layout: Mapping[str, list[list[int]]]) -> list[str]:
    """The group kinds in which `rank` has company: each is a communicator on NCCL (made when
    the group is created, or at its first use), which reserves device memory for its buffers
    once it connects. "world" is the default process group's own. Groups of one rank have
    none (`ParallelState.build` makes no process group for them)."""
    return [
        kind
        for kind, lists in layout.items()
        for ranks in lists
        if rank in ranks and len(ranks) > 1
    ]


@dataclass(frozen=True)
class ParallelState:
    """This rank's place in the TP x CP x DP x PP layout and the groups it communicates over."""

    world_size: int
    rank: int
    world: Group  # every rank: the default process group, passed here like every other group
    tp: Group
    pp: Group
    dp: Group
    model_parallel: Group
    embedding: Group | None  # None on middle pipeline stages, which hold no embedding
    device: torch.device
    # Hybrid sharding (--num-distributed-optimizer-instances N > 1): the DP group split into N
    # groups of consecutive DP ranks (`dp_inner`, where parameters are sharded) and the groups
    # of the ranks at the same place in each (`dp_outer`, across which they are replicated).
    dp_inner: Group | None = None
    dp_outer: Group | None = None
    # Context parallelism: `cp`, the ranks that each hold a part of one sequence, and `dp_cp`,
    # DP x CP, the ranks that hold one replica's parameters (where gradients are reduced and
    # the distributed optimizer shards). Left out (CP 1), they are this rank alone and `dp`.
    cp: Group = None  # type: ignore[assignment]  # set in __post_init__ when not given
    dp_cp: Group = None  # type: ignore[assignment]
    # Expert parallelism (MoE): `ep`, the ranks of one DP x CP group that split the experts
    # and exchange tokens; `expert_dp`, the ranks holding the same experts, over which expert
    # gradients are reduced. Left out (EP 1): this rank alone, and `dp_cp`.
    ep: Group = None  # type: ignore[assignment]
    expert_dp: Group = None  # type: ignore[assignment]

    def __post_init__(self) -> None:
        if self.cp is None:
            object.__setattr__(self, "cp", Group.single(self.rank))
        if self.dp_cp is None:
            if self.cp.size > 1:
                raise ValueError("ParallelState with a context-parallel group needs its dp_cp")
            object.__setattr__(self, "dp_cp", self.dp)
        if self.ep is None:
            object.__setattr__(self, "ep", Group.single(self.rank))
        if self.expert_dp is None:
            if self.ep.size > 1:
                raise ValueError("ParallelState with an expert-parallel group needs expert_dp")
            object.__setattr__(self, "expert_dp", self.dp_cp)

    @property
    def tp_rank(self) -> int:
        return self.tp.rank

    @property
    def cp_rank(self) -> int:
        return self.cp.rank

    @property
    def pp_rank(self) -> int:
        return self.pp.rank

    @property
    def dp_rank(self) -> int:
        return self.dp.rank

    @property
    def is_first_stage(self) -> bool:
        return self.pp.rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp.rank == self.pp.size - 1

    @classmethod
    def single(cls, device: torch.device | str = "cpu") -> ParallelState:
        """A one-rank world: every group is just this rank; no torch.distributed needed."""
        one = Group.single()
        groups = dict.fromkeys(GROUP_KINDS, one)
        return cls(1, 0, device=torch.device(device), **groups)

    @classmethod
    def build(
        cls,
        tensor_model_parallel_size: int = 1,
        pipeline_model_parallel_size: int = 1,
        device: torch.device | str | None = None,
        *,
        context_parallel_size: int = 1,
        data_parallel_instances: int = 1,
        expert_model_parallel_size: int = 1,
    ) -> ParallelState:
        """Create every group from the initialised default process group.

        Collective: all ranks must call it with the same sizes. Groups of one rank get no torch
        process group at all (nothing to communicate), which also keeps start-up fast. Every
        group gets the default group's timeout (--distributed-timeout-minutes). With CP 1 no
        context-parallel group is created (`dp_cp` is `dp`), so the groups are those of before.
        """
        if not dist.is_initialized():
            raise RuntimeError(
                "ParallelState.build needs torch.distributed initialised; "
                "use ParallelState.single() for one process"
            )
        world, me = dist.get_world_size(), dist.get_rank()
        layout = group_layout(
            world,
            tensor_model_parallel_size,
            pipeline_model_parallel_size,
            context_parallel_size,
            data_parallel_instances,
            expert_model_parallel_size,
        )
        timeout = default_group_timeout()
        groups: dict[str, Group | None] = dict.fromkeys(ALL_GROUP_KINDS)
        for kind, lists in layout.items():
            for ranks in lists:
                pg = None
                if kind == "world" and len(ranks) > 1:  # the default group: no second
                    pg = dist.group.WORLD  # communicator over the same ranks
                elif len(ranks) > 1:
                    pg = dist.new_group(ranks, timeout=timeout)
                if me in ranks:
                    groups[kind] = Group(tuple(ranks), ranks.index(me), pg)
        if device is None:
            device = torch.device("cpu")
        return cls(world, me, device=torch.device(device), **groups)  # type: ignore[arg-type]

    def communicators(self) -> list[str]:
        """The kinds of this rank's groups that have a process group, each once (`dp_cp` is
        `dp` with CP 1): on NCCL each is a communicator holding device buffers once connected
        (`communicators_of` says the same from the sizes alone)."""
        seen: set[int] = set()
        kinds = []
        for kind in ALL_GROUP_KINDS:
            group = getattr(self, kind)
            if group is not None and group.pg is not None and id(group.pg) not in seen:
                seen.add(id(group.pg))
                kinds.append(kind)
        return kinds

    def describe(self) -> str:
        context = f" cp {self.cp_rank}/{self.cp.size}" if self.cp.size > 1 else ""
        experts = f" ep {self.ep.rank}/{self.ep.size}" if self.ep.size > 1 else ""
        return (
            f"rank {self.rank}: tp {self.tp_rank}/{self.tp.size}{context} dp {self.dp_rank}/"
            f"{self.dp.size} pp {self.pp_rank}/{self.pp.size}{experts}"
        )
