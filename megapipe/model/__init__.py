"""The stage-aware GPT model and its parts."""

from megapipe.model.gpt import GPTModel
from megapipe.model.initialization import initialize_parameters

__all__ = ["GPTModel", "initialize_parameters"]
