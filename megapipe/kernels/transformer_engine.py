"""TransformerEngine and FP8: whether a run may use them, and the FP8 recipe and autocast.

The decisions are pure functions of plain data (is TE usable, the device type, its compute
capability, the flags) so that CPU tests can decide for a GPU they are not running on; only
`fp8_recipe` and `fp8_autocast` import TransformerEngine, and only when FP8 is on.
`FP8Scope` decides where the autocast is entered: once per model chunk forward (the amax
reduction and scale update run when the outermost autocast exits, so once per chunk, not once
per module), and again only for TE modules that run outside it (a recomputation in backward).

Rules (each refusal is one ConfigError line naming the flag and what is missing):
- `--transformer-impl transformer_engine` needs a CUDA device and an importable
  `transformer_engine.pytorch`;
- `--fp8-format` needs `--transformer-impl transformer_engine` (FP8 GEMMs are TE's) and a GPU
  of compute capability >= 8.9 (Ada / Hopper and later: the first with FP8 tensor cores).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from megapipe.errors import ConfigError
from megapipe.kernels.availability import Probe

FP8_FORMATS = ("hybrid", "e4m3")
FP8_AMAX_COMPUTE_ALGOS = ("max", "most_recent")
FP8_MIN_CAPABILITY = (8, 9)
_USE_LOCAL = "use --transformer-impl local"


def check_transformer_engine(
    transformer_impl: str,
    fp8_format: str | None,
    *,
    te: Probe,
    device_type: str,
    capability: tuple[int, int] | None,
) -> None:
    """Refuse a TE / FP8 request that cannot run here. te: can TransformerEngine run (a
    probe's verdict); capability: the CUDA device's (major, minor), None when unknown (then
    the FP8 capability check waits for the device)."""
    if fp8_format is not None:
        if fp8_format not in FP8_FORMATS:
            raise ConfigError(
                f"--fp8-format {fp8_format}: expected one of {', '.join(FP8_FORMATS)}"
            )
        if transformer_impl != "transformer_engine":
            raise ConfigError(
                f"--fp8-format {fp8_format} needs --transformer-impl transformer_engine "
                f"(FP8 matmuls are TransformerEngine's); got --transformer-impl {transformer_impl}"
            )
    if transformer_impl != "transformer_engine":
        return
    if device_type != "cuda":
        raise ConfigError(
            "--transformer-impl transformer_engine: TransformerEngine needs a CUDA device "
            f"and this run is on {device_type}; {_USE_LOCAL}"
        )
    if not te.available:
        raise ConfigError(
            "--transformer-impl transformer_engine: TransformerEngine is not usable here "
            f"({te.reason}); {_USE_LOCAL}"
        )
    if fp8_format is not None and capability is not None and capability < FP8_MIN_CAPABILITY:
        major, minor = capability
        raise ConfigError(
            f"--fp8-format {fp8_format}: FP8 needs a GPU of compute capability >= 8.9 (Ada, "
            f"Hopper or later) and this one is {major}.{minor}; drop --fp8-format"
        )


def check_fp8_recipe(margin: int, amax_history_len: int, amax_compute_algo: str) -> None:
    """The recipe flags' own ranges."""
    if amax_compute_algo not in FP8_AMAX_COMPUTE_ALGOS:
        raise ConfigError(
            f"--fp8-amax-compute-algo {amax_compute_algo}: expected one of "
            f"{', '.join(FP8_AMAX_COMPUTE_ALGOS)}"
        )
    if amax_history_len < 1:
        raise ConfigError(f"--fp8-amax-history-len {amax_history_len}: must be at least 1")
    if margin < 0:
        raise ConfigError(f"--fp8-margin {margin}: must be >= 0")


def fp8_recipe_kwargs(settings: Any) -> dict[str, Any] | None:
    """DelayedScaling's keyword arguments for these settings (a KernelConfig or anything with
    its fp8_* fields), as plain data: the format is the `Format` member's name. None: no FP8."""
    if getattr(settings, "fp8_format", None) is None:
        return None
    return {
        "margin": settings.fp8_margin,
        "fp8_format": settings.fp8_format.upper(),  # Format.HYBRID / Format.E4M3
        "amax_history_len": settings.fp8_amax_history_len,
        "amax_compute_algo": settings.fp8_amax_compute_algo,
    }


def fp8_recipe(kwargs: dict[str, Any], *, reduce_amax: bool = True) -> Any:
    """TE's DelayedScaling recipe from `fp8_recipe_kwargs` (imports TransformerEngine).
    reduce_amax False: no amax all-reduce (one TP rank: the default group would be the whole
    world, which pipeline stages with different layers must not reduce over together). A TE
    whose DelayedScaling has no reduce_amax field always reduces; at TP=1 with PP>1 that is
    the world group (untested: no GPU has run this yet)."""
    from transformer_engine.common import recipe

    values = dict(kwargs, fp8_format=getattr(recipe.Format, kwargs["fp8_format"]))
    fields = getattr(recipe.DelayedScaling, "__dataclass_fields__", {})
    if "reduce_amax" in fields:
        values["reduce_amax"] = reduce_amax
    return recipe.DelayedScaling(**values)


@contextlib.contextmanager
def fp8_autocast(recipe: Any | None, group: Any | None) -> Iterator[None]:
    """TE's FP8 autocast with `recipe` and amax reduction over `group` (a process group); a
    no-op when recipe is None (no FP8)."""
    if recipe is None:
        yield
        return
    import transformer_engine.pytorch as te

    if hasattr(te, "autocast"):  # TE >= 2.8 (fp8_autocast is its deprecated alias there)
        context = te.autocast(enabled=True, recipe=recipe, amax_reduction_group=group)
    else:
        context = te.fp8_autocast(enabled=True, fp8_recipe=recipe, fp8_group=group)
    with context:
        yield


class FP8Scope:
    """One model chunk's FP8 autocast: `with scope():` enters `enter()` (e.g. a
    `functools.partial(fp8_autocast, recipe, group)`) unless this scope is already entered, so
    a chunk's forward enters it once and the modules inside, which also ask, enter nothing.
    enter None: no FP8, every `with scope():` is a no-op. `entries` counts real entries."""

    def __init__(self, enter: Callable[[], contextlib.AbstractContextManager] | None) -> None:
        self._enter = enter
        self._depth = 0
        self.entries = 0

    @property
    def enabled(self) -> bool:
        return self._enter is not None

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        if self._enter is None or self._depth:
            yield
            return
        self._depth += 1
        self.entries += 1
        try:
            with self._enter():
                yield
        finally:
            self._depth -= 1

    def wrap(self, function: Callable[..., Any]) -> Callable[..., Any]:
        """`function` run inside this scope (for a recomputed piece: its forward again in
        backward, outside the chunk's autocast, enters it once for the whole piece)."""
        if self._enter is None:
            return function

        def scoped(*args: Any, **kwargs: Any) -> Any:
            with self():
                return function(*args, **kwargs)

        return scoped
