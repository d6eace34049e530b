"""Schedules as data: complete, deadlock-free under rendezvous p2p, and as idle as theory says."""

import pytest

from megapipe.errors import ConfigError
from megapipe.pipeline.schedules import (
    P2P,
    Comm,
    Compute,
    build_schedule,
    compute_order,
    format_schedule,
    validate_schedule,
)
from megapipe.pipeline.simulator import ScheduleError, replay, simulate, simulate_kind

GRID = [(kind, p, v, m)
        for kind, vs in (("gpipe", [1]), ("1f1b", [1]), ("interleaved-1f1b", [2, 3, 4]))
        for v in vs for p in (2, 3, 4, 8) for m in (1, 2, 3, 4, 5, 8, 12, 16)
        if kind != "interleaved-1f1b" or m % p == 0]  # fmt: skip


@pytest.mark.parametrize("kind,p,v,m", GRID)
def test_every_schedule_is_complete_deadlock_free_and_matches_the_bubble_formula(kind, p, v, m):
    sim = simulate_kind(kind, p, v, m)  # raises ScheduleError on deadlock or missing work
    expected = (p - 1) / m if kind != "interleaved-1f1b" else (p - 1) / (v * m)
    for rank in range(p):
        assert sim.bubble_fraction(rank) == pytest.approx(expected, rel=1e-12)
        assert sim.busy(rank) == pytest.approx(3.0 * m)  # F 1/v + B 2/v, per chunk per micro-batch


@pytest.mark.parametrize("p,m", [(2, 8), (4, 8), (4, 2), (8, 16)])
def test_1f1b_holds_at_most_p_micro_batches_where_gpipe_holds_all(p, m):
    one_f_one_b = simulate_kind("1f1b", p, 1, m)
    assert one_f_one_b.peak_in_flight == [min(p - r, m) for r in range(p)]
    assert simulate_kind("gpipe", p, 1, m).peak_in_flight == [m] * p


def test_interleaved_activation_bound_matches_megatron_warmup():
    # rank r keeps (p - r - 1) * 2 + (v - 1) * p warm-up forwards, plus the steady one
    p, v, m = 4, 2, 8
    sim = simulate_kind("interleaved-1f1b", p, v, m)
    assert sim.peak_in_flight == [(p - r - 1) * 2 + (v - 1) * p + 1 for r in range(p)]


def test_1f1b_order_is_warmup_steady_cooldown():
    order = [str(a) for a in compute_order("1f1b", 4, 1, 6, 1)]
    assert order == ["F0", "F1", "F2", "B0", "F3", "B1", "F4", "B2", "F5", "B3", "B4", "B5"]


def test_interleaved_forwards_go_through_chunks_in_groups_of_p():
    forwards = [str(a) for a in compute_order("interleaved-1f1b", 2, 2, 4, 1) if a.phase == "F"]
    assert forwards == ["F0", "F1", "F0.1", "F1.1", "F2", "F3", "F2.1", "F3.1"]


def test_communication_is_paired_with_the_neighbouring_compute():
    text = format_schedule(build_schedule("1f1b", 2, 1, 2, 0))
    assert text == "F0 [send-F0.0@1] F1 [recv-B0.0@1 send-F1.0@1] B0 [recv-B1.0@1] B1"


def test_a_dependency_cycle_deadlocks_and_the_simulator_says_where():
    # Rank 0 posts its send of F0 only after B0, which needs rank 1's gradient, which needs
    # F0's output: each rank waits for the other forever.
    rank0 = [
        Compute("F", 0),
        Comm((P2P("recv", "B", 0, 0, 1),)),
        Compute("B", 0),
        Comm((P2P("send", "F", 0, 0, 1),)),
    ]
    rank1 = [
        Comm((P2P("recv", "F", 0, 0, 0),)),
        Compute("F", 0),
        Compute("B", 0),
        Comm((P2P("send", "B", 0, 0, 0),)),
    ]
    with pytest.raises(ScheduleError, match=r"deadlock: rank 0 waits in B0 .*rank 1 waits in F0"):
        simulate([rank0, rank1], 1)


def test_a_send_nobody_receives_deadlocks_at_the_drain():
    # p2p waits for a batch's sends after posting the next batch: a receive that is posted
    # only after the peer's wait (here: never) leaves that rank waiting for its send.
    rank0 = [Compute("F", 0), Comm((P2P("send", "F", 0, 0, 1),))]
    rank1 = [Comm((P2P("recv", "F", 1, 0, 0),))]  # the wrong micro-batch
    with pytest.raises(ScheduleError, match=r"rank 0 waits in its end \(for its send-F0"):
        simulate([rank0, rank1], 1, forward_only=True)


def test_transfers_posted_in_different_orders_are_caught():
    send_both = Comm((P2P("send", "F", 0, 0, 1), P2P("send", "F", 1, 0, 1)))
    recv_swapped = Comm((P2P("recv", "F", 1, 0, 0), P2P("recv", "F", 0, 0, 0)))
    rank0 = [Compute("F", 0), Compute("F", 1), send_both, Comm((P2P("recv", "B", 0, 0, 1),
             P2P("recv", "B", 1, 0, 1))), Compute("B", 0), Compute("B", 1)]  # fmt: skip
    rank1 = [
        recv_swapped,
        Compute("F", 0),
        Compute("F", 1),
        Compute("B", 0),
        Compute("B", 1),
        Comm((P2P("send", "B", 0, 0, 0), P2P("send", "B", 1, 0, 0))),
    ]
    with pytest.raises(ScheduleError, match="different orders"):
        simulate([rank0, rank1], 2)


def test_missing_work_and_compute_before_input_are_caught():
    with pytest.raises(ScheduleError, match="never runs"):
        simulate([[Compute("F", 0), Compute("B", 0)]], 2)
    with pytest.raises(ScheduleError, match="before receiving its input"):
        simulate(
            [
                [
                    Compute("F", 0),
                    Comm((P2P("send", "F", 0, 0, 1),)),
                    Comm((P2P("recv", "B", 0, 0, 1),)),
                    Compute("B", 0),
                ],
                [Compute("F", 0), Compute("B", 0)],
            ],
            1,
        )


@pytest.mark.parametrize(
    "kind,p,v,m,fragment",
    [
        ("interleaved-1f1b", 4, 2, 6, "micro-batches (6)"),
        ("interleaved-1f1b", 1, 2, 4, "--pipeline-model-parallel-size > 1"),
        ("1f1b", 2, 2, 4, "interleaved-1f1b"),
        ("no-pipelining", 2, 1, 4, "--pipeline-model-parallel-size 1"),
        ("zero-bubble", 2, 1, 4, "'zero-bubble'"),
        ("zero-bubble-h1", 2, 2, 4, "interleaved-zero-bubble"),
        ("interleaved-zero-bubble", 2, 1, 4, "needs virtual pipeline stages"),
        ("interleaved-zero-bubble", 4, 2, 6, "micro-batches (6)"),
    ],
)
def test_impossible_schedules_are_rejected_with_the_numbers(kind, p, v, m, fragment):
    with pytest.raises(ConfigError) as err:
        build_schedule(kind, p, v, m, 0)
    assert fragment in str(err.value)


def test_interleaving_error_suggests_allowed_micro_batch_counts():
    with pytest.raises(ConfigError) as err:
        build_schedule("interleaved-1f1b", 4, 2, 6, 0)
    assert "Use 4 or 8 micro-batches" in str(err.value)


FORWARD_ONLY_GRID = [(p, v, m) for p in (2, 3, 4, 8) for v in (1, 2, 3, 4)
                     for m in (1, 2, 3, 4, 5, 7, 8, 12, 16)]  # fmt: skip


@pytest.mark.parametrize("p,v,m", FORWARD_ONLY_GRID)
def test_forward_only_is_complete_deadlock_free_and_holds_one_output(p, v, m):
    # Every forward of every chunk and no backward (the simulator raises otherwise), for any m,
    # a partial group of p included; each output is let go of once it is sent.
    sim = simulate_kind("forward-only", p, v, m)
    assert sim.peak_in_flight == [1] * (p - 1) + [1 if v > 1 else 0]
    for rank in range(p):
        assert sim.busy(rank) == pytest.approx(m)  # one forward of 1/v per chunk per micro-batch
        if v == 1 or m % p == 0:  # one chunk: (p - 1) / m, like GPipe's forward half
            expected = (p - 1) / (v * m)
            assert sim.bubble_fraction(rank) == pytest.approx(expected, rel=1e-12)
        else:  # a partial group: never more idle than without interleaving
            assert sim.bubble_fraction(rank) <= (p - 1) / m + 1e-12


def test_forward_only_runs_forwards_in_the_interleaved_order_with_derived_transfers():
    forwards = [str(a) for a in compute_order("forward-only", 2, 2, 3, 1)]
    assert forwards == ["F0", "F1", "F0.1", "F1.1", "F2", "F2.1"]
    assert format_schedule(build_schedule("forward-only", 2, 1, 3, 0)) == (
        "F0 [send-F0.0@1] F1 [send-F1.0@1] F2 [send-F2.0@1]"
    )
    assert format_schedule(build_schedule("forward-only", 2, 1, 2, 1)) == (
        "[recv-F0.0@0] F0 [recv-F1.0@0] F1"
    )


def test_a_backward_in_a_forward_only_simulation_is_caught():
    with pytest.raises(ScheduleError, match="B0 in a forward-only schedule"):
        simulate([[Compute("F", 0), Compute("B", 0)]], 1, forward_only=True)


def test_forward_only_is_not_a_training_schedule_and_checks_its_sizes():
    with pytest.raises(ConfigError, match="'forward-only' is not one of"):
        validate_schedule("forward-only", 2, 1, 2)  # what --pipeline-schedule is checked with
    with pytest.raises(ConfigError, match=r"micro-batches \(0\)"):
        build_schedule("forward-only", 2, 1, 0, 0)
    with pytest.raises(ConfigError, match="--pipeline-model-parallel-size > 1"):
        build_schedule("forward-only", 1, 2, 4, 0)


ZERO_BUBBLE_GRID = [(kind, p, v, m, ahead)
                    for kind, vs in (("zero-bubble-h1", [1]), ("interleaved-zero-bubble", [2, 3]))
                    for v in vs for p in (2, 3, 4, 8) for m in (1, 2, 3, 4, 5, 8, 12, 16)
                    for ahead in (False, True)
                    if kind == "zero-bubble-h1" or m % p == 0]  # fmt: skip


@pytest.mark.parametrize("kind,p,v,m,ahead", ZERO_BUBBLE_GRID)
def test_zero_bubble_schedules_are_complete_deadlock_free_and_less_idle(kind, p, v, m, ahead):
    sim = simulate_kind(kind, p, v, m, post_ahead=ahead)  # raises on deadlock or missing F/B/W
    base = simulate_kind("1f1b" if v == 1 else "interleaved-1f1b", p, v, m)
    for rank in range(p):
        assert sim.busy(rank) == pytest.approx(3.0 * m)  # F, B and W 1/v each
        assert sim.bubble_fraction(rank) < base.bubble_fraction(rank)
    # at the activation memory of the schedule it splits: no rank holds more micro-batches
    # (forward done, weight gradient not yet) than the unsplit schedule's busiest rank
    assert max(sim.peak_in_flight) == max(base.peak_in_flight)


@pytest.mark.parametrize("p", [2, 3, 4, 8])
@pytest.mark.parametrize("m", [8, 16])
@pytest.mark.parametrize("f,b,w", [(1.0, 1.0, 1.0), (1.0, 1.5, 0.5)])
def test_zero_bubble_h1_idles_as_the_paper_says(p, m, f, b, w):
    # Qi et al. 2023, Table 2 (m >= p): 1F1B idles (p-1)(T_F + T_B + T_W) on every rank, ZB-H1
    # (p-1)(T_F + T_B - T_W), T_B being the input gradient only: a third when all are equal.
    zb = simulate_kind("zero-bubble-h1", p, 1, m, forward_cost=f, backward_cost=b, weight_cost=w)
    one_f_one_b = simulate_kind("1f1b", p, 1, m, forward_cost=f, backward_cost=b + w)
    for rank in range(p):
        assert zb.idle(rank) == pytest.approx((p - 1) * (f + b - w))
        assert one_f_one_b.idle(rank) == pytest.approx((p - 1) * (f + b + w))
    if f == b == w:
        assert zb.bubble_fraction() == pytest.approx(one_f_one_b.bubble_fraction() / 3)
        assert zb.bubble_fraction() == pytest.approx((p - 1) / (3 * m))


def test_zero_bubble_h1_holds_p_micro_batches_on_every_rank():
    # ZB-H1 evens the in-flight count out at 1F1B's rank-0 peak (the paper's memory argument)
    for p, m in [(2, 8), (4, 8), (4, 2), (8, 16)]:
        assert simulate_kind("zero-bubble-h1", p, 1, m).peak_in_flight == [min(p, m)] * p


def test_interleaved_zero_bubble_bubble():
    # With rank r's W 2r backwards late, a rank idles at most (2p - 3) chunk-costs (what the
    # derivation that split batches at W units gave), against interleaved 1F1B's 3(p - 1), and
    # never less than ZB-H1's p - 1. Receives that move over W units into the batch before them
    # (`build_schedule`) let the peer's send complete while the W computes: p - 1 at p <= 4.
    for p, v, m in [(2, 2, 8), (4, 2, 8), (4, 3, 8), (8, 2, 16)]:
        for ahead in (False, True):
            bubble = simulate_kind("interleaved-zero-bubble", p, v, m, post_ahead=ahead)
            idle = bubble.bubble_fraction() * 3 * v * m  # in chunk-costs
            assert p - 1 - 1e-9 <= idle <= 2 * p - 3 + 1e-9, (p, v, m, idle)
            if p <= 4:
                assert idle == pytest.approx(p - 1)


def test_zero_bubble_h1_order_defers_each_w_by_the_rank():
    # hand-derived from the paper's rule for p = 4, rank 1 (warm-up of p - 1 - r = 2 forwards,
    # then 1F1B, each W one backward late, the last one at the end)
    order = " ".join(str(a) for a in compute_order("zero-bubble-h1", 4, 1, 6, 1))
    assert order == "F0 F1 F2 B0 F3 B1 W0 F4 B2 W1 F5 B3 W2 B4 W3 B5 W4 W5"
    first = " ".join(str(a) for a in compute_order("zero-bubble-h1", 4, 1, 3, 0))
    assert first == "F0 F1 F2 B0 W0 B1 W1 B2 W2"  # the first stage defers none
    last = " ".join(str(a) for a in compute_order("zero-bubble-h1", 4, 1, 3, 3))
    assert last == "F0 B0 F1 B1 F2 B2 W0 W1 W2"  # the last stage p - 1


def test_a_w_posts_nothing_and_the_b_send_goes_before_it():
    # a W never splits a batch: B1's receive moves over W0 into the batch before it
    text = format_schedule(build_schedule("zero-bubble-h1", 2, 1, 2, 0))
    assert text == "F0 [send-F0.0@1] F1 [recv-B0.0@1 send-F1.0@1] B0 [recv-B1.0@1] W0 B1 W1"
    text = format_schedule(build_schedule("zero-bubble-h1", 2, 1, 2, 1))
    assert text == "[recv-F0.0@0] F0 B0 [send-B0.0@0 recv-F1.0@0] F1 B1 [send-B1.0@0] W0 W1"


def test_post_ahead_moves_a_receive_over_a_unit_that_sends_nothing():
    # B1's receive moves over B0, which sends nothing on the first stage; B0's stays behind
    # F1, whose send would otherwise queue behind it
    text = format_schedule(build_schedule("1f1b", 2, 1, 2, 0, post_ahead=True))
    assert text == "F0 [send-F0.0@1] F1 [recv-B0.0@1 recv-B1.0@1 send-F1.0@1] B0 B1"
    text = format_schedule(build_schedule("zero-bubble-h1", 2, 1, 2, 0, post_ahead=True))
    # units F0, F1, B0, W0, B1, W1: B1's receive goes out before W0, which does not need it
    assert text == "F0 [send-F0.0@1] F1 [recv-B0.0@1 send-F1.0@1] B0 [recv-B1.0@1] W0 B1 W1"


ALL_KINDS = [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("zero-bubble-h1", 1),
             ("interleaved-zero-bubble", 2)]  # fmt: skip


@pytest.mark.parametrize("kind,v", ALL_KINDS)
def test_posting_ahead_is_never_slower(kind, v):
    # Receives move only over units that send nothing (what NCCL's rules allow without a peer
    # waiting for a send queued behind the receive): never slower, under either ordering, and
    # faster where a rank receives several units in a row (GPipe's first stage: its backward
    # gradients arrive while it runs the backwards before)
    for p, m in [(2, 16), (4, 8)]:
        for cost in (0.05, 0.2):
            for ordering in ("gloo", "nccl"):
                kw = {"comm_cost": cost, "ordering": ordering}
                late = simulate_kind(kind, p, v, m, **kw).makespan
                ahead = simulate_kind(kind, p, v, m, post_ahead=True, **kw).makespan
                assert ahead <= late + 1e-9, (p, m, cost, ordering)
    if kind == "gpipe":
        late = simulate_kind(kind, 2, 1, 16, comm_cost=0.2, ordering="nccl").makespan
        ahead = simulate_kind(kind, 2, 1, 16, comm_cost=0.2, ordering="nccl", post_ahead=True)
        assert ahead.makespan < late - 1


def test_a_w_before_its_b_is_caught():
    with pytest.raises(ScheduleError, match="W0 before its B"):
        simulate([[Compute("F", 0), Compute("W", 0), Compute("B", 0)]], 1)


def test_measured_costs_replay_per_rank_and_action():
    """1F1B, p=2, m=2, rank 1 twice as slow (F 2, B 4; rank 0 F 1, B 2), free transfers, by
    hand: rank 0 runs F0 [0,1] F1 [1,2]; rank 1 F0 [1,3] B0 [3,7] F1 [7,9] B1 [9,13]; rank 0
    B0 [7,9] and B1 [13,15]."""
    schedules = [build_schedule("1f1b", 2, 1, 2, r) for r in range(2)]
    sim = simulate(schedules, 2, compute_cost=lambda r, c: (1 if c.phase == "F" else 2) * (1 + r))
    assert sim.makespan == 15
    assert (sim.busy(0), sim.busy(1)) == (6, 12)
    assert [(i.start, i.end) for i in sim.intervals if i.rank == 0] == [
        (0, 1),
        (1, 2),
        (7, 9),
        (13, 15),
    ]


@pytest.mark.parametrize("kind,v", [("1f1b", 1), ("interleaved-1f1b", 2), ("zero-bubble-h1", 1)])
def test_replay_keys_durations_by_rank_and_compute(kind, v):
    """Durations that are the cost model's give the cost model's timeline; a missing one is
    named."""
    for ahead in (False, True):
        model = simulate_kind(kind, 2, v, 4, post_ahead=ahead)
        durations = {(i.rank, i.action): i.end - i.start for i in model.intervals}
        assert replay(kind, 2, v, 4, durations, post_ahead=ahead).makespan == model.makespan
    del durations[(1, Compute("F", 3, v - 1))]
    missing = "F3.1" if v > 1 else "F3"
    with pytest.raises(KeyError, match=f"no measured duration of {missing} on rank 1"):
        replay(kind, 2, v, 4, durations)
