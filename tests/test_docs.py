"""The README and docs/: the README stays short and states the commands CI runs, every relative
link (and anchor) in README.md and docs/*.md resolves, every docs page is reachable from the
README, and docs/troubleshooting.md's error tables are the bad-input catalogue
(tests/test_bad_input.py), as tools/gen_troubleshooting.py renders it."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = [README, *sorted(DOCS.glob("*.md"))]
README_LIMIT = 16 * 1024  # bytes

LINK = re.compile(r"!?\[(?:[^\]\\]|\\.)*\]\(([^()\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(```|~~~)")


def prose(text: str) -> str:
    """`text` without fenced code blocks and inline code spans (links there are not links)."""
    kept, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line.strip()):
            fenced = not fenced
            continue
        if not fenced:
            kept.append(re.sub(r"`[^`]*`", "", line))
    return "\n".join(kept)


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = text.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading's anchor on a page (a repeated heading gets -1, -2, ... as on GitHub)."""
    seen: dict[str, int] = {}
    found = set()
    fenced = False
    for line in page.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line.strip()):
            fenced = not fenced
            continue
        heading = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if fenced or not heading:
            continue
        anchor = github_anchor(heading[1])
        count = seen.get(anchor, 0)
        seen[anchor] = count + 1
        found.add(anchor if count == 0 else f"{anchor}-{count}")
    return found


def relative_links(page: Path) -> list[str]:
    targets = LINK.findall(prose(page.read_text(encoding="utf-8")))
    return [t for t in targets if not re.match(r"[a-z][a-z0-9+.-]*:", t)]  # no http:, mailto:


def broken_links(page: Path, root: Path = ROOT) -> list[str]:
    broken = []
    for target in relative_links(page):
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{page.relative_to(root)}: {target} (no such file)")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{page.relative_to(root)}: {target} (no such heading)")
    return broken


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    assert not broken_links(page), "\n".join(broken_links(page))


def test_the_link_checker_finds_broken_links(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# A title, with `code`\n\n## Twice\n\n## Twice\n")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](other.md) [ok](other.md#a-title-with-code) [ok](other.md#twice-1) [ok](#here)\n"
        "# Here\n[gone](missing.md) [bad](other.md#nowhere) [web](https://example.com)\n"
        "`[not a link](nothing.md)`\n```\n[not a link](nothing.md)\n```\n"
    )
    assert broken_links(page, tmp_path) == [
        "page.md: missing.md (no such file)",
        "page.md: other.md#nowhere (no such heading)",
    ]


def test_every_docs_page_is_linked_from_the_readme() -> None:
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in relative_links(README)}
    missing = [p.name for p in DOCS.glob("*.md") if p.resolve() not in linked]
    assert not missing, f"docs pages the README does not link to: {missing}"


def test_readme_is_short_and_states_the_commands() -> None:
    text = README.read_text(encoding="utf-8")
    assert len(text.encode()) <= README_LIMIT, f"README.md is {len(text.encode())} bytes"
    # What .ci/run runs is what the README tells a user to run.
    ci = (ROOT / ".ci" / "run").read_text()
    test_command = "ruff check . && ruff format --check . && python -m pytest"
    assert test_command in ci and '-e ".[dev]"' in ci
    assert f'\npip install -e ".[dev]" && {test_command}\n' in text
    # the demo installs megapipe without the [dev] extra: only what it needs
    demo = "pip install torch==2.13.0 && pip install -e . && bash examples/pretrain_gpt_demo_cpu.sh"
    assert f"\n{demo}\n" in text
    assert 'python -m pytest -m "not slow"' in text


def _generator():
    spec = importlib.util.spec_from_file_location(
        "gen_troubleshooting", ROOT / "tools" / "gen_troubleshooting.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_troubleshooting_page_is_the_bad_input_catalogue() -> None:
    gen = _generator()
    page = gen.PAGE.read_text(encoding="utf-8")
    wanted = gen.splice(page, gen.render(gen.catalogue()))
    assert page == wanted, (
        "docs/troubleshooting.md differs from the bad-input catalogue in tests/test_bad_input.py: "
        "run python tools/gen_troubleshooting.py"
    )
    rows = sum(len(group) for group in gen.catalogue().values())
    assert page.count("\n| `") >= rows


def test_the_troubleshooting_check_notices_a_change() -> None:
    gen = _generator()
    page = gen.PAGE.read_text(encoding="utf-8")
    groups = {name: list(rows) for name, rows in gen.catalogue().items()}
    groups["flags"] = groups["flags"][1:]  # a row taken out of the catalogue
    assert gen.splice(page, gen.render(groups)) != page
