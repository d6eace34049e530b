"""Failures that every rank of a group agrees on: a rank's error becomes one line, gathered
over the group, and the lowest failing rank's line is raised on every rank, so no rank is
left waiting in a collective that its peers abandoned."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

from megapipe.checkpointing.errors import CheckpointError

T = TypeVar("T")


def gather(obj: Any, group: dist.ProcessGroup | None) -> list[Any]:
    """Every rank's `obj`, in rank order (`group` None: this process alone)."""
    if group is None:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def one_line(exc: BaseException, where: str) -> str:
    """A failure as one line naming `where` (DCP's multi-rank exceptions: the first rank's)."""
    if isinstance(exc, CheckpointError):
        return str(exc)
    failures = getattr(exc, "failures", None)  # DCP's CheckpointException: per-rank errors
    if failures:
        return one_line(failures[min(failures)][0], where)
    return (
        f"checkpoint {where}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    )


def attempt(fn: Callable[[], T], where: str) -> tuple[T | None, str | None]:
    """(result, None), or (None, the failure as one line) for the group to agree on."""
    try:
        return fn(), None
    except Exception as e:  # every failure becomes a message the group agrees on
        return None, one_line(e, where)


def agree(error: str | None, group: dist.ProcessGroup | None) -> None:
    """Raise the lowest failing rank's error on every rank (one collective)."""
    first = next((e for e in gather(error, group) if e), None)
    if first is not None:
        raise CheckpointError(first)
