"""The elementwise fused ops: each Triton kernel (forward and every input's gradient) against
its plain-torch reference, and each reference against an independent formula.

The Triton kernels run under Triton's CPU interpreter (TRITON_INTERPRET=1, set by conftest.py
before Triton is imported), fp32, on small shapes cut into small blocks so that every op has
partial tiles at the row and column edges. The interpreter is slow: keep shapes tiny.

Errors are printed as max |got - want| and the max of |got - want| / (|want| + rms(want)), the
relative error the tolerance bounds; run with -s to see them.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megapipe.kernels import bias_dropout_add, bias_gelu, rotary, swiglu
from megapipe.kernels.availability import triton_probe
from megapipe.model.dropout import LogicalDropout
from megapipe.model.rotary import RotaryEmbedding
from megapipe.model.transformer_layer import bias_dropout_add as model_bias_dropout_add

TRITON = triton_probe()
needs_triton = pytest.mark.skipif(not TRITON.available, reason=TRITON.reason)
FP32_TOL = 1e-6  # relative to the largest reference value


def compare(what: str, got: torch.Tensor, want: torch.Tensor, tol: float = FP32_TOL) -> None:
    """Assert |got - want| <= tol * (|want| + rms(want)) elementwise (relative, with the
    tensor's rms as the floor near zero); print the max abs and relative error either way."""
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, want.shape)
    assert torch.isfinite(got).all(), f"{what}: non-finite values"
    got, want = got.double(), want.double()
    error = (got - want).abs()
    floor = want.square().mean().sqrt().item() or 1.0
    relative = (error / (want.abs() + floor)).max().item()
    print(f"{what}: max error {error.max().item():.3e}, relative {relative:.3e}")
    assert relative <= tol, f"{what}: relative error {relative:.3e} > {tol}"


def outputs_and_grads(fn, inputs: list[torch.Tensor | None], dtype=torch.float32):
    """fn(*inputs) and the gradients of every tensor input for one fixed random cotangent."""
    leaves = [t.detach().to(dtype).requires_grad_() if t is not None else None for t in inputs]
    out = fn(*leaves)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    wanted = [t for t in leaves if t is not None]
    return [out.detach(), *torch.autograd.grad(out, wanted, g)]


def compare_with_reference(name, fused, reference, inputs, tol: float = FP32_TOL) -> None:
    """fused vs reference in fp32 (within tol) and vs the reference in float64 (within 1e-6:
    the kernel's own fp32 error), forward and every input's gradient."""
    names = ["forward"] + [f"grad[{i}]" for i, t in enumerate(inputs) if t is not None]
    got = outputs_and_grads(fused, inputs)
    want = outputs_and_grads(reference, inputs)
    exact = outputs_and_grads(reference, inputs, torch.float64)
    for what, a, b, c in zip(names, got, want, exact):
        compare(f"{name} {what}", a, b, tol)
        compare(f"{name} {what} vs float64", a.double(), c, FP32_TOL)


def randn(*shape: int, seed: int, scale: float = 1.0, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype) * scale


# (shape, block): partial tiles on both axes, and one default-tiled shape in a single tile
SHAPES = [((3, 5, 19), (4, 16)), ((2, 40), None)]


@needs_triton
@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize(("shape", "block"), SHAPES)
def test_bias_gelu_triton_matches_reference(approximate, with_bias, shape, block) -> None:
    x = randn(*shape, seed=0, scale=3.0)
    x.view(-1)[:3] = torch.tensor([-12.0, 12.0, 0.0])  # exp overflow and the exact zero
    bias = randn(shape[-1], seed=1) if with_bias else None
    fused = lambda x, b: bias_gelu.bias_gelu_triton(x, b, approximate, block=block)
    reference = lambda x, b: bias_gelu.bias_gelu_reference(x, b, approximate)
    # torch's own fp32 tanh-GeLU backward is 1.3e-6 (relative) from float64 where 1 - tanh^2
    # cancels (x near -5), which the kernel avoids: its bound is vs float64
    tol = 2e-6 if approximate == "tanh" else FP32_TOL
    compare_with_reference(f"bias_gelu[{approximate}]", fused, reference, [x, bias], tol)


@needs_triton
@pytest.mark.parametrize("mask", ["bool", "uint8", None])
@pytest.mark.parametrize(("shape", "block"), SHAPES)
def test_bias_dropout_add_triton_matches_reference(mask, shape, block) -> None:
    x, residual, bias = randn(*shape, seed=0), randn(*shape, seed=1), randn(shape[-1], seed=2)
    keep = torch.rand(shape, generator=torch.Generator().manual_seed(3)) >= 0.3
    keep = {"bool": keep, "uint8": keep.to(torch.uint8), None: None}[mask]
    scale = 1.0 / (1.0 - 0.3)
    fused = lambda x, b, r: bias_dropout_add.bias_dropout_add_triton(
        x, b, r, keep, scale, block=block
    )
    reference = lambda x, b, r: bias_dropout_add.bias_dropout_add_reference(x, b, r, keep, scale)
    compare_with_reference(f"bias_dropout_add[{mask}]", fused, reference, [x, bias, residual])


@needs_triton
def test_bias_dropout_add_triton_without_bias() -> None:
    x, residual = randn(3, 2, 7, seed=0), randn(3, 2, 7, seed=1)
    keep = torch.rand(3, 2, 7, generator=torch.Generator().manual_seed(3)) >= 0.5
    fused = lambda x, r: bias_dropout_add.bias_dropout_add_triton(
        x, None, r, keep, 2.0, block=(2, 4)
    )
    reference = lambda x, r: bias_dropout_add.bias_dropout_add_reference(x, None, r, keep, 2.0)
    compare_with_reference("bias_dropout_add[no bias]", fused, reference, [x, residual])


@needs_triton
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize(("shape", "block"), [((3, 5, 26), (4, 8)), ((2, 40), None)])
def test_swiglu_triton_matches_reference(with_bias, shape, block) -> None:
    h = randn(*shape, seed=0, scale=2.0)
    h.view(-1)[:2] = torch.tensor([-100.0, 100.0])  # sigmoid's exp overflow, both sides
    bias = randn(shape[-1], seed=1) if with_bias else None
    fused = lambda h, b: swiglu.swiglu_triton(h, b, block=block)
    compare_with_reference("swiglu", fused, swiglu.swiglu_reference, [h, bias])


@needs_triton
@pytest.mark.parametrize(("offset", "d", "block"), [(0, 12, (8, 4)), (3, 12, None), (0, 10, None)])
def test_rotary_triton_matches_reference(offset, d, block) -> None:
    table = RotaryEmbedding(d, max_positions=16)
    x = randn(5, 2, 3, d, seed=0)
    fused = lambda x: rotary.rotary_triton(x, table.cos, table.sin, offset, block=block)
    reference = lambda x: rotary.rotary_reference(x, table.cos, table.sin, offset)
    compare_with_reference(f"rotary[offset={offset}, d={d}]", fused, reference, [x])


@pytest.mark.slow
@needs_triton
def test_kernels_compile_for_a_hopper_gpu_without_one(tmp_path) -> None:
    """The interpreter never lowers a kernel; kernels_compile_check.py does, to sm_90 cubins."""
    pytest.importorskip("triton.backends.nvidia", reason="Triton without its CUDA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path), TRITON_DEFAULT_FP_FUSION="1")
    script = Path(__file__).with_name("kernels_compile_check.py")
    run = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stdout + run.stderr[-4000:]
    assert run.stdout.count("sm_90 cubin") == 7, run.stdout


# ---- the references against independent formulas (float64) and the model's own paths ----


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_bias_gelu_reference_is_gelu(approximate) -> None:
    x, bias = (
        randn(4, 6, seed=0, scale=3.0, dtype=torch.float64),
        randn(6, seed=1, dtype=torch.float64),
    )
    u = x + bias
    if approximate == "none":
        want = 0.5 * u * (1.0 + torch.special.erf(u / math.sqrt(2.0)))
    else:
        want = 0.5 * u * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (u + 0.044715 * u**3)))
    compare("bias_gelu reference", bias_gelu.bias_gelu_reference(x, bias, approximate), want, 1e-15)
    check = lambda x, b: bias_gelu.bias_gelu_reference(x, b, approximate)
    assert torch.autograd.gradcheck(check, (x.requires_grad_(), bias.requires_grad_()))


def test_bias_dropout_add_reference_is_the_models_dropout_path() -> None:
    p, shape = 0.25, (6, 2, 8)  # [s, b, h]
    x, residual, bias = randn(*shape, seed=0), randn(*shape, seed=1), randn(8, seed=2)
    dropout = LogicalDropout(seed=7, sample_ids=torch.tensor([3, 11]))
    drop = lambda t: dropout.hidden(t, p=p, layer=2, site="mlp_output")
    want = model_bias_dropout_add(x, bias, residual, p, training=True, drop=drop)
    keep = dropout.hidden_keep_mask(shape, p, 2, "mlp_output", x.device)
    got = bias_dropout_add.bias_dropout_add_reference(x, bias, residual, keep, 1.0 / (1.0 - p))
    assert torch.equal(got, want)
    x64, r64, b64 = x.double(), residual.double(), bias.double()
    formula = r64 + torch.where(keep, (x64 + b64) / (1.0 - p), 0.0)
    compare("bias_dropout_add vs formula", got.double(), formula, 1e-7)
    args = (x64.requires_grad_(), b64.requires_grad_(), r64.requires_grad_())
    check = lambda x, b, r: bias_dropout_add.bias_dropout_add_reference(x, b, r, keep, 1 / (1 - p))
    assert torch.autograd.gradcheck(check, args)
    no_dropout = bias_dropout_add.bias_dropout_add_reference(x, bias, residual)
    assert torch.equal(no_dropout, model_bias_dropout_add(x, bias, residual, p, training=False))


def test_swiglu_reference_is_silu_gate_times_up() -> None:
    h, bias = randn(3, 4, 10, seed=0, dtype=torch.float64), randn(10, seed=1, dtype=torch.float64)
    gate, up = (h + bias)[..., :5], (h + bias)[..., 5:]
    want = gate / (1.0 + torch.exp(-gate)) * up
    compare("swiglu reference", swiglu.swiglu_reference(h, bias), want, 1e-15)
    args = (h.requires_grad_(), bias.requires_grad_())
    assert torch.autograd.gradcheck(swiglu.swiglu_reference, args)


@pytest.mark.parametrize("offset", [0, 4])
def test_rotary_reference_is_the_complex_rotation_and_the_models(offset) -> None:
    d, base = 8, 10000
    table = RotaryEmbedding(d, max_positions=16, base=base)
    x = randn(5, 2, 3, d, seed=0)
    got = rotary.rotary_reference(x, table.cos, table.sin, offset)
    assert torch.equal(got, table(x, offset))  # the model's own rotary
    half = d // 2
    angles = torch.tensor(
        [[p * base ** (-2 * i / d) for i in range(half)] for p in range(offset, offset + 5)],
        dtype=torch.float64,
    )
    turned = (
        torch.complex(x[..., :half].double(), x[..., half:].double())
        * torch.polar(torch.ones_like(angles), angles)[:, None, None, :]
    )
    compare(
        "rotary vs complex rotation", got.double(), torch.cat([turned.real, turned.imag], -1), 1e-6
    )
    x64 = x.double().requires_grad_()
    cos, sin = table.cos.double(), table.sin.double()
    assert torch.autograd.gradcheck(lambda t: rotary.rotary_reference(t, cos, sin, offset), (x64,))


def test_bad_inputs_are_named() -> None:
    x = torch.zeros(2, 4)
    with pytest.raises(ValueError, match="approximate"):
        bias_gelu.bias_gelu_reference(x, None, "erf")
    with pytest.raises(ValueError, match="bias"):
        bias_gelu.bias_gelu_reference(x, torch.zeros(3))
    with pytest.raises(ValueError, match="keep mask"):
        bias_dropout_add.bias_dropout_add_reference(x, None, x, torch.ones(2, 4), 2.0)
    with pytest.raises(ValueError, match="even"):
        swiglu.swiglu_reference(torch.zeros(2, 5))
    table = RotaryEmbedding(4, max_positions=4)
    with pytest.raises(ValueError, match="outside"):
        rotary.rotary_reference(torch.zeros(3, 1, 1, 4), table.cos, table.sin, offset=2)
