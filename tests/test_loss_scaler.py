"""Loss scaling with Megatron's rules, stepped by hand, and the one-collective overflow check."""

from __future__ import annotations

import io

import pytest
import torch

from megapipe.distributed import loss_scaler as ls
from megapipe.distributed.loss_scaler import (
    ConstantLossScaler,
    DynamicLossScaler,
    found_inf_or_nan,
    make_loss_scaler,
)
from megapipe.errors import ConfigError
from megapipe.testing import run_distributed

INF, NAN = float("inf"), float("nan")


def run(scaler: DynamicLossScaler, flags: str) -> list[float]:
    """Feed a sequence of iterations ('x' = overflow, '.' = clean); the scale after each."""
    scales = []
    for c in flags:
        scaler.update(c == "x")
        scales.append(scaler.scale)
    return scales


def test_megatron_defaults():
    s = DynamicLossScaler()
    assert s.scale == 2.0**32 and isinstance(s.scale, float)
    assert (s.min_scale, s.growth_interval, s.hysteresis) == (1.0, 1000, 2)
    assert (s.growth_factor, s.backoff_factor) == (2.0, 0.5)
    assert s.inv_scale == 2.0**-32


def test_forced_overflow_sequence_step_by_step():
    s = DynamicLossScaler(initial_scale=1024.0, growth_interval=3, hysteresis=2)
    got = run(s, "xxx...x.x...")
    expected = [
        1024,  # 1st overflow: hysteresis 2 -> 1, no back-off
        512,  # 2nd overflow: hysteresis used up -> back off
        256,  # still no hysteresis left: every overflow backs off
        256,  # clean 1
        256,  # clean 2
        512,  # clean 3 = window: double, hysteresis restored to 2
        512,  # overflow absorbed by hysteresis again
        512,  # clean (does NOT restore hysteresis; only growth does, as in Megatron)
        256,  # overflow two steps after the last: hysteresis exhausted -> back off
        256,  # clean 1
        256,  # clean 2
        512,  # clean 3: growth
    ]
    assert got == expected


def test_overflow_restarts_the_growth_window():
    s = DynamicLossScaler(initial_scale=64.0, growth_interval=3, hysteresis=5)
    got = run(s, "..x..." + "..")
    # 2 clean, overflow (absorbed by hysteresis) resets the count: growth only 3 cleans later
    assert got == [64, 64, 64, 64, 64, 128, 128, 128]


def test_hysteresis_one_backs_off_on_every_overflow():
    s = DynamicLossScaler(initial_scale=2.0**20, hysteresis=1)
    assert run(s, "xxx") == [2.0**19, 2.0**18, 2.0**17]


def test_growth_after_exactly_the_default_window():
    s = DynamicLossScaler(initial_scale=2.0**16)
    scales = run(s, "." * 2000)
    assert scales[998] == 2.0**16  # 999 clean steps
    assert scales[999] == 2.0**17  # the 1000th doubles
    assert scales[1998] == 2.0**17 and scales[1999] == 2.0**18


def test_min_scale_floor():
    s = DynamicLossScaler(initial_scale=16.0, min_scale=2.0, hysteresis=1)
    assert run(s, "xxxxx") == [8, 4, 2, 2, 2]
    odd = DynamicLossScaler(initial_scale=16.0, min_scale=3.0, hysteresis=1)
    assert run(odd, "xxx...") == [8, 4, 3, 3, 3, 3]
    assert run(DynamicLossScaler(initial_scale=1.0, growth_interval=2), "xxxx..") == [1] * 5 + [2]


def test_scale_is_held_in_float32_like_megatron():
    s = DynamicLossScaler(initial_scale=1e11, min_scale=1.0, hysteresis=1)
    f32 = torch.tensor(1e11, dtype=torch.float32).item()
    assert f32 != 1e11 and s.scale == f32
    assert s.inv_scale == torch.tensor(1 / f32, dtype=torch.float32).item()
    s.update(True)
    assert s.scale == f32 / 2


def test_state_dict_round_trip_resumes_identically():
    a = DynamicLossScaler(initial_scale=2.0**20, growth_interval=4, hysteresis=3)
    run(a, "x..x.xx..")  # mid-window, hysteresis partly used, scale backed off
    sd = a.state_dict()
    assert set(sd) == {"scale", "growth_tracker", "hysteresis_tracker"}  # Megatron's keys
    assert sd["scale"].dtype == torch.float32 and sd["scale"].shape == (1,)
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    b = DynamicLossScaler(initial_scale=2.0**20, growth_interval=4, hysteresis=3)
    b.load_state_dict(torch.load(buf, weights_only=True))
    assert b.scale == a.scale == 2.0**18  # 3 overflows used the hysteresis, the 4th backs off
    tail = "..x.x....xxx...."
    assert run(b, tail) == run(a, tail)


def test_state_dict_restores_trackers_not_just_the_scale():
    a = DynamicLossScaler(initial_scale=256.0, growth_interval=3, hysteresis=2)
    run(a, "x..")  # hysteresis 1 left, 2 clean steps into the window
    b = DynamicLossScaler(initial_scale=1.0, growth_interval=3, hysteresis=2)
    b.load_state_dict(a.state_dict())
    assert run(b, ".") == [512.0]  # third clean step: growth
    c = DynamicLossScaler(initial_scale=1.0, growth_interval=3, hysteresis=2)
    c.load_state_dict(a.state_dict())
    assert run(c, "x") == [128.0]  # the one hysteresis left was used before saving
    d = DynamicLossScaler(initial_scale=1.0, growth_interval=3, hysteresis=2)
    d.load_state_dict({"scale": 8.0, "growth_tracker": 0, "hysteresis_tracker": 2})
    assert d.scale == 8.0  # a plain float is accepted too


def test_constant_scaler():
    s = ConstantLossScaler(128.0)
    for flag in (True, True, True, False):
        s.update(flag)
    assert s.scale == 128.0 and s.inv_scale == 1 / 128
    assert s.state_dict() == {}
    s.load_state_dict({})
    assert s.scale == 128.0


def test_make_loss_scaler_follows_megatron_precedence():
    assert make_loss_scaler(fp16=False) is None
    const = make_loss_scaler(fp16=True, loss_scale=4096.0)
    assert isinstance(const, ConstantLossScaler) and const.scale == 4096.0
    assert isinstance(make_loss_scaler(fp16=False, loss_scale=8.0), ConstantLossScaler)
    dyn = make_loss_scaler(
        fp16=True, initial_loss_scale=2.0**10, min_loss_scale=4.0, loss_scale_window=7, hysteresis=3
    )
    assert isinstance(dyn, DynamicLossScaler)
    assert (dyn.scale, dyn.min_scale, dyn.growth_interval, dyn.hysteresis) == (1024, 4, 7, 3)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"initial_scale": 0.0}, r"--initial-loss-scale must be positive, got 0.0"),
        ({"min_scale": -1.0}, r"--min-loss-scale must be positive, got -1.0"),
        (
            {"initial_scale": 4.0, "min_scale": 8.0},
            r"--min-loss-scale \(8.0\) must not exceed --initial-loss-scale \(4.0\)",
        ),
        ({"growth_interval": 0}, r"--loss-scale-window must be positive, got 0"),
        ({"hysteresis": 0}, r"--hysteresis must be positive, got 0"),
        ({"growth_factor": 1.0}, r"growth factor must exceed 1"),
        ({"backoff_factor": 1.0}, r"backoff factor must be in \(0, 1\)"),
    ],
)
def test_bad_settings_raise_config_errors(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        DynamicLossScaler(**kwargs)


def test_bad_constant_scale():
    with pytest.raises(ConfigError, match=r"--loss-scale must be positive, got -2.0"):
        ConstantLossScaler(-2.0)


# --- overflow detection -------------------------------------------------------------------


def grads(*values: list[float], dtype=torch.float32) -> list[torch.Tensor]:
    return [torch.tensor(v, dtype=dtype) for v in values]


def test_finite_grads_are_not_an_overflow():
    gs = grads([1.0, -2.0], [3.0], [[0.0, 1e30]])
    assert found_inf_or_nan(gs, None) is False
    assert found_inf_or_nan([], None) is False
    assert found_inf_or_nan([torch.zeros(0), torch.ones(0, 3)], None) is False


@pytest.mark.parametrize("bad", [INF, -INF, NAN])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_any_non_finite_entry_is_found(bad, dtype):
    gs = grads([1.0, 2.0], [3.0, 4.0, 5.0], dtype=dtype)
    gs[1][2] = bad
    before = [g.clone() for g in gs]
    assert found_inf_or_nan(gs, None) is True
    for g, b in zip(gs, before):
        torch.testing.assert_close(g, b, equal_nan=True)  # the check does not touch the grads


def test_mixed_dtypes_and_a_nan_in_a_later_group():
    gs = grads([1.0], dtype=torch.float16) + grads([2.0]) + grads([NAN], dtype=torch.bfloat16)
    assert found_inf_or_nan(gs, None) is True
    assert found_inf_or_nan(gs[:2], None) is False


def test_large_finite_fp16_grads_are_not_an_overflow():
    # Their L2 norm (and any sum of squares) overflows fp16; each entry does not.
    gs = [torch.full((1024,), 60000.0, dtype=torch.float16) for _ in range(4)]
    assert torch.linalg.vector_norm(gs[0]).isinf()  # the trap an L2-norm check would fall into
    assert found_inf_or_nan(gs, None) is False


def test_scaler_with_overflow_check_skips_and_backs_off():
    """The optimizer's loop: unscale, check, update the scale, step only when clean."""
    scaler = DynamicLossScaler(initial_scale=2.0**15, hysteresis=1)
    w = torch.zeros(1)
    skipped = 0
    for true_grad in (1.0, 4.0, 1.0):  # 4 x 2**15 overflows fp16 (max 65504)
        fp16_grad = (torch.tensor([true_grad]) * scaler.scale).to(torch.float16)
        main_grad = fp16_grad.float() * scaler.inv_scale
        overflow = found_inf_or_nan([main_grad], None)
        scaler.update(overflow)
        if overflow:
            skipped += 1
            continue
        w -= main_grad
    assert skipped == 1 and scaler.scale == 2.0**14
    assert w.item() == -2.0  # both clean steps applied the true gradient, the bad one nothing


def _check_on_ranks(rank: int, world_size: int, case: str) -> tuple[bool, int]:
    import torch.distributed as dist

    calls = []
    real = ls.dist.all_reduce

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    ls.dist.all_reduce = counting
    gs = [torch.ones(5), torch.ones(3, dtype=torch.float16), torch.ones(2, 2)]
    if case == "inf_on_1" and rank == 1:
        gs[2][1, 0] = INF
    if case == "nan_on_0" and rank == 0:
        gs[1][0] = NAN
    if case == "empty_on_1" and rank == 1:
        gs = []
    if case == "empty_on_1" and rank == 0:
        gs[0][4] = -INF
    group = dist.new_group([0, 1])
    found = found_inf_or_nan(gs, group)
    return found, len(calls)


@pytest.mark.parametrize(
    "case,expected",
    [("inf_on_1", True), ("nan_on_0", True), ("clean", False), ("empty_on_1", True)],
)
def test_every_rank_agrees_after_one_all_reduce(case, expected):
    results = run_distributed(_check_on_ranks, 2, case)
    for rank, (found, n_calls) in enumerate(results):
        assert found is expected, (rank, case)
        assert n_calls == 1, f"rank {rank} made {n_calls} all-reduces, want exactly one"
