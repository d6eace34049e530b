"""What a `PUT /api` request may ask, checked in full on rank 0 before any rank does work.

Megatron's fields: `prompts` (a list of strings, required), `tokens_to_generate` (default 64),
`temperature`, `top_k`, `top_p`, `random_seed`, `logprobs`, `no_log`. `top_k` 1 is greedy, as
in Megatron. A request naming none of temperature / top_k / top_p samples as the server's flags
say; one naming any of them samples with those, Megatron's defaults for the rest (1.0, 0, 0.0).
Megatron's fields this server does not implement are accepted only at the value that means
"off" (`add_BOS` false, ...); any other value, and any field Megatron does not have, is refused
by name. Every problem is a RequestError: an HTTP status and one line naming the field.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass

from megapipe.data.errors import TokenizerError
from megapipe.errors import MegapipeError
from megapipe.inference.sampling import SamplingOptions

SAMPLING_FIELDS = ("temperature", "top_k", "top_p")
KNOWN_FIELDS = ("prompts", "tokens_to_generate", *SAMPLING_FIELDS, "random_seed", "logprobs",
                "no_log")  # fmt: skip
# Megatron's fields we do not implement, at the value that asks for nothing.
OFF_VALUES = {
    "add_BOS": False,
    "stop_on_eol": False,
    "stop_on_double_eol": False,
    "prevent_newline_after_colon": False,
    "top_p_decay": 0.0,
    "top_p_bound": 0.0,
    "top_n_logprobs": 0,
}
UNSUPPORTED = ("beam_width", "stop_token", "length_penalty")  # beam search
RENAMED = {"max_len": "tokens_to_generate", "sentences": "prompts"}  # Megatron's old names
MAX_SEED = 2**63 - 1
MAX_TEMPERATURE = 100.0  # Megatron's bound
DEFAULT_TOKENS_TO_GENERATE = 64  # Megatron's


class RequestError(MegapipeError, ValueError):
    """A request the server refuses: `status` (400, 411, 413) and the reason, naming the field."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status, self.reason = status, reason


@dataclass(frozen=True)
class Limits:
    """How much one request may ask for (the server's --max-* flags)."""

    max_request_bytes: int = 1 << 20
    max_prompts: int = 128
    max_tokens_to_generate: int = 256
    request_timeout_s: float = 10.0  # a client slower than this to send its request is dropped

    @property
    def default_tokens_to_generate(self) -> int:
        return min(DEFAULT_TOKENS_TO_GENERATE, self.max_tokens_to_generate)

    def problems(self) -> list[str]:
        """Out-of-range limits as `--flag value: why` lines (empty when all is well)."""
        found = []
        for flag, value in (
            ("--max-request-bytes", self.max_request_bytes),
            ("--max-prompts", self.max_prompts),
            ("--max-tokens-to-generate", self.max_tokens_to_generate),
        ):
            if value < 1:
                found.append(f"{flag} {value}: must be >= 1")
        if not self.request_timeout_s > 0:
            found.append(f"--request-timeout {self.request_timeout_s}: must be > 0")
        return found


@dataclass(frozen=True)
class GenerateRequest:
    """A request that passed every check that needs no tokenizer."""

    prompts: tuple[str, ...]
    tokens_to_generate: int
    options: SamplingOptions | None  # None: the server's sampling flags
    random_seed: int | None  # None: the server picks one
    logprobs: bool = False
    no_log: bool = False


def content_length(header: str | None, transfer_encoding: str | None, limits: Limits) -> int:
    """The body's size from the Content-Length header, refused before any byte is read."""
    if transfer_encoding is not None:
        raise RequestError(411, "Transfer-Encoding is not supported: send a Content-Length")
    if header is None:
        raise RequestError(411, "Content-Length is required")
    if not header.strip().isdigit():
        raise RequestError(400, f"Content-Length {header[:40]!r} is not a byte count")
    size = int(header)
    if size > limits.max_request_bytes:
        raise RequestError(
            413, f"body of {size} bytes exceeds --max-request-bytes {limits.max_request_bytes}"
        )
    return size


def _refuse_constant(name: str) -> float:
    raise ValueError(f"{name} is not a number JSON allows")


def parse_body(body: bytes) -> dict:
    """The body as a JSON object (NaN and Infinity refused, as strict JSON does)."""
    try:
        value = json.loads(body.decode("utf-8"), parse_constant=_refuse_constant)
    except UnicodeDecodeError as error:
        raise RequestError(400, f"body is not UTF-8: {error}") from None
    except ValueError as error:  # json.JSONDecodeError is one
        raise RequestError(400, f"body is not valid JSON: {error}") from None
    if not isinstance(value, dict):
        raise RequestError(400, f"body must be a JSON object, got {type(value).__name__}")
    return value


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)


def _check_fields(fields: dict) -> None:
    for name, value in fields.items():
        if name in KNOWN_FIELDS:
            continue
        if name in RENAMED:
            raise RequestError(400, f"{name} is no longer used: use {RENAMED[name]}")
        if name in UNSUPPORTED:
            raise RequestError(400, f"{name}: beam search is not supported by this server")
        if name in OFF_VALUES:
            off = OFF_VALUES[name]
            if type(value) is not type(off) or value != off:
                raise RequestError(
                    400, f"{name} {json.dumps(value)[:40]}: not supported (only {json.dumps(off)})"
                )
            continue
        raise RequestError(400, f"unknown field {name!r}")


def _prompts(fields: dict, limits: Limits) -> tuple[str, ...]:
    if "prompts" not in fields:
        raise RequestError(400, "prompts: required (a list of strings)")
    prompts = fields["prompts"]
    if not isinstance(prompts, list):
        raise RequestError(400, f"prompts must be a list of strings, got {type(prompts).__name__}")
    if not prompts:
        raise RequestError(400, "prompts is empty")
    if len(prompts) > limits.max_prompts:
        raise RequestError(
            400, f"prompts: {len(prompts)} prompts exceed --max-prompts {limits.max_prompts}"
        )
    for i, prompt in enumerate(prompts):
        if not isinstance(prompt, str):
            raise RequestError(400, f"prompts[{i}] must be a string, got {type(prompt).__name__}")
        if not prompt:
            raise RequestError(400, f"prompts[{i}] is empty")
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError:
            raise RequestError(400, f"prompts[{i}] holds a lone surrogate (not Unicode)") from None
    return tuple(prompts)


def _tokens_to_generate(fields: dict, limits: Limits, logprobs: bool) -> int:
    count = fields.get("tokens_to_generate", limits.default_tokens_to_generate)
    if not _is_int(count):
        raise RequestError(400, f"tokens_to_generate must be an integer, got {json.dumps(count)}")
    if count < 0:
        raise RequestError(400, f"tokens_to_generate {count}: must be >= 0")
    if count > limits.max_tokens_to_generate:
        raise RequestError(
            400, f"tokens_to_generate {count} exceeds --max-tokens-to-generate "
            f"{limits.max_tokens_to_generate}",
        )  # fmt: skip
    if count == 0 and not logprobs:
        raise RequestError(400, "tokens_to_generate 0 needs logprobs true (nothing to return)")
    return count


def _flag(fields: dict, name: str) -> bool:
    value = fields.get(name, False)
    if not isinstance(value, bool):
        raise RequestError(400, f"{name} must be true or false, got {json.dumps(value)[:40]}")
    return value


def _sampling(fields: dict) -> SamplingOptions | None:
    if not any(name in fields for name in SAMPLING_FIELDS):
        return None
    temperature = fields.get("temperature", 1.0)
    if not _is_number(temperature) or not 0 < temperature <= MAX_TEMPERATURE:
        raise RequestError(
            400, f"temperature {json.dumps(temperature)[:40]}: must be a number in "
            f"(0, {MAX_TEMPERATURE:g}]",
        )  # fmt: skip
    top_k = fields.get("top_k", 0)
    if not _is_int(top_k) or top_k < 0:
        raise RequestError(400, f"top_k {json.dumps(top_k)[:40]}: must be an integer >= 0")
    top_p = fields.get("top_p", 0.0)
    if not _is_number(top_p) or not 0 <= top_p <= 1:
        raise RequestError(400, f"top_p {json.dumps(top_p)[:40]}: must be a number in [0, 1]")
    if top_k > 0 and top_p > 0:
        raise RequestError(400, "top_k and top_p: give one of them, not both")
    return SamplingOptions(top_k == 1, float(temperature), top_k, float(top_p))


def _seed(fields: dict) -> int | None:
    seed = fields.get("random_seed")
    if seed is None or seed == -1:  # Megatron's -1: no seed given
        return None
    if not _is_int(seed) or not 0 <= seed <= MAX_SEED:
        raise RequestError(
            400, f"random_seed {json.dumps(seed)[:40]}: must be an integer in 0..{MAX_SEED}"
        )
    return seed


def parse_request(body: bytes, limits: Limits) -> GenerateRequest:
    """The request in `body`, or RequestError naming the first field that is wrong."""
    fields = parse_body(body)
    _check_fields(fields)
    prompts = _prompts(fields, limits)
    logprobs = _flag(fields, "logprobs")
    count = _tokens_to_generate(fields, limits, logprobs)
    return GenerateRequest(
        prompts, count, _sampling(fields), _seed(fields), logprobs, _flag(fields, "no_log")
    )


def tokenize_prompts(
    request: GenerateRequest, tokenize: Callable[[str], list[int]], vocab: int, context: int
) -> list[list[int]]:
    """Each prompt's ids; RequestError naming a prompt the tokenizer refuses, that has no
    tokens or ids outside 0..vocab-1, or that does not fit `context` with the new tokens."""
    out = []
    for i, text in enumerate(request.prompts):
        try:
            ids = tokenize(text)
        except TokenizerError as error:
            raise RequestError(400, f"prompts[{i}]: {error}") from None
        if not ids:
            raise RequestError(400, f"prompts[{i}] has no tokens")
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise RequestError(
                400, f"prompts[{i}]: token id {bad} is outside the model's vocabulary "
                f"0..{vocab - 1}",
            )  # fmt: skip
        if len(ids) + request.tokens_to_generate > context:
            raise RequestError(
                400, f"prompts[{i}]: {len(ids)} tokens + tokens_to_generate "
                f"{request.tokens_to_generate} exceed the model's context of {context} positions",
            )  # fmt: skip
        out.append(ids)
    return out
