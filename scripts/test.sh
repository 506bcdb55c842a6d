#!/usr/bin/env bash
# Install everything, then run lint and the whole test suite: the single-process tests on two
# workers (pytest-xdist), then the multi-process and end-to-end ones (marked slow) one at a time,
# as they start processes and wait on timeouts. Arguments go to both pytest runs.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
python -m ruff check src tests bench tools
python -m pytest -m "not slow" -n 2 "$@"
python -m pytest -m slow "$@"
