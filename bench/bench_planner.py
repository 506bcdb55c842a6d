"""Redistribution planning: bytes against the lower bound, and planning time, for shardwise and
torch.distributed.tensor's planners in the same run.

Every transition between placement tuples of Shard(0), Shard(1), Shard(2), Replicate and
Partial on meshes (4,), (2, 2) and (2, 2, 2) is planned by both libraries for one tensor (the
targets with a Partial summed apart: "to_partial", printed as "MESH to Partial"), and on
(2, 2, 2) again for a tensor whose shards are uneven (some empty). Planning time is cold (the
plan caches cleared, shard and mesh geometry kept): per transition the median of 5 plans, timed
in rounds over the whole sweep.
Bytes are those all devices receive under the ring model of DESIGN.md; DTensor's steps are
priced by the same model (its flattened steps move what the per-dim steps they merge move, so
they are priced unflattened). The bound is ``shardwise.geometry.lower_bound_bytes``.

Run: python bench/bench_planner.py [--json FILE] [--quick]   (--quick: meshes (4,) and (2, 2)
only for the all-pairs sweep; the named 2x2x2 transitions always run)
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed import tensor as torch_dt
from torch.distributed.tensor._dtensor_spec import DTensorSpec as TorchSpec
from torch.distributed.tensor._dtensor_spec import TensorMeta as TorchMeta
from torch.distributed.tensor._redistribute import _gen_transform_infos_non_cached
from torch.testing._internal.distributed.fake_pg import FakeStore

import shardwise as sw
from shardwise.redistribute import lower_bound_bytes, plan_cross_mesh, plan_redistribute
from shardwise.redistribute.exchange import exchange_cost
from shardwise.redistribute.plan import _PLANS, _moves, _plan, _step_kind
from shardwise.redistribute.pricing import Pricer
from shardwise.spec import DTensorSpec, contiguous_meta

SHAPE = (16, 12, 8)
UNEVEN = (5, 3, 7)  # swept on the 2x2x2 mesh too
ITEMSIZE = 4
MESHES = [(4,), (2, 2), (2, 2, 2)]
NAMED = [  # the transitions of issue 13, on the 2x2x2 mesh
    ("S0,S1,S2", "S2,S0,S1"),
    ("S0,S0,R", "S1,S1,R"),
    ("S0,R,R", "R,R,S0"),
    ("P,P,P", "R,R,R"),
    ("P,R,S0", "S0,S1,R"),
    ("S0,S1,R", "R,S0,S1"),
]


def _ours(code: str) -> sw.Placement:
    return {"R": sw.Replicate(), "P": sw.Partial()}.get(code) or sw.Shard(int(code[1]))


def _theirs(code: str):
    return {"R": torch_dt.Replicate(), "P": torch_dt.Partial()}.get(code) or torch_dt.Shard(
        int(code[1])
    )


def _their_bytes(mesh: sw.DeviceMesh, infos, source: tuple, shape: tuple[int, ...]) -> int:
    """DTensor's steps priced by shardwise's ring model, tracking the placements."""
    pricer = Pricer(mesh, shape, ITEMSIZE)
    state, total = source, 0
    for info in infos:
        m = info.mesh_dim
        a, b = (_ours(_code(p)) for p in info.src_dst_placements)
        after = state[:m] + (b,) + state[m + 1 :]
        kind = _step_kind(a, b, mesh.shape[m])
        if a.is_shard() and b.is_partial() and mesh.shape[m] > 1:
            kind = "all_gather"  # DTensor runs no Shard -> Partial: Shard -> Replicate -> Partial
        total += pricer.price(kind, state, after, m)[1]
        state = after
    return total


def _code(p) -> str:
    if p.is_replicate():
        return "R"
    if p.is_partial():
        return "P"
    return f"S{p.dim}"


ROUNDS = 5  # cold plans timed per transition, in rounds over all of a sweep's transitions


def _time_ms(fn) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def _time_rounds(rows: list[dict], timers: list[dict]) -> None:
    """Each row's ``*_ms`` entries: the median of ``ROUNDS`` timings of its functions, taken
    one transition after another, round after round (a burst of load on a shared machine then
    hits one round of many transitions, not every timing of one)."""
    times: list[dict[str, list[float]]] = [{k: [] for k in t} for t in timers]
    for _ in range(ROUNDS):
        for fns, spent in zip(timers, times, strict=True):
            for key, fn in fns.items():
                start = time.perf_counter()
                fn()
                spent[key].append(time.perf_counter() - start)
    for row, spent in zip(rows, times, strict=True):
        row.update({key: statistics.median(t) * 1e3 for key, t in spent.items()})


def run(meshes: list[tuple[int, ...]] = MESHES) -> dict:
    results: dict = {"meshes": {}, "to_partial": {}, "named": []}
    sweeps = [(m, SHAPE, str(m)) for m in meshes]
    if (2, 2, 2) in meshes:
        sweeps.append(((2, 2, 2), UNEVEN, f"(2, 2, 2) uneven {'x'.join(map(str, UNEVEN))}"))
    for mesh_shape, shape, name in sweeps:
        ids = torch.arange(int(torch.tensor(mesh_shape).prod())).reshape(mesh_shape)
        ours_mesh = sw.DeviceMesh("meta", ids)
        their_mesh = torch_dt.DeviceMesh("cpu", ids)
        codes = ["S0", "S1", "S2", "R", "P"]
        states = list(itertools.product(codes, repeat=len(mesh_shape)))
        rows, timers, to_partial, partial_timers = [], [], [], []
        for src, dst in itertools.product(states, states):
            row, fns = _compare(ours_mesh, their_mesh, src, dst, graph=False, shape=shape)
            # Partial targets summed on their own, so the Partial-free rows stay comparable
            (to_partial if "P" in dst else rows).append(row)
            (partial_timers if "P" in dst else timers).append(fns)
        _time_rounds(rows, timers)
        _time_rounds(to_partial, partial_timers)
        results["meshes"][name] = _summary(rows)
        results["to_partial"][name] = _summary(to_partial)
    cube = sw.DeviceMesh("meta", torch.arange(8).reshape(2, 2, 2))
    their_cube = torch_dt.DeviceMesh("cpu", torch.arange(8).reshape(2, 2, 2))
    timers = []
    for src, dst in NAMED:
        row, fns = _compare(cube, their_cube, tuple(src.split(",")), tuple(dst.split(",")), True)
        results["named"].append(row)
        timers.append(fns)
    _time_rounds(results["named"], timers)
    spec = DTensorSpec(cube, (sw.Shard(0), sw.Shard(1), sw.Shard(2)),
                       contiguous_meta(SHAPE, torch.float32))
    target = (sw.Shard(2), sw.Shard(0), sw.Shard(1))
    plan_redistribute(spec, target)
    n = 20000
    start = time.perf_counter()
    for _ in range(n):
        plan_redistribute(spec, target)
    results["cached_lookup_us"] = (time.perf_counter() - start) / n * 1e6
    return results


def _compare(
    mesh, their_mesh, src: tuple, dst: tuple, graph: bool, shape: tuple[int, ...] = SHAPE
) -> tuple[dict, dict]:
    """The bytes of both planners against the bound, and the functions whose cold planning
    time goes in the row (DTensor's graph planner, much slower, is timed once here)."""
    source = tuple(_ours(c) for c in src)
    target = tuple(_ours(c) for c in dst)
    bound = lower_bound_bytes(mesh, shape, ITEMSIZE, source, target)
    spec = DTensorSpec(mesh, source, contiguous_meta(shape, torch.float32))

    def plan_ours():  # cold: the plan caches cleared (shard and mesh geometry stay cached)
        _plan.cache_clear()
        exchange_cost.cache_clear()
        _moves.cache_clear()
        plan_cross_mesh.cache_clear()
        _PLANS.clear()
        # as redistribute(): spreads, and a point to point step where that moves fewer bytes
        return plan_redistribute(spec, target, spread=True)

    ours = plan_ours().global_bytes
    meta = TorchMeta(torch.Size(shape), (shape[1] * shape[2], shape[2], 1), torch.float32)
    tsrc = TorchSpec(their_mesh, tuple(_theirs(c) for c in src), meta)
    tdst = TorchSpec(their_mesh, tuple(_theirs(c) for c in dst), meta)
    row = {
        "transition": f"({','.join(src)})->({','.join(dst)})",
        "bound": bound,
        "shardwise": ours,
    }
    greedy = _gen_transform_infos_non_cached(tsrc, tdst, use_graph_based_transform=False)
    row["dtensor_greedy"] = _their_bytes(mesh, greedy, source, shape)
    timers = {
        "shardwise_ms": plan_ours,
        "dtensor_greedy_ms": lambda: _gen_transform_infos_non_cached(
            tsrc, tdst, use_graph_based_transform=False
        ),
    }
    if graph:
        infos = _gen_transform_infos_non_cached(tsrc, tdst, use_graph_based_transform=True)
        row["dtensor_graph"] = _their_bytes(mesh, infos, source, shape)
        row["dtensor_graph_ms"] = _time_ms(
            lambda: _gen_transform_infos_non_cached(tsrc, tdst, use_graph_based_transform=True)
        )
    return row, timers


def _ratio(value: int, bound: int) -> float:
    return 1.0 if value == bound else (value / bound if bound else float("inf"))


def _summary(rows: list[dict]) -> dict:
    out = {"transitions": len(rows)}
    for who in ("shardwise", "dtensor_greedy"):
        moving = [r for r in rows if r["bound"] > 0 or r[who] > 0]
        ratios = [_ratio(r[who], r["bound"]) for r in moving] or [1.0]
        out[who] = {
            "at_bound": sum(r[who] == r["bound"] for r in rows),
            "worst_ratio": max(ratios),
            "mean_ratio": statistics.fmean(ratios),
        }
    out["shardwise_plan_ms_median"] = statistics.median(r["shardwise_ms"] for r in rows)
    out["shardwise_plan_ms_max"] = max(r["shardwise_ms"] for r in rows)
    slowest = sorted(rows, key=lambda r: r["shardwise_ms"])[-3:]
    out["shardwise_slowest"] = {r["transition"]: r["shardwise_ms"] for r in reversed(slowest)}
    out["dtensor_greedy_ms_median"] = statistics.median(r["dtensor_greedy_ms"] for r in rows)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the results to this file")
    parser.add_argument("--quick", action="store_true", help="skip the 3-D all-pairs sweep")
    args = parser.parse_args()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    try:
        results = run(MESHES[:2] if args.quick else MESHES)
    finally:
        dist.destroy_process_group()
    print(f"Planner, tensor {list(SHAPE)} float32 (uneven: {list(UNEVEN)}): bytes over all "
          "devices / lower bound, cold planning ms")
    print(f"{'mesh':<24}{'pairs':>6}{'sw at bound':>13}{'sw worst':>10}{'DT at bound':>13}"
          f"{'DT worst':>10}{'sw ms':>8}{'sw max':>8}{'DT ms':>8}")
    sweeps = [*results["meshes"].items(),
              *((f"{m} to Partial", s) for m, s in results["to_partial"].items())]
    for mesh, s in sweeps:
        print(f"{mesh:<24}{s['transitions']:>6}{s['shardwise']['at_bound']:>13}"
              f"{s['shardwise']['worst_ratio']:>10.2f}{s['dtensor_greedy']['at_bound']:>13}"
              f"{s['dtensor_greedy']['worst_ratio']:>10.2f}{s['shardwise_plan_ms_median']:>8.2f}"
              f"{s['shardwise_plan_ms_max']:>8.2f}{s['dtensor_greedy_ms_median']:>8.2f}")
    for mesh, s in sweeps:
        print(f"slowest cold plans on {mesh}: "
              + ", ".join(f"{t} {ms:.2f} ms" for t, ms in s["shardwise_slowest"].items()))
    print(f"\n{'2x2x2 transition':<26}{'sw':>7}{'DT greedy':>11}{'DT graph':>10}{'sw ms':>8}"
          f"{'graph ms':>10}")
    for r in results["named"]:
        b = r["bound"]
        print(f"{r['transition']:<26}{_ratio(r['shardwise'], b):>7.2f}"
              f"{_ratio(r['dtensor_greedy'], b):>11.2f}{_ratio(r['dtensor_graph'], b):>10.2f}"
              f"{r['shardwise_ms']:>8.2f}{r['dtensor_graph_ms']:>10.1f}")
    print(f"\ncached plan lookup: {results['cached_lookup_us']:.2f} us")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
