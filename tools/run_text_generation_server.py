"""Serve text generation over HTTP (Megatron's `PUT /api`), on one process or under torchrun.

    python tools/run_text_generation_server.py --load CKPT --port 5000
    torchrun --nproc_per_node 4 tools/run_text_generation_server.py --load CKPT \\
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2
    curl -X PUT http://127.0.0.1:5000/api -H 'Content-Type: application/json' \\
        -d '{"prompts": ["Once upon a time"], "tokens_to_generate": 32, "top_p": 0.9}'

Rank 0 listens on --host (127.0.0.1) and --port (5000; 0 picks a free port) and prints
`serving on http://HOST:PORT/api` when ready; the other ranks run each request with it. One
request at a time. Fields: prompts (required), tokens_to_generate (64), temperature, top_k
(1: greedy), top_p, random_seed, logprobs, no_log; requests naming no sampling field sample as
the sampling flags here say. Bounded by --max-request-bytes, --max-prompts,
--max-tokens-to-generate and the model's context; a bad request gets 400 (or 404/405/411/413)
and `{"error": "..."}`. SIGINT or SIGTERM to rank 0 (its process id is printed) stops every
rank cleanly and the job exits 0; the other ranks ignore signals and wait for rank 0's stop.
(Signalling torchrun itself also stops the ranks, but torchrun then exits 1 by its own rule.)
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
from collections.abc import Sequence

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch.distributed as dist  # noqa: E402

from megapipe.console import say  # noqa: E402
from megapipe.data.tool_cli import OneLineParser  # noqa: E402
from megapipe.errors import run_cli  # noqa: E402
from megapipe.inference.server import (  # noqa: E402
    ServerError,
    print_address,
    serve,
    stop_on_signals,
)
from megapipe.inference.server_request import Limits  # noqa: E402
from megapipe.inference.session import (  # noqa: E402
    add_model_flags,
    add_sampling_flags,
    sampling_options,
    start_session,
)

PROG = "run_text_generation_server.py"


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog=PROG, description=__doc__.split("\n\n")[0])
    add_model_flags(parser)
    add_sampling_flags(parser)
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1", help="Address to listen on (rank 0).")
    group.add_argument("--port", type=int, default=5000, help="Port (0: any free one).")
    defaults = Limits()
    group.add_argument("--max-request-bytes", type=int, default=defaults.max_request_bytes)
    group.add_argument("--max-prompts", type=int, default=defaults.max_prompts)
    group.add_argument(
        "--max-tokens-to-generate", type=int, default=defaults.max_tokens_to_generate
    )
    group.add_argument(
        "--request-timeout",
        type=float,
        default=defaults.request_timeout_s,
        help="Seconds a client may take to send its request.",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """One rank of the job; returns its exit status: any megapipe error is one line on stderr
    and status 2 (`--debug`: the traceback first)."""
    return run_cli(PROG, _main, argv, status=2)


def _main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _run(args)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _run(args: argparse.Namespace) -> int:
    limits = Limits(args.max_request_bytes, args.max_prompts, args.max_tokens_to_generate,
                    args.request_timeout)  # fmt: skip
    problems = limits.problems()
    if not 0 <= args.port <= 65535:
        problems.append(f"--port {args.port}: must be in 0..65535")
    if problems:
        raise ServerError(problems[0])
    defaults = sampling_options(args)
    stop = threading.Event()
    stop_on_signals(stop)  # before loading: a signal during the load stops the server at once
    session = start_session(args)

    def ready(host: str, port: int) -> None:
        print_address(host, port)
        say(f"rank 0 is process {os.getpid()}: SIGINT or SIGTERM to it stops every rank")

    serve(session, limits, defaults, seed=args.seed, host=args.host, port=args.port, stop=stop,
          on_ready=ready)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
