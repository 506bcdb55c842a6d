"""Cross-mesh redistribution (``reshard``, ``redistribute(device_mesh=other)``), embedded.

The oracle is the global tensor and the reference geometry of conftest (plain index lists):
every result's components must be the reference slices of it, reduced over target Partial
dims. Bytes are what ``CommCounter`` counts the transport moving, set beside the cross-mesh
lower bound, and beside the one-mesh bound where the two meshes hold the same devices alike.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

import shardwise as sw
from conftest import check_components, components_for, make_tensor
from shardwise import DeviceMesh, InterleavedShard, Partial, Replicate, Shard
from shardwise.errors import InvalidArgumentError, InvalidPlacementError, MeshError
from shardwise.redistribute import cross_mesh_lower_bound_bytes, lower_bound_bytes

SHAPE = (5, 7)
OPTIONS = (Shard(0), Shard(1), Replicate(), Partial())


def _mesh(ids: list) -> DeviceMesh:
    return DeviceMesh("cpu", ids)


def _ids(shape: tuple[int, ...], start: int, order: int = 1) -> list:
    """Device ids ``start, start+1, ...`` (reversed with ``order=-1``) laid out as ``shape``."""
    flat = list(range(start, start + math.prod(shape)))[::order]
    return torch.tensor(flat).reshape(shape).tolist()


# source meshes over ids 0..n-1; targets shifted (disjoint or overlapping), reversed, reshaped
SOURCE_SHAPES = [(1,), (2,), (3,), (4,), (2, 2), (1, 2), (2, 1), (1, 3)]
TARGET_SHAPES = [(1,), (2,), (3,), (4,), (2, 2), (2, 1), (1, 3), (3, 1), (1, 4)]


def _pairs() -> list[tuple[list, list]]:
    pairs = []
    for s in SOURCE_SHAPES:
        src = _ids(s, 0)
        for t in TARGET_SHAPES:
            for start, order in ((0, 1), (1, 1), (math.prod(s), 1), (0, -1)):
                dst = _ids(t, start, order)
                if dst != src:
                    pairs.append((src, dst))
    return pairs


def _source(x: torch.Tensor, mesh: DeviceMesh, placements: tuple, seed: int) -> sw.DTensor:
    comps = components_for(x, mesh, placements, seed)
    return sw.DTensor.from_local(comps, mesh, list(placements), shape=x.shape)


def _check(dt: sw.DTensor, x: torch.Tensor, target: DeviceMesh, after: tuple) -> int:
    """Move ``dt`` to ``after`` on ``target``, check it, return the bytes counted."""
    with sw.debug.CommCounter() as counter:
        out = sw.dtensor.reshard(dt, target, list(after))
    assert out.device_mesh == target and out.placements == after
    check_components(sw.local_components(out), x, target, after)
    assert torch.equal(out.full_tensor(), x)
    return counter.total_bytes


@pytest.mark.slow  # end to end: every 1-D/2-D mesh pair of 1-4 devices (about 20 s of CPU)
def test_sweep_values_exact_and_bytes_at_the_bound() -> None:
    """Every pair of 1-D/2-D meshes of 1-4 devices (shifted, overlapping, reversed, reshaped),
    every Shard(0)/Shard(1)/Replicate/Partial combination on both: exact values, and bytes
    equal to the lower bound."""
    x = make_tensor(SHAPE, torch.float32, 0)
    tried = at_bound = 0
    for src_ids, dst_ids in _pairs():
        source, target = _mesh(src_ids), _mesh(dst_ids)
        for before in itertools.product(OPTIONS, repeat=source.ndim):
            dt = _source(x, source, before, tried)
            for after in itertools.product(OPTIONS, repeat=target.ndim):
                moved = _check(dt, x, target, after)
                bound = cross_mesh_lower_bound_bytes(SHAPE, 4, source, before, target, after)
                plan = sw.debug.explain_redistribute(dt, list(after), device_mesh=target)
                assert plan.global_bytes == moved and plan.lower_bound == bound
                tried += 1
                at_bound += moved == bound
    print(f"cross-mesh sweep: {at_bound} pairs at the bound / {tried} tried")
    assert at_bound == tried


def test_same_devices_other_mesh_matches_the_one_mesh_bound() -> None:
    """A mesh with the same devices in the same places (only the dim names differ) is another
    mesh to ``reshard``, yet it must cost what the one-mesh lower bound says."""
    x = make_tensor(SHAPE, torch.float32, 1)
    a = DeviceMesh("cpu", [[0, 1], [2, 3]])
    b = DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=("dp", "tp"))
    for before in itertools.product(OPTIONS, repeat=2):
        dt = _source(x, a, before, 3)
        for after in itertools.product(OPTIONS, repeat=2):
            moved = _check(dt, x, b, after)
            assert moved == lower_bound_bytes(a, SHAPE, 4, before, after), (before, after)


def test_partial_source_reduces_in_coordinate_order_like_one_mesh() -> None:
    """Random floats pending a sum: the cross-mesh result has the bits of the one-mesh one."""
    g = torch.Generator().manual_seed(0)
    comps = [torch.randn(SHAPE, generator=g) for _ in range(4)]
    a, b = _mesh([0, 1, 2, 3]), _mesh([[4, 5], [6, 3]])
    dt = sw.DTensor.from_local(comps, a, [Partial()], shape=SHAPE)
    one_mesh = dt.redistribute(a, [Replicate()]).full_tensor()
    for after in ([Replicate(), Replicate()], [Shard(0), Shard(1)], [Replicate(), Shard(1)]):
        assert torch.equal(dt.redistribute(device_mesh=b, placements=after).full_tensor(),
                           one_mesh)


def test_uneven_and_interleaved() -> None:
    x = make_tensor((6, 7), torch.float64, 2)
    a, b = _mesh([0, 1, 2]), _mesh([[1, 2], [3, 4]])
    placements = ([InterleavedShard(0, 2)], [Shard(1)])
    for before, after in itertools.product(placements, ([Shard(1), InterleavedShard(0, 3)],
                                                          [Replicate(), Shard(0)])):
        dt = sw.distribute_tensor(x, a, before)
        moved = _check(dt, x, b, tuple(after))
        assert moved == cross_mesh_lower_bound_bytes(
            (6, 7), 8, a, tuple(before), b, tuple(after)
        )


def test_resize_and_stage_handoff_examples() -> None:
    """4 -> 3 devices, a (dp, tp) training mesh to a 1-D inference mesh, and a pipeline
    handoff to disjoint devices: exact, differentiable back to the source mesh."""
    x = torch.randn(9, 10, dtype=torch.float64)
    train = DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=("dp", "tp"))
    dt = sw.distribute_tensor(x, train, [Replicate(), Shard(1)]).requires_grad_()
    infer = _mesh([0, 1, 2])
    out = dt.redistribute(device_mesh=infer, placements=[Shard(0)])
    assert torch.equal(out.full_tensor(), x)
    stage = _mesh([4, 5])
    handed = sw.dtensor.reshard(out, stage, [Shard(1)])
    assert torch.equal(handed.full_tensor(), x)
    (handed.full_tensor() * 2).sum().backward()
    assert dt.grad.device_mesh == train and dt.grad.placements == dt.placements
    assert torch.equal(dt.grad.full_tensor(), torch.full_like(x, 2.0))


def test_demo_model_resize_4_to_3_beside_gather_and_rescatter() -> None:
    """The demo GPT's parameters, sharded on 4 devices, resized to 3: the exchange moves at
    most what a gather to one device and a scatter from it move, and exactly the bound."""
    from shardwise.demo import GPT, GPTConfig, tensor_parallel_plan
    from shardwise.parallel import parallelize_module

    cfg = GPTConfig()
    torch.manual_seed(0)
    model = parallelize_module(GPT(cfg), _mesh([0, 1, 2, 3]), tensor_parallel_plan(cfg))
    mesh3 = _mesh([0, 1, 2])
    moved = bound = gather_scatter = 0
    for _, p in model.named_parameters():
        if not isinstance(p, sw.DTensor):
            continue
        after = p.placements  # the same placements, on 3 devices
        with sw.debug.CommCounter() as counter:
            out = sw.dtensor.reshard(p.detach(), mesh3, list(after))
        assert torch.equal(out.full_tensor(), p.detach().full_tensor())
        moved += counter.total_bytes
        size = p.element_size()
        bound += cross_mesh_lower_bound_bytes(tuple(p.shape), size, p.device_mesh,
                                              p.placements, mesh3, after)
        # gather on device 0 (it receives what it lacks), scatter 3 pieces from it
        held0 = sw.local_components(p.detach())[0].numel()
        pieces3 = [c.numel() for c in sw.local_components(out)]
        gather_scatter += (p.numel() - held0 + sum(pieces3[1:])) * size
    print(f"demo 4 -> 3 resize: reshard {moved} bytes (bound {bound}), gather-and-rescatter "
          f"{gather_scatter} bytes")
    assert moved == bound <= gather_scatter


def test_bad_input_errors_name_meshes_and_placements() -> None:
    x = torch.arange(12.0).reshape(3, 4)
    a = _mesh([0, 1])
    dt = sw.distribute_tensor(x, a, [Shard(0)])
    with pytest.raises(MeshError, match=r"\[Shard\(dim=1\)\]: the meshes have different device"):
        sw.dtensor.reshard(dt, DeviceMesh("meta", [0, 1, 2]), [Shard(1)])
    with pytest.raises(InvalidPlacementError, match=r"DeviceMesh\('cpu', \[2, 3, 4\]\)"):
        sw.dtensor.reshard(dt, _mesh([2, 3, 4]), [Shard(5)])
    with pytest.raises(InvalidArgumentError, match="async_op"):
        dt.redistribute(device_mesh=_mesh([2, 3]), placements=[Shard(0)], async_op=True)
    mixed = sw.DTensor.from_local([torch.ones(3, 4)] * 4, _mesh([[0, 1], [2, 3]]),
                                  [Partial("sum"), Partial("max")], shape=(3, 4))
    with pytest.raises(InvalidPlacementError, match=r"Partial\('max'\)\] to .*reduce differently"):
        sw.dtensor.reshard(mixed, _mesh([2, 3, 4]), [Replicate()])
