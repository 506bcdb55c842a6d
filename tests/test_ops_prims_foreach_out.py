"""Op families that PyTorch's own DTensor tests (test_math_ops.py, test_pointwise_ops.py) reach
beyond the aten pointwise ops: the elementwise ``prims`` and ``prims.view_of``, the power sums
of vector norms (``linalg__powsum``, ``_foreach_powsum``), ``_foreach_max``, and the ``out=``
overloads of pointwise ops. Single-device torch is the oracle for values; the placements are
PyTorch DTensor's (checked beside it across 2 processes at the end), except where PyTorch's
value is wrong (a power sum of a pending sum)."""

from __future__ import annotations

import math

import pytest
import torch

import shardwise as sw
from mp_harness import run_in_processes
from shardwise import DTensor, Partial, Replicate, Shard
from shardwise.errors import ImplicitRedistributeError, OpArgumentError
from shardwise.ops import registry
from shardwise.torch_compat import elementwise_prims

aten, prims = torch.ops.aten, torch.ops.prims
MESHES = [(1,), (2,), (4,), (2, 2)]


def _mesh(*shape: int) -> sw.DeviceMesh:
    return sw.init_device_mesh("cpu", shape)


def _x(*shape: int, seed: int = 0, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _pending(mesh: sw.DeviceMesh, pieces: list[torch.Tensor], op: str = "sum") -> DTensor:
    return DTensor.from_local(pieces, mesh, [Partial(op)])


def _sharded(mesh_shape: tuple[int, ...]) -> list:
    return [Shard(0)] + [Shard(1)] * (len(mesh_shape) - 1)


# ----- elementwise prims -------------------------------------------------------------------------


def _prim_inputs(op) -> tuple[torch.Tensor, ...]:
    """Arguments the prim accepts on one device: floats in (0.1, 0.9) (in every special
    function's domain), else integers, booleans or complex numbers."""
    n = sum(str(a.type) == "Tensor" for a in op._schema.arguments)
    g = torch.Generator().manual_seed(3)
    candidates = [
        tuple(torch.rand(6, 4, generator=g, dtype=torch.float64) * 0.8 + 0.1 for _ in range(n)),
        tuple(torch.randint(1, 9, (6, 4), generator=g) for _ in range(n)),
        tuple(torch.rand(6, 4, generator=g) > 0.5 for _ in range(n)),
        tuple(torch.randn(6, 4, generator=g, dtype=torch.complex128) for _ in range(n)),
    ]
    for args in candidates:
        try:
            op(*args)
        except (RuntimeError, TypeError):
            continue
        return args
    raise AssertionError(f"no sample input for {op}")


def test_the_enumeration_finds_the_prims_pytorchs_tests_call() -> None:
    names = {str(op) for op in elementwise_prims()}
    for name in ["bessel_i0e", "bessel_i1", "bessel_i1e", "bessel_j0", "bessel_j1", "erfcx",
                 "ndtri", "spherical_bessel_j0", "div", "gcd", "ne", "zeta", "add", "imag"]:
        assert f"prims.{name}.default" in names
    # shape, reduction and view prims are not elementwise
    for name in ["sum", "amax", "broadcast_in_dim", "view_of", "where", "convert_element_type"]:
        assert f"prims.{name}.default" not in names
    assert len(names) >= 70


@pytest.mark.parametrize("mesh_shape", MESHES)
def test_every_elementwise_prim_keeps_a_shard(mesh_shape: tuple[int, ...]) -> None:
    mesh = _mesh(*mesh_shape)
    placements = _sharded(mesh_shape)
    for op in elementwise_prims():
        args = _prim_inputs(op)
        want = op(*args)
        got = op(*(sw.distribute_tensor(a, mesh, placements) for a in args))
        assert got.placements == tuple(placements), op
        torch.testing.assert_close(got.full_tensor(), want, equal_nan=True, msg=str(op))


def test_a_prim_reduces_a_pending_input_first() -> None:
    """Nonlinear, as in PyTorch: ``prims.div`` truncates integers, so even the arithmetic
    prims do not pass a pending sum."""
    mesh = _mesh(2)
    a, b = torch.tensor([7, -7, 9]), torch.tensor([2, 2, 4])
    pending = _pending(mesh, [torch.tensor([3, -3, 4]), torch.tensor([4, -4, 5])])
    divisor = sw.distribute_tensor(b, mesh, [Replicate()])
    with pytest.raises(ImplicitRedistributeError):
        prims.div(pending, divisor)
    with sw.config.allow_implicit_redistribute():
        got = prims.div(pending, divisor)
    assert not got.placements[0].is_partial()  # reduce-scattered: the cheaper move
    assert torch.equal(got.full_tensor(), prims.div(a, b))


@pytest.mark.parametrize("mesh_shape", [(1,), (2,), (2, 2)])
def test_view_of_keeps_the_layout_and_aliases(mesh_shape: tuple[int, ...]) -> None:
    mesh = _mesh(*mesh_shape)
    x = _x(6, 4)
    for placements in (_sharded(mesh_shape), [Replicate()] * len(mesh_shape)):
        d = sw.distribute_tensor(x, mesh, placements)
        v = prims.view_of(d)
        assert v.placements == d.placements
        assert torch.equal(v.full_tensor(), x)
        for a, b in zip(sw.local_components(v), sw.local_components(d), strict=True):
            assert a.data_ptr() == b.data_ptr()
    pending = _pending(_mesh(2), [torch.ones(3), 2 * torch.ones(3)])
    assert prims.view_of(pending).placements == (Partial(),)  # the identity on values


# ----- power sums and foreach max ----------------------------------------------------------------


@pytest.mark.parametrize("mesh_shape", MESHES)
def test_powsum_of_a_shard_is_a_pending_sum(mesh_shape: tuple[int, ...]) -> None:
    mesh = _mesh(*mesh_shape)
    x = _x(6, 4).abs() + 0.1
    placements = _sharded(mesh_shape)
    d = sw.distribute_tensor(x, mesh, placements)
    for order in (1, 2, 3, 0.5, 0, math.inf, -1):
        got = aten.linalg__powsum(d, order)
        assert got.placements == tuple(Partial() if isinstance(p, Shard) else p
                                       for p in placements)
        torch.testing.assert_close(got.full_tensor(), aten.linalg__powsum(x, order))
    kept = aten.linalg__powsum(d, 2, [1], True)  # over an unsharded dim (1-D mesh): stays
    torch.testing.assert_close(kept.full_tensor(), aten.linalg__powsum(x, 2, [1], True))
    if len(mesh_shape) == 1:
        assert kept.placements == (Shard(0),)


def test_powsum_over_uneven_and_empty_shards_and_in_half_precision() -> None:
    mesh = _mesh(4)
    for rows in (3, 5):  # 3 rows over 4 devices: one holds none (its power sum is 0)
        x = _x(rows, 2, seed=rows)
        got = aten.linalg__powsum(sw.distribute_tensor(x, mesh, [Shard(0)]), 3)
        assert got.placements == (Partial(),)
        torch.testing.assert_close(got.full_tensor(), aten.linalg__powsum(x, 3))
    x = _x(8, 16, dtype=torch.bfloat16)
    got = aten.linalg__powsum(sw.distribute_tensor(x, mesh, [Shard(1)]), 2)
    torch.testing.assert_close(got.full_tensor(), aten.linalg__powsum(x, 2))


def test_powsum_reduces_a_pending_sum_first() -> None:
    """|a + b|^p is not |a|^p + |b|^p: the pending sum is reduced (PyTorch's DTensor keeps it
    pending and answers 15 here, where the power sum is 27)."""
    mesh = _mesh(2)
    pending = _pending(mesh, [torch.ones(3), 2 * torch.ones(3)])
    with pytest.raises(ImplicitRedistributeError):
        aten.linalg__powsum(pending, 2)
    with sw.config.allow_implicit_redistribute():
        got = aten.linalg__powsum(pending, 2)
        listed = aten._foreach_powsum([pending], 2)
    assert got.full_tensor().item() == 27.0
    assert listed[0].full_tensor().item() == 27.0 and listed[0].placements == (Replicate(),)


@pytest.mark.parametrize("mesh_shape", [(2,), (4,), (2, 2)])
def test_foreach_powsum_per_tensor(mesh_shape: tuple[int, ...]) -> None:
    mesh = _mesh(*mesh_shape)
    xs = [_x(12, 8, seed=1), _x(8, 8, seed=2), _x(5, 3, seed=3)]
    layouts = [_sharded(mesh_shape), [Shard(1)] * len(mesh_shape),
               [Replicate()] * len(mesh_shape)]
    ds = [sw.distribute_tensor(x, mesh, p) for x, p in zip(xs, layouts, strict=True)]
    for order in (1, 2, 3):
        got = aten._foreach_powsum(ds, order)
        for g, x, p in zip(got, xs, layouts, strict=True):
            assert g.placements == tuple(Partial() if isinstance(q, Shard) else q for q in p)
            torch.testing.assert_close(g.full_tensor(), (x.abs() ** order).sum())


@pytest.mark.parametrize("mesh_shape", [(2,), (4,), (2, 2)])
def test_foreach_max_is_a_pending_max(mesh_shape: tuple[int, ...]) -> None:
    """PyTorch's test_foreach_compose: ``_foreach_abs`` then ``_foreach_max``."""
    mesh = _mesh(*mesh_shape)
    xs = [_x(4, 8, seed=s) for s in range(3)] + [torch.randint(-9, 9, (8, 4))]
    ds = [sw.distribute_tensor(x, mesh, _sharded(mesh_shape)) for x in xs]
    got = torch._foreach_max(torch._foreach_abs(ds))
    want = torch._foreach_max(torch._foreach_abs(xs))
    for g, w in zip(got, want, strict=True):
        assert g.placements == (Partial("max"),) * len(mesh_shape)
        assert torch.equal(g.full_tensor(), w)


def test_foreach_max_of_pending_and_replicated_tensors() -> None:
    mesh = _mesh(2)
    pmax = _pending(mesh, [torch.tensor([1.0, 5.0]), torch.tensor([3.0, 2.0])], "max")
    psum = _pending(mesh, [torch.tensor([1.0, 5.0]), torch.tensor([3.0, 2.0])])
    whole = sw.distribute_tensor(_x(3, 3), mesh, [Replicate()])
    kept, replicated = torch._foreach_max([pmax, whole])
    assert kept.placements == (Partial("max"),) and kept.full_tensor().item() == 5.0
    assert replicated.placements == (Replicate(),)
    assert torch.equal(replicated.full_tensor(), whole.full_tensor().max())
    with pytest.raises(ImplicitRedistributeError):  # a max of a pending sum needs the sum
        torch._foreach_max([psum])
    with sw.config.allow_implicit_redistribute():
        (summed,) = torch._foreach_max([psum])
    assert summed.placements == (Replicate(),) and summed.full_tensor().item() == 7.0


def test_foreach_max_gathers_a_shard_that_leaves_a_device_nothing() -> None:
    """A max of no elements has no value (torch raises): such shards are gathered first."""
    mesh = _mesh(4)
    x = _x(3, 2)  # 3 rows over 4 devices
    d = sw.distribute_tensor(x, mesh, [Shard(0)])
    with pytest.raises(ImplicitRedistributeError):
        torch._foreach_max([d])
    with sw.config.allow_implicit_redistribute():
        (got,) = torch._foreach_max([d])
    assert got.placements == (Replicate(),) and torch.equal(got.full_tensor(), x.max())
    (even,) = torch._foreach_max([sw.distribute_tensor(_x(4, 2), mesh, [Shard(0)])])
    assert even.placements == (Partial("max"),)


# ----- out= overloads ----------------------------------------------------------------------------


def test_mul_out_writes_into_out_and_returns_it() -> None:
    """PyTorch's test_mul_out, on an embedded mesh of 4: per-device pieces as the ranks'."""
    mesh = _mesh(4)
    pieces = [[_x(8, 4, seed=10 * k + i) for i in range(3)] for k in range(4)]
    a, b, out = (DTensor.from_local([p[i] for p in pieces], mesh, [Shard(0)]) for i in range(3))
    kept = [c.clone() for c in sw.local_components(a)]
    held = [c.data_ptr() for c in sw.local_components(out)]
    result = torch.mul(a, b, out=out)
    assert result is out and out.placements == (Shard(0),)
    assert [c.data_ptr() for c in sw.local_components(out)] == held
    for k, c in enumerate(sw.local_components(out)):
        assert torch.equal(c, pieces[k][0] * pieces[k][1])
    assert all(torch.equal(c, w) for c, w in zip(sw.local_components(a), kept, strict=True))


def _unary_out_ops() -> list:
    """The registered out overloads of one tensor (``exp.out``, ``special_erfcx.out``...)."""
    found = []
    for op in registry.entries():
        args = getattr(op, "_schema", None) and op._schema.arguments
        if not args or op.namespace != "aten" or not any(a.is_out for a in args):
            continue
        plain = [a for a in args if not a.is_out]
        if len(plain) == 1 and str(plain[0].type) == "Tensor":
            found.append(op)
    return found


@pytest.mark.parametrize("mesh_shape", [(2,), (2, 2)])
def test_every_unary_pointwise_out_overload(mesh_shape: tuple[int, ...]) -> None:
    mesh = _mesh(*mesh_shape)
    placements = _sharded(mesh_shape)
    ops = _unary_out_ops()
    assert len(ops) >= 60 and aten.exp.out in ops and aten.special_erfcx.out in ops
    x = torch.rand(6, 4, dtype=torch.float64) * 0.8 + 0.1
    ran = 0
    for op in ops:
        try:
            want = op(x, out=torch.empty(0, dtype=torch.float64))
        except RuntimeError:
            continue  # not for float64 (the bitwise and logical ones)
        if want.shape != x.shape:
            continue  # a reduction's (max.unary_out...): tests/test_ops_out_overloads.py
        out = sw.distribute_tensor(torch.zeros(6, 4, dtype=want.dtype), mesh, placements)
        assert op(sw.distribute_tensor(x, mesh, placements), out=out) is out, op
        assert out.placements == tuple(placements)
        torch.testing.assert_close(out.full_tensor(), want, equal_nan=True, msg=str(op))
        ran += 1
    assert ran >= 50


def test_out_overloads_of_several_arguments() -> None:
    mesh = _mesh(2)
    x, y = _x(6, 4, seed=1), _x(6, 4, seed=2).abs() + 0.5
    dx, dy = (sw.distribute_tensor(t, mesh, [Shard(0)]) for t in (x, y))
    row = sw.distribute_tensor(_x(4, seed=3), mesh, [Replicate()])
    cases = [
        (lambda a, b, r, o: torch.add(a, b, alpha=3, out=o), aten.add.out),
        (lambda a, b, r, o: torch.pow(a, 2, out=o), aten.pow.Tensor_Scalar_out),
        (lambda a, b, r, o: torch.pow(2, a, out=o), aten.pow.Scalar_out),
        (lambda a, b, r, o: torch.div(a, b, rounding_mode="floor", out=o), aten.div.out_mode),
        (lambda a, b, r, o: torch.where(a > 0, a, b, out=o), None),
        (lambda a, b, r, o: torch.clamp(a, -0.5, 0.5, out=o), aten.clamp.out),
        (lambda a, b, r, o: torch.xlogy(2.0, b, out=o), aten.xlogy.OutScalar_Self),
        (lambda a, b, r, o: torch.lerp(a, b, 0.25, out=o), aten.lerp.Scalar_out),
        (lambda a, b, r, o: torch.mul(a, r, out=o), aten.mul.out),  # broadcast, replicated
    ]
    for fn, op in cases:
        want = fn(x, y, row.full_tensor(), torch.empty(0, dtype=torch.float64))
        out = sw.distribute_tensor(torch.zeros(6, 4, dtype=torch.float64), mesh, [Shard(0)])
        assert fn(dx, dy, row, out) is out
        assert out.placements == (Shard(0),)
        torch.testing.assert_close(out.full_tensor(), want)
        assert op is None or op in registry.entries()


def test_out_decides_the_placements_as_in_pytorch() -> None:
    mesh = _mesh(2)
    x = _x(6, 4)
    whole = sw.distribute_tensor(x, mesh, [Replicate()])
    rows = sw.distribute_tensor(torch.zeros(6, 4, dtype=torch.float64), mesh, [Shard(0)])
    with sw.debug.CommCounter() as counter:  # a replicated input is sliced where it is
        torch.mul(whole, whole, out=rows)
    assert counter.counts == {} and torch.equal(rows.full_tensor(), x * x)
    sharded = sw.distribute_tensor(x, mesh, [Shard(0)])
    cols = sw.distribute_tensor(torch.zeros(6, 4, dtype=torch.float64), mesh, [Shard(1)])
    with pytest.raises(ImplicitRedistributeError):  # the inputs would have to move
        torch.mul(sharded, sharded, out=cols)
    with sw.config.allow_implicit_redistribute():
        torch.mul(sharded, sharded, out=cols)
    assert cols.placements == (Shard(1),) and torch.equal(cols.full_tensor(), x * x)
    assert sharded.placements == (Shard(0),)  # the input itself did not move


def test_out_keeps_a_pending_sum_where_the_op_is_linear() -> None:
    mesh = _mesh(2)
    pending = _pending(mesh, [torch.ones(3), 2 * torch.ones(3)])
    out = _pending(mesh, [torch.zeros(3), torch.zeros(3)])
    with sw.debug.CommCounter() as counter:
        assert torch.mul(pending, 2.0, out=out) is out
    assert counter.counts == {} and out.placements == (Partial(),)
    assert torch.equal(out.full_tensor(), torch.full((3,), 6.0))
    bf16 = torch.bfloat16
    half = _pending(mesh, [torch.ones(3, dtype=bf16), 2 * torch.ones(3, dtype=bf16)])
    half_out = _pending(mesh, [torch.zeros(3, dtype=bf16), torch.zeros(3, dtype=bf16)])
    torch.mul(half, 3.0, out=half_out)
    assert torch.equal(half_out.full_tensor(), torch.full((3,), 9.0, dtype=torch.bfloat16))


def test_out_errors_name_shapes_and_placements() -> None:
    mesh = _mesh(2)
    pending = _pending(mesh, [torch.ones(3), 2 * torch.ones(3)])
    with pytest.raises(OpArgumentError, match=r"aten.exp.out cannot write into out \[Partial"):
        torch.exp(pending, out=_pending(mesh, [torch.zeros(3), torch.zeros(3)]))
    d = sw.distribute_tensor(_x(6, 4), mesh, [Shard(0)])
    with pytest.raises(OpArgumentError, match=r"out has shape \[6, 1\] but the result has "
                                              r"shape \[6, 4\]"):
        torch.mul(d, d, out=sw.distribute_tensor(torch.zeros(6, 1, dtype=torch.float64), mesh,
                                                 [Shard(0)]))
    with pytest.raises(OpArgumentError, match="not a DTensor"):
        torch.mul(d, d, out=torch.zeros(6, 4, dtype=torch.float64))
    longs = sw.distribute_tensor(torch.zeros(6, 4, dtype=torch.long), mesh, [Shard(0)])
    with pytest.raises(OpArgumentError, match="can't be cast"):
        torch.mul(d, d, out=longs)
    assert isinstance(OpArgumentError("x"), RuntimeError)  # PyTorch raises RuntimeError here


# ----- beside torch.distributed.tensor -----------------------------------------------------------


def _beside_torch() -> dict:
    """The same calls on PyTorch's DTensor and on shardwise, on 2 processes: placements and
    values."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate as TR
    from torch.distributed.tensor import Shard as TS
    from torch.distributed.tensor import distribute_tensor

    def kind(p):
        if p.is_shard():
            return ("shard", p.dim)
        return ("partial", p.reduce_op) if p.is_partial() else ("replicate",)

    def describe(r):
        items = r if isinstance(r, (list, tuple)) else [r]
        return [(tuple(kind(p) for p in e.placements), e.full_tensor()) for e in items]

    x, y = _x(12, 8, seed=1).float(), _x(8, 8, seed=2).float()
    libs = {
        "torch": (init_device_mesh("cpu", (2,)), distribute_tensor, TS, TR),
        "shardwise": (_mesh(2), sw.distribute_tensor, Shard, Replicate),
    }
    found = {}
    for lib, (mesh, distribute, S, R) in libs.items():
        dx, dy = distribute(x, mesh, [S(0)]), distribute(y, mesh, [S(0)])
        whole = distribute(x, mesh, [R()])
        out = distribute(torch.zeros(12, 8), mesh, [S(0)])
        found[lib] = {
            "i0e": describe(prims.bessel_i0e(dx.abs().clamp(0.1, 3.0))),
            "ndtri": describe(prims.ndtri(dx.abs().clamp(0.1, 0.9))),
            "gcd": describe(prims.gcd(dx.int(), dx.int() + 3)),
            "view_of": describe(prims.view_of(dx)),
            "powsum": describe(aten.linalg__powsum(dx, 3)),
            "foreach_powsum": describe(aten._foreach_powsum([dx, dy], 2)),
            "foreach_max": describe(torch._foreach_max([dx, dy])),
            "mul_out": describe(torch.mul(dx, dx, out=out)),
            "mul_out_replicated_in": describe(torch.mul(whole, whole, out=out)),
        }
    return found


@pytest.mark.slow
def test_placements_match_pytorch_dtensor() -> None:
    for rank in run_in_processes(_beside_torch, 2, timeout=240):
        for name, theirs in rank["torch"].items():
            ours = rank["shardwise"][name]
            assert [p for p, _ in ours] == [p for p, _ in theirs], name
            for (_, a), (_, b) in zip(ours, theirs, strict=True):
                torch.testing.assert_close(a, b, msg=name)
