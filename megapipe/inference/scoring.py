"""How likely the model finds a sequence: the log-probability of each token given those before.

What Megatron's server returns as `logprobs`: for tokens t_0..t_{n-1}, the n-1 values
log p(t_i | t_0..t_{i-1}) for i >= 1, from the model's own distribution (no temperature or
top-k / top-p: those shape sampling, not the model). One full forward per sequence, so memory
is one sequence's logits at a time.
"""

from __future__ import annotations

import torch

from megapipe.inference.generation import full_logits
from megapipe.inference.loading import InferenceModel


def token_logprobs(m: InferenceModel, sequence: list[int]) -> list[float]:
    """log p(token i | tokens before it) for i = 1..len-1 (collective over the job)."""
    if len(sequence) < 2:
        return []
    tokens = torch.tensor([sequence], device=m.state.device)
    logits = full_logits(m, tokens)[0, :-1]  # [n-1, vocab] fp32, on every rank
    chosen = tokens[0, 1:].unsqueeze(-1)
    return torch.log_softmax(logits, dim=-1).gather(-1, chosen).squeeze(-1).tolist()
