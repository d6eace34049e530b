"""The LR schedule against Megatron's formulas, written out here independently of the module."""

from __future__ import annotations

import math

import pytest

from megapipe.errors import ConfigError
from megapipe.training.lr_schedule import LRSchedule, resolve_schedule

MAX, MIN = 3e-4, 3e-5
W, D = 10, 110  # warmup and decay iterations: 100 decay iterations after warmup


def make(style: str, **kw) -> LRSchedule:
    kw = {"max_lr": MAX, "min_lr": MIN, "warmup_iters": W, "decay_iters": D, **kw}
    return LRSchedule(decay_style=style, **kw)


# Expected values, one closed form per style (iteration units, global batch 1).
def warm(i: float) -> float:
    return MAX * i / W


def linear(i: float) -> float:
    return MIN + (MAX - MIN) * (1 - (i - W) / (D - W))


def cosine(i: float) -> float:
    return MIN + (MAX - MIN) * (1 + math.cos(math.pi * (i - W) / (D - W))) / 2


def inv_sqrt(i: float) -> float:
    return max(MIN, MAX * math.sqrt(W) / math.sqrt(i))


WSD_ANNEAL = 20  # last 20 of the 110 iterations
WSD_SHAPES = {
    "linear": lambda r: 1 - r,
    "cosine": lambda r: (1 + math.cos(math.pi * r)) / 2,
    "exponential": lambda r: 2 * 0.5**r - 1,
    "minus_sqrt": lambda r: 1 - r**0.5,
}


def wsd(shape: str, i: float) -> float:
    start = D - WSD_ANNEAL
    if i <= start:
        return MAX
    return MIN + (MAX - MIN) * WSD_SHAPES[shape]((i - start) / WSD_ANNEAL)


CLOSED_FORMS = {"linear": linear, "cosine": cosine, "inverse-square-root": inv_sqrt}


@pytest.mark.parametrize("style", ["constant", "linear", "cosine", "inverse-square-root", "WSD"])
def test_warmup_is_linear_from_zero_and_reaches_max_at_its_last_iteration(style):
    s = make(style, wsd_decay_iters=WSD_ANNEAL)
    assert s.lr_at(0) == 0.0
    for i in range(1, W + 1):
        assert s.lr_at(i) == pytest.approx(warm(i), rel=1e-12)
    assert s.lr_at(W) == MAX
    assert s.lr_at(W // 2) == pytest.approx(MAX / 2, rel=1e-12)


def test_last_warmup_iteration_is_still_warmup():
    # Megatron's warmup covers step <= warmup and evaluates max_lr * step / warmup left to right;
    # the decay branch would give min + (max - min) * 1.0. These values tell the two apart in the
    # last bit, so this pins the boundary (and Megatron's rounding) exactly.
    hi, lo, w = 0.029, 0.006, 5
    warmup_value, decay_value = hi * w / w, lo + (hi - lo) * 1.0
    assert warmup_value != decay_value
    for style in ("linear", "cosine"):
        s = LRSchedule(max_lr=hi, min_lr=lo, warmup_iters=w, decay_iters=50, decay_style=style)
        assert s.lr_at(w) == warmup_value
        assert s.lr_at(w + 1) < decay_value


@pytest.mark.parametrize("style", sorted(CLOSED_FORMS))
def test_decay_styles_follow_their_formula_at_every_iteration(style):
    s = make(style)
    for i in range(W + 1, D + 1):
        assert s.lr_at(i) == pytest.approx(CLOSED_FORMS[style](i), rel=1e-12), i


def test_key_points_of_linear_and_cosine():
    for style in ("linear", "cosine"):
        s = make(style)
        assert s.lr_at(W + (D - W) // 2) == pytest.approx((MAX + MIN) / 2, rel=1e-12)
        assert s.lr_at(D) == pytest.approx(MIN, rel=1e-12)
    # cosine stays above linear in the first half of the decay (flat start), below in the second
    lin, cos = make("linear"), make("cosine")
    assert cos.lr_at(W + 25) > lin.lr_at(W + 25)
    assert cos.lr_at(W + 75) < lin.lr_at(W + 75)


@pytest.mark.parametrize("style", ["linear", "cosine", "inverse-square-root", "WSD"])
def test_min_lr_after_decay_iters(style):
    s = make(style, wsd_decay_iters=WSD_ANNEAL)
    for i in (D + 1, D + 7, 10 * D):
        assert s.lr_at(i) == MIN


def test_constant_stays_at_max_lr_even_after_decay_iters():
    s = make("constant")
    assert [s.lr_at(i) for i in (W, W + 1, D, D + 1, 10 * D)] == [MAX] * 5


def test_inverse_square_root_values():
    s = make("inverse-square-root", min_lr=0.0)
    assert s.lr_at(4 * W) == pytest.approx(MAX / 2, rel=1e-12)
    assert s.lr_at(9 * W) == pytest.approx(MAX / 3, rel=1e-12)
    # floored at min_lr before decay_iters
    floored = make("inverse-square-root", min_lr=MAX / 2, decay_iters=1000)
    assert floored.lr_at(900) == MAX / 2


def test_inverse_square_root_without_warmup_counts_samples_as_megatron():
    # Megatron steps in samples and clamps max(warmup, 1) / max(step, 1): with no warmup the
    # global batch size shows. Expected: lr * sqrt(1) / sqrt(iteration * global_batch).
    s = LRSchedule(max_lr=1.0, decay_iters=100, decay_style="inverse-square-root")
    s8 = LRSchedule(
        max_lr=1.0, decay_iters=100, decay_style="inverse-square-root", global_batch_size=8
    )
    assert s.lr_at(0) == 1.0 and s8.lr_at(0) == 1.0
    assert s.lr_at(4) == pytest.approx(0.5, rel=1e-12)
    assert s8.lr_at(1) == pytest.approx(1 / math.sqrt(8), rel=1e-12)
    assert s8.lr_at(2) == pytest.approx(0.25, rel=1e-12)
    # with warmup the batch size cancels
    w1 = make("inverse-square-root", min_lr=0.0)
    w8 = make("inverse-square-root", min_lr=0.0, global_batch_size=8)
    for i in (0, 3, W, W + 1, 40, D):
        assert w8.lr_at(i) == pytest.approx(w1.lr_at(i), rel=1e-12)


@pytest.mark.parametrize("shape", sorted(WSD_SHAPES))
def test_wsd_is_stable_then_anneals_with_the_chosen_shape(shape):
    s = make("WSD", wsd_decay_iters=WSD_ANNEAL, wsd_decay_style=shape)
    for i in range(W, D + 1):
        assert s.lr_at(i) == pytest.approx(wsd(shape, i), rel=1e-12, abs=1e-18), i
    assert s.lr_at(D - WSD_ANNEAL) == MAX
    assert s.lr_at(D) == pytest.approx(MIN, rel=1e-12)


def test_wsd_midpoints_by_hand():
    mid = D - WSD_ANNEAL // 2
    expect = {
        "linear": 0.5,
        "cosine": 0.5,
        "exponential": math.sqrt(2) - 1,
        "minus_sqrt": 1 - math.sqrt(0.5),
    }
    for shape, coeff in expect.items():
        s = make("WSD", wsd_decay_iters=WSD_ANNEAL, wsd_decay_style=shape)
        assert s.lr_at(mid) == pytest.approx(MIN + coeff * (MAX - MIN), rel=1e-12), shape


def test_wsd_default_shape_is_exponential():
    s = make("WSD", wsd_decay_iters=WSD_ANNEAL)
    assert s.lr_at(D - 5) == pytest.approx(wsd("exponential", D - 5), rel=1e-12)


@pytest.mark.parametrize(
    "style,extra",
    [
        ("linear", {}),
        ("cosine", {}),
        ("inverse-square-root", {}),
        *[("WSD", {"wsd_decay_iters": WSD_ANNEAL, "wsd_decay_style": s}) for s in WSD_SHAPES],
    ],
)
def test_monotone_up_in_warmup_and_down_after(style, extra):
    s = make(style, **extra)
    lrs = [s.lr_at(i) for i in range(0, 2 * D)]
    assert all(a < b for a, b in zip(lrs[:W], lrs[1 : W + 1])), "warmup must strictly increase"
    tail = lrs[W:]
    assert all(a >= b for a, b in zip(tail, tail[1:])), "after warmup it must never increase"
    assert max(lrs) == MAX and min(lrs[W:]) >= MIN


def test_no_warmup_starts_at_max_lr():
    for style in ("constant", "linear", "cosine"):
        s = make(style, warmup_iters=0)
        assert s.lr_at(0) == pytest.approx(MAX, rel=1e-15)
        assert s.lr_at(1) <= s.lr_at(0)


def test_warmup_init_lr():
    s = make("linear", warmup_init_lr=1e-4)
    assert s.lr_at(0) == 1e-4
    assert s.lr_at(W // 2) == pytest.approx(1e-4 + (MAX - 1e-4) / 2, rel=1e-12)
    assert s.lr_at(W) == pytest.approx(MAX, rel=1e-15)  # init + (max - init) * 1.0, rounded


def test_global_batch_size_cancels_for_ratio_styles():
    for style in ("constant", "linear", "cosine"):
        a, b = make(style), make(style, global_batch_size=16)
        for i in (0, 1, W, W + 1, 60, D, D + 1):
            assert b.lr_at(i) == pytest.approx(a.lr_at(i), rel=1e-12)


def test_negative_iteration_is_rejected():
    with pytest.raises(ValueError, match="negative"):
        make("linear").lr_at(-1)


# --- resolve_schedule: Megatron's flag semantics -------------------------------------------


def test_decay_iters_default_to_train_iters():
    s = resolve_schedule(lr=1.0, train_iters=50, lr_warmup_iters=5)
    assert (s.decay_iters, s.warmup_iters, s.decay_style) == (50, 5, "linear")
    assert resolve_schedule(lr=1.0, train_iters=50, lr_decay_iters=40).decay_iters == 40


def test_warmup_fraction_is_a_fraction_of_decay_iters_and_may_be_fractional():
    s = resolve_schedule(lr=2.0, train_iters=500, lr_decay_iters=150, lr_warmup_fraction=0.01)
    assert s.warmup_iters == pytest.approx(1.5)
    assert s.lr_at(1) == pytest.approx(2.0 / 1.5, rel=1e-12)  # still warming up
    assert s.lr_at(2) == pytest.approx(2.0 * (1 - 0.5 / 148.5), rel=1e-12)  # linear decay


def test_resolve_passes_every_setting_through():
    s = resolve_schedule(
        lr=1e-3,
        min_lr=1e-5,
        train_iters=1000,
        lr_decay_iters=800,
        lr_warmup_iters=None,
        lr_decay_style="WSD",
        lr_wsd_decay_iters=100,
        lr_wsd_decay_style="cosine",
        lr_warmup_init=1e-6,
        global_batch_size=32,
    )
    assert s == LRSchedule(
        max_lr=1e-3,
        decay_iters=800,
        min_lr=1e-5,
        warmup_iters=0,
        decay_style="WSD",
        wsd_decay_iters=100,
        wsd_decay_style="cosine",
        warmup_init_lr=1e-6,
        global_batch_size=32,
    )


BAD = [
    (
        {"lr_warmup_iters": 10, "lr_warmup_fraction": 0.1},
        r"--lr-warmup-iters \(10\) and --lr-warmup-fraction \(0.1\), not both",
    ),
    ({"lr_warmup_iters": 100}, r"--lr-warmup-iters \(100\) must be less than --lr-decay-iters"),
    ({"lr_warmup_iters": 150}, r"--lr-warmup-iters \(150\).*\(100\)"),
    (
        {"lr_warmup_iters": 40, "lr_decay_iters": 30},
        r"--lr-warmup-iters \(40\) must be less than --lr-decay-iters \(30\)$",
    ),
    ({"lr_warmup_iters": -1}, r"--lr-warmup-iters must not be negative, got -1"),
    ({"lr_warmup_fraction": 1.0}, r"--lr-warmup-fraction must be in \[0, 1\), got 1.0"),
    ({"lr_warmup_fraction": -0.1}, r"--lr-warmup-fraction must be in \[0, 1\), got -0.1"),
    ({"min_lr": 2e-3}, r"--min-lr \(0.002\) must not exceed --lr \(0.001\)"),
    ({"min_lr": -1e-5}, r"--min-lr must not be negative, got -1e-05"),
    ({"lr": -1e-3, "min_lr": 0.0}, r"--lr must not be negative, got -0.001"),
    ({"lr": None}, r"--lr is required"),
    ({"lr_decay_style": "exp"}, r"--lr-decay-style 'exp' is not one of constant, linear, cosine"),
    ({"lr_decay_style": "wsd"}, r"--lr-decay-style 'wsd' is not one of"),
    (
        {"lr_decay_style": "WSD", "lr_wsd_decay_iters": 10, "lr_wsd_decay_style": "sqrt"},
        r"--lr-wsd-decay-style 'sqrt' is not one of exponential, linear, cosine, minus_sqrt",
    ),
    ({"lr_decay_style": "WSD"}, r"--lr-decay-style WSD needs --lr-wsd-decay-iters"),
    (
        {"lr_decay_style": "WSD", "lr_wsd_decay_iters": -5},
        r"--lr-wsd-decay-iters must not be negative, got -5",
    ),
    (
        {"lr_decay_style": "WSD", "lr_wsd_decay_iters": 95, "lr_warmup_iters": 10},
        r"--lr-wsd-decay-iters \(95\) must not exceed --lr-decay-iters \(100\) minus the warmup",
    ),
    ({"lr_decay_iters": 0}, r"--lr-decay-iters must be positive, got 0"),
    ({"lr_decay_iters": None, "train_iters": None}, r"--lr-decay-iters or --train-iters"),
    (
        {"lr_decay_iters": None, "train_iters": 0},
        r"defaults to --train-iters, which must be positive, got 0",
    ),
    ({"lr_warmup_init": 0.01}, r"--lr-warmup-init \(0.01\) must be in \[0, --lr \(0.001\)\]"),
    ({"global_batch_size": 0}, r"--global-batch-size must be positive, got 0"),
]


@pytest.mark.parametrize("overrides,message", BAD)
def test_bad_flags_raise_one_line_config_errors(overrides, message):
    kwargs = {"lr": 1e-3, "min_lr": 1e-5, "train_iters": 1000, "lr_decay_iters": 100, **overrides}
    with pytest.raises(ConfigError, match=message) as err:
        resolve_schedule(**kwargs)
    assert "\n" not in str(err.value)


def test_warmup_error_names_train_iters_when_decay_iters_defaulted():
    with pytest.raises(ConfigError, match=r"\(20\).*\(20\), which defaults to --train-iters"):
        resolve_schedule(lr=1.0, train_iters=20, lr_warmup_iters=20)


def test_megatron_default_warmup_iters_zero_is_not_a_second_warmup_flag():
    s = resolve_schedule(lr=1.0, train_iters=100, lr_warmup_iters=0, lr_warmup_fraction=0.2)
    assert s.warmup_iters == pytest.approx(20)


def test_direct_construction_is_validated_too():
    with pytest.raises(ConfigError, match="--lr-decay-style 'step'"):
        LRSchedule(max_lr=1.0, decay_iters=10, decay_style="step")
    with pytest.raises(ConfigError, match=r"--lr-warmup-iters \(10\) must be less than"):
        LRSchedule(max_lr=1.0, decay_iters=10, warmup_iters=10)
