"""The packages import downwards only (docs/architecture.md's table), read from the source: no import circle; and
one forward calls downwards only."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# bottom to top; a module may import its own layer's and any lower layer's
LAYERS = [
    {"patchkit.errors", "patchkit.warn", "patchkit.dtypes", "patchkit.gates", "patchkit.names", "patchkit.env"},
    {"forward"},
    {"backends"},
    # hooks/, bottom to top: its rooms by role (docs/architecture.md), hooks/family_route.py on top
    {"hooks.parallel"},
    {"hooks.install"},
    {"hooks.generation"},
    {"hooks.decide"},
    {"hooks.attention"},
    {"hooks.head"},
    {"hooks.forwards"},
    {"hooks.name"},
    {"hooks"},
    {"eras"},
    {"patches"},
    {"patchkit.handles"},
    {"patchkit.api"},
    {"patchkit.nn"},
    {"entry"},  # entry/, patchkit/launch.py and patchkit/__main__.py (`python -m patchkit[.launch]`, entry's CLIs)
    {"patchkit"},  # the package's public names, loaded on first use
]


def node_of(module: str) -> str | None:
    """The layer table's name for a patchkit module: its subpackage, or itself when it sits at the top level."""
    parts = module.split(".")
    if parts[0] == "patches" or parts[:2] == ["patchkit", "patches"]:
        return "patches"
    if parts[0] != "patchkit":
        return None
    if len(parts) == 1:
        return "patchkit"
    if parts[1] in ("launch", "__main__"):  # `python -m patchkit.launch`, `python -m patchkit`: entry/'s names
        return "entry"
    if parts[1] == "hooks" and len(parts) > 2 and (ROOT / "patchkit" / "hooks" / parts[2]).is_dir():
        return f"hooks.{parts[2]}"
    return parts[1] if (ROOT / "patchkit" / parts[1]).is_dir() else f"patchkit.{parts[1]}"


def is_module(name: str) -> bool:
    """`from patchkit import name` names a module or subpackage (not an attribute of the package)."""
    return (ROOT / "patchkit" / name).is_dir() or (ROOT / "patchkit" / f"{name}.py").exists()


def runtime_imports(path: Path) -> list[tuple[str, int]]:
    """(module, line) of every import in `path` outside `if TYPE_CHECKING:` blocks, lazy ones inside functions too."""
    tree = ast.parse(path.read_text())
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(
        node.test) for child in node.body for n in ast.walk(child)}
    found = []
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [f"patchkit.{a.name}" if is_module(a.name) else "patchkit" for a in node.names
                     ] if node.module == "patchkit" else [node.module]
            found += [(name, node.lineno) for name in names]
    return found


def edges() -> list[tuple[str, str, str]]:
    """(importing node, imported node, where) for every import between two different nodes."""
    files = [*ROOT.joinpath("patchkit").rglob("*.py"), *ROOT.joinpath("patches").glob("*.py")]
    out = []
    for path in files:
        rel = path.relative_to(ROOT).with_suffix("")
        src = node_of(".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts))
        for module, line in runtime_imports(path):
            dst = node_of(module)
            if dst is not None and dst != src:
                out.append((src, dst, f"{path.relative_to(ROOT)}:{line}"))
    return out


def layer(node: str) -> int:
    return next(i for i, names in enumerate(LAYERS) if node in names)


def test_every_module_has_a_layer():
    nodes = {n for src, dst, _ in edges() for n in (src, dst)}
    assert not [n for n in nodes if not any(n in names for names in LAYERS)], "add it to LAYERS"


def test_no_package_imports_one_above_it():
    upward = [f"{src} -> {dst} ({where})" for src, dst, where in edges() if layer(dst) > layer(src)]
    assert not upward, "imports against the layers:\n" + "\n".join(upward)


def test_no_import_circle():
    """Within a layer too: two packages never import each other, directly or through others."""
    graph: dict[str, set[str]] = {}
    for src, dst, _ in edges():
        graph.setdefault(src, set()).add(dst)

    def reaches(start: str, goal: str) -> bool:
        seen, todo = set(), [start]
        while todo:
            node = todo.pop()
            if node == goal:
                return True
            if node not in seen:
                seen.add(node)
                todo.extend(graph.get(node, ()))
        return False

    circles = sorted({tuple(sorted((a, b))) for a in graph for b in graph[a] if reaches(b, a)})
    assert not circles, circles


def test_a_padded_training_step_and_a_decode_step_call_downward_only():
    """Imports go downward; so must calls. A callback handed down (a registry's set, a backend object) lets the core
    call back up, and the path of one forward goes back and forth: tools/walk_forward.py profiles a tiny LLaMA's
    padded training step and decode step and lists every call from a package into one above it. Each forward
    wrapper enters the deciding code (hooks/decide/) once: the causal LM's `lm_cause` (and, where it asks for its
    head on real tokens, that head's self-check verdict, `head_cause`: two reads on a tested transformers), the base
    model's `plan_forward`; everything downstream reads the plan."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("walk_forward", ROOT / "tools" / "walk_forward.py")
    walk_forward = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(walk_forward)
    for what, (modules, upward) in walk_forward.walks().items():
        assert any(m.startswith("patchkit.backends.") for m in modules), what  # the walk saw the kernel call
        assert not upward, f"{what} calls upward: {upward}"
        decided = walk_forward.ENTRIES_OF[what].get("hooks.decide", {})  # the deciding code, entered from outside it
        assert decided == {"lm_forward.forward -> step_aside.lm_cause": 1,  # the causal LM's call, once
                           "lm_forward.ask -> self_check_lm.head_cause": 1,  # its head's request, once
                           "model_forward.served -> plan.plan_forward": 1}, decided  # the base model's, once
