"""Choosing the next token from logits: greedy, or temperature / top-k / top-p sampling.

Megatron's order: divide by the temperature, keep the top-k logits, then keep the smallest set
of tokens whose probability reaches top-p (the most likely token always stays), and draw from
what is left with a seeded generator, so a run with the same --seed writes the same text.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingOptions:
    """greedy ignores the rest; top_k 0 and top_p 0.0 mean "no such filter"."""

    greedy: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 0.0

    def problems(self) -> list[str]:
        """What is out of range, as `--flag value: why` lines (empty when all is well)."""
        found = []
        if not self.temperature > 0:
            found.append(f"--temperature {self.temperature}: must be > 0")
        if self.top_k < 0:
            found.append(f"--top-k {self.top_k}: must be >= 0")
        if not 0.0 <= self.top_p <= 1.0:
            found.append(f"--top-p {self.top_p}: must be in [0, 1]")
        if self.top_k > 0 and self.top_p > 0:
            found.append("--top-k and --top-p: give one of them, as Megatron asks")
        return found


def filtered_logits(logits: torch.Tensor, options: SamplingOptions) -> torch.Tensor:
    """fp32 logits [b, vocab] after temperature, top-k and top-p (removed tokens at -inf)."""
    logits = logits.float() / options.temperature
    if options.top_k > 0:
        k = min(options.top_k, logits.shape[-1])
        kth = torch.topk(logits, k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if options.top_p > 0:
        ordered, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(ordered, dim=-1)
        drop_sorted = probs.cumsum(dim=-1) - probs > options.top_p  # mass before it passed p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample(
    logits: torch.Tensor, options: SamplingOptions, generator: torch.Generator | None = None
) -> torch.Tensor:
    """The next token [b] (int64) for logits [b, vocab] (only real vocabulary ids)."""
    if options.greedy:
        return logits.argmax(dim=-1)
    probs = torch.softmax(filtered_logits(logits, options), dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
