"""The floors of `mlxkv_inference` point one way, and no module imports its way back to itself.

Reads the source with `ast` (nothing is imported), so it runs in milliseconds.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = "mlxkv_inference"
SOURCE = Path(__file__).resolve().parents[1] / "packages" / "inference" / "src" / PACKAGE
LOWER = ("binding", "native", "cache", "models")  # the model and its caches
HIGHER = ("generation", "scheduler", "speculative", "prompt_cache", "load")  # what acts on them, what loads them


def module_name(path: Path) -> str:
    parts = path.relative_to(SOURCE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def runtime_imports(path: Path) -> set[str]:
    """The package's modules `path` imports when it runs (not under `if TYPE_CHECKING:`)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
                   for n in ast.walk(node)}
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module is not None and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in found if name.split(".")[0] == PACKAGE}


def import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports. A package a module sits in runs before it
    anyway (`from mlxkv_inference import _mlx_lm` names the root package too): no edge."""
    paths = {module_name(p): p for p in SOURCE.rglob("*.py")}
    return {name: {m for m in runtime_imports(path) if m in paths and not (name + ".").startswith(m + ".")}
            for name, path in paths.items()}


def floor(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle among modules (a package's `__init__` counts as its own module), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)) is not None:
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)) is not None:
            return cycle
    return None


@pytest.mark.parametrize("lower", LOWER)
def test_lower_floor_never_imports_a_higher_one(lower: str) -> None:
    graph = import_graph()
    reaching_up = sorted(f"{module} -> {target}" for module, targets in graph.items() if floor(module) == lower
                         for target in targets if floor(target) in HIGHER)
    assert reaching_up == []


def test_no_import_circle_inside_the_package() -> None:
    assert find_cycle(import_graph()) is None


def test_the_check_sees_a_circle_and_a_floor() -> None:
    graph = {"p.a": {"p.b"}, "p.b": {"p.c"}, "p.c": {"p.a"}, "p.d": set()}
    assert find_cycle(graph) == ["p.a", "p.b", "p.c", "p.a"]
    assert find_cycle({"p.a": {"p.b"}, "p.b": set()}) is None
    assert floor(f"{PACKAGE}.cache.rounds") == "cache" and floor(f"{PACKAGE}.step_costs") == "step_costs"
    assert f"{PACKAGE}.cache.rounds" in import_graph()[f"{PACKAGE}.binding_probes"]
