"""--profile: capture iterations [--profile-step-start, --profile-step-end) on --profile-ranks.

As Megatron-LM does, two ways:
- with --use-pytorch-profiler, `torch.profiler.profile` (CPU, and CUDA activity on a GPU) with
  record_shapes, its schedule keyed by the loop's own iteration numbers (so a resumed run
  profiles the same iterations) and `tensorboard_trace_handler(--tensorboard-dir)`: one
  Chrome-trace JSON per profiling rank (`rank<R>.<time>.pt.trace.json`) that TensorBoard's
  profile plugin, Perfetto and chrome://tracing open. Each profiled iteration is a
  `record_function` range named `iteration N`;
- without it, for Nsight Systems (`nsys profile --capture-range=cudaProfilerApi`):
  `torch.cuda.profiler.start/stop` around those iterations, autograd's NVTX ranges
  (`emit_nvtx(record_shapes=True)`) and one NVTX range per iteration. On a CPU there is
  nothing for nsys to capture: the loop says so once and profiles nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch.profiler import ProfilerAction, ProfilerActivity

from megapipe.config import LoggingConfig


def profiler_schedule(
    start: int, end: int, first_iteration: int
) -> Callable[[int], ProfilerAction]:
    """torch.profiler's schedule for iterations [start, end) when the profiler's step 0 is
    iteration `first_iteration`: one warm-up iteration before `start` where there is one,
    the trace saved at the end of iteration end - 1."""

    def action(step: int) -> ProfilerAction:
        iteration = first_iteration + step
        if iteration == start - 1:
            return ProfilerAction.WARMUP
        if start <= iteration < end - 1:
            return ProfilerAction.RECORD
        if iteration == end - 1:
            return ProfilerAction.RECORD_AND_SAVE
        return ProfilerAction.NONE

    return action


class IterationProfiler:
    """--profile on one rank: call `begin(n)` before iteration n, `end(n)` after it, and
    `close()` when the loop ends (however it ends)."""

    def __init__(
        self, logging: LoggingConfig, rank: int, device: torch.device, first_iteration: int
    ) -> None:
        self.start, self.stop = logging.profile_step_start, logging.profile_step_end
        self.cuda = device.type == "cuda"
        self._range: contextlib.ExitStack | None = None
        self._nvtx: contextlib.ExitStack | None = None
        self.torch_profiler: torch.profiler.profile | None = None
        if logging.use_pytorch_profiler:
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
            handler = torch.profiler.tensorboard_trace_handler(
                logging.tensorboard_dir, worker_name=f"rank{rank}"
            )
            self.torch_profiler = torch.profiler.profile(
                activities=activities,
                schedule=profiler_schedule(self.start, self.stop, first_iteration),
                on_trace_ready=handler,
                record_shapes=True,
            )
            self.torch_profiler.start()

    def profiles(self, iteration: int) -> bool:
        return self.start <= iteration < self.stop

    def begin(self, iteration: int) -> None:
        """Before iteration `iteration`: open its named range; start nsys's capture."""
        if not self.profiles(iteration):
            return
        self._range = contextlib.ExitStack()
        if self.torch_profiler is not None:
            self._range.enter_context(torch.profiler.record_function(f"iteration {iteration}"))
        elif self.cuda:
            if self._nvtx is None:
                torch.cuda.profiler.start()
                self._nvtx = contextlib.ExitStack()
                self._nvtx.enter_context(torch.autograd.profiler.emit_nvtx(record_shapes=True))
            torch.cuda.nvtx.range_push(f"iteration {iteration}")
            self._range.callback(torch.cuda.nvtx.range_pop)

    def end(self, iteration: int) -> None:
        """After iteration `iteration`: close its range; advance or stop the capture."""
        if self._range is not None:
            self._range.close()
            self._range = None
        if self.torch_profiler is not None:
            self.torch_profiler.step()
        elif iteration == self.stop - 1:
            self._stop_nsys()

    def _stop_nsys(self) -> None:
        if self._nvtx is not None:
            self._nvtx.close()
            self._nvtx = None
            torch.cuda.profiler.stop()

    def close(self) -> None:
        """Stop whatever is running (an early exit inside the window still writes its trace)."""
        if self._range is not None:
            self._range.close()
            self._range = None
        if self.torch_profiler is not None:
            self.torch_profiler.stop()
            self.torch_profiler = None
        self._stop_nsys()


def profiler_for(
    logging: LoggingConfig, rank: int, device: torch.device, first_iteration: int
) -> tuple[IterationProfiler | None, str | None]:
    """This rank's profiler (None where it does not profile) and a start-up note, if any."""
    if not logging.profile:
        return None, None
    if not logging.use_pytorch_profiler and device.type != "cuda":
        return None, (
            "--profile without --use-pytorch-profiler drives the CUDA profiler (nsys); there is "
            "nothing to capture without CUDA: add --use-pytorch-profiler for a torch.profiler "
            "trace in --tensorboard-dir"
        )
    if rank not in logging.profile_ranks:
        return None, None
    return IterationProfiler(logging, rank, device, first_iteration), None
