#!/usr/bin/env bash
# The venv the library tests run in (tests/test_as_torch.py: transformers, Lightning, torchtitan
# through shardwise.as_torch): .venvs/libraries, made with --system-site-packages so it reuses
# this Python's torch==2.13.0 (pinned for pip too: never a torch download) and shardwise. None of
# these libraries is a dependency of shardwise. Idempotent: a stamp of the requirements skips pip
# when nothing changed. Each library installs on its own: one that cannot leaves the others, and
# its tests skip. Prints the venv's python on stdout (pip's output goes to stderr); exits non-zero
# only when the venv itself cannot be made.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venvs/libraries
# one pip call per library; torchtitan imports triton at import time, even on CPU
LIBRARIES=(
    "transformers>=5.0,<6 accelerate>=1.0"
    "lightning>=2.6,<2.7"
    "torchtitan==0.2.2 triton==3.9.0"
)
STAMP="$VENV/shardwise-requirements.txt"
WANTED="$(printf '%s\n' "torch==2.13.0" "${LIBRARIES[@]}")"
if [[ ! -x "$VENV/bin/python" ]]; then
    python -m venv --system-site-packages "$VENV" >&2
fi
"$VENV/bin/python" -c "import torch; assert torch.__version__.split('+')[0] == '2.13.0'" >&2
if [[ ! -f "$STAMP" || "$(cat "$STAMP")" != "$WANTED" ]]; then
    CONSTRAINTS="$VENV/torch-constraint.txt"
    echo "torch==2.13.0" > "$CONSTRAINTS"
    failed=0
    for library in "${LIBRARIES[@]}"; do
        # shellcheck disable=SC2086  # one word per requirement
        "$VENV/bin/python" -m pip install -q --disable-pip-version-check -c "$CONSTRAINTS" \
            $library >&2 || { failed=1; echo "library_venv.sh: could not install $library" >&2; }
    done
    [[ $failed == 1 ]] || echo "$WANTED" > "$STAMP"
fi
echo "$PWD/$VENV/bin/python"
