"""megapipe: Megatron-style 3D-parallel GPT training in plain PyTorch, with a real CPU mode."""

from megapipe.config import ConfigError, ModelConfig, ParallelConfig, TrainingConfig

__version__ = "0.1.0"
__all__ = ["ConfigError", "ModelConfig", "ParallelConfig", "TrainingConfig", "__version__"]
