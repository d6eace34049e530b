"""Megatron's text-generation server, on the standard library: `PUT /api`, one request at a time.

Rank 0 serves HTTP; every other rank of the TP x PP job waits in `follow`. Rank 0 checks a
request in full (fields, tokens, context: `server_request`) before any other rank hears of it,
so a bad request costs one 400 and no collective. A good one is broadcast over the world group
as plain data (`Work`), every rank runs `execute` on it together, and rank 0 answers. A
GenerationError inside generation is raised alike on every rank, so every rank catches it and
keeps serving; any other failure stops rank 0 (the ranks may be out of step). While idle, rank 0
broadcasts a ping every `heartbeat_s` seconds so the waiting ranks never reach the process
group's timeout. On `stop` (SIGINT/SIGTERM in the tool), rank 0 finishes the request in hand,
broadcasts a stop and every rank returns.

Answer: `{"text": [prompt + continuation], "tokens": [prompt ids + new ids], "segments":
[[each token's text]], "random_seed": seed used}`, plus `"logprobs"` when asked; an error is
`{"error": "reason naming the field"}` with 400 (bad field), 404 (path), 405 (method), 411, 413.
"""

from __future__ import annotations

import contextlib
import json
import random
import signal
import socket
import socketserver
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, HTTPServer
from urllib.parse import urlsplit

import torch.distributed as dist

from megapipe.console import say
from megapipe.data.tokenizers.base import Tokenizer
from megapipe.errors import MegapipeError
from megapipe.inference.generation import Generation, GenerationError, generate
from megapipe.inference.loading import InferenceModel
from megapipe.inference.sampling import SamplingOptions
from megapipe.inference.scoring import token_logprobs
from megapipe.inference.server_request import (
    GenerateRequest,
    Limits,
    RequestError,
    content_length,
    parse_request,
    tokenize_prompts,
)
from megapipe.inference.session import Session
from megapipe.parallel.state import ParallelState

API_PATH = "/api"
POLL_S = 0.5  # how often rank 0 looks at the stop event while idle
HEARTBEAT_S = 60.0  # well inside the process group's timeout (10 min)

Say = Callable[[str], None]


class ServerError(MegapipeError, RuntimeError):
    """The server cannot start (address in use, ...) or had to stop; the message says why."""


@dataclass(frozen=True)
class Work:
    """One request as every rank needs it: plain data, broadcast from rank 0."""

    prompts: list[list[int]]
    tokens_to_generate: int
    options: SamplingOptions
    seed: int
    logprobs: bool
    eod: int | None


@dataclass(frozen=True)
class Outcome:
    generations: list[Generation]
    logprobs: list[list[float]] | None


def execute(model: InferenceModel, work: Work) -> Outcome:
    """Generate (and score, with logprobs) for `work` (collective: every rank calls it)."""
    generations = generate(model, work.prompts, work.tokens_to_generate, work.options,
                           eod=work.eod, seed=work.seed)  # fmt: skip
    logprobs = None
    if work.logprobs:
        logprobs = [token_logprobs(model, p + g.tokens) for p, g in zip(work.prompts, generations)]
    return Outcome(generations, logprobs)


def continuation(tokenizer: Tokenizer, prompt: str, ids: list[int], new: list[int]) -> str:
    """The prompt's text followed by its continuation, with the spacing the tokenizer gives
    the whole sequence (NullTokenizer's space, SentencePiece's word starts)."""
    whole, head = tokenizer.detokenize(ids + new), tokenizer.detokenize(ids)
    if whole.startswith(head):
        return prompt + whole[len(head) :]
    return prompt + tokenizer.detokenize(new)


def response_body(
    tokenizer: Tokenizer, request: GenerateRequest, work: Work, outcome: Outcome
) -> dict:
    """Megatron's answer for a finished request."""
    sequences = [p + g.tokens for p, g in zip(work.prompts, outcome.generations)]
    body = {
        "text": [continuation(tokenizer, text, ids, g.tokens)
                 for text, ids, g in zip(request.prompts, work.prompts, outcome.generations)],
        "tokens": sequences,
        "segments": [[tokenizer.detokenize([t]) for t in seq] for seq in sequences],
        "random_seed": work.seed,
    }  # fmt: skip
    if outcome.logprobs is not None:
        body["logprobs"] = outcome.logprobs
    return body


def _broadcast(state: ParallelState, message: tuple | None) -> tuple:
    """Rank 0's `message` on every rank of the job (no-op on one rank)."""
    if state.world_size == 1:
        return message
    box = [message]
    device = state.device if state.device.type == "cuda" else None
    dist.broadcast_object_list(box, src=state.world.ranks[0], group=state.world.pg, device=device)
    return box[0]


class Endpoint:
    """Rank 0's side of the job: a request body in, a status and a JSON body out."""

    def __init__(
        self, session: Session, limits: Limits, defaults: SamplingOptions, seed: int, say: Say
    ) -> None:
        self.session, self.limits, self.defaults, self.say = session, limits, defaults, say
        self._seeds = random.Random(seed)  # seeds for requests without random_seed
        self.last_broadcast = time.monotonic()
        self.broken: str | None = None  # set when the ranks may be out of step

    def broadcast(self, message: tuple) -> None:
        _broadcast(self.session.state, message)
        self.last_broadcast = time.monotonic()

    def answer(self, body: bytes) -> tuple[int, dict, GenerateRequest | None]:
        """(HTTP status, JSON body, the parsed request when it parsed)."""
        model = self.session.model
        try:
            request = parse_request(body, self.limits)
            ids = tokenize_prompts(request, self.session.tokenizer.tokenize,
                                   model.config.vocab_size, model.context_length)  # fmt: skip
        except RequestError as error:
            return error.status, {"error": error.reason}, None
        seed = request.random_seed
        if seed is None:
            seed = self._seeds.randrange(2**31)
        work = Work(ids, request.tokens_to_generate, request.options or self.defaults, seed,
                    request.logprobs, self.session.eod)  # fmt: skip
        try:
            self.broadcast(("work", work))
            outcome = execute(model, work)
        except GenerationError as error:  # raised alike on every rank: they all go on
            return 400, {"error": str(error)}, request
        except Exception as error:
            self.say(traceback.format_exc().rstrip())
            self.broken = f"generation failed on rank 0: {error}"
            return 500, {"error": f"{self.broken}; the server stops"}, request
        try:
            return 200, response_body(self.session.tokenizer, request, work, outcome), request
        except Exception as error:  # rank 0 alone, after the collective part: keep serving
            self.say(traceback.format_exc().rstrip())
            return 500, {"error": f"could not write the answer: {error}"}, request


class _HTTPServer(HTTPServer):
    def __init__(self, address: tuple[str, int], endpoint: Endpoint) -> None:
        self.endpoint = endpoint
        super().__init__(address, _Handler)

    def server_bind(self) -> None:
        # HTTPServer's own asks DNS for the host's full name (socket.getfqdn), which can take
        # seconds on a machine without DNS; the name is only used in CGI variables.
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = self.server_address[:2]

    def handle_error(self, request: object, client_address: tuple) -> None:
        error = sys.exc_info()[1]  # e.g. a client that hung up before reading its answer
        self.endpoint.say(f"{client_address[0]}: connection dropped: {error!r}")


class _Handler(BaseHTTPRequestHandler):
    server: _HTTPServer
    server_version = "megapipe-text-generation"

    def setup(self) -> None:
        self.timeout = self.server.endpoint.limits.request_timeout_s
        super().setup()

    def _send(self, status: int, body: dict, extra: dict[str, str] | None = None) -> None:
        data = json.dumps(body).encode("utf-8")
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for name, value in (extra or {}).items():
            self.send_header(name, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _path(self) -> str:
        return urlsplit(self.path).path

    def do_PUT(self) -> None:  # noqa: N802 (http.server's naming)
        if self._path() != API_PATH:
            return self._send(404, {"error": f"no such path {self._path()[:80]!r}: use PUT /api"})
        endpoint = self.server.endpoint
        try:
            headers = self.headers
            size = content_length(headers.get("Content-Length"),
                                  headers.get("Transfer-Encoding"), endpoint.limits)  # fmt: skip
        except RequestError as error:
            self.close_connection = True  # the body (if any) is never read
            self._send(error.status, {"error": error.reason}, {"Connection": "close"})
            return self._drain()
        body = self.rfile.read(size)
        if len(body) < size:
            return self._send(400, {"error": f"body ended after {len(body)} of {size} bytes"})
        start = time.perf_counter()
        status, answer, request = endpoint.answer(body)
        self._send(status, answer)
        if request is None or not request.no_log:
            what = answer.get("error") or (
                f"{len(request.prompts)} prompts, {request.tokens_to_generate} tokens"
            )
            endpoint.say(f"{self.client_address[0]} PUT {API_PATH} {status} "
                          f"({time.perf_counter() - start:.2f} s): {what}")  # fmt: skip

    def _drain(self, seconds: float = 1.0, most: int = 16 << 20) -> None:
        """Drop what a refused client is still sending, for a moment: closing a socket with
        unread data resets the connection, and the client could lose the refusal with it."""
        with contextlib.suppress(OSError):  # a timeout or a reset ends it
            self.connection.shutdown(socket.SHUT_WR)
            self.connection.settimeout(0.2)
            deadline = time.monotonic() + seconds
            while most > 0 and time.monotonic() < deadline:
                chunk = self.connection.recv(min(1 << 16, most))
                if not chunk:
                    break
                most -= len(chunk)

    def _wrong_method(self) -> None:
        if self._path() != API_PATH:
            self._send(404, {"error": f"no such path {self._path()[:80]!r}: use PUT /api"})
        else:
            self._send(405, {"error": f"method {self.command} not allowed: use PUT"},
                       {"Allow": "PUT"})  # fmt: skip

    do_GET = do_POST = do_DELETE = do_PATCH = do_HEAD = do_OPTIONS = _wrong_method  # noqa: N815

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        # http.server's own errors (bad request line, unknown method, huge headers) as JSON too
        self.log_error("code %d, message %s", code, message)
        self.close_connection = True
        self._send(code, {"error": message or HTTPStatus(code).phrase})

    def log_request(self, code: object = "-", size: object = "-") -> None:
        pass  # do_PUT logs one line per request, with what it asked

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (base's name)
        self.server.endpoint.say(f"{self.client_address[0]}: {format % args}")


def follow(session: Session) -> None:
    """A rank other than 0: run every request rank 0 broadcasts, until it says stop."""
    while True:
        message = _broadcast(session.state, None)
        if message[0] == "stop":
            return
        if message[0] == "fail":
            raise ServerError(message[1])
        if message[0] == "work":
            with contextlib.suppress(GenerationError):  # rank 0 meets it too, and answers it
                execute(session.model, message[1])


def serve(
    session: Session,
    limits: Limits,
    defaults: SamplingOptions,
    *,
    seed: int = 1234,
    host: str = "127.0.0.1",
    port: int = 5000,
    stop: threading.Event,
    on_ready: Callable[[str, int], None] | None = None,
    say: Say = say,
    heartbeat_s: float = HEARTBEAT_S,
) -> None:
    """Serve `PUT /api` until `stop` is set (collective: every rank calls it). Rank 0 binds
    host:port (port 0: any free one) and calls on_ready(host, bound port)."""
    if session.state.rank != 0:
        return follow(session)
    endpoint = Endpoint(session, limits, defaults, seed, say)
    try:
        httpd = _HTTPServer((host, port), endpoint)
    except OSError as error:
        reason = f"--host {host} --port {port}: cannot listen there: {error.strerror or error}"
        endpoint.broadcast(("fail", reason))
        raise ServerError(reason) from None
    httpd.timeout = POLL_S
    try:
        bound_host, bound_port = httpd.server_address[:2]
        if on_ready is not None:
            on_ready(str(bound_host), int(bound_port))
        while not stop.is_set() and endpoint.broken is None:
            httpd.handle_request()  # one request, or none within POLL_S
            if time.monotonic() - endpoint.last_broadcast > heartbeat_s:
                endpoint.broadcast(("ping",))
    finally:
        httpd.server_close()
    if endpoint.broken is not None:
        raise ServerError(endpoint.broken)
    endpoint.broadcast(("stop",))


def stop_on_signals(stop: threading.Event) -> None:
    """SIGINT and SIGTERM set `stop` instead of raising (main thread only). On rank 0 the
    server then stops after the request in hand; other ranks keep waiting for rank 0's stop,
    since leaving on their own would hang rank 0's next collective."""

    def handler(signum: int, frame: object) -> None:
        stop.set()

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, handler)


def print_address(host: str, port: int) -> None:
    """The line a script waits for: `serving on http://HOST:PORT/api` (stdout, flushed)."""
    sys.stdout.write(f"serving on http://{host}:{port}{API_PATH}\n")
    sys.stdout.flush()
