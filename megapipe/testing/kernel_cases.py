"""The inputs each fused op is measured and tested on: one `Case` per op, building that op's
positional arguments at given sizes (benchmarks/bench_kernels.py times them;
tests/test_kernels_cuda.py checks every implementation against an fp64 reference on them).

Add a case beside the others for a new op. Tensors that want gradients have requires_grad;
sizes that are not multiples of the kernels' block sizes exercise partial tiles.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from megapipe.model.rotary import RotaryEmbedding
from megapipe.parallel.state import Group


@dataclass(frozen=True)
class Sizes:
    """The model sizes the inputs are cut from: tokens = seq x micro_batch."""

    tokens: int
    hidden: int
    ffn: int
    heads: int
    micro_batch: int

    @property
    def seq(self) -> int:
        return self.tokens // self.micro_batch


# CPU sizes: tiny and deliberately not powers of two (partial tiles).
CPU_SIZES = Sizes(tokens=24, hidden=40, ffn=72, heads=2, micro_batch=2)


@dataclass(frozen=True)
class Inputs:
    """The op's positional arguments (tensors that want gradients have requires_grad) and
    the shape shown in the table."""

    args: tuple
    shape: str


@dataclass(frozen=True)
class Case:
    """One op: its name in dispatch's table and how to build its inputs."""

    op: str
    make: Callable[[Sizes, torch.dtype, torch.device, torch.Generator], Inputs]


def _randn(shape, dtype, device, gen, *, grad=True, scale=1.0) -> torch.Tensor:
    t = (torch.randn(shape, generator=gen, device=device) * scale).to(dtype)
    return t.requires_grad_(grad)


def _bias_gelu(sizes, dtype, device, gen) -> Inputs:
    x = _randn((sizes.tokens, sizes.ffn), dtype, device, gen, scale=2.0)
    return Inputs(
        (x, _randn((sizes.ffn,), dtype, device, gen), "none"), f"{sizes.tokens}x{sizes.ffn}"
    )


def _bias_dropout_add(sizes, dtype, device, gen) -> Inputs:
    shape = (sizes.seq, sizes.micro_batch, sizes.hidden)
    keep = torch.rand(shape, generator=gen, device=device) >= 0.1
    x, residual = _randn(shape, dtype, device, gen), _randn(shape, dtype, device, gen)
    bias = _randn((sizes.hidden,), dtype, device, gen)
    return Inputs((x, bias, residual, keep, 1.0 / 0.9), "x".join(map(str, shape)))


def _swiglu(sizes, dtype, device, gen) -> Inputs:
    h = _randn((sizes.tokens, 2 * sizes.ffn), dtype, device, gen, scale=2.0)
    return Inputs((h, None), f"{sizes.tokens}x{2 * sizes.ffn}")


def _rotary(sizes, dtype, device, gen) -> Inputs:
    head_dim = sizes.hidden // sizes.heads
    table = RotaryEmbedding(head_dim, max_positions=sizes.seq).to(device)
    x = _randn((sizes.seq, sizes.micro_batch, sizes.heads, head_dim), dtype, device, gen)
    return Inputs((x, table.cos, table.sin, 0), "x".join(map(str, x.shape)))


def _norm_inputs(sizes, dtype, device, gen, *, bias: bool) -> Inputs:
    x = _randn((sizes.seq, sizes.micro_batch, sizes.hidden), dtype, device, gen, scale=2.0)
    weight = (1 + 0.1 * torch.randn(sizes.hidden, generator=gen, device=device)).to(dtype)
    params = (weight.requires_grad_(),)
    if bias:
        params += (_randn((sizes.hidden,), dtype, device, gen, scale=0.1),)
    return Inputs((x, *params, 1e-5), "x".join(map(str, x.shape)))


def _layer_norm(sizes, dtype, device, gen) -> Inputs:
    return _norm_inputs(sizes, dtype, device, gen, bias=True)


def _rms_norm(sizes, dtype, device, gen) -> Inputs:
    return _norm_inputs(sizes, dtype, device, gen, bias=False)


def _attention_scores(sizes, dtype, device, gen) -> torch.Tensor:
    shape = (sizes.micro_batch, sizes.heads, sizes.seq, sizes.seq)
    return _randn(shape, dtype, device, gen, scale=3.0)


def _causal_softmax(sizes, dtype, device, gen) -> Inputs:
    scores = _attention_scores(sizes, dtype, device, gen)
    return Inputs((scores, None, 0.125), "x".join(map(str, scores.shape)) + " causal")


def _masked_softmax(sizes, dtype, device, gen) -> Inputs:
    """Causal within documents of a quarter of the sequence (--reset-attention-mask)."""
    scores = _attention_scores(sizes, dtype, device, gen)
    document = torch.arange(sizes.seq, device=device) * 4 // sizes.seq
    causal = torch.ones(sizes.seq, sizes.seq, dtype=torch.bool, device=device).tril()
    mask = (causal & (document[:, None] == document[None, :])).expand(sizes.micro_batch, 1, -1, -1)
    return Inputs((scores, mask, 0.125), "x".join(map(str, scores.shape)) + " mask")


VOCAB = {"cuda": (50257, 50304), "cpu": (77, 80)}  # (real vocabulary, padded logits)


def _cross_entropy(sizes, dtype, device, gen) -> Inputs:
    vocab, padded = VOCAB[device.type]
    logits = _randn((sizes.seq, sizes.micro_batch, padded), dtype, device, gen, scale=2.0)
    target = torch.randint(0, vocab, (sizes.seq, sizes.micro_batch), generator=gen, device=device)
    return Inputs((logits, target, Group.single(), 0, vocab), "x".join(map(str, logits.shape)))


# The ops, in dispatch's table order (masked_softmax twice: causal, and a per-document mask).
CASES = [
    Case("bias_gelu", _bias_gelu),
    Case("bias_dropout_add", _bias_dropout_add),
    Case("swiglu", _swiglu),
    Case("rotary", _rotary),
    Case("layer_norm", _layer_norm),
    Case("rms_norm", _rms_norm),
    Case("masked_softmax", _causal_softmax),
    Case("masked_softmax", _masked_softmax),
    Case("cross_entropy", _cross_entropy),
]


def leaves(inputs: Inputs) -> list[torch.Tensor]:
    """The input tensors that want gradients."""
    return [a for a in inputs.args if isinstance(a, torch.Tensor) and a.requires_grad]


def as_dtype(inputs: Inputs, dtype: torch.dtype | None) -> Inputs:
    """The same inputs with every floating tensor cast to `dtype` (fp64 for a reference run;
    None: each keeps its dtype), as new leaves with the same requires_grad; integer and bool
    tensors are shared."""
    args = []
    for a in inputs.args:
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            a = a.detach().to(dtype or a.dtype, copy=True).requires_grad_(a.requires_grad)
        args.append(a)
    return Inputs(tuple(args), inputs.shape)


def forward_backward(fn: Callable, inputs: Inputs, grad: torch.Tensor) -> list[torch.Tensor]:
    """The output and every input gradient of one forward + backward of `fn`."""
    for leaf in leaves(inputs):
        leaf.grad = None
    out = fn(*inputs.args)
    out.backward(grad.to(out.dtype))
    return [out.detach()] + [leaf.grad.clone() for leaf in leaves(inputs)]


def max_error(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    """The largest over tensors of max |got - want| / max |want|."""
    worst = 0.0
    for a, b in zip(got, want, strict=True):
        scale = b.double().abs().max().item() or 1.0
        error = (a.double() - b.double()).abs().max().item()
        worst = max(worst, error / scale if torch.isfinite(a).all() else float("inf"))
    return worst
