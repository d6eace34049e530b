"""The error every checkpoint reader and writer raises: one line that names the file or
directory and the mismatch (a corrupt, incomplete, foreign or malicious checkpoint)."""

from __future__ import annotations

from megapipe.errors import MegapipeError


class CheckpointError(MegapipeError, RuntimeError):
    """A checkpoint that cannot be written or loaded as asked. The message names where and why."""
