"""MultiWorkerMirroredStrategy across 2 gloo processes x 2 simulated devices gives the same
numbers as MirroredStrategy with 4 devices in one process (one spawned job runs every check),
and the example trains the same losses both ways."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import shardwise.distribute as swd
from mp_harness import run_in_processes
from shardwise.debug import CommCounter
from shardwise.distribute import VariableAggregation as VA
from shardwise.distribute import VariableSynchronization as VS

ROOT = Path(__file__).resolve().parents[1]


def _rid() -> torch.Tensor:
    return swd.get_replica_context().replica_id_in_sync_group.float()


def _train(strategy: swd.Strategy) -> list[float]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 4, generator=g)
    y = x @ torch.tensor([[1.0], [2.0], [-1.0], [0.5]])
    data = [(x[i : i + 8], y[i : i + 8]) for i in range(0, 40, 8)]
    with strategy.scope():
        torch.manual_seed(1)
        model = strategy.distribute_module(
            torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        )
        opt = swd.Optimizer(torch.optim.Adam, model.variables(), lr=0.05)

    def step(xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        loss = swd.compute_average_loss(((model(xb) - yb) ** 2).mean(dim=1), global_batch_size=8)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    return [
        strategy.reduce("sum", strategy.run(step, args=b), axis=None).item()
        for b in strategy.experimental_distribute_dataset(data)
    ]


def program(multi_worker: bool) -> dict:
    """Every check; values that are per replica are this process's local results."""
    if multi_worker:
        s: swd.Strategy = swd.MultiWorkerMirroredStrategy(["cpu:0", "cpu:1"])
    else:
        s = swd.MirroredStrategy([f"cpu:{i}" for i in range(4)])
    out: dict = {"n": s.num_replicas_in_sync, "devices": s.extended.worker_devices}

    def local(value: object) -> list:
        return [
            t.tolist() if isinstance(t, torch.Tensor) else t
            for t in s.experimental_local_results(value)
        ]

    out["ids"] = local(s.run(lambda: swd.get_replica_context().replica_id_in_sync_group))
    ids = s.run(lambda: _rid() * torch.tensor([1.0, 2.0]))
    out["reduce"] = [
        s.reduce(op, ids, axis=a).tolist() for op in ("sum", "mean") for a in (None, 0)
    ]
    with s.scope():
        init = torch.tensor(float(torch.distributed.get_rank() + 5)) if multi_worker else 5.0
        v = {
            agg: swd.Variable(init, aggregation=agg)
            for agg in (VA.SUM, VA.MEAN, VA.ONLY_FIRST_REPLICA)
        }
        sor = {
            agg: swd.Variable(1.0, synchronization=VS.ON_READ, aggregation=agg)
            for agg in (VA.SUM, VA.MEAN, VA.ONLY_FIRST_REPLICA)
        }
    out["initial"] = [x.read_value().item() for x in v.values()]  # worker 0's value everywhere

    def updates() -> None:
        for var in (*v.values(), *sor.values()):
            var.assign_add(_rid() + 1.0)

    s.run(updates)
    out["mirrored"] = [[c.value().item() for c in x.values] for x in v.values()]
    out["sync_on_read_local"] = [[c.value().item() for c in x.values] for x in sor.values()]
    out["sync_on_read"] = [x.read_value().item() for x in sor.values()]
    sor[VA.SUM].assign(8.0)
    out["sum_assign_local"] = [c.value().item() for c in sor[VA.SUM].values]
    out["sum_assign_read"] = sor[VA.SUM].read_value().item()

    def replica_collectives() -> tuple:
        rc = swd.get_replica_context()
        r = int(rc.replica_id_in_sync_group)
        value = {"a": torch.tensor(1.0 + 2 * r), "b": [torch.tensor([40.0, 1.0]) + r]}
        merged = rc.merge_call(lambda st, x: st.reduce("sum", x, axis=None), args=(_rid(),))
        return (
            rc.all_reduce("sum", value),
            rc.all_reduce("mean", value),
            rc.all_gather(torch.arange(r + 1), axis=0),
            merged,
        )

    with CommCounter() as c:
        res = s.run(replica_collectives)
    out["all_reduce_sum"] = [d["a"].item() for d in s.experimental_local_results(res[0])]
    out["all_reduce_mean_b"] = [d["b"][0].tolist() for d in s.experimental_local_results(res[1])]
    out["all_gather"] = local(res[2])
    out["merge"] = res[3].item()
    out["fused"] = c.counts["all_reduce"]
    with s.scope():
        w = swd.Variable(0.0)
    grads = [s.run(lambda k=k: torch.full((k,), 1.0) * (_rid() + k)) for k in (1, 2, 3)]
    with CommCounter() as c:
        reduced = s.extended.batch_reduce_to("sum", [(g, w) for g in grads])
    out["batch_reduce"] = [local(r) for r in reduced]
    out["batch_reduce_collectives"] = c.counts["all_reduce"]
    ds = [torch.arange(8.0), torch.arange(8.0, 11.0)]
    steps = list(s.experimental_distribute_dataset(ds))
    out["dataset"] = [local(b) for b in steps]
    out["dataset_mean"] = [s.reduce("mean", b, axis=0).item() for b in steps]
    out["gather"] = s.gather(s.run(lambda: _rid().reshape(1, 1)), 0).tolist()
    out["training"] = _train(s)
    return out


def _expected_single() -> tuple[dict, list[float]]:
    single = program(False)
    # plain single-device training on the same global batches
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 4, generator=g)
    y = x @ torch.tensor([[1.0], [2.0], [-1.0], [0.5]])
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    losses = []
    for i in range(0, 40, 8):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x[i : i + 8]), y[i : i + 8])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return single, losses


PER_ITEM_KEYS = {"mirrored", "sync_on_read_local", "batch_reduce", "dataset"}
LOCAL_KEYS = {
    "ids",
    "sum_assign_local",
    "all_reduce_sum",
    "all_reduce_mean_b",
    "all_gather",
    "devices",
}


def test_two_workers_match_one_process_with_four_devices() -> None:
    single, plain_losses = _expected_single()
    assert single["ids"] == [0, 1, 2, 3] and single["n"] == 4
    assert single["mirrored"] == [[15.0] * 4, [7.5] * 4, [6.0] * 4]
    assert single["sync_on_read_local"] == [[2.0, 3.0, 4.0, 5.0]] * 3
    assert single["sync_on_read"] == [14.0, 3.5, 2.0]
    assert single["sum_assign_local"] == [2.0] * 4 and single["sum_assign_read"] == 8.0
    assert single["all_reduce_sum"] == [16.0] * 4 and single["merge"] == 6.0
    assert single["all_gather"] == [[0, 0, 1, 0, 1, 2, 0, 1, 2, 3]] * 4
    assert single["fused"] == 3  # two all_reduce calls (one fused collective each) + merge reduce
    assert single["batch_reduce_collectives"] == 1
    assert single["dataset_mean"] == [3.5, 9.0]
    assert single["training"] == pytest.approx(plain_losses, rel=1e-5, abs=1e-6)
    per_rank = run_in_processes(
        program, 2, True, timeout=120, env={"SHARDWISE_COLLECTIVE_TIMEOUT": "60"}
    )
    for key, expected in single.items():
        if key in PER_ITEM_KEYS:  # one list of local components per variable / pair / step
            got = [a + b for a, b in zip(per_rank[0][key], per_rank[1][key], strict=True)]
        elif key in LOCAL_KEYS:
            got = [x for rank in per_rank for x in rank[key]]
        else:
            got = per_rank[0][key]
            assert per_rank[1][key] == got, key
        if key == "devices":
            continue
        assert got == expected, key
    assert per_rank[0]["devices"] == per_rank[1]["devices"] == ("cpu:0", "cpu:1")


def test_example_trains_the_same_losses_both_ways() -> None:
    env = dict(
        os.environ, PYTHONPATH=str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")
    )
    run = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "distribute_mirrored.py"), "--steps", "3"],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    mirrored = lines[0].split(":", 1)[1].split()
    multi = lines[1].split(":", 1)[1].split()
    assert len(mirrored) == 3 and mirrored == multi and lines[2] == "same losses: True"
