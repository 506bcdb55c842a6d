"""Checkpoint throughput: ``shardwise.checkpoint.save/load`` of a sharded state (one process,
2x2 mesh, loaded back resharded onto 3 devices) beside ``torch.save``/``torch.load`` of the
same tensors as plain tensors.

Run: python bench/bench_checkpoint.py [MB] [--json FILE]   (default 200 MB of float32 in 50
tensors)
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

import shardwise as sw
import shardwise.checkpoint as ckpt
from shardwise import Shard


def _module(tensors: dict[str, torch.Tensor]) -> nn.Module:
    module = nn.Module()
    for name, t in tensors.items():
        module.register_parameter(name, nn.Parameter(t, requires_grad=False))
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("megabytes", nargs="?", type=float, default=200.0)
    parser.add_argument("--json", help="write the results to this file")
    args = parser.parse_args()
    torch.set_num_threads(1)  # steadier on a shared machine; the same for both sides
    megabytes = args.megabytes
    count = 50
    numel = int(megabytes * 1e6 / 4 / count)
    cols = 1000
    rows = max(numel // cols, 1)
    torch.manual_seed(0)
    plain = {f"w{i}": torch.randn(rows, cols) for i in range(count)}
    nbytes = sum(t.numel() * t.element_size() for t in plain.values())
    m22 = sw.DeviceMesh("cpu", [[0, 1], [2, 3]])
    m3 = sw.DeviceMesh("cpu", [0, 1, 2])
    saved = _module({k: sw.distribute_tensor(t, m22, [Shard(0), Shard(1)]) for k, t in
                     plain.items()})
    target = _module({k: sw.distribute_tensor(torch.zeros_like(t), m3, [Shard(1)]) for k, t in
                      plain.items()})
    root = Path(tempfile.mkdtemp(prefix="bench_ckpt_"))
    try:
        rows_out = []
        start = time.perf_counter()
        ckpt.save(root / "sharded", saved, progress=False)
        rows_out.append(("shardwise.checkpoint.save (2x2 mesh)", time.perf_counter() - start))
        start = time.perf_counter()
        ckpt.load(root / "sharded", target, progress=False)
        rows_out.append(("shardwise.checkpoint.load (resharded to 3)",
                         time.perf_counter() - start))
        for name, t in plain.items():
            assert torch.equal(getattr(target, name).full_tensor(), t), name
        start = time.perf_counter()
        torch.save(plain, root / "plain.pt")
        rows_out.append(("torch.save (plain tensors)", time.perf_counter() - start))
        start = time.perf_counter()
        back = torch.load(root / "plain.pt")
        rows_out.append(("torch.load (plain tensors)", time.perf_counter() - start))
        assert all(torch.equal(back[k], v) for k, v in plain.items())
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"state: {count} float32 tensors, {nbytes / 1e6:.0f} MB")
    for label, seconds in rows_out:
        print(f"{label:45s} {seconds:7.2f} s  {nbytes / 1e6 / seconds:8.0f} MB/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"megabytes": nbytes / 1e6,
                       "rows": [{"label": k, "seconds": v} for k, v in rows_out]}, f, indent=1)


if __name__ == "__main__":
    main()
