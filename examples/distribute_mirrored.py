"""Data-parallel training with tf.distribute's strategies on shardwise.

    python examples/distribute_mirrored.py [--steps N]

trains a small regression model with ``MirroredStrategy`` over 4 simulated CPU devices (one
process, one replica thread per device), then runs itself under
``python -m shardwise.launch --nproc 2`` where each process trains the same model with
``MultiWorkerMirroredStrategy`` over its own 2 simulated devices (4 replicas in all), and checks
that both print the same losses.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import torch

import shardwise.distribute as swd

GLOBAL_BATCH = 16


def batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The same global batches in every process."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(steps * GLOBAL_BATCH, 8, generator=g)
    y = torch.sin(x.sum(dim=1, keepdim=True))
    return [
        (x[i : i + GLOBAL_BATCH], y[i : i + GLOBAL_BATCH]) for i in range(0, len(x), GLOBAL_BATCH)
    ]


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))


def train(strategy: swd.Strategy, steps: int) -> list[float]:
    with strategy.scope():
        model = strategy.distribute_module(build_model())  # one mirrored copy per replica
        optimizer = swd.Optimizer(torch.optim.SGD, model.variables(), lr=0.05, momentum=0.9)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        per_example = ((model(x) - y) ** 2).mean(dim=1)
        loss = swd.compute_average_loss(per_example, global_batch_size=GLOBAL_BATCH)
        loss.backward()
        optimizer.step()  # replica context: gradients all-reduced as one batch, copies updated
        optimizer.zero_grad()
        return loss

    losses = []
    for x, y in strategy.experimental_distribute_dataset(batches(steps)):
        per_replica = strategy.run(step, args=(x, y))
        losses.append(strategy.reduce("sum", per_replica, axis=None).item())
    return losses


def show(losses: list[float]) -> str:
    return " ".join(f"{loss:.6f}" for loss in losses)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=10, help="training steps")
    parser.add_argument("--no-multiworker", action="store_true", help="skip the 2-process run")
    args = parser.parse_args()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # started by shardwise.launch / torchrun
        strategy = swd.MultiWorkerMirroredStrategy(["cpu:0", "cpu:1"])
        losses = train(strategy, args.steps)
        if strategy.worker_index == 0:
            world = int(os.environ["WORLD_SIZE"])
            print(f"MultiWorkerMirroredStrategy ({world} processes x 2 devices): {show(losses)}")
        return 0
    mirrored = train(swd.MirroredStrategy([f"cpu:{i}" for i in range(4)]), args.steps)
    print(f"MirroredStrategy (4 devices):                          {show(mirrored)}")
    if args.no_multiworker:
        return 0
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "shardwise.launch",
            "--nproc",
            "2",
            __file__,
            "--steps",
            str(args.steps),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    print(run.stdout, end="")
    if run.returncode:
        print(run.stderr, file=sys.stderr)
        return run.returncode
    same = run.stdout.split(":", 1)[-1].split() == show(mirrored).split()
    print(f"same losses: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
