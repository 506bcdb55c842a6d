"""Every ```python block of README.md and docs/*.md runs (each file's blocks in order, one
namespace per file), so the documentation's examples stay true."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_doc_examples_run(path: Path) -> None:
    blocks = BLOCK.findall(path.read_text())
    namespace: dict = {"__name__": f"doc_{path.stem}"}
    for i, block in enumerate(blocks):
        code = compile(block, f"{path.name} block {i + 1}", "exec")
        exec(code, namespace)
