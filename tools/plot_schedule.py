"""Draw a pipeline schedule as a timeline image (PNG, SVG, PDF, ...), simulated or measured.

    python tools/plot_schedule.py --schedule interleaved-1f1b --pp 4 --vp 2 --microbatches 8 \\
        --output docs/schedule_interleaved_sim.png
    python tools/plot_schedule.py --trace /tmp/trace.json --output docs/schedule_1f1b_measured.png

A simulated schedule uses the simulator's cost model (forward 1/v, backward 2/v per chunk, or for
the zero-bubble kinds forward, B and W 1/v each; free transfers), and its bubble is printed on
stdout as in the picture's title (`bubble N% of compute time`); a trace is the Chrome-trace
JSON written by `pretrain_gpt.py --pipeline-trace`, of which one iteration is drawn (`--step`,
default the last recorded). Needs matplotlib (`pip install -e ".[dev]"`).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from collections.abc import Sequence

from megapipe.data.tool_cli import OneLineParser
from megapipe.errors import ConfigError, MegapipeError, error_line, split_debug
from megapipe.pipeline.schedules import SCHEDULE_KINDS, validate_schedule
from megapipe.pipeline.timeline import (
    load_trace,
    measured_timeline,
    simulated_timeline,
)

PROG = "plot_schedule.py"

# The schedule checks speak pretrain_gpt.py's flags; this tool's own stand in for them.
TOOL_FLAGS = (
    ("--pipeline-schedule", "--schedule"),
    (
        "virtual pipeline stages (--num-layers-per-virtual-pipeline-stage or "
        "--num-virtual-stages-per-pipeline-rank)",
        "--vp 2 or more (model chunks per rank)",
    ),
    ("--pipeline-model-parallel-size", "--pp"),
    ("(global batch = micro-batch x data-parallel size x micro-batches)", "(--microbatches)"),
)


def in_tool_flags(message: str) -> str:
    """A schedule check's message with this tool's flag names."""
    for training, tool in TOOL_FLAGS:
        message = message.replace(training, tool)
    return message


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog=PROG, description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--schedule", choices=SCHEDULE_KINDS, help="Simulate this schedule.")
    source.add_argument("--trace", help="Chrome-trace JSON written by --pipeline-trace.")
    parser.add_argument("--pp", type=int, default=4, help="Pipeline ranks (simulated). Default 4.")
    parser.add_argument("--vp", type=int, default=1, help="Chunks per rank (simulated). Default 1.")
    parser.add_argument("--microbatches", type=int, default=8, help="Simulated. Default 8.")
    parser.add_argument("--step", type=int, help="Trace iteration to draw (default: the last).")
    parser.add_argument(
        "--output",
        required=True,
        help="Image file to write, in the format its suffix names (.png, .svg, .pdf, .jpg, ...).",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv, debug = split_debug(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if importlib.util.find_spec("matplotlib") is None:
        print(
            f"{PROG}: error: matplotlib is not installed "
            '(pip install matplotlib, or pip install -e ".[dev]")',
            file=sys.stderr,
        )
        return 1
    from megapipe.pipeline.timeline_plot import draw_timeline, image_format

    try:
        image_format(args.output)
        if args.trace:
            timeline = measured_timeline(load_trace(args.trace), args.step)
        else:
            try:
                validate_schedule(args.schedule, args.pp, args.vp, args.microbatches)
            except ConfigError as error:
                raise ConfigError(in_tool_flags(str(error))) from error
            timeline = simulated_timeline(args.schedule, args.pp, args.vp, args.microbatches)
    except MegapipeError as error:  # a bad schedule or trace: one line, status 1
        print(error_line(PROG, error, debug), file=sys.stderr)
        return 1
    draw_timeline(timeline, args.output)
    first, *rest = timeline.title.splitlines()
    print(f"{PROG}: wrote {args.output} ({first})")
    for line in rest:
        print(f"{PROG}: {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
