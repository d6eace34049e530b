"""A linear weight's gradient GEMM, accumulated into its fp32 `main_grad`.

main_grad [out, in] += grad_output [n, out]^T @ input [n, in], with main_grad the grad buffer's
fp32 view and the two factors in the parameters' dtype. Which path runs (`weight_grad_path`):

| path            | where                                  | what                                  |
|-----------------|----------------------------------------|---------------------------------------|
| "addmm"         | factors in main_grad's dtype (fp32     | main_grad.addmm_(dy^T, x): the model's|
|                 | models), any device                    | own dtype, the numbers as always      |
| "apex"          | bf16/fp16 on CUDA, apex's              | wgrad_gemm_accum_fp32: one cuBLAS GEMM|
|                 | fused_weight_gradient_mlp_cuda imports | in the half dtype accumulating in fp32|
|                 |                                        | straight into main_grad (beta = 1)    |
| "mm_out_dtype"  | bf16/fp16 on CUDA without apex         | torch.mm(dy^T, x, out_dtype=float32): |
|                 |                                        | the same half GEMM, fp32 output, then |
|                 |                                        | added (one fp32 [out, in] temporary)  |
| "half_mm"       | bf16/fp16 on CPU (aten::mm.dtype has no| dy^T @ x in the half dtype, added into|
|                 | CPU kernel in torch 2.13), or a torch  | main_grad: Megatron's path without    |
|                 | without mm.dtype                       | --gradient-accumulation-fusion        |

Why not widen the factors and run an fp32 GEMM (what the layers did first): on an H100 an fp32
GEMM runs at ~1/15 of the bf16 tensor-core rate (NVIDIA's H100 SXM datasheet: 67 TFLOP/s fp32
against 989 dense bf16; not measured here), weight gradients are a third of a step's GEMM
FLOPs, and widening copies both factors to fp32 for every linear and micro-batch. On every half
path the sum over micro-batches (and over layers sharing a weight) is in fp32, in main_grad;
"half_mm" also rounds each micro-batch's product to the half dtype once (2^-9 relative, bf16).

apex is probed at run time, once, on the first half-precision CUDA call, and never required
(kernels/availability.py's rules: any import failure means "not usable"). TransformerEngine's
GEMM is not called here: its layers (model/te_layers.py) compute their own weight gradients,
and its raw GEMM entry point changed between releases (`gemm`, then `general_gemm`), while
torch's mm.dtype gives the same half-precision GEMM on any CUDA build.
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType

import torch

from megapipe.kernels.availability import Probe, _import_error

APEX_MODULE = "fused_weight_gradient_mlp_cuda"  # built by apex with --cuda_ext


def apex_weight_grad_probe() -> Probe:
    """Can apex's fused weight-gradient accumulation (wgrad_gemm_accum_fp32) run here?"""
    if not torch.cuda.is_available():
        return Probe(False, "apex's fused weight-gradient GEMM needs a CUDA device")
    error = _import_error(APEX_MODULE)
    if error is not None:
        return Probe(False, error)
    if not hasattr(importlib.import_module(APEX_MODULE), "wgrad_gemm_accum_fp32"):
        return Probe(False, f"{APEX_MODULE} has no wgrad_gemm_accum_fp32 (an old apex?)")
    return Probe(True, f"apex {APEX_MODULE}")


@functools.cache
def _apex() -> ModuleType | None:
    """apex's extension if it can run, probed on first use (a CUDA half-precision GEMM)."""
    return importlib.import_module(APEX_MODULE) if apex_weight_grad_probe().available else None


def _has_mm_out_dtype() -> bool:
    return "dtype" in torch.ops.aten.mm.overloads()


def weight_grad_path(
    main_grad: torch.Tensor, grad_output: torch.Tensor, inputs: torch.Tensor
) -> str:
    """Which of the table's paths `accumulate_weight_grad` takes for these tensors."""
    if grad_output.dtype == inputs.dtype == main_grad.dtype:
        return "addmm"
    half = (torch.bfloat16, torch.float16)
    if grad_output.dtype != inputs.dtype or grad_output.dtype not in half:
        return "addmm"  # mixed factors (not seen in training): widened, as before
    if main_grad.is_cuda and main_grad.dtype == torch.float32:
        if _apex() is not None:
            return "apex"
        if _has_mm_out_dtype():
            return "mm_out_dtype"
    return "half_mm"


def accumulate_weight_grad(
    main_grad: torch.Tensor, grad_output: torch.Tensor, inputs: torch.Tensor
) -> None:
    """main_grad += grad_output^T @ inputs (grad_output [n, out], inputs [n, in]), the GEMM in
    the factors' dtype and the sum in main_grad's (see the module docstring for the paths)."""
    path = weight_grad_path(main_grad, grad_output, inputs)
    if path == "addmm":
        main_grad.addmm_(grad_output.t().to(main_grad.dtype), inputs.to(main_grad.dtype))
    elif path == "apex":
        _apex().wgrad_gemm_accum_fp32(inputs.contiguous(), grad_output.contiguous(), main_grad)
    elif path == "mm_out_dtype":
        main_grad.add_(torch.mm(grad_output.t(), inputs, out_dtype=torch.float32))
    else:
        main_grad.add_(grad_output.t().mm(inputs))
