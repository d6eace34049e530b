"""The text-generation server (megapipe/inference/server.py, tools/run_text_generation_server.py),
with real HTTP requests on loopback.

A tiny model learns to count on mock data (as in test_generation.py). Against a server at one
rank (in a thread), at TP=2 (two forked gloo ranks) and the tool itself (a subprocess):
- a greedy request answers what `generate` returns, a seeded sampled one the same twice and
  what `generate` gives with that seed, logprobs are the model's own;
- every malformed or out-of-bounds request gets its status and a reason naming the field, and
  the server goes on serving; a client that sends nothing is dropped after the timeout;
- SIGTERM to a non-zero rank changes nothing, to rank 0 stops every rank with status 0.
"""

from __future__ import annotations

import http.client
import json
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from megapipe.data.tokenizers.null_tokenizer import NullTokenizer
from megapipe.inference.generation import full_logits, generate
from megapipe.inference.loading import load_inference_model
from megapipe.inference.sampling import SamplingOptions
from megapipe.inference.server import ServerError, serve, stop_on_signals
from megapipe.inference.server_request import Limits, RequestError, content_length
from megapipe.inference.session import Session
from megapipe.parallel.state import ParallelState
from megapipe.testing import DistributedTestError, run_distributed
from tests.helpers import MOCK, NO_DROPOUT, run

ROOT = Path(__file__).resolve().parent.parent
COUNTING = [
    "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
    "--seq-length", "32", "--max-position-embeddings", "64", "--micro-batch-size", "1",
    "--global-batch-size", "8", "--lr", "3e-3", "--log-interval", "10", "--eval-iters", "0",
    "--train-iters", "30",
]  # fmt: skip
LIMITS = Limits(max_request_bytes=4000, max_prompts=4, max_tokens_to_generate=16,
                request_timeout_s=1.0)  # fmt: skip
PROMPTS = ["5 6 7", "40 41 42 43 44 45"]
IDS = [[5, 6, 7], [40, 41, 42, 43, 44, 45]]
HOT = SamplingOptions(temperature=3.0)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("server")
    run(1, COUNTING + MOCK + NO_DROPOUT + ["--save", str(root / "ckpt")])
    return root / "ckpt"


def session_at(checkpoint: Path, state: ParallelState) -> Session:
    """What start_session gives for a mock-data checkpoint: ids in, ids out, no EOD."""
    model = load_inference_model(str(checkpoint), state)
    return Session(model, NullTokenizer(model.config.vocab_size), None)


class Served:
    """A server in a thread of this process, at one rank."""

    def __init__(self, session: Session, **kwargs) -> None:
        self.session, self.lines, self.stop = session, [], threading.Event()
        ready = threading.Event()

        def on_ready(host: str, port: int) -> None:
            self.port = port
            ready.set()

        self.thread = threading.Thread(
            target=serve,
            args=(session, kwargs.pop("limits", LIMITS), SamplingOptions()),
            kwargs={"port": 0, "stop": self.stop, "on_ready": on_ready,
                    "say": self.lines.append, **kwargs},
            daemon=True,
        )  # fmt: skip
        self.thread.start()
        assert ready.wait(30), "the server did not start"

    def line_after(self, count: int, timeout_s: float = 10.0) -> str:
        """The server's line number `count` (from 0), waiting for it: the server logs a request
        after it has sent the answer, so the client can read the answer first."""
        deadline = time.monotonic() + timeout_s
        while len(self.lines) <= count and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(self.lines) > count, f"no log line {count} within {timeout_s} s: {self.lines}"
        return self.lines[count]

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)
        assert not self.thread.is_alive(), "the server did not stop"


@pytest.fixture(scope="module")
def single(checkpoint: Path):
    served = Served(session_at(checkpoint, ParallelState.single()))
    yield served
    served.close()


def request(port: int, body, method: str = "PUT", path: str = "/api") -> tuple[int, dict]:
    """(status, JSON answer) of one HTTP request; a dict body is sent as JSON."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        connection.request(method, path, body=data, headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        return response.status, json.loads(response.read() or b"{}")
    finally:
        connection.close()


GREEDY = SamplingOptions(greedy=True)


def expected(session: Session, ids, new: int, options=GREEDY, seed=1234) -> list[list[int]]:
    """What generate() gives, as the server answers it: prompt ids + new ids."""
    results = generate(session.model, ids, new, options, seed=seed)
    return [p + r.tokens for p, r in zip(ids, results)]


def test_a_greedy_request_answers_what_generate_returns(single: Served) -> None:
    want = expected(single.session, IDS, 8)
    assert want[0][3:6] == [8, 9, 10]  # the model counts: the comparison means something
    for sampling in ({"top_k": 1}, {"temperature": 1e-4}):
        status, answer = request(single.port, {"prompts": PROMPTS, "tokens_to_generate": 8,
                                               **sampling})  # fmt: skip
        assert status == 200, answer
        assert answer["tokens"] == want, sampling
    assert answer["text"] == [" ".join(map(str, seq)) for seq in want]
    assert answer["segments"] == [[str(t) for t in seq] for seq in want]
    assert "logprobs" not in answer


def test_a_seeded_sampled_request_is_reproducible(single: Served) -> None:
    body = {"prompts": PROMPTS, "tokens_to_generate": 10, "temperature": 3.0, "random_seed": 11}
    first, again = (request(single.port, body)[1] for _ in range(2))
    assert first["tokens"] == again["tokens"] == expected(single.session, IDS, 10, HOT, seed=11)
    other = request(single.port, {**body, "random_seed": 12})[1]
    assert other["tokens"] != first["tokens"]
    unseeded = request(single.port, {k: v for k, v in body.items() if k != "random_seed"})[1]
    replay = request(single.port, {**body, "random_seed": unseeded["random_seed"]})[1]
    assert replay["tokens"] == unseeded["tokens"]


def _logprobs(session: Session, sequence: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's log-probability, and the largest one at its position."""
    logits = full_logits(session.model, torch.tensor([sequence]))[0, :-1]
    every = torch.log_softmax(logits, -1)
    return every.gather(-1, torch.tensor(sequence[1:])[:, None])[:, 0], every.max(-1).values


def test_logprobs_are_the_models_own(single: Served) -> None:
    status, answer = request(single.port, {"prompts": PROMPTS, "tokens_to_generate": 4,
                                           "logprobs": True, "top_k": 1})  # fmt: skip
    assert status == 200, answer
    for seq, values in zip(answer["tokens"], answer["logprobs"]):
        assert len(values) == len(seq) - 1
        ours, best = _logprobs(single.session, seq)
        assert torch.allclose(torch.tensor(values), ours, atol=1e-5)
        assert torch.allclose(ours[-4:], best[-4:])  # greedy: each new token the likeliest
        assert (ours[-4:] > -math.log(100)).all()  # and likelier than a uniform guess
    status, scored = request(single.port, {"prompts": ["5 6 7"], "tokens_to_generate": 0,
                                           "logprobs": True})  # fmt: skip
    assert status == 200 and scored["tokens"] == [[5, 6, 7]] and scored["text"] == ["5 6 7"]
    assert scored["logprobs"][0] == pytest.approx(answer["logprobs"][0][:2], abs=1e-5)


LONG = " ".join(["1"] * 60)
BAD = [
    (b"{not json", "body is not valid JSON"),
    (b"\xff\xfe", "body is not UTF-8"),
    (b"[1, 2]", "body must be a JSON object, got list"),
    (b'{"prompts": ["5"], "temperature": NaN}', "NaN is not a number JSON allows"),
    ({}, "prompts: required"),
    ({"prompts": "5 6"}, "prompts must be a list of strings, got str"),
    ({"prompts": []}, "prompts is empty"),
    ({"prompts": [5]}, "prompts[0] must be a string, got int"),
    ({"prompts": ["5", ""]}, "prompts[1] is empty"),
    ({"prompts": ["5"] * 5}, "5 prompts exceed --max-prompts 4"),
    (b'{"prompts": ["\\ud800"]}', "prompts[0] holds a lone surrogate"),
    ({"prompts": ["5"], "tokens_to_generate": 17}, "tokens_to_generate 17 exceeds --max-tokens"),
    ({"prompts": ["5"], "tokens_to_generate": "8"}, 'must be an integer, got "8"'),
    ({"prompts": ["5"], "tokens_to_generate": True}, "tokens_to_generate must be an integer"),
    ({"prompts": ["5"], "tokens_to_generate": -1}, "tokens_to_generate -1: must be >= 0"),
    ({"prompts": ["5"], "tokens_to_generate": 0}, "tokens_to_generate 0 needs logprobs true"),
    ({"prompts": ["5"], "temperature": 0}, "temperature 0: must be a number in (0, 100]"),
    ({"prompts": ["5"], "temperature": "hot"}, "temperature \"hot\""),
    (b'{"prompts": ["5"], "temperature": 1e400}', "temperature Infinity: must be"),
    ({"prompts": ["5"], "top_k": 2.5}, "top_k 2.5: must be an integer >= 0"),
    ({"prompts": ["5"], "top_p": 1.5}, "top_p 1.5: must be a number in [0, 1]"),
    ({"prompts": ["5"], "top_k": 2, "top_p": 0.5}, "top_k and top_p: give one of them"),
    ({"prompts": ["5"], "random_seed": -5}, "random_seed -5: must be an integer"),
    ({"prompts": ["5"], "logprobs": "yes"}, 'logprobs must be true or false, got "yes"'),
    ({"prompts": ["5"], "no_log": 1}, "no_log must be true or false"),
    ({"prompts": ["5 six"]}, "prompts[0]: NullTokenizer expects integers"),
    ({"prompts": ["5", "6 100"]}, "prompts[1]: token id 100 is outside the model's vocabulary"),
    ({"prompts": ["   "]}, "prompts[0] has no tokens"),
    ({"prompts": [LONG], "tokens_to_generate": 10}, "exceed the model's context of 64 positions"),
    ({"prompts": ["5"], "temprature": 1.0}, "unknown field 'temprature'"),
    ({"prompts": ["5"], "max_len": 3}, "max_len is no longer used: use tokens_to_generate"),
    ({"prompts": ["5"], "beam_width": 2}, "beam_width: beam search is not supported"),
    ({"prompts": ["5"], "add_BOS": True}, "add_BOS true: not supported (only false)"),
    ({"prompts": ["5"], "top_p_decay": 0.5}, "top_p_decay 0.5: not supported"),
]  # fmt: skip


@pytest.mark.parametrize("body, reason", BAD, ids=[r[:40] for _, r in BAD])
def test_a_bad_request_gets_400_naming_it_and_the_server_goes_on(single, body, reason) -> None:
    status, answer = request(single.port, body)
    assert status == 400 and reason in answer["error"], answer
    status, answer = request(single.port, {"prompts": ["5"], "tokens_to_generate": 1, "top_k": 1})
    assert status == 200 and answer["tokens"] == [[5, 6]]


def test_megatrons_off_values_are_accepted(single: Served) -> None:
    off = {"add_BOS": False, "stop_on_eol": False, "top_p_decay": 0.0, "random_seed": -1,
           "no_log": True}  # fmt: skip
    body = {"prompts": ["5"], "tokens_to_generate": 2, "top_k": 1, **off}
    status, answer = request(single.port, body)
    assert status == 200 and answer["tokens"] == [[5, 6, 7]]


def _raw(port: int, head: bytes, body: bytes = b"", close_write: bool = False) -> tuple[int, dict]:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(head + b"\r\n" + body)
        if close_write:
            sock.shutdown(socket.SHUT_WR)
        response = http.client.HTTPResponse(sock)
        response.begin()
        return response.status, json.loads(response.read())


def test_http_level_refusals(single: Served) -> None:
    port = single.port
    started = time.monotonic()  # a huge body is refused from its header, before it is sent
    status, answer = _raw(port, b"PUT /api HTTP/1.1\r\nContent-Length: 1000000000\r\n")
    assert status == 413 and "exceeds --max-request-bytes 4000" in answer["error"]
    assert time.monotonic() - started < 5
    status, answer = request(port, {"prompts": ["5" * 5000]})
    assert status == 413 and "--max-request-bytes" in answer["error"]
    status, answer = _raw(port, b"PUT /api HTTP/1.1\r\n")
    assert status == 411 and "Content-Length is required" in answer["error"]
    status, answer = _raw(port, b"PUT /api HTTP/1.1\r\nContent-Length: 50\r\n", b"{}", True)
    assert status == 400 and "body ended after 2 of 50 bytes" in answer["error"]
    assert request(port, {"prompts": ["5"]}, path="/generate")[0] == 404
    status, answer = request(port, b"", method="GET")
    assert status == 405 and "method GET not allowed: use PUT" in answer["error"]
    assert request(port, {"prompts": ["5"]}, method="POST")[0] == 405
    status, answer = _raw(port, b"BREW /api HTTP/1.1\r\n")
    assert status == 501 and "BREW" in answer["error"]
    assert request(port, {"prompts": ["5"], "tokens_to_generate": 1, "top_k": 1})[0] == 200


def test_a_silent_client_is_dropped_and_the_next_one_served(single: Served) -> None:
    with socket.create_connection(("127.0.0.1", single.port)):
        time.sleep(0.2)  # the server is now waiting for this client's request line
        started = time.monotonic()
        status, _ = request(single.port, {"prompts": ["5"], "tokens_to_generate": 1, "top_k": 1})
        waited = time.monotonic() - started
    assert status == 200 and waited < LIMITS.request_timeout_s + 3
    assert any("timed out" in line for line in single.lines), single.lines


def test_requests_are_logged_unless_no_log(single: Served) -> None:
    before = len(single.lines)
    request(single.port, {"prompts": ["5", "6"], "tokens_to_generate": 3})
    line = single.line_after(before)
    assert "PUT /api 200" in line and "2 prompts, 3 tokens" in line
    request(single.port, {"prompts": ["5"], "tokens_to_generate": 1, "no_log": True})
    request(single.port, {"prompts": ["7"], "tokens_to_generate": 2})  # logged: a marker
    assert "1 prompts, 2 tokens" in single.line_after(before + 1)  # nothing came between


def test_a_port_in_use_is_named(checkpoint: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        session = session_at(checkpoint, ParallelState.single())
        with pytest.raises(ServerError, match=f"--port {port}: cannot listen there"):
            serve(session, LIMITS, SamplingOptions(), port=port, stop=threading.Event())


def test_content_length_checks() -> None:
    assert content_length("12", None, LIMITS) == 12
    for header, encoding, status in (("-1", None, 400), ("x", None, 400), (None, None, 411),
                                     ("5", "chunked", 411), ("4001", None, 413)):  # fmt: skip
        with pytest.raises(RequestError) as caught:
            content_length(header, encoding, LIMITS)
        assert caught.value.status == status
    problems = Limits(max_tokens_to_generate=0).problems()
    assert problems == ["--max-tokens-to-generate 0: must be >= 1"]
    assert Limits(max_tokens_to_generate=8).default_tokens_to_generate == 8


# --- TP=2: two forked gloo ranks, a client thread in this process -----------------------------


def _serve_on_ranks(rank: int, world: int, load: str, folder: str, port: int = 0) -> str:
    stop = threading.Event()
    stop_on_signals(stop)
    session = session_at(Path(load), ParallelState.build(2, 1))
    Path(folder, f"pid{rank}.tmp").write_text(str(os.getpid()))  # whole, or not there yet
    os.replace(Path(folder, f"pid{rank}.tmp"), Path(folder, f"pid{rank}"))

    def on_ready(host: str, port: int) -> None:
        Path(folder, "port.tmp").write_text(str(port))
        os.replace(Path(folder, "port.tmp"), Path(folder, "port"))

    # heartbeat_s 0.2: pings go between the requests too
    serve(session, LIMITS, SamplingOptions(), port=port, stop=stop, on_ready=on_ready,
          say=lambda _: None, heartbeat_s=0.2)  # fmt: skip
    return f"rank {rank} stopped"


def _client(folder: Path, answers: dict, errors: list) -> None:
    port_file = folder / "port"
    try:
        deadline = time.monotonic() + 60
        while not (port_file.exists() and (folder / "pid1").exists()):
            assert time.monotonic() < deadline, "the TP=2 server did not start"
            time.sleep(0.05)
        port = int(port_file.read_text())
        pids = {r: int((folder / f"pid{r}").read_text()) for r in (0, 1)}
        greedy = {"prompts": PROMPTS, "tokens_to_generate": 8, "top_k": 1, "logprobs": True}
        answers["greedy"] = request(port, greedy)
        answers["bad"] = request(port, {"prompts": ["5 6 100"]})
        hot = {"prompts": PROMPTS, "tokens_to_generate": 8, "temperature": 3.0, "random_seed": 5}
        answers["hot"] = [request(port, hot) for _ in range(2)]
        os.kill(pids[1], signal.SIGTERM)  # only rank 0 may stop the job: this changes nothing
        time.sleep(0.3)
        answers["after_sigterm_to_rank_1"] = request(port, greedy)
    except BaseException as error:
        errors.append(error)
    finally:  # stop the job whatever happened, or run_distributed waits for its timeout
        if (folder / "pid0").exists():
            os.kill(int((folder / "pid0").read_text()), signal.SIGTERM)


def test_tp2_serves_what_one_rank_generates_and_stops_every_rank(checkpoint, single, tmp_path):
    answers: dict = {}
    errors: list = []
    client = threading.Thread(target=_client, args=(tmp_path, answers, errors), daemon=True)
    client.start()
    started = time.monotonic()
    per_rank = run_distributed(_serve_on_ranks, 2, str(checkpoint), str(tmp_path), timeout=90)
    client.join(10)
    assert not errors, errors
    assert per_rank == ["rank 0 stopped", "rank 1 stopped"]
    print(f"\nTP=2 server: up, 5 requests, stopped in {time.monotonic() - started:.1f} s")
    status, greedy = answers["greedy"]
    assert status == 200 and greedy["tokens"] == expected(single.session, IDS, 8)
    one_rank = request(single.port, {"prompts": PROMPTS, "tokens_to_generate": 8, "top_k": 1,
                                     "logprobs": True})[1]  # fmt: skip
    for ours, theirs in zip(greedy["logprobs"], one_rank["logprobs"]):
        assert ours == pytest.approx(theirs, abs=1e-4)
    status, bad = answers["bad"]
    assert status == 400 and "prompts[0]: token id 100" in bad["error"]
    (s1, hot1), (s2, hot2) = answers["hot"]
    assert s1 == s2 == 200 and hot1["tokens"] == hot2["tokens"]
    status, after = answers["after_sigterm_to_rank_1"]
    assert status == 200 and after["tokens"] == greedy["tokens"]


def test_tp2_a_port_in_use_fails_every_rank_with_its_name(checkpoint, tmp_path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(DistributedTestError, match="2 of 2 ranks failed") as caught:
            run_distributed(_serve_on_ranks, 2, str(checkpoint), str(tmp_path), port, timeout=60)
    assert f"ServerError: --host 127.0.0.1 --port {port}: cannot listen there" in str(caught.value)


# --- the tool, as a user runs it -------------------------------------------------------------


@pytest.mark.slow
def test_the_tool_serves_and_stops_on_sigint(checkpoint: Path, single: Served) -> None:
    argv = [sys.executable, str(ROOT / "tools/run_text_generation_server.py"), "--load",
            str(checkpoint), "--port", "0", "--greedy", "--max-tokens-to-generate",
            "8"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("RANK", None)
    tool = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)  # fmt: skip
    try:
        line = tool.stdout.readline()
        assert line.startswith("serving on http://127.0.0.1:"), (line, tool.stderr.read())
        port = int(line.rsplit(":", 1)[1].split("/")[0])
        status, answer = request(port, {"prompts": PROMPTS})  # no sampling field: --greedy
        assert status == 200 and answer["tokens"] == expected(single.session, IDS, 8)
        status, answer = request(port, {"prompts": ["5"], "tokens_to_generate": 9})
        assert status == 400 and "exceeds --max-tokens-to-generate 8" in answer["error"]
        tool.send_signal(signal.SIGINT)
        _, err = tool.communicate(timeout=20)
    finally:
        tool.kill()
        tool.wait()
    assert tool.returncode == 0, err
    assert "Traceback" not in err and "PUT /api 200" in err


def test_the_tool_refuses_bad_flags_with_one_line(checkpoint: Path, capsys) -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "server_tool", ROOT / "tools/run_text_generation_server.py"
    )
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    cases = [
        (["--max-tokens-to-generate", "0"], "--max-tokens-to-generate 0"),
        (["--port", "70000"], "--port 70000: must be in 0..65535"),
        (["--top-k", "2", "--top-p", "0.5"], "--top-k and --top-p"),
    ]
    for flags, message in cases:
        assert tool.main(["--load", str(checkpoint), *flags]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err
        assert err[0].startswith("run_text_generation_server.py: error:")
