"""--attention-dropout-rng: fused (SDPA's own dropout from the tensor-parallel RNG stream, the
default on CUDA) and layout-invariant (sample-keyed masks, the default on CPU).

Which path runs (`attention_path`), that the fused one hands SDPA a causal call with no mask
and allocates nothing [s, s] around it, that its values equal attention written out here, that
its dropout comes from the TP stream (reproducible, different per TP rank, p of the allowed
probabilities zeroed, the rest scaled by 1 / (1 - p)), and that layout-invariant still gives
the sample-keyed masks. The parity tests (test_parity_dropout) cover layout invariance.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from megapipe.arguments import parse_args
from megapipe.config import KernelConfig, ModelConfig, RecomputeConfig
from megapipe.errors import ConfigError
from megapipe.kernels.availability import triton_probe
from megapipe.kernels.softmax import masked_softmax_reference, masked_softmax_triton
from megapipe.model.attention import SelfAttention, explicit_attention
from megapipe.model.attention_backends import (
    FLASH_ATTN,
    LAYOUT_INVARIANT,
    NO_DROPOUT,
    SDPA,
    TP_STREAM,
    UNFUSED,
    AttentionPath,
    attention_dropout_rng,
    attention_path,
    check_attention_backend,
    describe_attention,
)
from megapipe.model.dropout import LogicalDropout
from megapipe.model.gpt import GPTModel
from megapipe.parallel.random import RNGTracker
from megapipe.parallel.state import ParallelState

P = 0.1
SEED = 5
S = 16
CONFIG = ModelConfig(
    num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, vocab_size=64,
    seq_length=S, max_position_embeddings=S, attention_dropout=P, hidden_dropout=0.0,
)  # fmt: skip
TRITON = triton_probe()


def _attention(rng: str, config: ModelConfig = CONFIG, seed: int = SEED, tp_rank: int = 0):
    torch.manual_seed(0)
    attn = SelfAttention(
        config,
        ParallelState.single().tp,
        RNGTracker(seed, tp_rank=tp_rank),
        output_init_std=0.02,
        sequence_parallel=False,
        layer_number=1,
        dropout_rng=rng,
    )
    return attn.train()


def _qkv(b: int, heads: int, groups: int, s: int, d: int, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, heads, s, d, generator=gen)
    return (
        q,
        torch.randn(b, groups, s, d, generator=gen),
        torch.randn(b, groups, s, d, generator=gen),
    )


def _written_out(q, k, v, mask=None):
    """softmax(q k^T / sqrt(d) + causal (or mask)) v, GQA by repeating k and v."""
    repeat = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(repeat, 1), v.repeat_interleave(repeat, 1)
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    s = q.shape[-2]
    allowed = torch.ones(s, s, dtype=torch.bool).tril() if mask is None else mask
    return torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1) @ v


def _keyed_masks(b: int = 2) -> LogicalDropout:
    return LogicalDropout(SEED, torch.arange(b) + 7)


def test_auto_is_fused_on_cuda_and_layout_invariant_on_cpu() -> None:
    assert attention_dropout_rng("auto", "cuda") == "fused"
    assert attention_dropout_rng("auto", "cpu") == "layout-invariant"
    assert attention_dropout_rng("fused", "cpu") == "fused"
    with pytest.raises(ConfigError, match="--attention-dropout-rng philox: choose from"):
        attention_dropout_rng("philox", "cuda")


@pytest.mark.parametrize(
    "backend, dropout, rng, keyed, flash, mask, expected",
    [
        ("auto", P, "fused", True, False, False, AttentionPath(SDPA, TP_STREAM)),
        ("auto", P, "fused", True, False, True, AttentionPath(SDPA, TP_STREAM)),
        ("flash", P, "fused", True, True, False, AttentionPath(FLASH_ATTN, TP_STREAM)),
        ("flash", P, "fused", True, True, True, AttentionPath(SDPA, TP_STREAM)),
        ("unfused", P, "fused", True, False, False, AttentionPath(UNFUSED, TP_STREAM)),
        ("auto", P, "layout-invariant", True, False, False,
         AttentionPath(UNFUSED, LAYOUT_INVARIANT)),
        ("auto", P, "layout-invariant", False, False, False, AttentionPath(SDPA, TP_STREAM)),
        ("auto", 0.0, "layout-invariant", True, False, False, AttentionPath(SDPA, NO_DROPOUT)),
    ],
)  # fmt: skip
def test_the_path_of_each_setting(backend, dropout, rng, keyed, flash, mask, expected) -> None:
    path = attention_path(backend, dropout=dropout, dropout_rng=rng, sample_keyed=keyed,
                          flash_attn_usable=flash, mask=mask)  # fmt: skip
    assert path == expected
    assert path.fused_dropout == (expected.kernel != UNFUSED and expected.dropout == TP_STREAM)


class _TorchCalls(TorchFunctionMode):
    """Every torch function megapipe's code calls (not what runs inside a kernel): its name,
    kwargs and output shapes."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, dict, list[tuple[int, ...]]]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outs = out if isinstance(out, (tuple, list)) else [out]
        shapes = [tuple(o.shape) for o in outs if isinstance(o, torch.Tensor)]
        self.calls.append((getattr(func, "__name__", str(func)), kwargs or {}, shapes))
        return out


class _AtenOutputs(TorchDispatchMode):
    """The output shapes of every aten op that runs, kernels included."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[str, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outs = out if isinstance(out, (tuple, list)) else [out]
        self.shapes += [(str(func), tuple(o.shape)) for o in outs if isinstance(o, torch.Tensor)]
        return out


def _square(shapes) -> list:
    return [shape for shape in shapes if len(shape) >= 2 and shape[-2:] == (S, S)]


def test_fused_mode_calls_sdpa_causal_with_its_dropout_and_builds_nothing_s_by_s(
    monkeypatch,
) -> None:
    x = torch.randn(S, 2, CONFIG.hidden_size)
    attn = _attention("fused")
    monkeypatch.setattr(LogicalDropout, "attention_keep_mask", None)  # must not be drawn
    with _TorchCalls() as mode:
        attn(x, None, dropout_masks=_keyed_masks())
    sdpa = [kw for name, kw, _ in mode.calls if name == "scaled_dot_product_attention"]
    assert len(sdpa) == 1
    assert sdpa[0]["attn_mask"] is None and sdpa[0]["is_causal"] and sdpa[0]["dropout_p"] == P
    assert _square(shapes for _, _, out in mode.calls for shapes in out) == []
    monkeypatch.undo()
    with _TorchCalls() as control:  # the recorder sees the layout-invariant path's [b, h, s, s]
        _attention("layout-invariant")(x, None, dropout_masks=_keyed_masks())
    assert _square(shapes for _, _, out in control.calls for shapes in out)


def test_causal_attention_allocates_nothing_s_by_s_down_to_the_kernels() -> None:
    """Every aten op of the forward, SDPA's kernel included, at dropout 0 (on CPU, SDPA has a
    fused kernel only without dropout; on CUDA flash and memory-efficient attention take
    dropout_p, as the test above hands it)."""
    x = torch.randn(S, 2, CONFIG.hidden_size)
    with _AtenOutputs() as mode:
        _attention("fused").eval()(x, None)
    assert any("scaled_dot_product" in op for op, _ in mode.shapes)
    assert _square(shape for _, shape in mode.shapes) == []


@pytest.mark.parametrize("rng, backend", [("fused", "auto"), ("fused", "unfused"),
                                          ("layout-invariant", "auto")])  # fmt: skip
@pytest.mark.parametrize("per_document", [False, True])
def test_each_path_at_dropout_0_equals_attention_written_out(rng, backend, per_document) -> None:
    attn = _attention(rng)
    attn.backend, attn.dropout = backend, 0.0
    q, k, v = _qkv(2, 4, 2, S, CONFIG.head_dim)
    mask = None
    if per_document:  # two documents of 8 tokens, causal within each
        doc = torch.arange(S) // 8
        mask = (doc[:, None] == doc[None, :]) & torch.ones(S, S, dtype=torch.bool).tril()
        mask = mask.expand(2, 1, S, S)
    out = attn.core(q, k, v, mask, causal=mask is None, dropout_masks=_keyed_masks())
    torch.testing.assert_close(out, _written_out(q, k, v, mask), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "softmax",
    [masked_softmax_reference,
     pytest.param(masked_softmax_triton,
                  marks=pytest.mark.skipif(not TRITON.available, reason=TRITON.reason))],
)  # fmt: skip
def test_the_unfused_path_takes_the_fused_softmaxs_causal_mode(softmax) -> None:
    masks = []

    def spy(scores, mask, scale):
        masks.append(mask)
        return softmax(scores, mask, scale)

    q, k, v = _qkv(2, 4, 2, S, 8)
    out = explicit_attention(q, k, v, None, 1 / math.sqrt(8), lambda p: p, softmax=spy)
    assert masks == [None]  # no [s, s] mask handed over: the kernel applies causality
    torch.testing.assert_close(out, _written_out(q, k, v), rtol=1e-5, atol=1e-6)


def test_fused_dropout_draws_from_the_tensor_parallel_stream() -> None:
    q, k, v = _qkv(2, 4, 2, S, CONFIG.head_dim)

    def run(tp_rank: int = 0, seed: int = SEED) -> torch.Tensor:
        attn = _attention("fused", seed=seed, tp_rank=tp_rank)
        return attn.core(q, k, v, None, causal=True, dropout_masks=_keyed_masks())

    default_stream = torch.get_rng_state()
    first = run()
    assert torch.equal(torch.get_rng_state(), default_stream)  # only the TP stream moved
    torch.rand(100)  # draws on the default stream do not change the mask
    assert torch.equal(run(), first)
    assert not torch.equal(run(tp_rank=1), first)  # another TP rank, other heads: another mask
    assert not torch.equal(run(seed=SEED + 1), first)
    tracker = RNGTracker(SEED)  # the very mask SDPA draws from the TP stream's seed
    torch.manual_seed(tracker.tensor_parallel_seed)
    expected = F.scaled_dot_product_attention(
        q, k, v, dropout_p=P, is_causal=True, scale=1 / math.sqrt(CONFIG.head_dim), enable_gqa=True
    )
    torch.set_rng_state(default_stream)
    torch.testing.assert_close(first, expected, rtol=0, atol=0)


def test_fused_dropout_zeroes_p_of_the_probabilities_and_scales_the_rest() -> None:
    """With v = I (head size = s) the output rows are the dropped probabilities themselves."""
    s = 32
    config = ModelConfig(num_layers=2, hidden_size=4 * s, num_attention_heads=4,
                         num_query_groups=2, vocab_size=64, seq_length=s,
                         max_position_embeddings=s, attention_dropout=P)  # fmt: skip
    attn = _attention("fused", config)
    b = 8
    q, k, _ = _qkv(b, 4, 2, s, s)
    v = torch.eye(s).expand(b, 2, s, s)
    dropped = attn.core(q, k, v, None, causal=True, dropout_masks=_keyed_masks(b))
    probs = _written_out(q, k, v)
    allowed = torch.ones(s, s, dtype=torch.bool).tril().expand_as(probs)
    assert torch.all(dropped[~allowed] == 0)
    kept = dropped[allowed] != 0
    n = kept.numel()
    zeroed = 1 - kept.float().mean().item()
    assert abs(zeroed - P) < 5 * math.sqrt(P * (1 - P) / n), (zeroed, n)
    torch.testing.assert_close(dropped[allowed][kept], probs[allowed][kept] / (1 - P))


def test_layout_invariant_mode_still_applies_the_sample_keyed_masks() -> None:
    q, k, v = _qkv(2, 4, 2, S, CONFIG.head_dim)
    masks = _keyed_masks()
    scale = 1 / math.sqrt(CONFIG.head_dim)
    expected = explicit_attention(q, k, v, None, scale, lambda p: masks.attention_probs(p, P, 1))
    for rng in ("layout-invariant", "auto"):  # auto is layout-invariant on CPU
        out = _attention(rng).core(q, k, v, None, causal=True, dropout_masks=masks)
        torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_recomputing_core_attention_replays_the_fused_dropout() -> None:
    """Selective recomputation of core_attn reruns SDPA with its dropout: the replayed TP
    stream must draw the same mask, so the gradients are those without recomputation."""
    tokens = torch.randint(64, (2, S), generator=torch.Generator().manual_seed(2))
    grads = {}
    for modules in ((), ("core_attn",)):
        recompute = RecomputeConfig("selective", None, None, modules) if modules else None
        model = GPTModel(CONFIG, ParallelState.single(), RNGTracker(SEED), seed=SEED,
                         recompute=recompute,
                         kernels=KernelConfig(attention_dropout_rng="fused"))  # fmt: skip
        loss = model.train()(tokens=tokens, labels=tokens, sample_ids=torch.arange(2)).mean()
        loss.backward()
        grads[modules] = loss.detach(), [p.grad for p in model.parameters()]
    (loss, plain), (recomputed_loss, recomputed) = grads.values()
    assert torch.equal(loss, recomputed_loss)
    assert all(torch.equal(a, b) for a, b in zip(plain, recomputed, strict=True))


ARGV = [
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
    "--seq-length", "16", "--mock-data", "--vocab-size", "100", "--micro-batch-size", "2",
    "--global-batch-size", "4", "--train-iters", "1", "--lr", "3e-3",
]  # fmt: skip


def test_the_flag_reaches_the_kernel_config() -> None:
    assert parse_args(ARGV, 1).kernels.attention_dropout_rng == "auto"
    for value in ("fused", "layout-invariant"):
        flags = ARGV + ["--attention-dropout-rng", value]
        assert parse_args(flags, 1).kernels.attention_dropout_rng == value


def test_forced_backends_take_fused_dropout_where_the_kernel_can() -> None:
    cpu, f32 = torch.device("cpu"), torch.float32
    state = torch.get_rng_state()
    with pytest.raises(ConfigError, match="use --attention-dropout-rng fused"):
        check_attention_backend("flash", cpu, f32, attention_dropout=P, reset_attention_mask=False,
                                dropout_rng="layout-invariant")  # fmt: skip
    with pytest.raises(ConfigError, match="not available on cpu with torch.float32 with attention"):
        check_attention_backend("flash", cpu, f32, attention_dropout=P,
                                reset_attention_mask=False, dropout_rng="fused")  # fmt: skip
    check_attention_backend("flash", cpu, f32, attention_dropout=0.0, reset_attention_mask=False,
                            dropout_rng="fused")  # fmt: skip
    assert torch.equal(torch.get_rng_state(), state)  # the probe draws from a forked stream


def test_the_start_up_line_names_the_kernel_and_the_dropout() -> None:
    def line(device: str, rng: str = "auto", **kw) -> str:
        kw = {"attention_dropout": P, "reset_attention_mask": False} | kw
        return describe_attention("auto", rng, torch.device(device), torch.bfloat16, **kw)

    assert line("cuda", softmax="triton") == (
        "attention: sdpa, causal in the kernel (is_causal), dropout 0.1 fused in the kernel "
        "from the tensor-parallel RNG stream (--attention-backend auto, --attention-dropout-rng "
        "auto -> fused)"
    )
    assert line("cpu") == (
        "attention: unfused softmax(QK^T)V (masked_softmax=reference), causal mask [s, s], "
        "dropout 0.1 from layout-invariant [heads, s, s] masks (--attention-backend auto, "
        "--attention-dropout-rng auto -> layout-invariant)"
    )
    assert line("cuda", "layout-invariant", softmax="triton").startswith(
        "attention: unfused softmax(QK^T)V (masked_softmax=triton), causal in the kernel, "
    )
    assert "dropout 0.1 in SDPA's math path (no fused dropout on CPU)" in line("cpu", "fused")
    assert line("cuda", reset_attention_mask=True, attention_dropout=0.0) == (
        "attention: sdpa, per-document mask [b, 1, s, s], no dropout (--attention-backend "
        "auto, --attention-dropout-rng auto)"
    )
