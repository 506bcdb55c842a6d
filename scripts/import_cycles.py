"""Import circles in src/shardwise: the import graph (lazy imports inside functions included)
and its strongly connected components of more than one module.

Run: python scripts/import_cycles.py [MODULE_PREFIX ...]   (prefixes: report only circles that
touch a module starting with one of them, e.g. shardwise.redistribute shardwise.geometry)
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "src"


def modules() -> dict[str, Path]:
    found = {}
    for path in (ROOT / "shardwise").rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _runtime_nodes(tree: ast.AST):
    """Every node but those under ``if TYPE_CHECKING:`` (imports that never run)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            yield from (n for child in node.orelse for n in [child, *_runtime_nodes(child)])
            continue
        yield node
        yield from _runtime_nodes(node)


def edges(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in _runtime_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            base = f"{base}.{node.module}" if node.level and node.module else (
                base if node.level else node.module or "")
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for target in targets:
            # a module runs its own package's __init__ anyway: only other modules count
            if target in known and target != "shardwise" and target != name:
                out.add(target)
    return out


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            found.append(sorted(component))

    sys.setrecursionlimit(10000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def main() -> None:
    known = modules()
    graph = {name: edges(name, path, known) for name, path in known.items()}
    circles = [c for c in strongly_connected(graph) if len(c) > 1]
    prefixes = sys.argv[1:]
    if prefixes:
        circles = [c for c in circles if any(m.startswith(p) for m in c for p in prefixes)]
    print(f"{len(graph)} modules, {len(circles)} import circles"
          + (f" touching {', '.join(prefixes)}" if prefixes else ""))
    for c in circles:
        print(f"  {len(c)} modules: {', '.join(c)}")


if __name__ == "__main__":
    main()
