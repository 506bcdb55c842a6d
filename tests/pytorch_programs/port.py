"""Port a PyTorch per-rank program to shardwise by rewriting its imports, and nothing else.

``port(source)`` maps every ``from torch.distributed.<tensor API> import ...`` (and ``import
<tensor API> as name``) onto the shardwise module with the same names, and returns the new source
with a count of the lines that changed outside import statements (the goal, and so far the
result, is 0). ``python tests/pytorch_programs/port.py PROGRAM.py [OUT.py]`` writes the port
(to stdout without OUT) and prints the count to stderr.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

# torch module -> shardwise module exporting the same public names (longest prefix wins)
MODULES: dict[str, str] = {
    "torch.distributed.tensor.parallel": "shardwise.parallel",
    "torch.distributed.tensor.device_mesh": "shardwise",
    "torch.distributed.tensor.placement_types": "shardwise",
    "torch.distributed.tensor": "shardwise",
    "torch.distributed._tensor.device_mesh": "shardwise",
    "torch.distributed._tensor.placement_types": "shardwise",
    "torch.distributed._tensor": "shardwise",
    "torch.distributed.device_mesh": "shardwise",
    "torch.distributed.fsdp": "shardwise.parallel",
    "torch.distributed._composable.fsdp": "shardwise.parallel",
    "torch.distributed._composable.replicate": "shardwise.parallel",
}


class UnportableImport(ValueError):
    """An import of torch's tensor API that rewriting the import alone cannot port."""


@dataclass(frozen=True)
class Port:
    source: str
    import_lines_changed: int
    other_lines_changed: int


def _target(module: str) -> str | None:
    for prefix in sorted(MODULES, key=len, reverse=True):
        if module == prefix or module.startswith(prefix + "."):
            if module != prefix:
                raise UnportableImport(f"no shardwise module for {module!r} (under {prefix!r})")
            return MODULES[prefix]
    return None


def _rewrite_line(line: str, old: str, new: str) -> str:
    if line.count(old) != 1:
        raise UnportableImport(f"cannot find {old!r} once on the line {line!r}")
    return line.replace(old, new)


def port(source: str) -> Port:
    """Rewrite the imports of ``source``; count the changed lines inside and outside imports."""
    lines = source.splitlines(keepends=True)
    import_lines: set[int] = set()  # 0-based, every line of every import statement
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            import_lines.update(range(node.lineno - 1, node.end_lineno or node.lineno))
            new = _target(node.module)
            if new is not None:
                i = node.lineno - 1
                lines[i] = _rewrite_line(lines[i], f"from {node.module} ", f"from {new} ")
        elif isinstance(node, ast.Import):
            import_lines.update(range(node.lineno - 1, node.end_lineno or node.lineno))
            for alias in node.names:
                new = _target(alias.name)
                if new is None:
                    continue
                if alias.asname is None:  # the code names torch.distributed... itself
                    raise UnportableImport(f"'import {alias.name}' without 'as'")
                i = node.lineno - 1
                lines[i] = _rewrite_line(lines[i], f"import {alias.name} ", f"import {new} ")
    ported = "".join(lines)
    inside = outside = 0
    for i, (before, after) in enumerate(zip(source.splitlines(), ported.splitlines(), strict=True)):
        if before != after:
            if i in import_lines:
                inside += 1
            else:
                outside += 1
    return Port(ported, inside, outside)


def main(argv: list[str]) -> int:
    if len(argv) not in (1, 2):
        print(__doc__, file=sys.stderr)
        return 2
    result = port(Path(argv[0]).read_text())
    if len(argv) == 2:
        Path(argv[1]).write_text(result.source)
    else:
        sys.stdout.write(result.source)
    print(
        f"{argv[0]}: {result.import_lines_changed} import lines rewritten, "
        f"{result.other_lines_changed} other lines changed",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
