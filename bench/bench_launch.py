"""Launcher overhead: ``python -m shardwise.launch --nproc N`` of an empty program beside
``torchrun --nproc_per_node N`` in the same run, alternating, wall-clock seconds.

Run: python bench/bench_launch.py [--nproc 2] [--repeat 3] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _seconds(command: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(command, check=True, capture_output=True, timeout=300)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", help="write the results to this file")
    ns = parser.parse_args()
    torchrun = shutil.which("torchrun")
    with tempfile.TemporaryDirectory() as tmp:
        empty = Path(tmp) / "empty.py"
        empty.write_text("")
        ours = [sys.executable, "-m", "shardwise.launch", "--nproc", str(ns.nproc), str(empty)]
        theirs = [torchrun or "torchrun", "--nproc_per_node", str(ns.nproc), str(empty)]
        times: dict[str, list[float]] = {"shardwise.launch": [], "torchrun": []}
        for _ in range(ns.repeat):
            times["shardwise.launch"].append(_seconds(ours))
            times["torchrun"].append(_seconds(theirs))
    for name, values in times.items():
        print(
            f"{name:>16}: median {statistics.median(values):.2f} s "
            f"(runs {', '.join(f'{v:.2f}' for v in values)})"
        )
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump({"nproc": ns.nproc, "runs_s": times,
                       "median_s": {k: statistics.median(v) for k, v in times.items()}}, f,
                      indent=1)


if __name__ == "__main__":
    main()
