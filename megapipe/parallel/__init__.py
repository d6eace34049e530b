"""Process groups, autograd collectives and random streams for tensor/pipeline/data parallelism."""

from megapipe.parallel.initialize import initialize_distributed
from megapipe.parallel.random import RNGTracker
from megapipe.parallel.state import Group, ParallelState, rank_layout

__all__ = ["Group", "ParallelState", "RNGTracker", "initialize_distributed", "rank_layout"]
