"""Imports run one way (docs: DESIGN.md, "Imports run one way"): megapipe's module import graph,
read from the source of every module (imports inside functions and under TYPE_CHECKING count:
a lazy import hides a cycle, it does not remove it), has no cycle outside a short list of known
ones, each named with who removes it."""

from __future__ import annotations

import ast
from pathlib import Path

import megapipe

ROOT = Path(megapipe.__file__).resolve().parent

# Cycles that remain, each with who removes it: a cycle found must lie inside one entry (so an
# entry keeps passing while its cycle shrinks), and an entry no cycle lies in any more fails the
# test as stale (so the lists only shrink). Modules first, then packages (megapipe.X).
ALLOWED: dict[frozenset[str], str] = {}
ALLOWED_PACKAGES: dict[frozenset[str], str] = {}


# Which packages each lower package must not import (Imports run one way: parallel, layers,
# model, pipeline/distributed, checkpointing, then training/inference/arguments on top).
_UPPER = {"training", "inference", "arguments", "checkpointing", "conversion"}
NOT_IMPORTED: dict[str, set[str]] = {
    "parallel": {"layers", "model", "pipeline", "distributed", "data", *_UPPER},
    "layers": {"model", "pipeline", "distributed", "data", *_UPPER},
    "model": {"pipeline", "distributed", *_UPPER},
    "pipeline": _UPPER,
    "distributed": {"model", "pipeline", *_UPPER},
    "checkpointing": {"model", "pipeline", "training", "inference", "arguments", "conversion"},
}
# Upward imports that remain, with who removes them (the test fails on a stale entry too).
ALLOWED_UPWARD: dict[tuple[str, str], str] = {}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(path): path for path in sorted(ROOT.rglob("*.py"))}


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The longest prefix of dotted `name` that is a megapipe module."""
    parts = name.split(".")
    while parts:
        if ".".join(parts) in modules:
            return ".".join(parts)
        parts.pop()
    return None


def import_graph() -> dict[str, set[str]]:
    """module -> the megapipe modules its source imports, anywhere in the file."""
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")
                    anchor = anchor[: len(anchor) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                # `from pkg import sub` imports the submodule; `from mod import name` the module
                targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
            for target in targets:
                found = _resolve(target, modules) if target.startswith("megapipe") else None
                if found is not None and found != name:
                    graph[name].add(found)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(frozenset(component))
    return found


def _path(graph: dict[str, set[str]], component: frozenset[str]) -> str:
    """One cycle through the component, `a -> b -> a`, for the failure message."""
    start = min(component)
    seen = {start: None}
    queue = [start]
    while queue:
        node = queue.pop(0)
        for child in sorted(graph[node] & component):
            if child == start:
                chain = [node]
                while seen[chain[-1]] is not None:
                    chain.append(seen[chain[-1]])
                return " -> ".join([*reversed(chain), start])
            if child not in seen:
                seen[child] = node
                queue.append(child)
    return " <-> ".join(sorted(component))


def test_the_graph_sees_lazy_and_type_checking_imports() -> None:
    graph = import_graph()
    assert "megapipe.errors" in graph and "megapipe.config" in graph
    assert all(target.startswith("megapipe") for targets in graph.values() for target in targets)


def test_cycles_are_found() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == [frozenset("abc")]
    assert _path(graph, frozenset("abc")) == "a -> b -> c -> a"


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The same graph between megapipe's subpackages and top-level modules (megapipe.X)."""

    def top(name: str) -> str:
        return ".".join(name.split(".")[:2])

    packages: dict[str, set[str]] = {top(name): set() for name in graph}
    for name, targets in graph.items():
        packages[top(name)] |= {top(t) for t in targets if top(t) not in (top(name), "megapipe")}
    return packages


def _check(graph: dict[str, set[str]], allowed: dict[frozenset[str], str], what: str) -> None:
    found = cycles(graph)
    new = [c for c in found if not any(c <= entry for entry in allowed)]
    stale = [sorted(entry) for entry in allowed if not any(c <= entry for c in found)]
    report = "\n".join(f"{len(c)} {what}: {_path(graph, c)}" for c in new)
    assert not new, f"import cycles (a lazy or TYPE_CHECKING import counts too):\n{report}"
    assert not stale, f"these cycles are gone: take them out of the allowed list: {stale}"


def test_modules_import_one_way() -> None:
    _check(import_graph(), ALLOWED, "modules")


def test_packages_import_one_way() -> None:
    _check(package_graph(import_graph()), ALLOWED_PACKAGES, "packages")


def _package(name: str) -> str:
    """`model` for megapipe.model.gpt; '' for megapipe itself."""
    return name.split(".")[1] if "." in name else ""


def test_lower_packages_do_not_import_upper_ones() -> None:
    upward = {
        (name, target)
        for name, targets in import_graph().items()
        for target in targets
        if _package(target) in NOT_IMPORTED.get(_package(name), ())
    }
    new = sorted(upward - set(ALLOWED_UPWARD))
    stale = sorted(set(ALLOWED_UPWARD) - upward)
    assert not new, "imports against the layering:\n" + "\n".join(f"{a} -> {b}" for a, b in new)
    assert not stale, f"these imports are gone: take them out of ALLOWED_UPWARD: {stale}"


def test_the_runtime_never_imports_test_support_and_kernels_never_import_the_model() -> None:
    """megapipe.testing (harness, parity, reference GPT, kernel cases) is for tests, tools and
    benchmarks; kernel inputs built from model code made kernels <-> model a cycle."""
    offenders = [
        f"{name} imports {target}"
        for name, targets in import_graph().items()
        if _package(name) != "testing"
        for target in targets
        if _package(target) == "testing"
        or (_package(name), _package(target)) == ("kernels", "model")
    ]
    assert offenders == []
