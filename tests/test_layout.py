"""The house as the README describes it: no import circle among patchkit's modules, none of them over ~400 lines,
no folder of more than ~10 modules."""

from __future__ import annotations

import ast
from pathlib import Path

from entrypoints import REPO

MAX_LINES = 420  # "~400": a module past this is split by what it holds


def modules() -> dict[str, Path]:
    """patchkit's modules by dotted name (patches/ installs as patchkit.patches)."""
    found = {}
    for path in (REPO / "patchkit").rglob("*.py"):
        name = ".".join(path.relative_to(REPO).with_suffix("").parts)
        found[name.removesuffix(".__init__")] = path
    for path in (REPO / "patches").glob("*.py"):
        found["patchkit.patches" + ("" if path.stem == "__init__" else f".{path.stem}")] = path
    return found


def import_graph(found: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the patchkit modules it imports anywhere: at module level, inside functions and under TYPE_CHECKING
    alike (a reader follows each of them, so a circle through a lazy or typing-only import is a circle too)."""
    graph = {}
    for name, path in found.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("patchkit"):
                subs = {f"{node.module}.{a.name}" for a in node.names} & found.keys()
                deps |= subs if len(subs) == len(node.names) else subs | {node.module}
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
        graph[name] = (deps & found.keys()) - {name}
    return graph


def cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import circle as a path of module names, or [] when there is none (depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                return path[path.index(dep):] + [dep]
            if dep not in state and (found := visit(dep)):
                return found
        state[node] = 2
        path.pop()
        return []

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return []


def test_the_cycle_finder_finds_a_planted_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}
    assert cycle(graph) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": set()}) == []


def test_no_import_circle_among_patchkit_modules():
    graph = import_graph(modules())
    assert len(graph) > 40  # the walk found the package
    assert cycle(graph) == []


def test_no_module_over_about_400_lines():
    long = {name: n for name, path in modules().items() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def test_no_folder_holds_more_than_about_10_modules():
    """A folder past this is split into rooms by role (hooks/ is: docs/architecture.md)."""
    folders: dict[Path, int] = {}
    for path in modules().values():
        if path.stem not in ("__init__", "__main__") and (REPO / "patchkit") in path.parents:  # dunders: no room
            folders[path.parent] = folders.get(path.parent, 0) + 1
    assert {str(f.relative_to(REPO)): n for f, n in folders.items() if n > 10} == {}
