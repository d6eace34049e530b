"""Megatron-LM flags beyond the ones megapipe implements: which are accepted with no effect here,
which are refused by name, and what an unknown flag probably meant.

A Megatron-LM user's launch script carries flags that only matter on a GPU with fused kernels
(`--use-cpu-initialization`, `--no-gradient-accumulation-fusion`, ...). Those are accepted and
reported once at start-up as having no effect, so the script runs unchanged. A Megatron-LM
feature megapipe does not have yet (`--fp8`, `--multi-latent-attention`) is refused
with a line that names it, rather than argparse's generic "unrecognized arguments", and never
silently ignored.
"""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Sequence
from dataclasses import dataclass

from megapipe.errors import ConfigError

GRAD_ACCUMULATION = "gradients always accumulate straight into the fp32 main_grad buffer"


@dataclass(frozen=True)
class NoEffectFlag:
    """A Megatron-LM flag accepted for compatibility that changes nothing here.

    `nargs` is 0 for a switch, else argparse's nargs. A value in `matching_values` is what
    megapipe does anyway, so it is accepted without a note.
    """

    flag: str
    reason: str
    nargs: int | str = 0
    matching_values: tuple[str, ...] = ()

    @property
    def dest(self) -> str:
        return "compat_" + self.flag.lstrip("-").replace("-", "_")


NO_EFFECT_FLAGS: tuple[NoEffectFlag, ...] = (
    NoEffectFlag("--use-mcore-models", "megapipe has one model implementation"),
    NoEffectFlag("--no-gradient-accumulation-fusion", GRAD_ACCUMULATION),
    NoEffectFlag(
        "--use-cpu-initialization",
        "parameters are always initialised from (seed, name) on the CPU generator",
    ),
    NoEffectFlag("--empty-unused-memory-level", "the CUDA cache is never emptied", 1, ("0",)),
    NoEffectFlag("--num-workers", "batches are read in the training process", 1),
    NoEffectFlag("--dataloader-type", "samples are read in order", 1, ("single",)),
    NoEffectFlag("--manual-gc", "Python's garbage collector runs as usual"),
    NoEffectFlag("--timing-log-level", "the log line always shows the iteration time", 1, ("0",)),
)

# Megatron-LM features megapipe does not have: refused by name (argv is scanned for them
# before argparse sees it, so a value after the flag does not matter).
UNSUPPORTED_FLAGS: tuple[str, ...] = (
    "--fp8",
    "--use-legacy-models",
    "--spec",
    "--yaml-cfg",
    "--multi-latent-attention",
    "--pipeline-model-parallel-split-rank",
    "--encoder-num-layers",
    "--decoder-num-layers",
    "--sft",
    "--hierarchical-context-parallel-sizes",
)


def refuse_unsupported(argv: Sequence[str]) -> None:
    """ConfigError for the first Megatron-LM flag in `argv` that megapipe does not support."""
    for token in argv:
        name = token.split("=", 1)[0]
        if name in UNSUPPORTED_FLAGS:
            raise ConfigError(f"{name} is a Megatron-LM flag that megapipe does not support yet")


def add_compat_args(group: argparse._ArgumentGroup) -> None:
    """Register the accepted-with-no-effect flags."""
    for item in NO_EFFECT_FLAGS:
        if item.nargs == 0:
            group.add_argument(
                item.flag, dest=item.dest, action="store_true", help=argparse.SUPPRESS
            )
        else:
            group.add_argument(
                item.flag, dest=item.dest, default=None, nargs=None, help=argparse.SUPPRESS
            )


def compat_notes(args: argparse.Namespace) -> list[str]:
    """One note per no-effect flag the user gave."""
    notes = []
    for item in NO_EFFECT_FLAGS:
        value = getattr(args, item.dest)
        if value in (None, False) or value in item.matching_values:
            continue
        given = item.flag if value is True else f"{item.flag} {value}"
        notes.append(f"{given} has no effect here: {item.reason}")
    return notes


def unknown_flag_message(message: str, parser: argparse.ArgumentParser) -> str:
    """argparse's "unrecognized arguments: --x" with the closest real flag suggested."""
    prefix = "unrecognized arguments: "
    if not message.startswith(prefix):
        return message
    known = [s for action in parser._actions for s in action.option_strings if s.startswith("--")]
    hints = []
    for token in message[len(prefix) :].split():
        name = token.split("=", 1)[0]
        if not name.startswith("--"):
            continue
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.75)
        hints.append(f"{name}: did you mean {close[0]}?" if close else f"{name} is not a flag")
    return message + (f" ({'; '.join(hints)})" if hints else "")
