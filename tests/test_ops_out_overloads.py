"""``out=`` overloads beyond the elementwise ones (reductions, the matmul family, ``cat`` and
``stack``, ops of several results, the foreach ops' ``out`` lists) and the elementwise
``torch.max(a, b)`` / ``torch.min(a, b)`` overloads (``aten.max.other``, ``aten.min.other``).
Single-device torch is the oracle for values; the functional call on the same DTensors gives
the placements an ``out`` takes without anything moving."""

from __future__ import annotations

import pytest
import torch

import shardwise as sw
from shardwise import DTensor, Partial, Replicate, Shard
from shardwise.errors import ImplicitRedistributeError, OpArgumentError
from shardwise.ops import registry

aten = torch.ops.aten
MESHES = [(2,), (4,), (2, 2)]


def _x(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed),
                       dtype=torch.float64)


def _placements(mesh_shape: tuple[int, ...]) -> list[list]:
    """Input layouts: sharded on each dim, and replicated, on every mesh dim."""
    if len(mesh_shape) == 1:
        return [[Shard(0)], [Shard(1)], [Replicate()]]
    return [[Shard(0), Shard(1)], [Replicate(), Shard(0)], [Shard(1), Replicate()]]


def _like(result: DTensor) -> DTensor:
    """An ``out`` of the result's spec, zeros in every piece (a pending value's too)."""
    pieces = [torch.zeros_like(c) for c in sw.local_components(result)]
    return DTensor.from_local(pieces, result.device_mesh, result.placements,
                              shape=result.shape, stride=result.stride())


# (name, call with out=, inputs): the out overload the call reaches is named in ``reaches``
CASES = [
    ("sum", lambda a, out=None: torch.sum(a[0], 1, out=out), [(8, 6)]),
    ("sum_keepdim", lambda a, out=None: torch.sum(a[0], 0, keepdim=True, out=out), [(8, 6)]),
    ("amax", lambda a, out=None: torch.amax(a[0], 1, out=out), [(8, 6)]),
    ("amin", lambda a, out=None: torch.amin(a[0], 0, out=out), [(8, 6)]),
    ("prod", lambda a, out=None: torch.prod(a[0], 1, out=out), [(8, 6)]),
    ("var", lambda a, out=None: torch.var(a[0], 1, out=out), [(8, 6)]),
    ("std", lambda a, out=None: torch.std(a[0], 0, out=out), [(8, 6)]),
    ("cumsum", lambda a, out=None: torch.cumsum(a[0], 1, out=out), [(8, 6)]),
    ("logsumexp", lambda a, out=None: torch.logsumexp(a[0], 1, out=out), [(8, 6)]),
    ("vector_norm", lambda a, out=None: torch.linalg.vector_norm(a[0], 2, 1, out=out),
     [(8, 6)]),
    ("mm", lambda a, out=None: torch.mm(a[0], a[1], out=out), [(8, 6), (6, 4)]),
    ("addmm", lambda a, out=None: torch.addmm(a[2], a[0], a[1], out=out),
     [(8, 6), (6, 4), (8, 4)]),
    ("matmul", lambda a, out=None: torch.matmul(a[0], a[1], out=out), [(8, 6), (6, 4)]),
    ("mv", lambda a, out=None: torch.mv(a[0], a[1][:, 0].contiguous(), out=out),
     [(8, 6), (6, 4)]),
    ("bmm", lambda a, out=None: torch.bmm(a[0].view(4, 2, 6), a[1].view(4, 6, 1), out=out),
     [(8, 6), (4, 6)]),
    ("cat", lambda a, out=None: torch.cat([a[0], a[1]], 0, out=out), [(8, 6), (4, 6)]),
    ("stack", lambda a, out=None: torch.stack([a[0], a[1]], 1, out=out), [(8, 6), (8, 6)]),
    ("max_other", lambda a, out=None: torch.max(a[0], a[1], out=out), [(8, 6), (8, 6)]),
    ("min_other", lambda a, out=None: torch.min(a[0], a[1], out=out), [(8, 6), (8, 6)]),
]


def test_the_out_overloads_are_registered() -> None:
    entries = registry.entries()
    for op in [aten.sum.IntList_out, aten.amax.out, aten.max.dim_max, aten.max.out,
               aten.min.out, aten.mm.out, aten.addmm.out, aten.bmm.out, aten.baddbmm.out,
               aten.mv.out, aten.dot.out, aten.cat.out, aten.stack.out, aten.cumsum.out,
               aten.sort.values, aten.topk.values, aten._foreach_add.List_out,
               aten._foreach_mul.Scalar_out, aten._foreach_exp.out, aten.max.other,
               aten.min.other]:
        assert op in entries, op
    # a twin with per-call hooks keeps its out overload off rather than run without them
    assert registry.registration(aten.mean.dim).local_args is not None
    assert aten.mean.out not in entries


@pytest.mark.parametrize("mesh_shape", MESHES)
@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_out_takes_the_functional_result_as_it_lies(name: str, mesh_shape: tuple) -> None:
    """For every input layout: ``out`` with the placements the functional call gives receives
    the single-device result, in its own pieces, and the call returns it."""
    fn, shapes = next((f, s) for n, f, s in CASES if n == name)
    mesh = sw.init_device_mesh("cpu", mesh_shape)
    plain = [_x(*s, seed=i) for i, s in enumerate(shapes)]
    want = fn(plain)
    for placements in _placements(mesh_shape):
        inputs = [sw.distribute_tensor(t, mesh, placements) for t in plain]
        with sw.config.allow_implicit_redistribute():
            functional = fn(inputs)
            out = _like(functional)
            held = [c.data_ptr() for c in sw.local_components(out)]
            assert fn(inputs, out=out) is out
        assert out.placements == functional.placements, (name, placements)
        assert [c.data_ptr() for c in sw.local_components(out)] == held
        torch.testing.assert_close(out.full_tensor(), want, msg=f"{name} {placements}")


def test_results_of_several_outputs() -> None:
    mesh = sw.init_device_mesh("cpu", (2, 2))
    x = _x(8, 6)
    d = sw.distribute_tensor(x, mesh, [Shard(0), Replicate()])
    for call, want in [
        (lambda t, out=None: torch.max(t, 1, out=out), x.max(1)),
        (lambda t, out=None: torch.min(t, 1, keepdim=True, out=out), x.min(1, keepdim=True)),
        (lambda t, out=None: torch.sort(t, 1, out=out), x.sort(1)),
        (lambda t, out=None: torch.topk(t, 3, 1, out=out), x.topk(3, 1)),
    ]:
        values, indices = call(d)
        outs = (_like(values), _like(indices))
        got = call(d, out=outs)
        assert got[0] is outs[0] and got[1] is outs[1]
        assert outs[0].placements == values.placements == (Shard(0), Replicate())
        assert torch.equal(outs[0].full_tensor(), want[0])
        assert torch.equal(outs[1].full_tensor(), want[1])


def test_max_and_min_of_two_tensors_as_maximum_and_minimum() -> None:
    """``torch.max(a, b)`` shards as ``torch.maximum``: elementwise, a pending max of pending
    maxes stays pending (nothing moves)."""
    mesh = sw.init_device_mesh("cpu", (2,))
    pieces = [_x(3, 4, seed=s) for s in range(4)]
    a = DTensor.from_local(pieces[:2], mesh, [Partial("max")])
    b = DTensor.from_local(pieces[2:], mesh, [Partial("max")])
    with sw.debug.CommCounter() as counter:
        both = torch.max(a, b)
    assert counter.counts == {} and both.placements == (Partial("max"),)
    torch.testing.assert_close(both.full_tensor(),
                               torch.maximum(a.full_tensor(), b.full_tensor()))
    low = DTensor.from_local(pieces[:2], mesh, [Partial("min")])
    assert torch.min(low, low).placements == (Partial("min"),)
    x, y = _x(6, 4, seed=1), _x(6, 4, seed=2)
    dx, dy = (sw.distribute_tensor(t, mesh, [Shard(1)]) for t in (x, y))
    assert torch.max(dx, dy).placements == (Shard(1),)
    assert torch.equal(torch.max(dx, dy).full_tensor(), torch.max(x, y))
    assert torch.equal(torch.min(dx, dy).full_tensor(), torch.min(x, y))
    assert torch.equal(dx.max(dy).full_tensor(), x.max(y))


@pytest.mark.parametrize("mesh_shape", MESHES)
def test_foreach_out_lists(mesh_shape: tuple) -> None:
    mesh = sw.init_device_mesh("cpu", mesh_shape)
    placements = _placements(mesh_shape)
    xs = [_x(8, 6, seed=i) for i in range(3)]
    ys = [_x(8, 6, seed=10 + i) for i in range(3)]
    dxs = [sw.distribute_tensor(t, mesh, p) for t, p in zip(xs, placements, strict=True)]
    dys = [sw.distribute_tensor(t, mesh, p) for t, p in zip(ys, placements, strict=True)]
    for op, args, want in [
        (aten._foreach_add.List_out, (dxs, dys), [a + b for a, b in zip(xs, ys, strict=True)]),
        (aten._foreach_mul.Scalar_out, (dxs, 3.0), [a * 3.0 for a in xs]),
        (aten._foreach_exp.out, (dxs,), [a.exp() for a in xs]),
    ]:
        outs = [sw.distribute_tensor(torch.zeros(8, 6, dtype=torch.float64), mesh, p)
                for p in placements]
        assert op(*args, out=outs) is None  # as torch's: the foreach out overloads return ()
        for o, w, p in zip(outs, want, placements, strict=True):
            assert o.placements == tuple(p)
            torch.testing.assert_close(o.full_tensor(), w)


def test_out_placements_that_need_a_move() -> None:
    """A replicated ``out`` of a sum over the sharded dim: the input must be gathered first,
    refused in explicit mode, done with implicit moves; ``out`` itself never moves."""
    mesh = sw.init_device_mesh("cpu", (2,))
    x = _x(8, 6)
    d = sw.distribute_tensor(x, mesh, [Shard(1)])
    out = sw.distribute_tensor(torch.zeros(8, dtype=torch.float64), mesh, [Replicate()])
    with pytest.raises(ImplicitRedistributeError):
        torch.sum(d, 1, out=out)
    with sw.config.allow_implicit_redistribute():
        assert torch.sum(d, 1, out=out) is out
    assert out.placements == (Replicate(),) and d.placements == (Shard(1),)
    torch.testing.assert_close(out.full_tensor(), x.sum(1))


def test_out_errors_name_shapes_and_placements() -> None:
    mesh = sw.init_device_mesh("cpu", (2,))
    a = sw.distribute_tensor(_x(8, 6), mesh, [Shard(0)])
    b = sw.distribute_tensor(_x(6, 4), mesh, [Replicate()])
    wrong = sw.distribute_tensor(torch.zeros(8, 6, dtype=torch.float64), mesh, [Shard(0)])
    with pytest.raises(OpArgumentError, match=r"aten.mm.out: out has shape \[8, 6\] but the "
                                              r"result has shape \[8, 4\]"):
        torch.mm(a, b, out=wrong)
    pending = DTensor.from_local([torch.zeros(8, 4, dtype=torch.float64)] * 2, mesh,
                                 [Partial("max")])
    with pytest.raises(OpArgumentError, match=r"aten.mm.out cannot write into out "
                                              r"\[Partial\(.max.\)\]"):
        torch.mm(a, b, out=pending)
    with pytest.raises(OpArgumentError, match="not a DTensor"):
        torch.cat([a, a], out=torch.zeros(16, 6, dtype=torch.float64))
    with pytest.raises(OpArgumentError, match="not a DTensor"):
        aten._foreach_exp.out([a], out=[torch.zeros(8, 6, dtype=torch.float64)])
