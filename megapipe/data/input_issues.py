"""Bad input lines: what was wrong where, counted per kind with the first few line numbers.

Preprocessing and tokenizer training skip bad lines by default and report them in one summary;
with --strict the first one is fatal (`StrictInputError`, one line naming file:line).
"""

from __future__ import annotations

from dataclasses import dataclass

from megapipe.data.errors import DataError

EXAMPLES_PER_KIND = 5


@dataclass(frozen=True)
class InputIssue:
    """One skipped input line."""

    line: int
    kind: str  # "malformed JSON", "invalid UTF-8", "missing key", "empty document", ...
    detail: str = ""

    def message(self, path: str) -> str:
        detail = f": {self.detail}" if self.detail else ""
        return f"{path}:{self.line}: {self.kind}{detail}"


class StrictInputError(DataError):
    """A bad input line under --strict."""


class IssueLog:
    """Counts issues by kind, keeping the first EXAMPLES_PER_KIND line numbers of each."""

    def __init__(self, path: str, strict: bool = False) -> None:
        self.path = path
        self.strict = strict
        self.counts: dict[str, int] = {}
        self.examples: dict[str, list[int]] = {}

    def add(self, issue: InputIssue) -> None:
        if self.strict:
            raise StrictInputError(f"{issue.message(self.path)} (--strict)")
        self.counts[issue.kind] = self.counts.get(issue.kind, 0) + 1
        examples = self.examples.setdefault(issue.kind, [])
        if len(examples) < EXAMPLES_PER_KIND:
            examples.append(issue.line)

    def extend(self, issues: list[InputIssue]) -> None:
        for issue in sorted(issues, key=lambda i: i.line):
            self.add(issue)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def summary(self, lines: int | None = None) -> str:
        """E.g. `in.jsonl: skipped 3 of 1000 lines: 2 malformed JSON (lines 5, 9), ...`."""
        of = "" if lines is None else f" of {lines}"
        if not self.counts:
            return f"{self.path}: all{of} lines used"
        parts = []
        for kind, count in sorted(self.counts.items(), key=lambda item: -item[1]):
            shown = self.examples[kind]
            where = ", ".join(str(n) for n in shown) + (", ..." if count > len(shown) else "")
            parts.append(f"{count} {kind} (line{'s' if count > 1 else ''} {where})")
        return f"{self.path}: skipped {self.total}{of} lines: {'; '.join(parts)}"
