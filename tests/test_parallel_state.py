"""Process groups: Megatron's tp-dp-pp rank order, every group a partition, real gloo groups."""

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

from megapipe.errors import ConfigError
from megapipe.parallel.state import (
    GROUP_KINDS,
    ParallelState,
    communicators_of,
    group_layout,
    rank_layout,
)
from megapipe.testing import run_distributed


def test_layout_of_eight_ranks_matches_megatron_order():
    g = rank_layout(8, tp=2, pp=2)
    assert g["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g["pp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert g["model_parallel"] == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert g["embedding"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert g["world"] == [[0, 1, 2, 3, 4, 5, 6, 7]]
    assert set(g) == {"world", "tp", "dp", "pp", "model_parallel", "embedding"}


def test_embedding_group_is_first_and_last_stage():
    g = rank_layout(4, tp=1, pp=4)
    assert g["pp"] == [[0, 1, 2, 3]]
    assert g["embedding"] == [[0, 3]]
    assert rank_layout(2, tp=2, pp=1)["embedding"] == [[0], [1]]


@given(tp=st.integers(1, 4), pp=st.integers(1, 4), dp=st.integers(1, 4))
def test_every_kind_partitions_the_world(tp, pp, dp):
    world = tp * pp * dp
    g = rank_layout(world, tp, pp)
    sizes = {"world": world, "tp": tp, "pp": pp, "dp": dp, "model_parallel": tp * pp}
    for kind, size in sizes.items():
        assert sorted(r for grp in g[kind] for r in grp) == list(range(world)), kind
        assert all(len(grp) == size for grp in g[kind]), kind
    for grp in g["tp"]:  # TP neighbours are adjacent ranks (one node, NVLink)
        assert grp == list(range(grp[0], grp[0] + tp))
    for rank in range(world):  # rank = tp_rank + tp * (dp_rank + dp * pp_rank)
        t, rest = rank % tp, rank // tp
        d, p = rest % dp, rest // dp
        assert g["tp"][p * dp + d][t] == rank
        assert g["pp"][d * tp + t][p] == rank
        assert g["dp"][p * tp + t][d] == rank


@pytest.mark.parametrize("world,tp,pp", [(6, 4, 1), (8, 3, 1), (8, 2, 3), (4, 0, 1)])
def test_impossible_layout_names_the_sizes(world, tp, pp):
    with pytest.raises(ConfigError) as err:
        rank_layout(world, tp, pp)
    message = str(err.value)
    assert f"world size ({world})" in message
    assert f"--tensor-model-parallel-size ({tp})" in message
    assert f"--pipeline-model-parallel-size ({pp})" in message


def _groups_reduce_over_the_right_ranks(rank, world, tp, pp):
    state = ParallelState.build(tp, pp)
    sums = {}
    for kind in GROUP_KINDS:
        group = getattr(state, kind)
        if group is None:
            sums[kind] = None
            continue
        value = torch.tensor([float(rank)])
        if group.pg is not None:
            dist.all_reduce(value, group=group.pg)
        sums[kind] = (group.ranks, group.rank, value.item())
    return sums


def test_built_groups_communicate_within_their_members():
    results = run_distributed(_groups_reduce_over_the_right_ranks, 8, 2, 2)
    layout = rank_layout(8, 2, 2)
    for rank, sums in enumerate(results):
        member_of = {kind for kind in GROUP_KINDS if any(rank in g for g in layout[kind])}
        assert {kind for kind in GROUP_KINDS if sums[kind] is not None} == member_of
        for kind in member_of:
            ranks, index, total = sums[kind]
            assert list(ranks) in layout[kind]
            assert ranks[index] == rank
            assert total == sum(ranks), (kind, rank)


def test_single_rank_state_needs_no_process_group():
    state = ParallelState.single()
    assert state.tp.size == state.pp.size == state.dp.size == state.world.size == 1
    assert state.world.pg is None  # a group of one: collectives over it are skipped
    assert state.is_first_stage and state.is_last_stage


def test_communicators_per_rank_of_the_issues_layouts():
    # TP2 x PP4 (8 ranks) and TP2 x PP2 x CP2 (8 ranks): the groups each rank has company in,
    # each an NCCL communicator; the pipeline's transfers use `pp`'s, and `world` is the
    # default group's. Before, each rank also had a world group of its own and a group per
    # direction to each pipeline neighbour (4 more, the wrap-around's included): 9-10 and 12.
    tp2_pp4 = group_layout(8, 2, 4)
    ends = ["world", "tp", "pp", "model_parallel", "embedding"]
    assert [communicators_of(r, tp2_pp4) for r in (0, 1, 6, 7)] == [ends] * 4
    assert [communicators_of(r, tp2_pp4) for r in (2, 3, 4, 5)] == [ends[:-1]] * 4
    cp = group_layout(8, 2, 2, cp=2)
    assert all(communicators_of(r, cp) == [*ends, "cp", "dp_cp"] for r in range(8))
    # with DP and EP too (TP2 x PP2 x CP2 x DP2, EP2): every kind
    assert communicators_of(0, group_layout(16, 2, 2, 2, 1, 2)) == [
        "world", "tp", "pp", "dp", "model_parallel", "embedding", "cp", "dp_cp", "ep", "expert_dp"
    ]  # fmt: skip


def _process_groups(rank, world, tp, pp, cp):
    state = ParallelState.build(tp, pp, context_parallel_size=cp)
    kinds = communicators_of(rank, group_layout(world, tp, pp, cp))
    distinct = {id(getattr(state, kind).pg) for kind in kinds}
    return kinds, state.communicators(), len(distinct), state.world.pg is dist.group.WORLD


@pytest.mark.parametrize("tp,pp,cp", [(2, 2, 1), (1, 2, 2)])
def test_build_makes_one_process_group_per_communicator_and_world_is_the_default(tp, pp, cp):
    results = run_distributed(_process_groups, 4, tp, pp, cp)
    for from_sizes, built, distinct, world_is_default in results:
        assert built == from_sizes and distinct == len(from_sizes) and world_is_default
