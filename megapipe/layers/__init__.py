"""Tensor-parallel building blocks: linear layers, vocabulary-parallel embedding and loss."""

from megapipe.layers.cross_entropy import masked_mean, vocab_parallel_cross_entropy
from megapipe.layers.embedding import VocabParallelEmbedding, vocab_range
from megapipe.layers.linear import ColumnParallelLinear, RowParallelLinear
from megapipe.layers.linear_function import tensor_parallel_linear
from megapipe.layers.norms import LayerNorm, RMSNorm, build_norm
from megapipe.layers.param_meta import ParamMeta, make_param, shard_of
from megapipe.layers.weight_grad import WeightGradStore

__all__ = [
    "ColumnParallelLinear",
    "LayerNorm",
    "ParamMeta",
    "RMSNorm",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "WeightGradStore",
    "build_norm",
    "make_param",
    "masked_mean",
    "shard_of",
    "tensor_parallel_linear",
    "vocab_parallel_cross_entropy",
    "vocab_range",
]
