"""megapipe: Megatron-style 3D-parallel GPT training in plain PyTorch, with a real CPU mode.

Exports are imported lazily, so the data tools (which never need torch) start fast.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"
__all__ = ["ConfigError", "ModelConfig", "ParallelConfig", "TrainingConfig", "__version__"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("megapipe.config"), name)
    raise AttributeError(f"module 'megapipe' has no attribute {name!r}")
