"""A tensor-parallel training step with no host sync: the step (forward, backward, AdamW) of a
TP MLP on 2 simulated devices of one GPU runs under ``torch.cuda.set_sync_debug_mode("error")``
(any host read of device data raises), beside the same step written by hand on one device; the
ms per step of both. Part of ``bench/gpu_check.sh``; needs CUDA.

Run: python bench/sync_check.py [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from torch import nn

import shardwise as sw
from shardwise.parallel import ColwiseParallel, RowwiseParallel, parallelize_module


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 1024)).cuda()


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor) -> None:
    model(x).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _ms(model: nn.Module, x: torch.Tensor, steps: int) -> float:
    """ms per step, the steps run under the sync debug mode "error" after two warm-up steps."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    for _ in range(2):
        _step(model, optimizer, x)
    torch.cuda.synchronize()
    start = time.perf_counter()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(steps):
            _step(model, optimizer, x)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3 / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    x = torch.randn(64, 1024, device="cuda")
    hand = _ms(_model(), x, args.steps)
    mesh = sw.init_device_mesh("cuda", (2,))
    tp = parallelize_module(_model(), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    ours = _ms(tp, x, args.steps)
    result = {"hand_ms": hand, "shardwise_tp_ms": ours, "ratio": ours / hand,
              "sync_debug_mode": "error"}
    print(json.dumps(result))
    if args.json:
        json.dump(result, open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
