"""Gradient finalisation across TP/DP, the global gradient norm (optimizers come later)."""

from megapipe.distributed.finalize_grads import finalize_model_grads
from megapipe.distributed.grad_norm import global_grad_norm

__all__ = ["finalize_model_grads", "global_grad_norm"]
