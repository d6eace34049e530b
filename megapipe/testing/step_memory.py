"""One training step's memory on this rank, measured by kind: what pipeline/stage_memory
estimates, for the tests and benchmarks that check it.

`measure_step` steps a `Stepper` once and reads the optimizer's `state_bytes_per_parameter()`
after backward and the optimizer step, before `zero_grad` (FSDP2's sharded gradients are
freed there), and, under FSDP2, the peak of gathered parameters (`GatheredPeak`).

The gathered peak: FSDP2 allocates a parameter's unsharded storage only in its group's
`wait_for_unshard` (the copy-out of the all-gather into each parameter's
`all_gather_outputs`) and the all-gather's flat output buffer only in its `unshard` (which
`wait_for_unshard` calls when no prefetch did), and frees them when the group reshards (storage
resized to 0) and at the next copy-out (the forward keeps the last flat buffer that long). So
the bytes currently allocated, sampled right after every `unshard` and `wait_for_unshard`, reach
the true peak. `GatheredPeak` patches those two methods of `FSDPParamGroup` while it is entered
(a private torch class: for tests and benchmarks only, never the runtime) and counts, for the
given FSDP modules, the unsharded parameters' storages plus the flat all-gather buffers still
held (a pending result, or the one the forward defers freeing). Not counted: the unsharded
gradients of the group in backward and the reduce-scatter buffers.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup


def _storage(tensor) -> tuple[int, int]:
    storage = tensor.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


def gathered_bytes(groups: Sequence[FSDPParamGroup]) -> tuple[int, int]:
    """(bytes of unsharded parameter storage, bytes of flat all-gather buffers) that these
    FSDP2 parameter groups hold allocated now."""
    param_bytes, buffers = 0, {}
    for group in groups:
        for param in group.fsdp_params:
            tensors = list(param.all_gather_outputs)
            tensors += list(getattr(param, "_unsharded_inner_tensors", []))
            param_bytes += sum(_storage(t)[1] for t in tensors)
        state = group.comm_ctx.all_gather_state
        for result in (group._all_gather_result, state and state.all_gather_result):
            if result is not None:
                ptr, nbytes = _storage(result.all_gather_output)
                buffers[ptr] = nbytes  # the deferred one is shared by every group
    return param_bytes, sum(buffers.values())


class GatheredPeak:
    """`with GatheredPeak(modules) as probe: ...`, then `probe.peak` (bytes at the peak of
    their sum) and `probe.peak_parts` ((unsharded parameters, all-gather buffers) then)."""

    def __init__(self, modules: Sequence[FSDPModule]) -> None:
        self.groups = [g for m in modules for g in m._get_fsdp_state()._fsdp_param_groups]
        self.peak, self.peak_parts = 0, (0, 0)
        self._originals: dict[str, object] = {}

    def sample(self) -> None:
        parts = gathered_bytes(self.groups)
        if sum(parts) > self.peak:
            self.peak, self.peak_parts = sum(parts), parts

    def __enter__(self) -> GatheredPeak:
        for name in ("unshard", "wait_for_unshard"):
            original = self._originals[name] = getattr(FSDPParamGroup, name)

            def sampled(group, *args, _original=original, **kwargs):
                result = _original(group, *args, **kwargs)
                self.sample()
                return result

            setattr(FSDPParamGroup, name, sampled)
        return self

    def __exit__(self, *exc) -> None:
        for name, original in self._originals.items():
            setattr(FSDPParamGroup, name, original)


def measure_step(stepper) -> dict:
    """One iteration of `stepper` (training/step_by_step.Stepper): {"num_params": parameters
    on this rank (TP-local, unsharded), "bytes_per_param": by kind at rest, "gathered_bytes":
    FSDP2's peak of gathered parameters and all-gather buffers (0 without FSDP2),
    "gathered_parts": (parameters, buffers) at that peak}."""
    optimizer = stepper.optimizer
    measured: dict[str, float] = {}
    zero_grad = optimizer.zero_grad

    def measure_then_zero_grad() -> None:
        measured.update(optimizer.state_bytes_per_parameter())
        zero_grad()

    optimizer.zero_grad = measure_then_zero_grad
    probe = GatheredPeak(getattr(optimizer, "modules", []))  # FSDPOptimizer's, or none
    try:
        with probe:
            stepper.step()
    finally:
        del optimizer.zero_grad  # the class's method again
    params = {id(p): p for chunk in stepper.chunks for p in chunk.parameters()}
    return {
        "num_params": sum(p.numel() for p in params.values()),
        "bytes_per_param": measured,
        "gathered_bytes": probe.peak,
        "gathered_parts": probe.peak_parts,
    }
