"""The dependency rule of docs/architecture.md, read from the source: no two project modules import
each other, directly or around a loop, and the pure core imports nothing above it.

Every import counts: at module top, inside a function, under `TYPE_CHECKING`. A loop hidden in a
function body is still a loop: the two modules cannot be understood, tested or moved apart.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("disagg", "serve_app", "calibration")
# what each layer may not import: the layers above it (and, for the pure ones, the serving stack);
# the `disagg` command reaches `calibration` and `serve_app` through entry points, never by import
PURE = {"disagg.core": ("serve_app", "calibration", "disagg.bench", "disagg.cli", "disagg.sim", "ray", "vllm"),
        "disagg.sim": ("serve_app", "calibration", "disagg.bench", "disagg.cli", "ray", "vllm"),
        "disagg": ("serve_app", "calibration")}


def _modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imported(path: Path) -> set[str]:
    """Every absolute module name `path` imports, and for `from m import x` also `m.x` (x may be a module)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {m: {n for n in _imported(p) if n in modules and n != m and not m.startswith(n + ".")}
            for m, p in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_two_project_modules_import_each_other():
    assert cycles(_graph()) == []


def test_the_cycle_check_finds_loops_of_any_length():
    assert cycles({"a": {"b"}, "b": {"a"}}) == [["a", "b"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_each_layer_imports_nothing_above_it():
    modules = _modules()
    offending = {}
    for m, path in modules.items():
        for layer, banned in PURE.items():
            if m == layer or m.startswith(layer + "."):
                bad = sorted(n for n in _imported(path) if any(n == b or n.startswith(b + ".") for b in banned))
                if bad:
                    offending[m] = bad
    assert offending == {}
