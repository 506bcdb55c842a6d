#!/usr/bin/env bash
# Install shardwise and run the demo on the embedded single-process default.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
python -m shardwise demo
