"""Context parallelism in the rank layout: Megatron's tp-cp-dp-pp order, the cp and dp_cp groups,
and CP 1 leaving every group as it was.

The expected rank lists are written out by hand from `rank = t + tp * (c + cp * (d + dp * p))`
(and agree with Megatron-Core's RankGenerator, checked below where it is installed).
"""

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

from megapipe.errors import ConfigError
from megapipe.parallel.state import (
    GROUP_KINDS,
    Group,
    ParallelState,
    context_parallel_layout,
    rank_layout,
)
from megapipe.testing import run_distributed

# world 8 = tp 2 x cp 2 x dp 2: rank = t + 2c + 4d
TP2_CP2_DP2 = {
    "tp": [[0, 1], [2, 3], [4, 5], [6, 7]],
    "cp": [[0, 2], [1, 3], [4, 6], [5, 7]],
    "dp": [[0, 4], [1, 5], [2, 6], [3, 7]],
    "pp": [[0], [1], [2], [3], [4], [5], [6], [7]],
    "dp_cp": [[0, 2, 4, 6], [1, 3, 5, 7]],
    "model_parallel": [[0, 1], [2, 3], [4, 5], [6, 7]],
    "embedding": [[0], [1], [2], [3], [4], [5], [6], [7]],
    "world": [[0, 1, 2, 3, 4, 5, 6, 7]],
}
# world 8 = tp 1 x cp 2 x dp 2 x pp 2: rank = c + 2d + 4p
TP1_CP2_DP2_PP2 = {
    "tp": [[0], [1], [2], [3], [4], [5], [6], [7]],
    "cp": [[0, 1], [2, 3], [4, 5], [6, 7]],
    "dp": [[0, 2], [1, 3], [4, 6], [5, 7]],
    "pp": [[0, 4], [1, 5], [2, 6], [3, 7]],
    "dp_cp": [[0, 1, 2, 3], [4, 5, 6, 7]],
    "model_parallel": [[0, 4], [1, 5], [2, 6], [3, 7]],
    "embedding": [[0, 4], [1, 5], [2, 6], [3, 7]],
    "world": [[0, 1, 2, 3, 4, 5, 6, 7]],
}
# world 8 = tp 2 x cp 4: one replica, the whole world holds its parameters
TP2_CP4 = {
    "tp": [[0, 1], [2, 3], [4, 5], [6, 7]],
    "cp": [[0, 2, 4, 6], [1, 3, 5, 7]],
    "dp": [[0], [1], [2], [3], [4], [5], [6], [7]],
    "pp": [[0], [1], [2], [3], [4], [5], [6], [7]],
    "dp_cp": [[0, 2, 4, 6], [1, 3, 5, 7]],
    "model_parallel": [[0, 1], [2, 3], [4, 5], [6, 7]],
    "embedding": [[0], [1], [2], [3], [4], [5], [6], [7]],
    "world": [[0, 1, 2, 3, 4, 5, 6, 7]],
}
# world 8 = cp 2 x pp 2 x tp 2 (dp 1): rank = t + 2c + 4p
TP2_CP2_PP2 = {
    "tp": [[0, 1], [2, 3], [4, 5], [6, 7]],
    "cp": [[0, 2], [1, 3], [4, 6], [5, 7]],
    "dp": [[0], [1], [2], [3], [4], [5], [6], [7]],
    "pp": [[0, 4], [1, 5], [2, 6], [3, 7]],
    "dp_cp": [[0, 2], [1, 3], [4, 6], [5, 7]],
    "model_parallel": [[0, 1, 4, 5], [2, 3, 6, 7]],
    "embedding": [[0, 4], [1, 5], [2, 6], [3, 7]],
    "world": [[0, 1, 2, 3, 4, 5, 6, 7]],
}
CASES = {
    (8, 2, 1, 2): TP2_CP2_DP2,
    (8, 1, 2, 2): TP1_CP2_DP2_PP2,
    (8, 2, 1, 4): TP2_CP4,
    (8, 2, 2, 2): TP2_CP2_PP2,
}


def _all_groups(world: int, tp: int, pp: int, cp: int) -> dict[str, list[list[int]]]:
    return {**rank_layout(world, tp, pp, cp), **context_parallel_layout(world, tp, pp, cp)}


@pytest.mark.parametrize(("world", "tp", "pp", "cp"), list(CASES))
def test_layout_with_context_parallelism_is_megatrons_tp_cp_dp_pp(world, tp, pp, cp):
    assert _all_groups(world, tp, pp, cp) == CASES[world, tp, pp, cp]


@pytest.mark.parametrize(("world", "tp", "pp", "cp"), list(CASES))
def test_layout_equals_megatron_cores_rank_generator(world, tp, pp, cp):
    parallel_state = pytest.importorskip("megatron.core.parallel_state")
    dp = world // (tp * cp * pp)
    generator = parallel_state.RankGenerator(
        tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order="tp-cp-ep-dp-pp"
    )
    ours = _all_groups(world, tp, pp, cp)
    for kind, megatron_kind in [
        ("tp", "tp"), ("cp", "cp"), ("dp", "dp"), ("pp", "pp"), ("dp_cp", "dp-cp"),
        ("model_parallel", "tp-pp"),
    ]:  # fmt: skip
        assert ours[kind] == generator.get_ranks(megatron_kind), kind


@given(tp=st.integers(1, 3), cp=st.integers(1, 3), dp=st.integers(1, 3), pp=st.integers(1, 3))
def test_context_parallel_groups_partition_the_world(tp, cp, dp, pp):
    world = tp * cp * dp * pp
    groups = _all_groups(world, tp, pp, cp)
    sizes = {"tp": tp, "cp": cp, "dp": dp, "pp": pp, "dp_cp": dp * cp, "model_parallel": tp * pp}
    for kind, size in sizes.items():
        assert sorted(r for g in groups[kind] for r in g) == list(range(world)), kind
        assert all(len(g) == size for g in groups[kind]), kind
    for rank in range(world):  # rank = t + tp * (c + cp * (d + dp * p))
        t, c = rank % tp, rank // tp % cp
        d, p = rank // (tp * cp) % dp, rank // (tp * cp * dp)
        cp_group = next(g for g in groups["cp"] if rank in g)
        assert cp_group.index(rank) == c
        assert cp_group == [t + tp * (k + cp * (d + dp * p)) for k in range(cp)]
        dp_cp_group = next(g for g in groups["dp_cp"] if rank in g)
        assert dp_cp_group.index(rank) == c + cp * d  # CP fastest inside DP x CP
        dp_group = next(g for g in groups["dp"] if rank in g)
        assert set(dp_group) <= set(dp_cp_group) and set(cp_group) <= set(dp_cp_group)


@given(tp=st.integers(1, 4), pp=st.integers(1, 4), dp=st.integers(1, 4))
def test_cp_one_leaves_every_group_unchanged(tp, pp, dp):
    world = tp * pp * dp
    assert rank_layout(world, tp, pp, 1) == rank_layout(world, tp, pp)
    context = context_parallel_layout(world, tp, pp, 1)
    assert context["dp_cp"] == rank_layout(world, tp, pp)["dp"]
    assert context["cp"] == [[r] for r in range(world)]


def test_world_not_divisible_by_tp_cp_pp_names_the_three_flags():
    with pytest.raises(ConfigError) as err:
        rank_layout(8, 2, 1, 3)
    assert str(err.value) == (
        "world size (8) is not divisible by --tensor-model-parallel-size (2) x "
        "--context-parallel-size (3) x --pipeline-model-parallel-size (1)"
    )


def test_constructors_without_cp_get_this_rank_alone_and_dp():
    state = ParallelState.single()
    assert state.cp == Group.single(0) and state.cp_rank == 0
    assert state.dp_cp is state.dp
    dp = Group((1, 3), 0)
    built = ParallelState(
        4, 1, Group((0, 1, 2, 3), 1), Group((0, 1), 1), Group((1,), 0), dp,
        Group((0, 1), 1), Group((1,), 0), torch.device("cpu"),
    )  # fmt: skip
    assert built.cp == Group((1,), 0) and built.dp_cp is dp
    assert built.describe() == "rank 1: tp 1/2 dp 0/2 pp 0/1"


def _state_groups(rank, world, tp, pp, cp, instances=1):
    state = ParallelState.build(tp, pp, context_parallel_size=cp, data_parallel_instances=instances)
    out = {}
    for kind in (*GROUP_KINDS, "cp", "dp_cp", "dp_inner", "dp_outer"):
        group = getattr(state, kind)
        if group is None:
            out[kind] = None
            continue
        value = torch.tensor([float(rank)])
        if group.pg is not None:
            dist.all_reduce(value, group=group.pg)
        out[kind] = (list(group.ranks), group.rank, value.item(), group.pg is None)
    out["same_dp_cp"] = state.dp_cp is state.dp
    out["describe"] = state.describe()
    return out


def test_built_cp_groups_communicate_within_their_members():
    results = run_distributed(_state_groups, 8, 2, 1, 2, timeout=120)
    for rank, got in enumerate(results):
        for kind, expected in TP2_CP2_DP2.items():
            ranks, index, total, _ = got[kind]
            assert ranks in expected and ranks[index] == rank, (kind, rank)
            assert total == sum(ranks), (kind, rank)
        assert got["cp"][1] == rank // 2 % 2
        assert not got["same_dp_cp"]
        assert " cp " in got["describe"]


def test_built_with_cp_one_is_the_layout_of_before():
    results = run_distributed(_state_groups, 4, 2, 1, 1, timeout=120)
    layout = rank_layout(4, 2, 1)
    for rank, got in enumerate(results):
        assert got["same_dp_cp"]
        assert got["cp"] == ([rank], 0, float(rank), True)  # alone, no process group
        for kind in GROUP_KINDS:
            if got[kind] is not None:
                assert got[kind][0] in layout[kind]


def test_hybrid_sharding_splits_dp_x_cp():
    # tp 1, cp 2, dp 2: dp_cp [0, 1, 2, 3]; two instances: inner [0, 1] [2, 3], outer [0, 2] [1, 3]
    results = run_distributed(_state_groups, 4, 1, 1, 2, 2, timeout=120)
    for rank, got in enumerate(results):
        assert got["dp_cp"][0] == [0, 1, 2, 3]
        assert got["dp_inner"][0] == [[0, 1], [2, 3]][rank // 2]
        assert got["dp_outer"][0] == [[0, 2], [1, 3]][rank % 2]
