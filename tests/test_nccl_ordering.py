"""What NCCL and CUDA promise, in the model: every schedule completes under the two rules they
leave open, and the designs that relied on more are caught.

NCCL runs a communicator's group calls in posting order, and promises no more: connections are
made lazily, in a handshake that blocks the host until the peer's first call there
(`handshake=True`), and two streams are not promised to progress together, so at worst every
group call of a rank waits in one queue (`queue="rank"`). gloo completes transfers
independently, so a posting order that hangs on GPUs passes every gloo run. megapipe posts
each batch as one group call on the pipeline's communicator (`p2p_channel`), moves receives
early only over units that send nothing (`build_schedule`) and connects every pair at start-up
in one global order (`connect_schedule`); the grid below proves every training and evaluation
schedule complete under both rules, with receives posted ahead and without. The design before
(a communicator per direction between two stages, every receive one unit early) is the hazard
each rule must catch on its own.
"""

from __future__ import annotations

import pytest

from megapipe.pipeline.schedules import (
    FORWARD_ONLY,
    INTERLEAVED_KINDS,
    P2P,
    Comm,
    Compute,
    build_schedule,
    connect_schedule,
)
from megapipe.pipeline.simulator import PROVEN_KINDS, ScheduleError, proof_grid, simulate
from megapipe.testing.posting_before import link_channel as _link
from megapipe.testing.posting_before import receives_one_unit_early as _one_unit_early

KINDS = PROVEN_KINDS
BOTH_RULES = {"handshake": True, "queue": "rank"}
EACH_RULE = {"handshake": {"handshake": True}, "one-queue": {"queue": "rank"}}


GRID = proof_grid()


def _simulate(lists, kind, v, m, **rules):
    return simulate(lists, m, v, forward_only=kind == FORWARD_ONLY, ordering="nccl", **rules)


def _step(kind, p, v, m, ahead, *, warm_up=True):
    """Every rank's list for its first step: the start-up connections, then the schedule."""
    return [
        (connect_schedule(p, v, r) if warm_up else []) + build_schedule(kind, p, v, m, r,
                                                                         post_ahead=ahead)
        for r in range(p)
    ]  # fmt: skip


def _hangs(lists, kind, v, m, **rules) -> bool:
    try:
        _simulate(lists, kind, v, m, **rules)
    except ScheduleError:
        return True
    return False


# --------------------------------------------------------------------------------------------
# The design before: a communicator per link, every receive posted one unit early.
# --------------------------------------------------------------------------------------------


def _before(kind, p, v, m):
    return [_one_unit_early(kind, p, v, m, r) for r in range(p)]


def test_the_design_before_completes_with_a_stream_per_communicator():
    # what it was built for: each communicator's stream progresses on its own, no handshake
    for kind, p, v, m in [c for c in GRID if c[1] <= 4 and c[3] in (1, 4, 8)]:
        _simulate(_before(kind, p, v, m), kind, v, m, channel=_link)


@pytest.mark.parametrize("rule", EACH_RULE)
def test_each_rule_alone_hangs_the_design_before_at_pp2(rule):
    # the negative controls: 1F1B at PP=2 with the default flags, and every training
    # schedule with it, hang under either rule on its own
    for kind in [k for k in KINDS if k != FORWARD_ONLY]:
        v = 2 if kind in INTERLEAVED_KINDS else 1
        for m in (2, 4, 8):
            lists = _before(kind, 2, v, m)
            assert _hangs(lists, kind, v, m, channel=_link, **EACH_RULE[rule]), (kind, m)
            # gloo forgives it: why no gloo test could see the hang
            simulate(lists, m, v)


def test_one_communicator_with_every_receive_early_hangs_too():
    # the design before the per-link groups: one communicator, receives one unit early
    for kind, p, v, m in [c for c in GRID if c[3] >= c[1] and c[0] != FORWARD_ONLY]:
        assert _hangs(_before(kind, p, v, m), kind, v, m), (kind, p, v, m)


def test_the_handshake_hang_names_the_peer_it_waits_for():
    with pytest.raises(ScheduleError) as caught:
        _simulate(_before("1f1b", 2, 1, 4), "1f1b", 1, 4, channel=_link, handshake=True)
    assert "connecting to [1] on ('B', 1, 0)" in str(caught.value)


# --------------------------------------------------------------------------------------------
# The design now.
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("ahead", [False, True], ids=["posted-late", "posted-ahead"])
def test_every_schedule_completes_under_both_rules(ahead):
    # 238 (kind, p, v, m) cases, training and evaluation: each raises ScheduleError on a hang
    for kind, p, v, m in GRID:
        sim = _simulate(_step(kind, p, v, m, ahead), kind, v, m, **BOTH_RULES)
        gloo = simulate(_step(kind, p, v, m, ahead), m, v, forward_only=kind == FORWARD_ONLY)
        # with free transfers one queue costs nothing: never slower than gloo's rendezvous,
        # holding the same micro-batches
        assert sim.makespan <= gloo.makespan + 1e-9, (kind, p, v, m)
        assert sim.peak_in_flight == gloo.peak_in_flight, (kind, p, v, m)


def test_training_schedules_need_no_warm_up_and_evaluation_does():
    # training: every first contact is matched, so even lazy connections complete
    for kind, p, v, m in [c for c in GRID if c[0] != FORWARD_ONLY]:
        _simulate(_step(kind, p, v, m, True, warm_up=False), kind, v, m, **BOTH_RULES)
    # evaluation with virtual stages and one micro-batch: rank 0's first call reaches both its
    # neighbours (the wrap-around), whose own first calls reach others first: the start-up
    # connections are what make it safe
    for p in (3, 4, 8):
        lists = _step(FORWARD_ONLY, p, 2, 1, True, warm_up=False)
        assert _hangs(lists, FORWARD_ONLY, 2, 1, handshake=True)
        assert not _hangs(lists, FORWARD_ONLY, 2, 1)  # the streams alone run it


def test_the_start_up_connections_complete_under_both_rules_in_one_global_order():
    for p in range(2, 9):
        for v in (1, 2, 4):
            lists = [connect_schedule(p, v, r) for r in range(p)]
            simulate(lists, 0, v, ordering="nccl", **BOTH_RULES)
            pairs = p - 1 + (v > 1 and p > 2)  # the wrap-around pair only for interleaving
            assert sum(len(batches) for batches in lists) == 2 * pairs
            # each batch is one matched exchange with one peer
            for batches in lists:
                for batch in batches:
                    assert sorted(op.op for op in batch.ops) == ["recv", "send"]
                    assert len({op.peer for op in batch.ops}) == 1
    # with the wrap-around, a rank that met its pairs in another order would close a cycle:
    # rank 0 waits for rank 2, which waits for rank 1, which waits for rank 0
    lists = [connect_schedule(3, 2, r) for r in range(3)]
    assert not _hangs(lists, "1f1b", 2, 0, **BOTH_RULES)
    lists[0] = lists[0][::-1]
    assert _hangs(lists, "1f1b", 2, 0, handshake=True)


def _sends_by_call(actions: list) -> dict[P2P, int]:
    """For each receive, how many of the rank's sends are posted in its group call or before."""
    sends, by_receive = 0, {}
    for action in actions:
        if isinstance(action, Comm):
            sends += sum(op.op == "send" for op in action.ops)
            by_receive.update({op: sends for op in action.ops if op.op == "recv"})
    return by_receive


def test_posting_ahead_never_moves_a_receive_past_a_send():
    # a receive moves only over units that send nothing: every receive has the same sends of
    # its rank queued in or before its group call whether posted ahead or late, so a peer
    # never waits for a send queued behind a receive it has not yet served; the computes are
    # the same, in the same order
    for kind, p, v, m in [c for c in GRID if c[1] in (2, 4) and c[3] == 8]:
        for rank in range(p):
            late = build_schedule(kind, p, v, m, rank)
            ahead = build_schedule(kind, p, v, m, rank, post_ahead=True)
            assert _sends_by_call(ahead) == _sends_by_call(late), (kind, p, v, rank)
            computes = [[a for a in lst if isinstance(a, Compute)] for lst in (late, ahead)]
            assert computes[0] == computes[1]
    # and some do move: GPipe's first stage receives its gradients while it runs backwards
    late, ahead = (build_schedule("gpipe", 2, 1, 4, 0, post_ahead=x) for x in (False, True))
    assert sum(isinstance(a, Comm) for a in ahead) < sum(isinstance(a, Comm) for a in late)
