"""Real English that ships with Python itself: a demo corpus with no download.

Documents come first from `pydoc_data.topics` (the language reference topics behind `help()`),
then from the standard library's docstrings, one document per module, read with `ast` (nothing
is imported or executed). The order is deterministic for a given Python version.
"""

from __future__ import annotations

import ast
import os
import sysconfig
from collections.abc import Iterator

_SKIP_DIRS = frozenset(
    {"test", "tests", "idlelib", "site-packages", "dist-packages", "lib2to3", "turtledemo"}
    | {"pydoc_data", "__pycache__", "ensurepip"}
)
_MAX_SOURCE_BYTES = 1 << 20


def _topic_documents() -> Iterator[dict[str, str]]:
    from pydoc_data.topics import topics

    for name in sorted(topics):
        text = topics[name].strip()
        if text:
            yield {"text": text, "source": f"pydoc_data.topics:{name}"}


def _module_docstrings(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as file:
            tree = ast.parse(file.read())
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return ""
    docs = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            doc = ast.get_docstring(node)
            if doc and len(doc) >= 40:
                docs.append(doc.strip())
    return "\n\n".join(docs)


def _docstring_documents(min_chars: int) -> Iterator[dict[str, str]]:
    root = sysconfig.get_paths()["stdlib"]
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = sorted(
            d for d in subdirs if d not in _SKIP_DIRS and not d.startswith("config-")
        )
        for name in sorted(files):
            path = os.path.join(directory, name)
            if not name.endswith(".py") or os.path.getsize(path) > _MAX_SOURCE_BYTES:
                continue
            text = _module_docstrings(path)
            if len(text) >= min_chars:
                module = os.path.relpath(path, root)[: -len(".py")].replace(os.sep, ".")
                yield {"text": text, "source": f"stdlib:{module}"}


def demo_documents(
    max_chars: int | None = None, docstrings: bool = True, min_chars: int = 200
) -> Iterator[dict[str, str]]:
    """Documents {"text", "source"} until about `max_chars` characters (None: all of them)."""
    total = 0
    sources = [_topic_documents()]
    if docstrings:
        sources.append(_docstring_documents(min_chars))
    for source in sources:
        for document in source:
            if max_chars is not None and total >= max_chars:
                return
            total += len(document["text"])
            yield document
