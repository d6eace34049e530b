"""NCCL's ordering in the model: every schedule completes when each process group's transfers
run in posting order, and the ways of posting that would hang on GPUs are caught.

NCCL runs a group's transfers on one stream, one batch after another; gloo completes them
independently, so a posting order that hangs on GPUs passes every gloo run. The simulator's
`ordering="nccl"` is that rule; megapipe sends each direction between two stages over a
process group of its own (`p2p_link`), and the grid below proves every training and
evaluation schedule complete under it, with receives posted ahead and without. The cases with
one group per pipeline (what megapipe did before) are the hazard the rule must catch.
"""

from __future__ import annotations

import pytest

from megapipe.parallel.state import pipeline_links
from megapipe.pipeline.schedules import (
    FORWARD_ONLY,
    INTERLEAVED_KINDS,
    P2P,
    SCHEDULE_KINDS,
    Comm,
    build_schedule,
    p2p_link,
)
from megapipe.pipeline.simulator import ScheduleError, simulate

KINDS = [k for k in SCHEDULE_KINDS if k != "no-pipelining"] + [FORWARD_ONLY]


def _grid() -> list[tuple[str, int, int, int]]:
    cases = []
    for kind in KINDS:
        vs = [2, 3, 4] if kind in INTERLEAVED_KINDS else [1, 2] if kind == FORWARD_ONLY else [1]
        for p in (2, 3, 4, 8):
            for v in vs:
                for m in (1, 2, 3, 4, 5, 8, 12, 16):
                    if kind not in INTERLEAVED_KINDS or m % p == 0:
                        cases.append((kind, p, v, m))
    return cases


GRID = _grid()


def _one_group(rank: int, op: P2P) -> str:
    return "pipeline"  # every transfer of a rank on one group, one NCCL stream


def _simulate(kind, p, v, m, ahead, channel=p2p_link, ordering="nccl", **costs):
    schedules = [build_schedule(kind, p, v, m, r, post_ahead=ahead) for r in range(p)]
    forward_only = kind == FORWARD_ONLY
    return simulate(
        schedules, m, v, forward_only=forward_only, ordering=ordering, channel=channel, **costs
    )


@pytest.mark.parametrize("ahead", [False, True], ids=["posted-late", "posted-ahead"])
def test_every_schedule_completes_under_nccl_ordering_over_its_links(ahead):
    # 238 (kind, p, v, m) cases, training and evaluation: each raises ScheduleError on a hang
    for kind, p, v, m in GRID:
        sim = _simulate(kind, p, v, m, ahead)
        gloo = _simulate(kind, p, v, m, ahead, ordering="gloo")
        # with free transfers the streams cost nothing: never slower than under gloo (where
        # the host also waits for its earlier sends), holding the same micro-batches
        assert sim.makespan <= gloo.makespan + 1e-9, (kind, p, v, m)
        assert sim.peak_in_flight == gloo.peak_in_flight, (kind, p, v, m)


def test_one_group_per_pipeline_hangs_as_on_gpus():
    # What the issue measured on gloo with NCCL's ordering emulated: posted ahead, every
    # schedule hangs at its first step; posted late, interleaved zero-bubble still does.
    def hangs(kind, p, v, m, ahead):
        try:
            _simulate(kind, p, v, m, ahead, channel=_one_group)
        except ScheduleError:
            return True
        return False

    for kind, p, v, m in [c for c in GRID if c[3] >= c[1] and c[0] != FORWARD_ONLY]:
        assert hangs(kind, p, v, m, ahead=True), (kind, p, v, m)
        assert hangs(kind, p, v, m, ahead=False) == (kind == "interleaved-zero-bubble")
        # the same lists complete under gloo's semantics: why no gloo test could see it
        _simulate(kind, p, v, m, True, channel=_one_group, ordering="gloo")


def test_a_receive_posted_ahead_holds_back_the_send_behind_it_on_its_stream():
    # 1F1B at PP2 with one micro-batch and one group: rank 0 posts the receive of B0's gradient
    # ahead, then F0's send behind it; rank 1 needs F0 before it can send that gradient.
    with pytest.raises(ScheduleError) as caught:
        _simulate("1f1b", 2, 1, 1, True, channel=_one_group)
    message = str(caught.value)
    assert "rank 0 waits in B0" in message and "pipeline stream blocked in recv-" in message
    assert "rank 1 waits in F0" in message


@pytest.mark.parametrize("kind,v", [("1f1b", 1), ("interleaved-1f1b", 2), ("zero-bubble-h1", 1),
                                    ("interleaved-zero-bubble", 2)])  # fmt: skip
def test_posting_ahead_still_hides_transfer_time_under_nccl_ordering(kind, v):
    for cost in (0.05, 0.2):
        late = _simulate(kind, 4, v, 8, False, comm_cost=cost).makespan
        ahead = _simulate(kind, 4, v, 8, True, comm_cost=cost).makespan
        assert ahead < late


def test_every_transfer_of_a_schedule_has_a_link_and_each_link_carries_one_direction():
    links = pipeline_links([10, 11, 12, 13])
    assert len(links) == 8  # F and B between each neighbouring pair, the wrap-around included
    assert links[("F", 3, 0)] == links[("B", 0, 3)] == (10, 13)
    for kind, p, v, m in [c for c in GRID if c[1] == 4 and c[3] == 8]:
        for rank in range(p):
            for action in build_schedule(kind, p, v, m, rank, post_ahead=True):
                for op in action.ops if isinstance(action, Comm) else ():
                    phase, src, dst = p2p_link(rank, op)
                    assert (phase, src, dst) in links
                    # the link's sender sends and its receiver receives, never the reverse
                    assert (op.op == "send") == (src == rank)
    assert pipeline_links([5]) == {}
    two = pipeline_links([0, 1])
    assert sorted(two) == [("B", 0, 1), ("B", 1, 0), ("F", 0, 1), ("F", 1, 0)]
