"""Save in a background thread while training continues, at most one save in flight.

`AsyncSaver.save` copies this rank's pieces into fresh CPU tensors on the calling thread (the
only cost training sees: one memcpy of the shards), then runs `save_sharded` on a thread.
A second `save` first waits for the one in flight. The saver's `group` must be a process group
used for nothing else (create one for checkpointing): collectives of two threads on one group
would interleave: `new_saving_group` makes one, a gloo group whatever the run's backend (the
staged pieces are CPU tensors, and an NCCL group would need CUDA streams of its own on a thread
that training does not wait for). The thread makes the caller's CUDA device current first (a new
thread starts on device 0 whatever `set_device` the main thread called). `wait()` re-raises the
background save's error on the caller's thread.
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from megapipe.checkpointing.shards import ShardedState, TensorShard
from megapipe.checkpointing.torch_dist import save_sharded

SAVING_BACKEND = "gloo"  # CPU tensors off the training thread, on any machine


def new_saving_group(timeout: timedelta | None = None) -> dist.ProcessGroup:
    """A process group over the whole world for the saver's collectives only (collective:
    every rank calls it): gloo even where the default group is NCCL. timeout: None for
    torch's default (pass `parallel.initialize.default_group_timeout()`)."""
    if timeout is None:
        return dist.new_group(backend=SAVING_BACKEND)
    return dist.new_group(backend=SAVING_BACKEND, timeout=timeout)


def caller_device() -> torch.device:
    """The calling thread's device: cuda:N where CUDA is in use (initialised), else cpu."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def thread_cuda_device(device: torch.device) -> int | None:
    """The CUDA device index the saving thread makes current for `device` (the one training
    runs on), or None off CUDA (nothing to set)."""
    if device.type != "cuda":
        return None
    return 0 if device.index is None else device.index


def stage(shards: ShardedState) -> ShardedState:
    """Contiguous CPU copies of every piece, safe from later in-place updates of the originals."""
    staged = {}
    for name, pieces in shards.items():
        staged[name] = [
            TensorShard(
                torch.empty(p.tensor.shape, dtype=p.tensor.dtype).copy_(p.tensor.detach()),
                p.offsets,
                p.global_shape,
            )
            for p in pieces
        ]
    return staged


class AsyncSaver:
    """One background `save_sharded` at a time over a dedicated checkpointing `group`
    (None: this rank alone). device: the one training runs on (default: the caller's)."""

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device | None = None) -> None:
        self._group = group
        self.device = caller_device() if device is None else device
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def save(
        self,
        directory: str,
        shards: ShardedState,
        common: dict | None,
        *,
        coordinator: bool,
        then: Callable[[], None] | None = None,
        objects: dict[str, bytes] | None = None,
    ) -> float:
        """Stage and start saving; `then` (e.g. writing the tracker) runs on the background
        thread once `directory` is in place. Returns the seconds the caller was blocked
        (waiting for the previous save, plus staging)."""
        start = time.perf_counter()
        self.wait()
        staged = stage(shards)
        staged_common = copy.deepcopy(common)

        cuda_index = thread_cuda_device(self.device)

        def run() -> None:
            try:
                if cuda_index is not None:
                    torch.cuda.set_device(cuda_index)
                save_sharded(
                    directory,
                    staged,
                    staged_common,
                    group=self._group,
                    coordinator=coordinator,
                    objects=objects,
                )
                if then is not None:
                    then()
            except BaseException as e:  # handed to wait() on the caller's thread
                self._error = e

        self._thread = threading.Thread(target=run, name="megapipe-async-save", daemon=False)
        self._thread.start()
        return time.perf_counter() - start

    @property
    def in_flight(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> None:
        """Block until the save in flight (if any) is done; raise its error if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error
