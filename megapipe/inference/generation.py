"""Generating tokens with a KV cache, over tensor and pipeline parallel ranks.

Megatron's batching: a batch of prompts of different lengths runs from the shortest prompt's
end, one position per step, every sequence at the same position. Where a sequence still has
prompt tokens, its prompt token is kept instead of the sampled one, so no padding or mask is
ever needed and each sequence gets exactly what it would get alone.

With the cache, the first step (prefill) runs the shortest prompt whole and every later step
runs the one new position; without it, every step runs the whole prefix again (the reference
the cache is measured and tested against). Each step passes one activation [s, b, h] from
stage to stage; the last stage gathers the vocabulary-parallel logits of the last position,
samples, and sends the chosen tokens back to every stage. Every rank of the job calls the
same functions with the same prompts and options (collective).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megapipe.errors import MegapipeError
from megapipe.inference.loading import InferenceModel
from megapipe.inference.sampling import SamplingOptions, sample
from megapipe.model.kv_cache import KVCache
from megapipe.parallel.mappings import all_gather_along

GREEDY = SamplingOptions(greedy=True)


class GenerationError(MegapipeError, ValueError):
    """A prompt or request generation cannot serve; the message names it."""


@dataclass(frozen=True)
class Generation:
    """One prompt's continuation: the new token ids (the EOD included when it ended there)."""

    tokens: list[int]
    stopped_at_eod: bool


def _stage_forward(m: InferenceModel, tokens: torch.Tensor, cache: KVCache | None):
    """This rank's stage on `tokens` [b, s]; the last stage returns its logits [s, b, V/tp]."""
    state, (b, s) = m.state, tokens.shape
    hidden = None
    if not state.is_first_stage:
        hidden = torch.empty((s, b, m.config.hidden_size), dtype=m.dtype, device=state.device)
        dist.recv(hidden, src=state.pp.ranks[state.pp.rank - 1], group=state.pp.pg)
    first = tokens if state.is_first_stage else None
    out = m.model(tokens=first, hidden_states=hidden, kv_cache=cache)
    if not state.is_last_stage:
        dist.send(out.contiguous(), dst=state.pp.ranks[state.pp.rank + 1], group=state.pp.pg)
        return None
    return out


def _full_vocab(m: InferenceModel, logits: torch.Tensor) -> torch.Tensor:
    """[..., V/tp] vocabulary-parallel logits -> [..., vocab_size] fp32 (padding ids cut)."""
    if m.state.tp.size > 1:
        logits = all_gather_along(logits, -1, m.state.tp)
    return logits[..., : m.config.vocab_size].float()


def _from_last_stage(m: InferenceModel, tensor: torch.Tensor) -> torch.Tensor:
    """The last stage's `tensor` on every stage (the same shape and dtype on all ranks)."""
    state = m.state
    if state.pp.size > 1:
        dist.broadcast(tensor, src=state.pp.ranks[-1], group=state.pp.pg)
    return tensor


def full_logits(m: InferenceModel, tokens: torch.Tensor) -> torch.Tensor:
    """Logits [b, s, vocab_size] (fp32) of `tokens` [b, s] on every rank, with no cache."""
    b, s = tokens.shape
    with torch.no_grad():
        out = _stage_forward(m, tokens.to(m.state.device), None)
        logits = torch.empty((b, s, m.config.vocab_size), device=m.state.device)
        if out is not None:
            logits = _full_vocab(m, out).transpose(0, 1).contiguous()
        return _from_last_stage(m, logits)


def check_prompts(m: InferenceModel, prompts: list[list[int]], max_new_tokens: int) -> None:
    """GenerationError naming the first prompt that is empty, holds an id outside the
    vocabulary, or does not fit the model's context with `max_new_tokens` more."""
    if not prompts:
        raise GenerationError("no prompts given")
    if max_new_tokens < 0:
        raise GenerationError(f"--max-new-tokens {max_new_tokens}: must be >= 0")
    vocab, context = m.config.vocab_size, m.context_length
    for i, prompt in enumerate(prompts):
        if not prompt:
            raise GenerationError(f"prompt {i} is empty: it needs at least one token")
        bad = next((t for t in prompt if not 0 <= t < vocab), None)
        if bad is not None:
            raise GenerationError(
                f"prompt {i}: token id {bad} is outside the model's vocabulary 0..{vocab - 1}"
            )
        if len(prompt) + max_new_tokens > context:
            raise GenerationError(
                f"prompt {i}: {len(prompt)} tokens + --max-new-tokens {max_new_tokens} exceed "
                f"the model's context of {context} positions"
            )


def generate(
    m: InferenceModel,
    prompts: list[list[int]],
    max_new_tokens: int,
    options: SamplingOptions = GREEDY,
    *,
    eod: int | None = None,
    seed: int = 1234,
    use_cache: bool = True,
) -> list[Generation]:
    """Continue each prompt by up to `max_new_tokens` tokens, stopping a sequence at `eod`."""
    check_prompts(m, prompts, max_new_tokens)
    if max_new_tokens == 0:
        return [Generation([], False) for _ in prompts]
    state, device = m.state, m.state.device
    lengths = torch.tensor([len(p) for p in prompts], device=device)
    ends = lengths + max_new_tokens  # each sequence's last position + 1
    total = int(ends.max())
    tokens = torch.zeros((len(prompts), total), dtype=torch.long, device=device)
    for i, prompt in enumerate(prompts):
        tokens[i, : len(prompt)] = torch.tensor(prompt, device=device)
    stopped = torch.zeros(len(prompts), dtype=torch.bool, device=device)
    finished_at = ends.clone()
    generator = torch.Generator(device=device).manual_seed(seed)
    cache = KVCache(len(prompts), total) if use_cache else None
    done = int(lengths.min())
    with torch.no_grad():
        for position in range(done, total):
            start = cache.offset if cache is not None else 0
            out = _stage_forward(m, tokens[:, start:position], cache)
            chosen = torch.empty(len(prompts), dtype=torch.long, device=device)
            if out is not None:
                chosen = sample(_full_vocab(m, out[-1]), options, generator)
                if state.tp.size > 1:  # one choice for all, whatever each rank's rounding
                    dist.broadcast(chosen, src=state.tp.ranks[0], group=state.tp.pg)
            chosen = _from_last_stage(m, chosen)
            if cache is not None:
                cache.advance(position - start)
            writing = (position >= lengths) & (position < finished_at)
            tokens[:, position] = torch.where(writing, chosen, tokens[:, position])
            if eod is not None:
                hit = writing & (chosen == eod)
                stopped |= hit
                finished_at = torch.where(hit, position + 1, finished_at)
            if bool((finished_at <= position + 1).all()):
                break
    return [
        Generation(tokens[i, len(p) : int(finished_at[i])].tolist(), bool(stopped[i]))
        for i, p in enumerate(prompts)
    ]
