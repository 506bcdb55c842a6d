"""docs/ops.md is the registry's current table (regenerate with `python tools/ops_table.py`)."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
from ops_table import op_table_markdown, torch_dtensor_op_count  # noqa: E402


def test_docs_ops_table_is_current() -> None:
    assert (ROOT / "docs" / "ops.md").read_text() == op_table_markdown(), (
        "docs/ops.md is stale: run `python tools/ops_table.py > docs/ops.md`"
    )


def test_torch_count_is_read_from_the_installed_torch() -> None:
    assert torch_dtensor_op_count() > 100
