#!/usr/bin/env bash
# GPU readiness check: shardwise's CUDA paths and benchmarks on one CUDA device, in under 5
# minutes. Runs tests/test_cuda.py (values against plain PyTorch on the GPU), then the dispatch
# benchmark (world of one, NCCL, beside torch.distributed.tensor), redistribution on 4 simulated
# devices sharing the GPU (beside the same moves in plain torch ops) and the tensor-parallel
# training step (one process, NCCL, beside DTensor and hand-written TP); and a TP training step
# under torch.cuda.set_sync_debug_mode("error") (no host sync) beside hand-written.
#
# Run: bash bench/gpu_check.sh [RESULTS_DIR]   (default bench/results/gpu; $OUT when set); copy
# the JSON files into bench/results/gpu/ and `python bench/run_all.py` adds them to the docs.
# Uses the python on PATH (its torch must see CUDA) and this checkout's src/ (no install).
set -uo pipefail
cd "$(dirname "$0")/.."
results=${1:-${OUT:-bench/results/gpu}}
mkdir -p "$results"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
py=${PYTHON:-python3}
status=0

step() {  # step NAME TIMEOUT_S COMMAND...: run one part, keep its log, go on if it fails
    local name=$1 limit=$2
    shift 2
    echo "== $name"
    local start=$SECONDS
    if timeout "$limit" "$@" >"$results/$name.log" 2>&1; then
        echo "   ok in $((SECONDS - start)) s"
    else
        echo "   FAILED (exit $?) after $((SECONDS - start)) s; last lines:"
        status=1
    fi
    tail -n 25 "$results/$name.log"
}

$py - "$results/machine.json" <<'EOF' || exit 1
import datetime, json, sys, torch
assert torch.cuda.is_available(), "no CUDA device"
info = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
        "cuda": torch.version.cuda}
json.dump(info, open(sys.argv[1], "w"), indent=1)
print(info)
EOF
step cuda_tests 150 $py -m pytest -q -p no:cacheprovider tests/test_cuda.py
step dispatch 120 $py bench/bench_dispatch.py --quick --device cuda --json "$results/dispatch.json"
step redistribute 120 $py bench/bench_redistribute.py --simulate 4 --device cuda 1024 4096 \
    --json "$results/redistribute.json"
step sync_check 120 $py bench/sync_check.py --json "$results/sync_check.json"
step training 150 $py -m torch.distributed.run --standalone --nproc_per_node 1 \
    bench/bench_training.py --device cuda --json "$results/training.json"
$py - "$results/machine.json" "$SECONDS" <<'EOF'
import json, sys
info = json.load(open(sys.argv[1]))
info["seconds"] = float(sys.argv[2])
json.dump(info, open(sys.argv[1], "w"), indent=1)
EOF
echo "gpu_check: $SECONDS s in all"
exit $status
