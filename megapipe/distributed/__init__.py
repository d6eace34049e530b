"""Data-parallel gradients and the optimizer: buffers and buckets, the sharded mixed-precision
optimizer, the fp16 loss scaler, gradient finalisation across TP/PP/DP and the global norm."""

from megapipe.distributed.finalize_grads import finalize_model_grads
from megapipe.distributed.grad_buffer import GradBuffer
from megapipe.distributed.grad_norm import global_grad_norm
from megapipe.distributed.loss_scaler import make_loss_scaler
from megapipe.distributed.optimizer import ShardedOptimizer

__all__ = [
    "GradBuffer",
    "ShardedOptimizer",
    "finalize_model_grads",
    "global_grad_norm",
    "make_loss_scaler",
]
