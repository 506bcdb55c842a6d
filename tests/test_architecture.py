"""The package's shape: the import graph of src/shardwise has no new circles, the package loads
lazily, every public name resolves and every module can be imported first in a fresh process."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).parents[1] / "src"
PACKAGE = SRC / "shardwise"


def _modules() -> dict[str, tuple[Path, bool]]:
    """Every module of the package: dotted name -> (file, is a package ``__init__``)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1]
        found[".".join(parts)] = (path, is_package)
    return found


def _runtime_imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """The import statements of ``tree`` that run, at module level or inside functions (lazy
    imports count), leaving out ``if TYPE_CHECKING:`` blocks."""
    found, todo = [], [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            todo.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        todo.extend(ast.iter_child_nodes(node))
    return found


def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules importing it runs: the module named and, since importing
    ``a.b.c`` runs ``a/__init__`` and ``a/b/__init__`` first, its parent packages (those of the
    importing module itself aside: they started before it did)."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, (path, is_package) in modules.items():
        here = name.split(".") if is_package else name.split(".")[:-1]
        targets = []
        for node in _runtime_imports(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets += [a.name for a in node.names]
                continue
            if node.level:
                base = ".".join(here[: len(here) - node.level + 1] + [node.module or ""])
            else:
                base = node.module or ""
            base = base.rstrip(".")
            targets += [f"{base}.{a.name}" for a in node.names] + [base]
        deps = set()
        for target in targets:
            parts = target.split(".")
            for n in range(1, len(parts) + 1):
                dotted = ".".join(parts[:n])
                if dotted in modules and not f"{name}.".startswith(f"{dotted}."):
                    deps.add(dotted)
        graph[name] = deps
    return graph


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                circles.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(circles)


def test_the_import_graph_sees_lazy_imports_and_parent_packages() -> None:
    graph = import_graph()
    assert "shardwise.ops" in graph["shardwise.dispatch"]  # via ``from .ops.registry import``
    assert "shardwise.rank_threads" in graph["shardwise.launch"]  # inside a function
    assert graph["shardwise"] == set()  # TYPE_CHECKING imports are not run


def test_no_import_circle() -> None:
    circles = import_circles(import_graph())
    assert not circles, f"import circles: {circles}"


def _run(code: str) -> str:
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(SRC)},
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_import_shardwise_loads_nothing_and_every_public_name_resolves() -> None:
    out = _run(
        "import sys, importlib, shardwise\n"
        "loaded = sorted(m for m in sys.modules if m.startswith('shardwise.'))\n"
        "print(loaded, 'torch' in sys.modules)\n"
        "for name in shardwise.__all__:\n"
        "    value = getattr(shardwise, name)\n"
        "    home = importlib.import_module('shardwise.' + shardwise._NAMES[name])\n"
        "    assert value is getattr(home, name), name\n"
        "assert set(shardwise.__all__) <= set(dir(shardwise))\n"
        "assert shardwise.parallel.__name__ == 'shardwise.parallel'\n"
        "try:\n"
        "    shardwise.no_such_name\n"
        "except AttributeError:\n"
        "    print('missing ok')\n"
    )
    assert out.splitlines() == ["[] False", "missing ok"]


def test_the_launcher_imports_no_torch_and_a_scripts_own_arguments_stay_its_own(
    tmp_path: Path,
) -> None:
    assert _run("import sys, shardwise.launch; print('torch' in sys.modules)") == "False\n"
    script = tmp_path / "args.py"
    script.write_text("import sys\nimport shardwise\nprint(sys.argv[1:])\n")
    result = subprocess.run(
        [sys.executable, str(script), "-m", "shardwise.launch"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(SRC)},
    )
    assert result.stdout == "['-m', 'shardwise.launch']\n", result.stderr


def test_a_public_name_wins_over_the_submodule_of_that_name() -> None:
    _run(
        "import shardwise.deferred_init, shardwise.local_map, shardwise\n"
        "assert callable(shardwise.deferred_init) and callable(shardwise.local_map)\n"
    )


def test_names_from_the_package_run_ops() -> None:
    _run(
        "import torch\n"
        "from shardwise import Shard, distribute_tensor, init_device_mesh\n"
        "mesh = init_device_mesh('cpu', (2,))\n"
        "d = distribute_tensor(torch.arange(6.0), mesh, [Shard(0)])\n"
        "assert torch.equal((d * 2).full_tensor(), torch.arange(6.0) * 2)\n"
    )


def test_the_packages_users_import_load_the_op_layer() -> None:
    _run(
        "import importlib, sys\n"
        "for name in ['parallel', 'distribute', 'checkpoint', 'tf_dtensor', 'debug',\n"
        "             'deferred_init', 'tour', 'demo']:\n"
        "    for m in [m for m in sys.modules if m.split('.')[0] == 'shardwise']:\n"
        "        del sys.modules[m]\n"
        "    importlib.import_module('shardwise.' + name)\n"
        "    assert 'shardwise.dispatch' in sys.modules, name\n"
    )


@pytest.mark.parametrize("chunk", range(4))
def test_every_module_imports_first(chunk: int) -> None:
    """Each module imported in a process where no shardwise module was imported before (torch
    stays loaded between modules, the package's modules are dropped)."""
    names = [n for n in sorted(_modules()) if not n.endswith("__main__")][chunk::4]
    _run(
        "import importlib, sys\n"
        f"for name in {names!r}:\n"
        "    for m in [m for m in sys.modules if m.split('.')[0] == 'shardwise']:\n"
        "        del sys.modules[m]\n"
        "    importlib.import_module(name)\n"
    )
