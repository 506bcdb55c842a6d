#!/usr/bin/env bash
# Install everything, then run lint and the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
python -m ruff check src tests bench tools
python -m pytest "$@"
