"""Pipeline parallelism: schedules as data, their simulator and executor, and `Pipe`, the
pipeline as a library for any nn.Sequential (`from megapipe.pipeline import Pipe`)."""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    # Lazy, so that importing megapipe.pipeline.schedules does not import the executor and
    # the model behind it.
    if name == "Pipe":
        from megapipe.pipeline.pipe import Pipe

        return Pipe
    raise AttributeError(f"module 'megapipe.pipeline' has no attribute {name!r}")
