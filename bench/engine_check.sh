#!/usr/bin/env bash
# The engine across processes on this host's gloo: the per-collective model (bench_collective_
# model at N = 2, 4, 8, then the fit and the table to N = 1024), redistribution beside the raw
# backend collective and training steps beside hand-written and torch DTensor on 2 and 4
# processes (dim 128, and dim 1024 for the TP models, also with a steady heap). Writes
# bench/results/engine/*.json; `python bench/run_all.py --docs-only` puts them in
# docs/performance.md. Run it on a quiet host (about 4 minutes on 2 cores).
set -euo pipefail
cd "$(dirname "$0")/.."
out=bench/results/engine
mkdir -p "$out"
export OMP_NUM_THREADS=1 PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
launch() { python -m shardwise.launch --nproc "$1" "${@:2}"; }
for n in 2 4 8; do
    launch "$n" bench/bench_collective_model.py --json "$out/collectives_$n.json"
done
python bench/bench_collective_model.py --model "$out"/collectives_{2,4,8}.json \
    --json "$out/model.json"
for n in 2 4; do
    launch "$n" bench/bench_redistribute.py 1024 4096 --json "$out/redistribute_$n.json"
    launch "$n" bench/bench_training.py --quick --json "$out/training_$n.json"
    # a realistic width, where a step is compute and collectives rather than per-op Python
    launch "$n" bench/bench_training.py --quick --dim 1024 --models mlp,llama \
        --json "$out/training_1024_$n.json"
    # the same with glibc keeping freed heap pages: no step refaults its large tensors
    launch "$n" bench/bench_training.py --quick --dim 1024 --models mlp,llama --steady-heap \
        --json "$out/training_1024_steady_$n.json"
done
