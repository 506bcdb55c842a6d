"""Pointwise ops on DTensors against single-device torch (forward and backward), the Partial
rules (what passes through linear ops, what is reduced first) and in-place placements."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import shardwise as sw
from op_oracle import run_oracle
from shardwise import InterleavedShard, Partial, Replicate, Shard

MESH_1D = [(3,), (4,)]
MESHES = [(2,), (3,), (2, 2)]


def _x(*shape: int, seed: int = 0, low: float = -2.0, high: float = 2.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(shape, generator=g) * (high - low) + low


def _ints(*shape: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-6, 7, shape, generator=g)


UNARY = {
    "abs": torch.abs,
    "neg": torch.neg,
    "exp": torch.exp,
    "sin": torch.sin,
    "cos": torch.cos,
    "tanh": torch.tanh,
    "sigmoid": torch.sigmoid,
    "relu": torch.relu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
    "erf": torch.erf,
    "expm1": torch.expm1,
    "sign": torch.sign,
    "floor": torch.floor,
    "ceil": torch.ceil,
    "round": torch.round,
    "trunc": torch.trunc,
    "square": torch.square,
    "pow_scalar": lambda x: x**3,
    "scalar_pow": lambda x: 2.0**x,
    "leaky_relu": F.leaky_relu,
    "elu": F.elu,
    "softplus": F.softplus,
    "hardtanh": F.hardtanh,
    "clamp": lambda x: torch.clamp(x, -0.5, 0.7),
    "clamp_min": lambda x: torch.clamp_min(x, 0.1),
    "clamp_max": lambda x: torch.clamp_max(x, 0.1),
    "scalar_arith": lambda x: (3.0 - x) * 2 / 4 + 1,
    "nan_to_num": lambda x: torch.nan_to_num(torch.log(x), neginf=-7.0),
}

POSITIVE = {
    "log": torch.log,
    "sqrt": torch.sqrt,
    "rsqrt": torch.rsqrt,
    "reciprocal": torch.reciprocal,
    "log1p": torch.log1p,
}


@pytest.mark.parametrize("name", sorted(UNARY))
def test_unary(name: str) -> None:
    fn = UNARY[name]
    run_oracle(fn, [_x(5, 3)], mesh_shapes=MESHES, max_cases=8)


@pytest.mark.parametrize("name", sorted(POSITIVE))
def test_unary_positive_domain(name: str) -> None:
    run_oracle(POSITIVE[name], [_x(3, 5, low=0.5, high=3.0)], mesh_shapes=MESHES, max_cases=8)


BINARY = {
    "add": lambda a, b: a + b,
    "add_alpha": lambda a, b: torch.add(a, b, alpha=-0.5),
    "sub": lambda a, b: a - b,
    "mul": lambda a, b: a * b,
    "div": lambda a, b: a / (b.abs() + 1),
    "maximum": torch.maximum,
    "minimum": torch.minimum,
    "atan2": torch.atan2,
    "pow": lambda a, b: torch.pow(a.abs() + 0.5, b),
    "fmod": lambda a, b: torch.fmod(a, b.abs() + 0.5),
    "remainder": lambda a, b: torch.remainder(a, b.abs() + 0.5),
    "lerp_scalar": lambda a, b: torch.lerp(a, b, 0.3),
    "clamp_tensor": lambda a, b: torch.clamp(a, min=b - 1, max=b + 1),
    "compare": lambda a, b: torch.stack([a < b, a <= b, a > b, a >= b, a == b, a != b]).sum(0),
}


@pytest.mark.parametrize("name", sorted(BINARY))
def test_binary_same_shape(name: str) -> None:
    fn = BINARY[name]
    run_oracle(fn, [_x(5, 3), _x(5, 3, seed=1)], mesh_shapes=MESHES, max_cases=10)


@pytest.mark.parametrize(
    "shapes",
    [((5, 3), (3,)), ((5, 1), (1, 3)), ((2, 5, 3), (5, 1)), ((3,), (7, 1, 3))],
    ids=["row", "outer", "rank3", "rank-up"],
)
def test_binary_broadcasting(shapes: tuple) -> None:
    a, b = _x(*shapes[0]), _x(*shapes[1], seed=1)
    run_oracle(lambda x, y: x * y + x, [a, b], mesh_shapes=MESHES, max_cases=12)


def test_ternary_ops() -> None:
    a, b, c = _x(5, 3), _x(5, 3, seed=1), _x(3, seed=2, low=0.5)
    run_oracle(lambda x, y, z: torch.addcmul(x, y, z, value=0.5), [a, b, c],
               mesh_shapes=MESHES, max_cases=10)
    run_oracle(lambda x, y, z: torch.addcdiv(x, y, z, value=-2), [a, b, c],
               mesh_shapes=MESHES, max_cases=10)
    run_oracle(lambda x, y, z: torch.lerp(x, y, z), [a, b, c], mesh_shapes=MESHES, max_cases=10)
    run_oracle(lambda x, y, z: torch.where(z > 1.0, x, y), [a, b, c],
               mesh_shapes=MESHES, max_cases=10)


def test_where_with_scalars_and_masked_fill() -> None:
    a = _x(4, 5)
    run_oracle(lambda x: torch.where(x > 0, x, 0.5), [a], mesh_shapes=MESHES, max_cases=8)
    run_oracle(lambda x: x.masked_fill(x < 0, 0.0), [a], mesh_shapes=MESHES, max_cases=8)
    run_oracle(lambda x, m: x.masked_fill(m > 0, -3.0), [a, _x(5, seed=4)],
               mesh_shapes=MESHES, max_cases=10)
    value = torch.tensor(2.5)
    run_oracle(lambda x, v: x.masked_fill(x > 0, v), [a, value], mesh_shapes=MESHES, max_cases=10)


def test_integer_bitwise_and_logical() -> None:
    a, b = _ints(5, 3), _ints(5, 3, seed=1)
    fns = [
        lambda x, y: x & y,
        lambda x, y: x | y,
        lambda x, y: x ^ y,
        lambda x, y: ~x,
        lambda x, y: torch.logical_and(x, y) ^ torch.logical_or(x > 0, y < 0),
        lambda x, y: torch.logical_xor(x, y) | torch.logical_not(y),
        lambda x, y: x // (y.abs() + 1),
        lambda x, y: torch.div(x, y.abs() + 1, rounding_mode="trunc"),
        lambda x, y: x * 3 - y,
    ]
    for fn in fns:
        run_oracle(fn, [a, b], mesh_shapes=MESHES, max_cases=8)


def test_nan_inf_predicates() -> None:
    a = torch.tensor([[1.0, float("nan"), float("inf")], [-float("inf"), 0.0, 2.0],
                      [3.0, float("nan"), -1.0]])
    run_oracle(lambda x: torch.stack([x.isnan(), x.isinf(), x.isfinite()]), [a],
               mesh_shapes=MESHES, partial=False, grad=False)
    run_oracle(torch.nan_to_num, [a], mesh_shapes=MESHES, partial=False, grad=False)


def test_casts() -> None:
    a = _x(5, 3)
    run_oracle(lambda x: x.to(torch.float64) * 2, [a], mesh_shapes=MESHES, max_cases=8)
    run_oracle(lambda x: (x > 0).to(torch.float32) + x, [a], mesh_shapes=MESHES, max_cases=8)


def test_interleaved_shard_inputs() -> None:
    a, b = _x(6, 4), _x(6, 4, seed=1)
    run_oracle(lambda x, y: torch.sigmoid(x) * y - x, [a, b], mesh_shapes=[(2,), (3,)],
               interleaved=True, max_cases=16)


def test_backward_ops_directly() -> None:
    g, x = _x(5, 3), _x(5, 3, seed=1)
    aten = torch.ops.aten
    fns = [
        lambda gr, s: aten.threshold_backward(gr, s, 0.0),
        lambda gr, s: aten.sigmoid_backward(gr, torch.sigmoid(s)),
        lambda gr, s: aten.tanh_backward(gr, torch.tanh(s)),
        lambda gr, s: aten.gelu_backward(gr, s),
        lambda gr, s: aten.silu_backward(gr, s),
    ]
    for fn in fns:  # torch has no derivatives for these ops themselves
        run_oracle(fn, [g, x], mesh_shapes=MESHES, max_cases=10, grad=False)


# ----- Partial rules -------------------------------------------------------------------------


def _mesh(*shape: int) -> sw.DeviceMesh:
    return sw.init_device_mesh("cpu", shape)


def test_partial_passes_through_linear_ops_without_communication() -> None:
    """Linear ops keep Partial("sum") in explicit mode: nothing moves, the value is exact."""
    mesh = _mesh(3)
    a, b, r = _x(5, 3), _x(5, 3, seed=1), _x(3, seed=2)
    pa = sw.distribute_tensor(a, mesh, [Partial()])
    pb = sw.distribute_tensor(b, mesh, [Partial()])
    rr = sw.distribute_tensor(r, mesh, [Replicate()])
    rb = sw.distribute_tensor(b, mesh, [Replicate()])
    aten = torch.ops.aten
    with sw.debug.CommCounter() as counter:
        results = {
            "add": (pa + pb, a + b),
            "add_replicate_made_partial": (pa + rr, a + r),
            "sub_alpha": (torch.sub(pa, pb, alpha=2), torch.sub(a, b, alpha=2)),
            "neg": (-pa, -a),
            "mul_scalar": (pa * 3.0, a * 3.0),
            "mul_replicate": (rr * pa, r * a),
            "div_replicate": (pa / (rr.abs() + 1), a / (r.abs() + 1)),
            "where": (torch.where(rr > 0, pa, pb), torch.where(r > 0, a, b)),
            "lerp": (torch.lerp(pa, pb, 0.25), torch.lerp(a, b, 0.25)),
            "addcmul": (torch.addcmul(pa, pb, rr), torch.addcmul(a, b, r)),
            "masked_fill_zero": (pa.masked_fill(rr > 0, 0.0), a.masked_fill(r > 0, 0.0)),
            "relu_backward": (aten.threshold_backward(pa, rb, 0.0), a * (b > 0)),
            "gelu_backward": (aten.gelu_backward(pa, rb), aten.gelu_backward(a, b)),
        }
    assert counter.counts == {}, counter.records
    for name, (got, want) in results.items():
        assert got.placements == (Partial(),), name
        torch.testing.assert_close(got.full_tensor(), want, msg=name)


@pytest.mark.parametrize(
    "name",
    ["exp", "add_scalar", "mul_partials", "compare", "rounding_div", "pow", "abs"],
)
def test_nonlinear_ops_on_partial_need_reduction(name: str) -> None:
    """Explicit mode refuses; implicit mode reduces (reduce_scatter, the cheapest way to a
    placement a pointwise op takes) and gives the single-device value."""
    fns = {
        "exp": torch.exp,
        "add_scalar": lambda x: x + 1.0,
        "mul_partials": lambda x: x * x,
        "compare": lambda x: x > 0,
        "rounding_div": lambda x: torch.div(x, 2, rounding_mode="floor"),
        "pow": lambda x: x**2,
        "abs": torch.abs,
    }
    fn = fns[name]
    a = _x(6, 4)
    pa = sw.distribute_tensor(a, _mesh(3), [Partial()])
    with pytest.raises(sw.errors.ImplicitRedistributeError, match="Partial"):
        fn(pa)
    with sw.config.allow_implicit_redistribute(), sw.debug.CommCounter() as counter:
        got = fn(pa)
    if name == "mul_partials":  # x * x: reduce one factor, the other stays Partial
        assert counter.counts == {"all_reduce": 1} and got.placements == (Partial(),)
    else:
        assert counter.counts == {"reduce_scatter": 1} and got.placements[0].is_shard()
    assert torch.equal(got.full_tensor(), fn(a))


def test_affine_ops_keep_partial_avg_and_monotone_ops_keep_max() -> None:
    mesh = _mesh(4)
    a = _x(7, 5)
    avg = sw.distribute_tensor(a, mesh, [Partial("avg")])
    shifted = avg + 2.0
    assert shifted.placements == (Partial("avg"),)
    torch.testing.assert_close(shifted.full_tensor(), a + 2.0)
    sharded = sw.distribute_tensor(a, mesh, [Shard(0)])
    peak = sharded.amax(0)  # Partial("max") of the per-shard maxima
    assert peak.placements == (Partial("max"),)
    expected = a.amax(0)
    rr = sw.distribute_tensor(_x(5, seed=3), mesh, [Replicate()])
    with sw.debug.CommCounter() as counter:
        cases = {
            "exp": (torch.exp(peak), torch.exp(expected), "max"),
            "relu_shift": (torch.relu(peak - 1.0), torch.relu(expected - 1.0), "max"),
            "add_replicate": (peak + rr, expected + rr.full_tensor(), "max"),
            "neg": (-peak, -expected, "min"),
            "clamp": (peak.clamp(-0.5, 0.5), expected.clamp(-0.5, 0.5), "max"),
            "sub_from": (1.0 - peak, 1.0 - expected, "min"),
        }
    assert counter.counts == {}
    for name, (got, want, op) in cases.items():
        assert got.placements == (Partial(op),), name
        torch.testing.assert_close(got.full_tensor(), want, msg=name)
    flipped = torch.sub(rr, peak, alpha=-2.0)  # rr + 2 * peak: still increasing in peak
    assert flipped.placements == (Partial("max"),)
    torch.testing.assert_close(flipped.full_tensor(), rr.full_tensor() + 2 * expected)
    assert torch.add(rr, peak, alpha=-1).placements == (Partial("min"),)
    with pytest.raises(sw.errors.ImplicitRedistributeError):
        peak * 2.0  # scaling is not monotone for negative factors: reduce first
    with pytest.raises(sw.errors.ImplicitRedistributeError):
        peak + peak


def test_sharded_and_replicated_inputs_need_no_communication() -> None:
    mesh = _mesh(2, 2)
    a, r = _x(5, 7), _x(7, seed=1)
    sa = sw.distribute_tensor(a, mesh, [Shard(0), Shard(1)])
    rr = sw.distribute_tensor(r, mesh, [Replicate(), Replicate()])
    with sw.debug.CommCounter() as counter:
        out = torch.sigmoid(sa) * rr + sa
    assert counter.counts == {}
    assert out.placements == (Shard(0), Shard(1))
    torch.testing.assert_close(out.full_tensor(), torch.sigmoid(a) * r + a)
    inter = sw.distribute_tensor(_x(6, 4), mesh, [InterleavedShard(0, 3), Replicate()])
    col = sw.distribute_tensor(_x(6, 1, seed=2), mesh, [InterleavedShard(0, 3), Replicate()])
    with sw.debug.CommCounter() as counter:
        out = inter * col
    assert counter.counts == {}
    assert out.placements == (InterleavedShard(0, 3), Replicate())


def test_mismatched_shards_choose_cheapest_move() -> None:
    """Shard(0) + Shard(1) of the same square-ish tensor: one input moves by all_to_all,
    never a full all_gather of both."""
    mesh = _mesh(3)
    a, b = _x(6, 9), _x(6, 9, seed=1)
    sa = sw.distribute_tensor(a, mesh, [Shard(0)])
    sb = sw.distribute_tensor(b, mesh, [Shard(1)])
    with pytest.raises(sw.errors.ImplicitRedistributeError, match="add"):
        sa + sb
    with sw.config.allow_implicit_redistribute(), sw.debug.CommCounter() as counter:
        out = sa + sb
    assert counter.counts == {"all_to_all": 1}
    assert out.placements in ((Shard(0),), (Shard(1),))
    torch.testing.assert_close(out.full_tensor(), a + b)


# ----- in-place ops ----------------------------------------------------------------------------


def test_inplace_ops_keep_self_placements() -> None:
    mesh = _mesh(3)
    a, r = _x(5, 4), _x(4, seed=1)
    sa = sw.distribute_tensor(a.clone(), mesh, [Shard(0)])
    rr = sw.distribute_tensor(r.clone(), mesh, [Replicate()])
    with sw.debug.CommCounter() as counter:
        out = sa.mul_(2.0).add_(rr).clamp_(-1.0, 1.0).sigmoid_()
    assert out is sa and counter.counts == {}
    assert sa.placements == (Shard(0),)
    torch.testing.assert_close(sa.full_tensor(), torch.sigmoid((a * 2 + r).clamp(-1, 1)))

    pa = sw.distribute_tensor(a.clone(), mesh, [Partial()])
    pa.mul_(0.5).add_(sw.distribute_tensor(a.clone(), mesh, [Partial()]))
    assert pa.placements == (Partial(),)
    torch.testing.assert_close(pa.full_tensor(), a * 1.5)
    with pytest.raises(sw.errors.ImplicitRedistributeError, match="add_"):
        pa.add_(1.0)  # not linear for Partial("sum"); self cannot change placement in place

    full = sw.distribute_tensor(a.clone(), mesh, [Replicate()])
    other = sw.distribute_tensor(a.clone(), mesh, [Shard(1)])
    with sw.config.allow_implicit_redistribute(), sw.debug.CommCounter() as counter:
        full.sub_(other)
    assert full.placements == (Replicate(),) and counter.counts == {"all_gather": 1}
    assert torch.equal(full.full_tensor(), torch.zeros_like(a))


def test_inplace_masked_fill_and_where_backward_path() -> None:
    run_oracle(lambda x: (x * 1).masked_fill_(x > 0.5, 0.0) * 2, [_x(5, 3)],
               mesh_shapes=MESHES, max_cases=8)
    run_oracle(lambda x, y: (x * 1).addcmul_(y, y, value=0.5), [_x(5, 3), _x(5, 3, seed=1)],
               mesh_shapes=MESHES, max_cases=8)
