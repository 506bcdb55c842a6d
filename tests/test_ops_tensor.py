"""Tensor ops (casts, copies, *_like / new_* factories, fill_, tril/triu, one_hot) and the
public factories, against single-device torch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import shardwise as sw
from op_oracle import run_oracle
from shardwise import InterleavedShard, Partial, Replicate, Shard

MESHES = [(2,), (3,), (4,), (2, 2)]


def _t(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# ----- oracle --------------------------------------------------------------------------------

ORACLE = {
    "clone": (lambda a: a.clone(), [_t(5, 3)]),
    "to_float64": (lambda a: a.to(torch.float64), [_t(5, 3)]),
    "to_int64": (lambda a: (a * 4).to(torch.int64), [_t(5, 3)]),
    "to_bool": (lambda a: a.to(torch.bool), [_t(3, 5)]),
    "zeros_like": (lambda a: torch.zeros_like(a) + a, [_t(5, 3)]),
    "empty_like_shape": (lambda a: torch.empty_like(a).shape, [_t(5, 3)]),
    "ones_like": (lambda a: torch.ones_like(a) * a, [_t(5, 3)]),
    "full_like": (lambda a: torch.full_like(a, 2.5), [_t(3, 5)]),
    "new_zeros_other_size": (lambda a: a.new_zeros((2, 7)), [_t(5, 3)]),
    "new_zeros_same_size": (lambda a: a.new_zeros((5, 3)) + a, [_t(5, 3)]),
    "new_ones": (lambda a: a.new_ones((5, 3)) * a, [_t(5, 3)]),
    "new_full": (lambda a: a.new_full((5, 3), 3.0) * a, [_t(5, 3)]),
    "new_empty_strided": (lambda a: a.new_empty_strided((5, 3), (1, 5)).shape, [_t(5, 3)]),
    "fill_": (lambda a: (a * 1).fill_(2.0), [_t(5, 3)]),
    "zero_": (lambda a: (a * 1).zero_() + a, [_t(5, 3)]),
    "copy_": (lambda a, b: (a * 1).copy_(b), [_t(5, 3), _t(5, 3, seed=1)]),
    "copy_broadcast": (lambda a, b: (a * 1).copy_(b), [_t(5, 3), _t(3, seed=1)]),
    "copy_cast": (lambda a, b: a.to(torch.float64).copy_(b), [_t(3, 5), _t(3, 5, seed=1)]),
    "tril": (lambda a: a.tril(), [_t(5, 7)]),
    "triu_1": (lambda a: a.triu(1), [_t(7, 5)]),
    "tril_batched": (lambda a: a.tril(-2), [_t(3, 5, 6)]),
    "triu_batched": (lambda a: a.triu(2), [_t(3, 6, 5)]),
}


@pytest.mark.parametrize("name", list(ORACLE))
def test_oracle(name: str) -> None:
    fn, tensors = ORACLE[name]
    assert run_oracle(fn, tensors, max_cases=10) > 0


def test_tril_interleaved_input() -> None:
    """An interleaved shard of the row dim is not contiguous: it is redistributed first."""
    run_oracle(
        lambda a: a.tril(1), [_t(6, 5)], mesh_shapes=[(2,), (3,)], interleaved=True, max_cases=12
    )


def test_cast_to_int_of_partial_reduces_first() -> None:
    """Two partial halves of 1 truncate to 0 each: the cast must see the summed value."""
    mesh = sw.init_device_mesh("cpu", (2,))
    x = sw.DTensor.from_local([torch.full((3,), 0.5), torch.full((3,), 0.5)], mesh, [Partial()])
    with sw.config.allow_implicit_redistribute():
        got = x.to(torch.int64)
    assert not got.placements[0].is_partial()
    assert torch.equal(got.full_tensor(), torch.ones(3, dtype=torch.int64))
    assert x.to(torch.float64).placements == (Partial(),)  # linear cast: no move


def test_one_hot() -> None:
    labels = torch.randint(0, 5, (7, 3), generator=torch.Generator().manual_seed(0))
    run_oracle(lambda a: F.one_hot(a, 5), [labels], max_cases=10)
    mesh = sw.init_device_mesh("cpu", (3,))
    out = F.one_hot(sw.distribute_tensor(labels, mesh, [Shard(0)]), 5)
    assert out.placements == (Shard(0),)


# ----- placements and communication ----------------------------------------------------------


def test_new_factories_placements() -> None:
    mesh = sw.init_device_mesh("cpu", (2, 2))
    x = sw.distribute_tensor(_t(5, 3), mesh, [Shard(0), Partial()])
    assert x.new_zeros((4, 4)).placements == (Replicate(), Replicate())
    assert x.new_zeros((5, 3)).placements == (Shard(0), Partial())
    ones = x.new_ones((5, 3))
    assert ones.placements == (Shard(0), Replicate())
    assert torch.equal(ones.full_tensor(), torch.ones(5, 3))
    full = x.new_full((2,), 7.0)
    assert full.placements == (Replicate(), Replicate())
    assert torch.equal(full.full_tensor(), torch.full((2,), 7.0))


@pytest.mark.parametrize("reduce_op", ["sum", "avg", "max", "min"])
def test_fill_partial_keeps_value(reduce_op: str) -> None:
    mesh = sw.init_device_mesh("cpu", (2, 2))
    x = sw.distribute_tensor(_t(5, 3), mesh, [Partial(reduce_op), Shard(1)])
    x.fill_(3.0)
    assert x.placements == (Partial(reduce_op), Shard(1))
    assert torch.equal(x.full_tensor(), torch.full((5, 3), 3.0))


def test_copy_into_partial_int() -> None:
    """A replicated source into a Partial("sum") int tensor is written once, not n times."""
    mesh = sw.init_device_mesh("cpu", (3,))
    dst = sw.DTensor.from_local(
        [torch.zeros(4, dtype=torch.int64) for _ in range(3)], mesh, [Partial()]
    )
    src = sw.distribute_tensor(torch.tensor([0.6, 1.5, 2.0, -3.2]), mesh, [Partial()])
    with sw.config.allow_implicit_redistribute():
        dst.copy_(src)
    assert dst.placements == (Partial(),)
    assert torch.equal(dst.full_tensor(), torch.tensor([0, 1, 2, -3]))


def test_copy_explicit_mode_and_cost() -> None:
    mesh = sw.init_device_mesh("cpu", (2,))
    dst = sw.distribute_tensor(torch.zeros(4, 6), mesh, [Shard(0)])
    src = sw.distribute_tensor(_t(4, 6), mesh, [Shard(1)])
    with pytest.raises(sw.errors.ImplicitRedistributeError, match="copy_"):
        dst.copy_(src)
    with sw.debug.CommCounter() as counter, sw.config.allow_implicit_redistribute():
        dst.copy_(src)
    assert dict(counter.counts) == {"all_to_all": 1}
    assert dst.placements == (Shard(0),)
    assert torch.equal(dst.full_tensor(), src.full_tensor())
    # from Replicate nothing moves, even in explicit mode
    dst.copy_(sw.distribute_tensor(torch.ones(4, 6), mesh, [Replicate()]))
    assert torch.equal(dst.full_tensor(), torch.ones(4, 6))


def test_tril_sharded_rows_moves_nothing() -> None:
    mesh = sw.init_device_mesh("cpu", (2, 2))
    x = _t(7, 9)
    d = sw.distribute_tensor(x, mesh, [Shard(0), Shard(1)])
    with sw.debug.CommCounter() as counter:
        out = d.tril(-1)
    assert counter.total_bytes == 0
    assert out.placements == (Shard(0), Shard(1))
    assert torch.equal(out.full_tensor(), x.tril(-1))


# ----- public factories ------------------------------------------------------------------------


def _placement_sets(ndim: int) -> list[list]:
    one = [Replicate(), Shard(0), Shard(1), Partial(), Partial("max")]
    return [[p] for p in one] + [[p, q] for p in one for q in one][:: 3 if ndim > 1 else 1]


@pytest.mark.parametrize("mesh_shape", MESHES)
def test_factories_match_torch(mesh_shape: tuple[int, ...]) -> None:
    mesh = sw.init_device_mesh("cpu", mesh_shape)
    for placements in _placement_sets(len(mesh_shape)):
        if len(placements) != len(mesh_shape):
            continue
        for make, ref in [
            (lambda **k: sw.zeros(5, 3, **k), torch.zeros(5, 3)),
            (lambda **k: sw.ones((5, 3), **k), torch.ones(5, 3)),
            (lambda **k: sw.full([5, 3], 2.5, **k), torch.full((5, 3), 2.5)),
            (lambda **k: sw.full((5, 3), 7, **k), torch.full((5, 3), 7)),
            (
                lambda **k: sw.ones(5, 3, dtype=torch.int32, **k),
                torch.ones(5, 3, dtype=torch.int32),
            ),
        ]:
            d = make(device_mesh=mesh, placements=placements)
            assert d.placements == tuple(placements)
            assert d.dtype == ref.dtype
            assert torch.equal(d.full_tensor(), ref), (placements, mesh_shape)
            spec = d._spec
            for c, device in zip(d._components, mesh.local_device_ids, strict=True):
                assert c.shape == spec.local_shape(device)
        e = sw.empty(5, 3, device_mesh=mesh, placements=placements)
        assert e.shape == (5, 3) and e.placements == tuple(placements)


def test_factories_requires_grad_and_defaults() -> None:
    mesh = sw.init_device_mesh("cpu", (3,))
    w = sw.ones(4, 2, requires_grad=True, device_mesh=mesh, placements=[Shard(0)])
    assert w.requires_grad and w.is_leaf
    (w * 2).sum().backward()
    assert torch.equal(w.grad.full_tensor(), torch.full((4, 2), 2.0))
    assert sw.zeros(3, device_mesh=mesh).placements == (Replicate(),)
    with sw.tf.default_mesh(mesh):
        assert sw.zeros(3).device_mesh == mesh


def test_factories_errors() -> None:
    mesh = sw.init_device_mesh("cpu", (2,))
    with pytest.raises(sw.errors.MeshError, match="device_mesh"):
        sw.zeros(3, 4)
    with pytest.raises(sw.errors.InvalidPlacementError):
        sw.zeros(3, 4, device_mesh=mesh, placements=[Shard(2)])
    with pytest.raises(sw.errors.InvalidArgumentError, match="layout"):
        sw.ones(3, device_mesh=mesh, layout=torch.sparse_coo)
    with pytest.raises(sw.errors.InvalidArgumentError, match="size"):
        sw.zeros(-1, device_mesh=mesh)


def test_interleaved_factory() -> None:
    mesh = sw.init_device_mesh("cpu", (2,))
    d = sw.full((6, 2), 1.5, device_mesh=mesh, placements=[InterleavedShard(0, 3)])
    assert torch.equal(d.full_tensor(), torch.full((6, 2), 1.5))


def test_dtype_keyword_keys_the_sharding_cache() -> None:
    """Two calls that differ only in a dtype keyword must not share cached output metadata."""
    mesh = sw.init_device_mesh("cpu", (2,))
    x = sw.distribute_tensor(_t(5, 3), mesh, [Shard(0)])
    assert x.new_zeros((2, 2)).dtype == torch.float32
    ints = x.new_zeros((2, 2), dtype=torch.int64)
    assert ints.dtype == ints.full_tensor().dtype == torch.int64
    assert torch.zeros_like(x).dtype == torch.float32
    assert torch.zeros_like(x, dtype=torch.float64).full_tensor().dtype == torch.float64


def test_is_same_size_compares_global_shapes_without_moves() -> None:
    """``is_same_size`` answers as single-device torch does on the global tensors, whatever the
    placements, with no collective; a plain tensor on either side is compared by its shape."""
    mesh = sw.init_device_mesh("cpu", (2, 2))
    shapes = [(8, 4), (8, 4), (8, 6), (4, 4)]
    layouts = [[Shard(0), Shard(1)], [Replicate(), Partial()], [Shard(1), Replicate()],
               [Replicate(), Replicate()]]
    tensors = [_t(*s, seed=k) for k, s in enumerate(shapes)]
    dts = [sw.distribute_tensor(t, mesh, p) for t, p in zip(tensors, layouts, strict=True)]
    with sw.debug.CommCounter() as counter:
        for i, j in [(0, 1), (0, 2), (1, 3), (2, 2)]:
            assert dts[i].is_same_size(dts[j]) == tensors[i].is_same_size(tensors[j])
        assert dts[0].is_same_size(tensors[1]) and not tensors[3].is_same_size(dts[0])
    assert dict(counter.counts) == {}
