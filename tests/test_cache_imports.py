"""The modules of radixlm/cache import one way: the graph of their imports has no cycle.

Every import statement counts, at module level or inside a function (a deferred import is still
a dependency), except those under `if TYPE_CHECKING:` (annotations only, never run). An import
of `radixlm.cache.a.b` is an edge to that module, not to the packages above it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

CACHE = Path(__file__).resolve().parents[1] / "radixlm" / "cache"


def module_name(path: Path) -> str:
    parts = path.relative_to(CACHE.parents[1]).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, known: set[str]) -> set[str]:
    """The modules of `known` that `path` imports (outside TYPE_CHECKING blocks)."""
    tree = ast.parse(path.read_text())
    skip = {
        id(n)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
        for stmt in block.body
        for n in ast.walk(stmt)
    }
    out: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)  # `from pkg import mod`
    return out & known


def import_graph() -> dict[str, set[str]]:
    files = sorted(CACHE.rglob("*.py"))
    known = {module_name(f) for f in files}
    return {module_name(f): imports(f, known) - {module_name(f)} for f in files}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as a path that returns to its start, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)) is not None:
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)) is not None:
            return cycle
    return None


def test_the_cache_package_has_no_import_cycle() -> None:
    graph = import_graph()
    assert "radixlm.cache.l2.tree" in graph and "radixlm.cache.radix_tree" in graph
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])


@pytest.mark.parametrize(
    ("graph", "cyclic"),
    [
        ({"a": {"b"}, "b": {"c"}, "c": set()}, False),
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, True),
        ({"a": {"a"}}, True),
    ],
)
def test_the_cycle_finder_finds_cycles(graph: dict[str, set[str]], cyclic: bool) -> None:
    assert (find_cycle(graph) is not None) == cyclic


def test_deferred_imports_count_and_type_only_imports_do_not(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    import radixlm.cache.a\n"
        "def f():\n    from radixlm.cache import b\n"
    )
    assert imports(source, {"radixlm.cache.a", "radixlm.cache.b"}) == {"radixlm.cache.b"}
