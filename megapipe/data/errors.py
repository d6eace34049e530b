"""Errors for bad data, bad files and bad tokenizer settings: one line, naming what and where.

Tools print `str(error)` and exit non-zero; `pretrain_gpt.py` turns them into config errors before
any process group exists. Nothing here ever carries a traceback to the user.
"""

from __future__ import annotations

from megapipe.errors import MegapipeError


class DataError(MegapipeError, ValueError):
    """Bad input data or a bad data file. The message names the file (and line or offset)."""


class IndexedDatasetError(DataError):
    """A .bin/.idx pair that is missing, truncated or inconsistent."""


class TokenizerError(DataError):
    """A tokenizer that cannot be built (missing file, missing flag) or cannot encode a text."""
