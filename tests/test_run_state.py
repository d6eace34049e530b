"""Random states survive a checkpoint: what python, numpy, torch and the TP stream draw after a
restore is what they drew after the save."""

from __future__ import annotations

import random

import numpy as np
import torch

from megapipe.checkpointing.run_state import restore_rng, rng_shards
from megapipe.parallel.random import RNGTracker
from megapipe.parallel.state import ParallelState


def _draws(tracker: RNGTracker) -> tuple:
    with tracker.fork():
        tp = torch.rand(3).tolist()
    return (
        random.random(),
        random.gauss(0, 1),
        np.random.rand(2).tolist(),
        torch.rand(2).tolist(),
        tp,
    )


def test_every_random_stream_continues_after_a_restore() -> None:
    state = ParallelState.single()
    tracker = RNGTracker(7)
    random.seed(3)
    random.gauss(0, 1)  # leaves a cached gaussian in python's state
    np.random.seed(5)
    saved = {k: v[0].tensor.clone() for k, v in rng_shards(tracker, state).items()}
    expected = _draws(tracker)
    _draws(tracker)  # move every stream on
    restore_rng(saved, tracker, state.rank)
    assert _draws(tracker) == expected
