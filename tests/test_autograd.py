"""Autograd through from_local / pack, redistribute, full_tensor, to_local and local_components.

Components are built from one float64 input ``x`` with the reference geometry so that
``from_local(...).redistribute(target).full_tensor()`` is the identity on ``x``: on Replicate
mesh dims only the device at coordinate 0 depends on ``x`` (the others hold ``x.detach()``),
sum-Partial dims split ``x`` as ``[x - r1 - r2, r1, r2]`` with constant ``r``, avg-Partial dims
as ``[x - r1 - r2, x + r1, x + r2]``, and Shard dims take slices of ``x``. That follows
PyTorch's convention for from_local's backward, which ``gradcheck`` then verifies.
"""

from __future__ import annotations

import math

import pytest
import torch

import shardwise as sw
from conftest import ref_coords, ref_indices, ref_slice
from shardwise import DeviceMesh, InterleavedShard, Partial, Placement, Replicate, Shard


def grad_components(
    x: torch.Tensor, mesh: DeviceMesh, placements: tuple[Placement, ...]
) -> list[torch.Tensor]:
    mesh_shape = tuple(mesh.mesh.shape)
    coords = ref_coords(mesh.mesh)
    partial = [m for m, p in enumerate(placements) if isinstance(p, Partial)]
    ops = {placements[m].reduce_op for m in partial}
    assert ops <= {"sum"} or ops == {"avg"}, "gradcheck sources use sum or avg partials"
    count = math.prod(mesh_shape[m] for m in partial)
    base = torch.linspace(-1.0, 1.0, x.numel(), dtype=x.dtype).reshape(x.shape)
    noise = [base * (q + 0.5) for q in range(count)]
    rest = sum(noise[1:], torch.zeros_like(x))
    out = []
    for device in sorted(coords):
        coord = coords[device]
        live = all(coord[m] == 0 for m, p in enumerate(placements) if isinstance(p, Replicate))
        value = x if live else x.detach()
        q = 0
        for m in partial:
            q = q * mesh_shape[m] + coord[m]
        if q == 0:
            value = value - rest
        elif ops == {"sum"}:
            value = noise[q]
        else:
            value = value + noise[q]
        out.append(ref_slice(value, ref_indices(x.shape, mesh_shape, placements, coord)))
    return out


def _identity_through(
    mesh: DeviceMesh, source: tuple[Placement, ...], target: tuple[Placement, ...]
):
    def f(x: torch.Tensor) -> torch.Tensor:
        dt = sw.DTensor.from_local(grad_components(x, mesh, source), mesh, source)
        return dt.redistribute(placements=target).full_tensor()

    return f


MESH1 = DeviceMesh("cpu", [0, 1, 2])
SOURCES_1D = [Replicate(), Shard(0), Shard(1), InterleavedShard(1, 2), Partial(), Partial("avg")]
TARGETS_1D = SOURCES_1D + [Partial("max"), Partial("min")]


@pytest.mark.parametrize("source", SOURCES_1D, ids=repr)
@pytest.mark.parametrize("target", TARGETS_1D, ids=repr)
def test_gradcheck_1d(source: Placement, target: Placement) -> None:
    x = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    f = _identity_through(MESH1, (source,), (target,))
    assert torch.allclose(f(x), x)
    assert torch.autograd.gradcheck(f, (x,))


MESH2 = sw.init_device_mesh("cpu", (2, 2))
SOURCES_2D = [
    (Replicate(), Replicate()),
    (Shard(0), Shard(1)),
    (Shard(0), Shard(0)),
    (Shard(1), Replicate()),
    (Partial(), Shard(1)),
    (Replicate(), Partial()),
    (Partial(), Partial()),
    (Partial("avg"), Shard(0)),
]
TARGETS_2D = [
    (Replicate(), Replicate()),
    (Shard(1), Shard(0)),
    (Shard(0), Shard(0)),
    (Partial(), Replicate()),
    (Shard(0), Partial()),
    (Replicate(), InterleavedShard(1, 5)),
]


@pytest.mark.parametrize("source", SOURCES_2D, ids=repr)
@pytest.mark.parametrize("target", TARGETS_2D, ids=repr)
def test_gradcheck_2d(source: tuple[Placement, ...], target: tuple[Placement, ...]) -> None:
    x = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    f = _identity_through(MESH2, source, target)
    assert torch.allclose(f(x), x)
    assert torch.autograd.gradcheck(f, (x,))


def test_gradcheck_3d() -> None:
    mesh = sw.init_device_mesh("cpu", (2, 1, 2))
    x = torch.randn(3, 2, dtype=torch.float64, requires_grad=True)
    source = (Shard(0), Partial(), Replicate())
    f = _identity_through(mesh, source, (Replicate(), Shard(1), Shard(0)))
    assert torch.autograd.gradcheck(f, (x,))


@pytest.mark.parametrize(
    "placements",
    [
        (Shard(0), Shard(1)),
        (Replicate(), Shard(0)),
    ],
    ids=repr,
)
def test_local_components_of_pack_is_identity_for_gradients(
    placements: tuple[Placement, ...],
) -> None:
    shapes = [
        tuple(len(i) for i in ref_indices((3, 4), (2, 2), placements, c))
        for c in ((0, 0), (0, 1), (1, 0), (1, 1))
    ]
    components = [torch.randn(s, dtype=torch.float64, requires_grad=True) for s in shapes]

    def f(*cs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(sw.local_components(sw.DTensor.from_local(list(cs), MESH2, placements)))

    assert torch.autograd.gradcheck(f, tuple(components))


def test_pieces_of_a_pending_sum_each_receive_the_whole_gradient() -> None:
    """torch 2.13's from_local rule: a gradient reaching a Partial DTensor is brought to
    Replicate (a pending gradient reduced, one all_reduce), since every piece of a pending sum
    moves the sum one for one; a replicated gradient passes as it is."""
    pieces = [torch.randn(3, 4, dtype=torch.float64, requires_grad=True) for _ in range(4)]
    pending = sw.DTensor.from_local(pieces, MESH2, [Partial(), Replicate()])
    upstream = [torch.randn(3, 4, dtype=torch.float64) for _ in range(4)]
    grad = sw.DTensor.from_local(upstream, MESH2, [Partial(), Replicate()])
    with sw.debug.CommCounter() as counter:
        pending.backward(grad)
    assert counter.counts == {"all_reduce": 1}
    for i in range(2):  # devices (i, j): the sum over mesh dim 0 reaches each piece
        for j in range(2):
            want = upstream[j] + upstream[2 + j]
            torch.testing.assert_close(pieces[2 * i + j].grad, want)
    for p in pieces:
        p.grad = None
    pending = sw.DTensor.from_local(pieces, MESH2, [Partial(), Replicate()])
    whole = torch.randn(3, 4, dtype=torch.float64)
    with sw.debug.CommCounter() as counter:
        pending.backward(sw.distribute_tensor(whole, MESH2, [Replicate(), Replicate()]))
    assert counter.counts == {}
    assert all(torch.equal(p.grad, whole) for p in pieces)


@pytest.mark.parametrize(
    "source, target",
    [
        ((Shard(0),), (Shard(1),)),
        ((Shard(1),), (InterleavedShard(1, 2),)),
        ((Replicate(),), (Shard(0),)),
        ((Partial(),), (Shard(1),)),
    ],
    ids=repr,
)
def test_gradcheck_local_components_of_sharded_result(
    source: tuple[Placement, ...], target: tuple[Placement, ...]
) -> None:
    x = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)

    def f(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        dt = sw.DTensor.from_local(grad_components(x, MESH1, source), MESH1, source)
        return tuple(sw.local_components(dt.redistribute(placements=target)))

    assert torch.autograd.gradcheck(f, (x,))


def test_local_components_of_replicated_result_follows_spmd_convention() -> None:
    """Every device of a Replicate dim is a replica running the same loss (SPMD): the
    gradient is one replica's, and it reaches every shard of the source."""
    x = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, 4, dtype=torch.float64)
    dt = sw.DTensor.from_local(grad_components(x, MESH1, (Shard(0),)), MESH1, [Shard(0)])
    copies = sw.local_components(dt.redistribute(placements=[Replicate()]))
    sum((c * w).sum() for c in copies).backward()
    assert torch.allclose(x.grad, w)


def test_gradcheck_to_local_on_a_one_device_mesh() -> None:
    mesh = DeviceMesh("cpu", [0])
    x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)

    def f(x: torch.Tensor) -> torch.Tensor:
        dt = sw.DTensor.from_local(x, mesh, [Shard(1)])
        return dt.redistribute(placements=[Partial()]).to_local() * 2

    assert torch.autograd.gradcheck(f, (x,))


def test_full_tensor_gradient_values() -> None:
    x = torch.arange(10.0, dtype=torch.float64).reshape(5, 2).requires_grad_()
    dt = sw.DTensor.from_local(grad_components(x, MESH1, (Shard(0),)), MESH1, [Shard(0)])
    (dt.full_tensor() ** 2).sum().backward()
    assert torch.equal(x.grad, 2 * x.detach())
