"""Compare a parallel model with the single-rank reference, shard by shard.

Every parallel layout must reproduce the single-rank model to fp32 rounding. These helpers
measure how far a rank's parameters, gradients or outputs are from the matching slice of the
reference, so the TP and PP parity tests share one definition of "the same".
"""

from __future__ import annotations

import torch

from megapipe.layers.param_meta import shard_of


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected|: scale-free, dominated by the worst entry."""
    actual, expected = actual.detach().double(), expected.detach().double()
    if actual.shape != expected.shape:
        raise ValueError(f"shape {tuple(actual.shape)} != reference {tuple(expected.shape)}")
    if expected.numel() == 0:  # e.g. a TP shard holding only vocabulary padding
        return 0.0
    scale = expected.abs().max().clamp(min=1e-30)
    return float((actual - expected).abs().max() / scale)


def shard_errors(
    parallel: torch.nn.Module,
    reference: torch.nn.Module,
    tp_rank: int,
    tp_size: int,
    *,
    grads: bool,
) -> dict[str, float]:
    """Per-parameter relative error of this rank's shard (or its gradient) vs the reference.

    Parameters are matched by global name; a mirrored parameter (ParamMeta.copy_of, the last
    stage's tied embedding) is matched with the parameter it mirrors. Vocabulary-padded tensors
    are compared on the real vocabulary's rows (the padding depends on the TP size).
    """
    ref = dict(reference.named_parameters())
    errors = {}
    for name, param in parallel.named_parameters():
        meta = param.meta
        ref_param = ref[meta.copy_of or name]
        ref_value = ref_param.grad if grads else ref_param
        value = param.grad if grads else param
        if value is None or ref_value is None:
            raise AssertionError(f"{name}: missing {'gradient' if grads else 'value'}")
        if meta.init_rows is not None:  # vocabulary rows: padding differs between layouts
            rows = value.shape[0]
            start = tp_rank * rows
            valid = max(0, min(rows, meta.init_rows - start))
            errors[name] = relative_error(value[:valid], ref_value[start : start + valid])
        else:
            errors[name] = relative_error(value, shard_of(ref_value, meta, tp_rank, tp_size))
    return errors
