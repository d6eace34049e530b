"""The "compile" implementation of an op: its reference under torch.compile, compiled on first
call (wrapping alone imports torch._dynamo, seconds), so it costs nothing where it is not used.

Dispatch chooses it only on a GPU and only for ops a measurement found faster than the Triton
kernel (KernelSettings.compile_ops; benchmarks/bench_kernels.py measures both).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch


class Compiled:
    """`fn` under torch.compile, built on the first call (the only state: the compiled fn)."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self._compiled: Callable[..., Any] | None = None
        functools.update_wrapper(self, fn)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._compiled is None:
            self._compiled = torch.compile(self.fn)
        return self._compiled(*args, **kwargs)
