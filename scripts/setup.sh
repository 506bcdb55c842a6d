#!/usr/bin/env bash
# Install shardwise and its test tools. torch==2.13.0 comes first, explicitly: letting pip
# resolve torch by itself would pull gigabytes of CUDA packages (see DEVELOPERS.md).
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q torch==2.13.0
python -m pip install -q -e ".[test,demo]"
