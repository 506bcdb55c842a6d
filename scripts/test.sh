#!/usr/bin/env bash
# Install everything, then run lint and the whole test suite: the single-process tests on two
# workers (pytest-xdist), then the multi-process and end-to-end ones (marked slow), also on two
# workers: much of their time is waiting (process start-up, timeouts), and every one of them has
# a timeout of its own and picks free ports. Arguments go to both pytest runs. The library tests
# (transformers, Lightning, torchtitan through shardwise.as_torch) run in the venv that
# scripts/library_venv.sh makes; where it cannot be made, they skip saying why.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
python -m ruff check src tests bench tools
if LIBRARY_PYTHON="$(bash scripts/library_venv.sh)"; then
    export SHARDWISE_LIBRARY_PYTHON="$LIBRARY_PYTHON"
else
    echo "scripts/library_venv.sh failed: the library tests of tests/test_as_torch.py skip" >&2
fi
python -m pytest -m "not slow" -n 2 --durations=15 "$@"
python -m pytest -m slow -n 2 --durations=25 "$@"
