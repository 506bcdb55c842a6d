"""The property behind issue 7: for every dtype and every placement pair on meshes (2,), (3,)
and (2, 2), every redistribution and every reduction either equals single-device torch (with
torch's own accumulation rules) or raises a shardwise error -- never a wrong value, never a raw
error. Partials made by matmuls of float16/bfloat16 operands equal torch's product too (their
pieces accumulate in float32 and round once).

CI runs a seeded sample (``CASES`` per mesh and dtype); ``SHARDWISE_PROPERTY_CASES=0`` runs every
combination (``=N`` caps at N per mesh and dtype).
"""

from __future__ import annotations

import itertools
import os
import random

import pytest
import torch

import shardwise as sw
from shardwise import DTensor, InterleavedShard, Partial, Placement, Replicate, Shard

CASES = int(os.environ.get("SHARDWISE_PROPERTY_CASES", "12"))
DTYPES = [torch.bool, torch.int8, torch.int64, torch.float16, torch.bfloat16, torch.float32,
          torch.float64, torch.complex64]
MESH_SHAPES = [(2,), (3,), (2, 2)]
PLACEMENTS: list[Placement] = [
    Shard(0), Shard(1), Replicate(), Partial("sum"), Partial("avg"), Partial("max"),
    Partial("min"), InterleavedShard(0, 2),
]
SHAPES = [(4, 3), (5, 2)]  # uneven on every mesh here; 5 rows interleave by 2 as torch.chunk's
REDUCTIONS = {
    "sum": lambda t: t.sum(),
    "sum(0)": lambda t: t.sum(0),
    "mean(1)": lambda t: t.mean(1),
    "amax(0)": lambda t: t.amax(0),
    "amin": lambda t: t.amin(),
    "prod(1)": lambda t: t.prod(1),
}


def _value(shape: tuple[int, ...], dtype: torch.dtype, rng: random.Random) -> torch.Tensor:
    """Small integers (exact in every dtype, so sums are exact too), with an imaginary part for
    complex dtypes."""
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    ints = torch.randint(-4, 5, shape, generator=gen)
    if dtype == torch.bool:
        return ints > 0
    if dtype.is_complex:
        return torch.complex(ints.float(), torch.randint(-4, 5, shape, generator=gen).float()).to(
            dtype)
    return ints.to(dtype)


def _partial_components(
    x: torch.Tensor, mesh: sw.DeviceMesh, placements: tuple, rng: random.Random
) -> list[torch.Tensor]:
    """Components whose reduction is exactly ``x`` but that differ per device on a 1-D mesh
    (every reduce op really combines something); ``distribute_tensor``'s on 2-D meshes."""
    base = sw.local_components(sw.distribute_tensor(x, mesh, placements))
    if mesh.ndim != 1 or not placements[0].is_partial():
        return base
    op, n = placements[0].reduce_op, mesh.size()
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    noise = [torch.randint(0, 3, x.shape, generator=gen).to(x.dtype) for _ in range(n)]
    if x.dtype == torch.bool:  # bool sum/max is "or", min is "and"
        if op == "min":
            return [x | noise[k] if k else x.clone() for k in range(n)]
        return [x & noise[k] if k else x.clone() for k in range(n)]
    if op == "sum":
        rest = [noise[k] for k in range(1, n)]
        return [x - sum(rest), *rest]
    if op == "max":
        return [x.clone()] + [x - noise[k] for k in range(1, n)]
    if op == "min":
        return [x.clone()] + [x + noise[k] for k in range(1, n)]
    return base  # avg: the value everywhere (an average of other values would round)


def _expected_problem(dtype: torch.dtype, *placement_lists: tuple) -> bool:
    """Placements that have no meaning for ``dtype`` (the rule of comm.reduction)."""
    for p in itertools.chain(*placement_lists):
        if p == Partial("avg") and not (dtype.is_floating_point or dtype.is_complex):
            return True
        if p in (Partial("max"), Partial("min")) and dtype.is_complex:
            return True
    return False


def _close(got: torch.Tensor, want: torch.Tensor, exact: bool) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, (got, want)
    if exact or not (want.is_floating_point() or want.is_complex()):
        assert torch.equal(got, want), (got, want)
    else:
        torch.testing.assert_close(got, want, equal_nan=True)


def _cases(mesh_shape: tuple[int, ...], dtype: torch.dtype) -> list[tuple]:
    states = list(itertools.product(PLACEMENTS, repeat=len(mesh_shape)))
    every = [(s, t, shape) for s in states for t in states for shape in SHAPES]
    rng = random.Random(f"{mesh_shape}{dtype}")
    limit = CASES if CASES > 0 else len(every)
    return rng.sample(every, min(limit, len(every)))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mesh_shape", MESH_SHAPES, ids=str)
def test_redistributions_and_reductions_equal_torch_or_raise(
    mesh_shape: tuple[int, ...], dtype: torch.dtype
) -> None:
    mesh = sw.init_device_mesh("cpu", mesh_shape)
    rng = random.Random(0)
    outcomes = {"equal": 0, "refused": 0}
    for source, target, shape in _cases(mesh_shape, dtype):
        x = _value(shape, dtype, rng)
        where = f"{dtype} {list(shape)} {list(source)} -> {list(target)} on {mesh}"
        try:
            dt = DTensor.from_local(_partial_components(x, mesh, source, rng), mesh, source,
                                    shape=shape)
            out = dt.redistribute(placements=target)
        except sw.errors.ShardwiseError as err:
            # only a placement that does not fit the dtype or the shape may be refused
            assert isinstance(err, sw.errors.InvalidPlacementError), (where, err)
            assert _expected_problem(dtype, source, target), (where, err)
            outcomes["refused"] += 1
            continue
        assert not _expected_problem(dtype, source, target), where
        # avg divides: float rounding may differ from the value in the last bit
        exact = Partial("avg") not in source + target
        _close(out.full_tensor(), x, exact)
        _close(out.redistribute(placements=source).full_tensor(), x, exact)
        outcomes["equal"] += 1
        for name, reduce in REDUCTIONS.items():
            try:
                want = reduce(x)
            except RuntimeError:
                want = None  # torch refuses (mean of integers, amax of complex...)
            try:
                with sw.config.allow_implicit_redistribute():
                    got = reduce(dt).full_tensor()
            except sw.errors.ShardwiseError:
                continue  # refused with a shardwise error: allowed
            except RuntimeError as err:
                assert want is None, (where, name, err)  # only where torch refuses too
                continue
            assert want is not None, (where, name, "torch refuses but shardwise answered")
            _close(got, want, exact=False)
    assert outcomes["equal"] > 0  # the sample is not all refusals


# ----- Partials made by matmuls: float16/bfloat16 pieces accumulate in float32 ---------------

# per mesh dim, how x @ w is split: the contraction dim (a Partial("sum") output), the rows of x
# (Shard(0) output) or nothing (Replicate)
MATMUL_SPLITS = {
    "contract": (Shard(1), Shard(0)),
    "rows": (Shard(0), Replicate()),
    "none": (Replicate(), Replicate()),
}


def _matmul_operands(dtype: torch.dtype, rng: random.Random) -> tuple[torch.Tensor, torch.Tensor]:
    """Integer-valued operands whose products are exact in float32 but whose partial sums need
    more bits than float16/bfloat16 hold, or overflow float16 (+-65504) before they cancel: the
    sum rounded once (torch) differs from a sum of rounded pieces. The product itself is finite
    (reductions of it then compare with torch's reductions of the rounded product)."""
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    scale = 2048.0 if dtype == torch.float16 else 64.0
    while True:
        x = torch.randint(-4, 5, (4, 12), generator=gen).to(dtype)
        w = torch.randint(-4, 5, (12, 3), generator=gen) * scale + torch.randint(
            -3, 4, (12, 3), generator=gen)
        w = w.to(dtype)
        if torch.isfinite(x @ w).all():
            return x, w


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("mesh_shape", MESH_SHAPES, ids=str)
def test_matmul_partials_of_half_dtypes_equal_torch(
    mesh_shape: tuple[int, ...], dtype: torch.dtype
) -> None:
    mesh = sw.init_device_mesh("cpu", mesh_shape)
    rng = random.Random(f"matmul{mesh_shape}{dtype}")
    splits = list(itertools.product(MATMUL_SPLITS, repeat=len(mesh_shape)))
    targets = list(itertools.product(
        [p for p in PLACEMENTS if not isinstance(p, InterleavedShard)], repeat=len(mesh_shape)))
    every = [(s, t) for s in splits if "contract" in s for t in targets]
    limit = CASES if CASES > 0 else len(every)
    for split, target in rng.sample(every, min(limit, len(every))):
        x, w = _matmul_operands(dtype, rng)
        want = x @ w  # torch: float32 accumulation, one rounding
        where = f"{dtype} {split} -> {list(target)} on {mesh}"
        dx = sw.distribute_tensor(x, mesh, [MATMUL_SPLITS[s][0] for s in split])
        dw = sw.distribute_tensor(w, mesh, [MATMUL_SPLITS[s][1] for s in split])
        out = dx @ dw
        assert Partial() in out.placements and out.dtype == dtype, where
        _close(out.full_tensor(), want, exact=True)
        try:
            moved = out.redistribute(placements=target)
        except sw.errors.ShardwiseError as err:
            assert isinstance(err, sw.errors.InvalidPlacementError), (where, err)
            assert _expected_problem(dtype, target), (where, err)
            continue
        _close(moved.full_tensor(), want, exact=Partial("avg") not in target)
        for name, reduce in REDUCTIONS.items():
            with sw.config.allow_implicit_redistribute():
                got = reduce(out).full_tensor()
            assert got.dtype == dtype, (where, name)
            _near_intermediate(got, reduce(want), reduce(want.abs().float()), (where, name))


def _near_intermediate(got: torch.Tensor, want: torch.Tensor, scale: torch.Tensor, where) -> None:
    """A linear reduction of a pending sum (sum, mean) reduces the float32 pieces: it skips
    torch's rounding of the intermediate product, so the two may differ by those roundings
    (half an epsilon of each reduced element, at most ``scale * eps``) plus one final rounding.
    Reductions that need the product whole (amax, prod) round it first and equal torch's."""
    eps = torch.finfo(want.dtype).eps
    ulp = torch.nextafter(want.abs(), torch.tensor(float("inf"), dtype=want.dtype)) - want.abs()
    bound = scale.float() * eps + ulp.float()
    near = (got == want) | ((got.float() - want.float()).abs() <= bound)  # == : infinities
    assert near.all(), (where, got, want)
