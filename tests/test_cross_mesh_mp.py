"""Cross-mesh redistribution across processes: source and target meshes on disjoint process
sets (ranks 0-1 to ranks 2-3), overlapping ones, several devices per process on one side, a
process in neither mesh, and a shape two processes disagree on. The oracle is the global tensor
(``full_tensor`` on the target, and the pieces ``distribute_tensor`` gives there); the bytes
every process counts add up to the cross-mesh lower bound."""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist

from mp_harness import run_in_processes

SHAPE = (5, 7)


def _source(x: torch.Tensor, mesh, placements: tuple):
    """``x`` on ``mesh``, with real Partial terms (integers, so every order sums exactly)."""
    import shardwise as sw
    from shardwise.geometry import extract_local, shard_segments

    terms = [m for m, p in enumerate(placements) if p.is_partial() and mesh.shape[m] > 1]
    noise = torch.arange(x.numel(), dtype=x.dtype).reshape(x.shape) % 5 - 2
    count = 1
    for m in terms:
        count *= mesh.shape[m]
    comps = []
    for d in mesh.local_device_ids:
        coord = mesh.coordinate_of(d)
        first = all(coord[m] == 0 for m in terms)
        value = x - (count - 1) * noise if first else noise
        comps.append(extract_local(value, shard_segments(x.shape, mesh.shape, placements, coord)))
    if not comps:
        return sw.DTensor.from_local(torch.empty(0, 0, dtype=x.dtype), mesh, list(placements),
                                     shape=x.shape)
    return sw.DTensor.from_local(comps, mesh, list(placements), shape=x.shape)


def _moves(pairs: list, options: tuple) -> list[dict]:
    """Every pair of meshes (as id lists) and placement combination: what this process got."""
    import shardwise as sw
    from shardwise import DeviceMesh, Partial
    from shardwise.redistribute import cross_mesh_lower_bound_bytes

    x = (torch.arange(35.0).reshape(SHAPE) * 3) % 11 - 5
    results = []
    for src_ids, dst_ids in pairs:
        source, target = DeviceMesh("cpu", src_ids), DeviceMesh("cpu", dst_ids)
        for before in itertools.product(options, repeat=source.ndim):
            dt = _source(x, source, before)
            for after in itertools.product(options, repeat=target.ndim):
                plan = sw.debug.explain_redistribute(dt, list(after), device_mesh=target)
                with sw.debug.CommCounter() as counter:
                    out = sw.dtensor.reshard(dt, target, list(after))
                ok_bytes = plan.bytes == counter.total_bytes
                full = out.full_tensor()
                ok = not target.local_device_ids or torch.equal(full, x)
                if target.local_device_ids and not any(isinstance(p, Partial) for p in after):
                    expected = sw.local_components(sw.distribute_tensor(x, target, list(after)))
                    ok = ok and all(torch.equal(a, b) for a, b in
                                    zip(sw.local_components(out), expected, strict=True))
                results.append({
                    "case": (src_ids, dst_ids, repr(before), repr(after)), "ok": ok and ok_bytes,
                    "bytes": counter.total_bytes, "held": len(sw.local_components(out)),
                    "shape": list(out.shape),
                    "bound": cross_mesh_lower_bound_bytes(SHAPE, 4, source, before, target, after),
                })
    return results


def _check(per_rank: list[list[dict]]) -> tuple[int, int]:
    at_bound = 0
    for cases in zip(*per_rank, strict=True):
        case = cases[0]["case"]
        assert all(c["ok"] for c in cases), case
        moved = sum(c["bytes"] for c in cases)
        at_bound += moved == cases[0]["bound"]
        assert moved == cases[0]["bound"], (case, moved, cases[0]["bound"])
    return at_bound, len(per_rank[0])


def _four() -> list[dict]:
    from shardwise import Partial, Replicate, Shard

    pairs = [
        ([0, 1], [2, 3]),  # disjoint process sets: a pipeline stage handoff
        ([0, 1, 2, 3], [[3, 2], [1, 0]]),  # the same processes, reshaped and reversed
        ([[0, 1], [2, 3]], [1, 2, 3]),  # 4 -> 3, overlapping
        ([0, 1], [1, 2]),  # overlapping in one process; rank 3 is in neither mesh
    ]
    return _moves(pairs, (Shard(0), Shard(1), Replicate(), Partial()))


def _two() -> list[dict]:
    from shardwise import Partial, Replicate, Shard

    # ids 0..3 over 2 processes are two devices each; ids [0, 1] are the ranks
    pairs = [([[0, 1], [2, 3]], [0, 1]), ([1], [0, 1, 2, 3]), ([0, 1, 2, 3], [1])]
    return _moves(pairs, (Shard(0), Shard(1), Replicate(), Partial()))


def test_four_processes_disjoint_overlapping_and_outside() -> None:
    per_rank = run_in_processes(_four, 4, timeout=600)
    at_bound, tried = _check(per_rank)
    outside = [c for c in per_rank[3] if c["case"][:2] == ([0, 1], [1, 2])]
    assert outside and all(c["held"] == 0 and c["shape"] == list(SHAPE) for c in outside)
    assert all(c["held"] == 1 for c in per_rank[2] if c["case"][:2] == ([0, 1], [2, 3]))
    print(f"4 processes: {at_bound} at the bound / {tried}")


def test_two_processes_several_devices_per_process() -> None:
    at_bound, tried = _check(run_in_processes(_two, 2, timeout=600))
    print(f"2 processes: {at_bound} at the bound / {tried}")


def _mismatch() -> str:
    import shardwise as sw
    from shardwise import DeviceMesh, Shard

    rows = 5 if dist.get_rank() < 2 else 6  # the target's processes think the rows are 6
    dt = sw.distribute_tensor(torch.ones(rows, 7), DeviceMesh("cpu", [0, 1]), [Shard(0)])
    try:
        sw.dtensor.reshard(dt, DeviceMesh("cpu", [2, 3]), [Shard(1)])
    except sw.errors.ShardwiseError as err:
        return f"{type(err).__name__}: {err}"
    return "no error"


def test_processes_disagreeing_on_the_shape_get_a_clear_error() -> None:
    for message in run_in_processes(_mismatch, 4, timeout=180):
        assert message.startswith("CollectiveMismatchError"), message
        assert "reshard" in message and "shape" in message and "Shard(dim=1)" in message
