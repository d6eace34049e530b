"""The error a bad setting raises, in a module of its own so that every layer can raise it
without importing the configs (and the configs stay pure data)."""

from __future__ import annotations


class ConfigError(ValueError):
    """An impossible or inconsistent setting. The message names the flags and their values."""


def flag(name: str) -> str:
    """The command-line flag for a config field name: `hidden_size` -> `--hidden-size`."""
    return "--" + name.replace("_", "-")
