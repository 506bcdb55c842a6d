"""docs/ops.md is the registry's current table (regenerate with `python -m shardwise ops-table`)."""

from pathlib import Path

import shardwise  # noqa: F401  (registers the ops)
from shardwise.debug import op_table_markdown, torch_dtensor_op_count

ROOT = Path(__file__).resolve().parents[1]


def test_docs_ops_table_is_current() -> None:
    assert (ROOT / "docs" / "ops.md").read_text() == op_table_markdown(), (
        "docs/ops.md is stale: run `python -m shardwise ops-table > docs/ops.md`"
    )


def test_torch_count_is_read_from_the_installed_torch() -> None:
    assert torch_dtensor_op_count() > 100
