"""The package's shape: imports run only downward through the layer table (docs/architecture.md),
the import graph has no circle, torch's private names stay behind ``torch_compat``, the package
loads lazily, every public name resolves and every module can be imported first in a fresh
process."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

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


# The layers, bottom to top (docs/architecture.md): a module imports from its own layer and the
# layers below it, never from one above. A name covers a module or a whole subpackage; every
# module of the package is in exactly one layer.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("foundation", ("errors", "settings", "torch_compat", "call_site", "process_wide",
                    "caches", "execution")),
    ("runtime", ("runtime",)),
    ("data", ("placements", "mesh_text", "mesh", "mesh_argument", "tf_mesh", "layout", "spec",
              "geometry", "tracing")),
    ("communication", ("comm",)),
    ("data movement", ("redistribute",)),
    ("tensor", ("dtensor", "components", "pending", "factories", "rng", "local_map",
                "dcp_protocol")),
    ("dispatch", ("dispatch", "dispatch_args", "dispatch_decision", "fast_call",
                  "custom_sharding", "ops", "op_inputs")),
    ("user packages", ("parallel", "distribute", "checkpoint", "tf_dtensor", "debug",
                       "deferred_init", "memory", "as_torch", "rank_threads", "launch", "demo",
                       "tour", "tf", "rules", "config")),
    ("command line", ("cli", "demo_cli", "__main__")),
]

def test_the_drawing_in_the_docs_is_the_layer_table() -> None:
    """docs/architecture.md draws the layers top to bottom, each labelled as in ``LAYERS`` and
    naming every module and subpackage of it."""
    text = (Path(__file__).parents[1] / "docs" / "architecture.md").read_text()
    drawing = text.split("```text\n", 1)[1].split("```", 1)[0]
    blocks: dict[str, str] = {}
    label = ""
    for line in drawing.splitlines():
        if line[:1].strip():
            label = line[:16].strip()
        blocks[label] = blocks.get(label, "") + line[16:] + "\n"
    assert list(blocks) == [name for name, _ in reversed(LAYERS)]
    missing = {
        name: [m for m in modules if not re.search(rf"(?<![\w.]){m}\b", blocks[name])]
        for name, modules in LAYERS
    }
    assert not any(missing.values()), f"missing from the drawing's layers: {missing}"


# Imports that run upward, each with why (lazy, inside a function, never at import time).
UPWARD_ALLOWED: dict[tuple[str, str], str] = {}


def layer_of(module: str) -> int:
    """The index in ``LAYERS`` of a dotted module name (the package itself is above them all)."""
    if module == "shardwise":
        return len(LAYERS)
    first = module.split(".")[1]
    for index, (_, names) in enumerate(LAYERS):
        if first in names:
            return index
    raise AssertionError(f"{module} is in no layer of LAYERS (tests/test_architecture.py)")


def _runtime_imports(
    tree: ast.AST, type_checking: bool = False
) -> list[ast.Import | ast.ImportFrom]:
    """The import statements of ``tree`` that run, at module level or inside functions (lazy
    imports count), leaving out ``if TYPE_CHECKING:`` blocks unless ``type_checking``."""
    found, todo = [], [tree]
    while todo:
        node = todo.pop()
        if (
            not type_checking
            and isinstance(node, ast.If)
            and "TYPE_CHECKING" in ast.unparse(node.test)
        ):
            todo.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        todo.extend(ast.iter_child_nodes(node))
    return found


def import_graph(type_checking: bool = False) -> dict[str, set[str]]:
    """Module -> the package modules importing it runs: the module named and, since importing
    ``a.b.c`` runs ``a/__init__`` and ``a/b/__init__`` first, its parent packages (those of the
    importing module itself aside: they started before it did). With ``type_checking``, the
    imports of ``if TYPE_CHECKING:`` blocks too (the static map)."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, (path, is_package) in modules.items():
        here = name.split(".") if is_package else name.split(".")[:-1]
        targets = []
        for node in _runtime_imports(ast.parse(path.read_text()), type_checking):
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
    circles = import_circles(import_graph(type_checking=True))
    assert not circles, f"import circles (TYPE_CHECKING imports included): {circles}"


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """``importer -> imported`` for every import from a lower layer to a higher one."""
    return sorted(
        f"{a} ({LAYERS[layer_of(a)][0]}) -> {b} ({LAYERS[layer_of(b)][0]})"
        for a, deps in graph.items()
        for b in deps
        if b != "shardwise" and layer_of(b) > layer_of(a) and (a, b) not in UPWARD_ALLOWED
    )


def test_imports_run_only_downward_through_the_layers() -> None:
    graph = import_graph()
    assert [layer_of(m) for m in sorted(graph)]  # every module has a layer
    upward = upward_imports(graph)
    assert not upward, "imports reaching up a layer:\n" + "\n".join(upward)


def test_the_layer_check_sees_an_upward_import() -> None:
    graph = {"shardwise.mesh": {"shardwise.dtensor"}, "shardwise.dtensor": {"shardwise.mesh"}}
    assert upward_imports(graph) == ["shardwise.mesh (data) -> shardwise.dtensor (tensor)"]


MAX_MODULE_LINES = 700


def long_modules(modules: dict[str, tuple[Path, bool]]) -> list[str]:
    """``module: N lines`` for every module longer than ``MAX_MODULE_LINES``."""
    return sorted(
        f"{name}: {n} lines"
        for name, (path, _) in modules.items()
        if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    )


def test_no_module_is_over_700_lines(tmp_path: Path) -> None:
    """One concept per module: a module past the bound holds more than one."""
    found = long_modules(_modules())
    assert not found, f"modules over {MAX_MODULE_LINES} lines: {found}"
    long = tmp_path / "long.py"
    long.write_text("x = 1\n" * (MAX_MODULE_LINES + 1))
    assert long_modules({"shardwise.long": (long, False)}) == [
        f"shardwise.long: {MAX_MODULE_LINES + 1} lines"
    ]


def _private(segment: str) -> bool:
    return segment.startswith("_") and not (segment.startswith("__") and segment.endswith("__"))


def private_torch_uses(tree: ast.AST) -> list[str]:
    """The private torch names a module reaches: imports of private modules or names, and
    attribute chains with a private part on a name bound to torch (op namespaces' op names
    such as ``torch.ops.aten._to_copy`` are torch's public ops)."""
    found, aliases = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "torch":
                    aliases.add(alias.asname or "torch")
                    if any(map(_private, alias.name.split("."))):
                        found.append(alias.name)
        elif isinstance(node, ast.ImportFrom) and not node.level:
            if (node.module or "").split(".")[0] == "torch":
                aliases.update(alias.asname or alias.name for alias in node.names)
                names = node.module.split(".") + [alias.name for alias in node.names]
                if any(map(_private, names)):
                    found.append(node.module)
    for node in ast.walk(tree):
        parts = []
        while isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        if not (isinstance(node, ast.Name) and node.id in aliases):
            continue
        parts.reverse()
        if "ops" in parts:
            parts = parts[: parts.index("ops") + 2]
        if any(map(_private, parts)):
            found.append(".".join([node.id, *parts]))
    return found


def test_torch_private_names_stay_behind_the_fence() -> None:
    found = {
        name: uses
        for name, (path, _) in _modules().items()
        if name != "shardwise.torch_compat"
        and (uses := private_torch_uses(ast.parse(path.read_text())))
    }
    assert not found, f"private torch names outside shardwise.torch_compat: {found}"
    assert "torch._C._foo" in private_torch_uses(ast.parse("import torch\ntorch._C._foo()\n"))
    frames = [
        name
        for name, (path, _) in _modules().items()
        if "_getframe" in path.read_text() and name != "shardwise.call_site"
    ]
    assert not frames, f"call-frame look-ups outside shardwise.call_site: {frames}"


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


# Where state outside ``settings.py`` is allowed, and why.
AMBIENT_ALLOWED: dict[str, str] = {
    "shardwise": "reads SHARDWISE_AS_TORCH before loading settings, so import loads nothing",
    "shardwise.launch": "copies the environment into its child processes' own",
    "shardwise.rank_threads": "installs the per-thread view of os.environ that settings reads",
    "shardwise.comm.wire": "a mailbox's own per-thread slot (an instance's, not the module's)",
    "shardwise.ops.embedding": "the embedding mask's threading.local (being removed: issue 31)",
}


def test_ambient_state_lives_in_settings() -> None:
    """No ContextVar, threading.local or environment read outside settings.py (each exception
    in ``AMBIENT_ALLOWED`` with why)."""
    ambient = ("ContextVar(", "threading.local", "os.environ", "os.getenv")
    found = {
        name: [a for a in ambient if a in path.read_text()]
        for name, (path, _) in _modules().items()
        if name not in ("shardwise.settings", *AMBIENT_ALLOWED)
    }
    found = {name: uses for name, uses in found.items() if uses}
    assert not found, f"ambient state outside shardwise.settings: {found}"


def test_the_top_level_is_small_and_every_moved_name_warns_and_resolves() -> None:
    out = _run(
        "import importlib, warnings, shardwise\n"
        "names = shardwise.__all__\n"
        "assert len(names) == len(set(names)) and not set(names) & set(shardwise._MOVED)\n"
        "for name, home in shardwise._MOVED.items():\n"
        "    new = importlib.import_module('shardwise.' + home)\n"
        "    with warnings.catch_warnings(record=True) as caught:\n"
        "        warnings.simplefilter('always')\n"
        "        value = getattr(shardwise, name)\n"
        "        exec(f'from shardwise import {name} as again')\n"
        "    assert value is getattr(new, name) is again, name\n"
        "    assert len(caught) >= 2, name  # the attribute and the from-import each warn\n"
        "    assert {w.category for w in caught} == {DeprecationWarning}, name\n"
        "    assert f'shardwise.{home}.{name}' in str(caught[0].message), name\n"
        "    assert caught[0].filename == '<string>', (name, caught[0].filename)\n"
        "    assert name in getattr(new, '__all__', [name]), name\n"
        "print(len(names), len(shardwise._MOVED))\n"
    )
    top, moved = map(int, out.split())
    assert top <= 25 and top + moved >= 110  # every old name kept its meaning


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


def test_every_module_imports_first() -> None:
    """Each module imported in a process where no shardwise module was imported before (torch
    stays loaded between modules, the package's modules are dropped): one process for all,
    since starting one costs more than the imports."""
    names = [n for n in sorted(_modules()) if not n.endswith("__main__")]
    _run(
        "import importlib, sys\n"
        f"for name in {names!r}:\n"
        "    for m in [m for m in sys.modules if m.split('.')[0] == 'shardwise']:\n"
        "        del sys.modules[m]\n"
        "    importlib.import_module(name)\n"
    )


def test_type_checkers_see_the_same_top_level_names() -> None:
    """``__init__``'s ``if TYPE_CHECKING:`` imports (what mypy and IDEs see of the lazy top
    level) name exactly ``_NAMES``, each from its module there."""
    import shardwise

    tree = ast.parse((PACKAGE / "__init__.py").read_text())
    seen: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            for stmt in node.body:
                assert isinstance(stmt, ast.ImportFrom) and stmt.level == 1, ast.dump(stmt)
                seen.update({alias.name: stmt.module for alias in stmt.names})
    assert seen == {name: module for name, module in shardwise._NAMES.items()}
