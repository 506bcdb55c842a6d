"""Linear algebra and FFTs on DTensors against single-device torch, forward and backward:
linalg shards batch dims and keeps matrix dims whole, an FFT shards the dims it does not
transform; both without communication when the input already is sharded that way."""

from __future__ import annotations

import pytest
import torch

import shardwise as sw
from op_oracle import check_op, run_oracle
from shardwise import Replicate, Shard
from shardwise.debug import CommCounter

MESHES = [(2,), (3,), (2, 2)]


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64)


def well_conditioned(*batch: int, n: int = 3, seed: int = 0) -> torch.Tensor:
    return randn(*batch, n, n, seed=seed) + 3 * torch.eye(n, dtype=torch.float64)


def spd(a: torch.Tensor) -> torch.Tensor:
    with sw.config.implicit_replication():  # the plain identity: every rank holds it whole
        return a @ a.mT + torch.eye(a.shape[-1], dtype=a.dtype)


LINALG = [
    ("inv", torch.linalg.inv),
    ("det", torch.linalg.det),
    ("slogdet", torch.linalg.slogdet),
    ("cholesky", lambda a: torch.linalg.cholesky(spd(a))),
    ("eigh", lambda a: torch.linalg.eigh(a + a.mT)),
    ("svdvals", torch.linalg.svdvals),
    ("matrix_exp", torch.linalg.matrix_exp),
    ("lu_factor", lambda a: torch.linalg.lu_factor(a)[0]),
]


@pytest.mark.parametrize("name,fn", LINALG, ids=[c[0] for c in LINALG])
def test_linalg_oracle(name, fn) -> None:
    a = well_conditioned(5, 2)
    assert run_oracle(fn, [a], mesh_shapes=MESHES, max_cases=2, atol=1e-8, rtol=1e-6) > 0


def test_qr_oracle() -> None:
    """One mesh dim: qr's backward updates a diagonal view in place, which a DTensor sharded
    on both matrix dims does not alias (a views limitation, not qr's)."""
    run_oracle(torch.linalg.qr, [well_conditioned(5, 2)], mesh_shapes=[(2,), (3,)], max_cases=3,
               atol=1e-8, rtol=1e-6)


def test_solves_broadcast_and_partial_right_hand_side() -> None:
    a, b = well_conditioned(5), randn(5, 3, 2, seed=1)
    run_oracle(torch.linalg.solve, [a, b], mesh_shapes=MESHES, max_cases=4, atol=1e-8)
    shared = well_conditioned(seed=2)  # one matrix for the whole batch: broadcast, replicated
    run_oracle(torch.linalg.solve, [shared, b], mesh_shapes=MESHES, max_cases=4, atol=1e-8)
    tri = torch.linalg.cholesky(spd(well_conditioned(4, seed=3)))
    run_oracle(lambda t, b: torch.linalg.solve_triangular(t, b, upper=False),
               [tri, randn(4, 3, 2, seed=4)], mesh_shapes=[(2,), (3,)], max_cases=4, atol=1e-8)


def test_householder_product_backward_on_row_sharded_input() -> None:
    """Its backward fills the diagonal of a row-sharded matrix in place: a local view."""
    a, tau = randn(5, 5), randn(4, seed=1)
    check_op(torch.linalg.householder_product, [a, tau], (2,), [(Shard(0),), (Replicate(),)],
             atol=1e-8)


def test_lstsq_runs_replicated() -> None:
    a, b = randn(4, 5, 3), randn(4, 5, 2, seed=1)
    run_oracle(lambda a, b: torch.linalg.lstsq(a, b).solution, [a, b], mesh_shapes=[(2,)],
               max_cases=3, atol=1e-8)


def test_batch_sharded_inverse_is_local() -> None:
    mesh = sw.init_device_mesh("cpu", (2,))
    a = well_conditioned(4)
    da = sw.distribute_tensor(a, mesh, [Shard(0)])
    with CommCounter() as counter:
        out = torch.linalg.inv(da)
    assert out.placements == (Shard(0),) and not counter.records
    torch.testing.assert_close(out.full_tensor(), torch.linalg.inv(a))


FFTS = [
    ("fft", lambda x: torch.fft.fft(x, dim=1)),
    ("rfft2", lambda x: torch.fft.rfft2(x)),
    ("irfft", lambda x: torch.fft.irfft(x, n=6, dim=-1)),
    ("ifftn", lambda x: torch.fft.ifftn(x, dim=(0, 2))),
    ("hfft", lambda x: torch.fft.hfft(x.to(torch.complex128), dim=0)),
]


@pytest.mark.parametrize("name,fn", FFTS, ids=[c[0] for c in FFTS])
def test_fft_oracle(name, fn) -> None:
    run_oracle(fn, [randn(5, 4, 6)], mesh_shapes=MESHES, max_cases=4, atol=1e-8)


def test_fft_keeps_untransformed_shards_and_partial() -> None:
    mesh = sw.init_device_mesh("cpu", (2,))
    x = randn(4, 8)
    dx = sw.distribute_tensor(x, mesh, [Shard(0)])
    with CommCounter() as counter:
        out = torch.fft.rfft(dx, dim=1)
    assert out.placements == (Shard(0),) and not counter.records
    torch.testing.assert_close(out.full_tensor(), torch.fft.rfft(x, dim=1))
    partial = sw.DTensor.from_local([x, 2 * x], mesh, [sw.Partial()])
    out = torch.fft.fft(partial, dim=0)
    assert out.placements[0].is_partial()
    torch.testing.assert_close(out.full_tensor(), torch.fft.fft(3 * x, dim=0))
