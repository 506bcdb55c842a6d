"""PyTorch DTensor's Partial encodings: mean is Partial("avg") of local means, p-norms are pending
norms, from_local keeps a permuted stride, and clip_grad_norm_ reduces once. Single-device
PyTorch is the oracle for values; the local pieces are checked against what they must be,
computed from the full tensor; torch.distributed.tensor, run beside us across 2 processes, is
the oracle for the encoding."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from mp_harness import run_in_processes
from shardwise import Partial, Replicate, Shard
from shardwise.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from shardwise.placements import norm_partial


def _mesh(*shape: int) -> sw.DeviceMesh:
    return sw.init_device_mesh("cpu", shape)


def _randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# ----- mean ------------------------------------------------------------------------------------


def test_mean_is_avg_of_local_means_on_even_shards() -> None:
    x = _randn(4, 6)
    d = sw.distribute_tensor(x, _mesh(2), [Shard(0)])
    for got, want, local in [
        (d.mean(), x.mean(), [x[:2].mean(), x[2:].mean()]),
        (d.mean(0), x.mean(0), [x[:2].mean(0), x[2:].mean(0)]),
        (d.mean((0, 1), keepdim=True), x.mean((0, 1), keepdim=True),
         [x[:2].mean((0, 1), keepdim=True), x[2:].mean((0, 1), keepdim=True)]),
    ]:
        assert got.placements == (Partial("avg"),)
        for c, w in zip(sw.local_components(got), local, strict=True):
            torch.testing.assert_close(c, w)
        torch.testing.assert_close(got.full_tensor(), want)
    kept = d.mean(1)  # over an unsharded dim: stays sharded
    assert kept.placements == (Shard(0),)


def test_mean_on_a_2d_mesh_and_of_partial_inputs() -> None:
    x = _randn(4, 6, seed=1)
    d = sw.distribute_tensor(x, _mesh(2, 2), [Shard(0), Shard(1)])
    m = d.mean()
    assert m.placements == (Partial("avg"), Partial("avg"))
    blocks = [x[i * 2:(i + 1) * 2, j * 3:(j + 1) * 3].mean() for i in range(2) for j in range(2)]
    for c, w in zip(sw.local_components(m), blocks, strict=True):
        torch.testing.assert_close(c, w)
    torch.testing.assert_close(m.full_tensor(), x.mean())
    # mean is linear: a pending sum stays pending
    p = sw.distribute_tensor(x, _mesh(2), [Replicate()]).redistribute(placements=[Partial()])
    assert p.mean(0).placements == (Partial(),)
    torch.testing.assert_close(p.mean(0).full_tensor(), x.mean(0))


@pytest.mark.parametrize("rows", [3, 5, 1])
def test_mean_over_uneven_shards_stays_exact(rows: int) -> None:
    """Uneven shards: Partial("sum") of local sum / global count, no communication."""
    x = _randn(rows, 3, seed=rows)
    mesh = _mesh(2)
    d = sw.distribute_tensor(x, mesh, [Shard(0)])
    with sw.debug.CommCounter() as counter:
        m = d.mean(0)
    assert counter.counts == {}
    assert m.placements == (Partial(),)
    first = (rows + 1) // 2
    shares = [x[:first].sum(0) / rows, x[first:].sum(0) / rows]
    for c, w in zip(sw.local_components(m), shares, strict=True):
        torch.testing.assert_close(c, w)
    torch.testing.assert_close(m.full_tensor(), x.mean(0))


def test_partial_avg_redistributes_and_backpropagates() -> None:
    x = _randn(4, 6, seed=2)
    mesh = _mesh(2)
    m = sw.distribute_tensor(x, mesh, [Shard(0)]).mean(0)
    torch.testing.assert_close(m.redistribute(placements=[Replicate()]).full_tensor(), x.mean(0))
    scattered = m.redistribute(placements=[Shard(0)])
    for c, w in zip(sw.local_components(scattered), x.mean(0).chunk(2), strict=True):
        torch.testing.assert_close(c, w)
    # from_local with Partial("avg"): the gradient of each piece is 1/n of the global one
    pieces = [x[:2].mean(0).requires_grad_(), x[2:].mean(0).requires_grad_()]
    avg = sw.DTensor.from_local(pieces, mesh, [Partial("avg")])
    avg.full_tensor().sum().backward()
    for piece in pieces:
        torch.testing.assert_close(piece.grad, torch.full((6,), 0.5))


# ----- losses ----------------------------------------------------------------------------------


def test_cross_entropy_mean_is_avg_of_local_means() -> None:
    logits, target = _randn(6, 5, seed=3), torch.tensor([0, 4, 2, 1, 3, 2])
    mesh = _mesh(2)
    dx = sw.distribute_tensor(logits, mesh, [Shard(0)]).requires_grad_()
    dt = sw.distribute_tensor(target, mesh, [Shard(0)])
    loss = F.cross_entropy(dx, dt)
    assert loss.placements == (Partial("avg"),)
    local = [F.cross_entropy(logits[:3], target[:3]), F.cross_entropy(logits[3:], target[3:])]
    for c, w in zip(sw.local_components(loss), local, strict=True):
        torch.testing.assert_close(c, w)
    ref = logits.clone().requires_grad_()
    expected = F.cross_entropy(ref, target)
    expected.backward()
    loss.backward()
    torch.testing.assert_close(loss.full_tensor(), expected)
    torch.testing.assert_close(dx.grad.full_tensor(), ref.grad)


def test_weighted_nll_mean_is_exact_where_local_means_are_not() -> None:
    """Class weights give the two halves different total weights: the average of the local
    weighted means is wrong, shardwise's pieces average to the exact value."""
    logp = F.log_softmax(_randn(6, 3, seed=4), 1)
    target, weight = torch.tensor([0, 0, 0, 2, 2, 1]), torch.tensor([1.0, 2.0, 5.0])
    mesh = _mesh(2)
    loss = F.nll_loss(sw.distribute_tensor(logp, mesh, [Shard(0)]),
                      sw.distribute_tensor(target, mesh, [Shard(0)]),
                      weight=sw.distribute_tensor(weight, mesh, [Replicate()]))
    assert loss.placements == (Partial("avg"),)
    expected = F.nll_loss(logp, target, weight=weight)
    torch.testing.assert_close(loss.full_tensor(), expected)
    naive = (F.nll_loss(logp[:3], target[:3], weight=weight)
             + F.nll_loss(logp[3:], target[3:], weight=weight)) / 2
    assert not torch.allclose(naive, expected)


def test_mse_mean_is_avg_of_local_means_on_even_shards() -> None:
    x, y = _randn(4, 3, seed=5), _randn(4, 3, seed=6)
    mesh = _mesh(2)
    loss = F.mse_loss(sw.distribute_tensor(x, mesh, [Shard(0)]),
                      sw.distribute_tensor(y, mesh, [Shard(0)]))
    assert loss.placements == (Partial("avg"),)
    for c, half in zip(sw.local_components(loss), (slice(0, 2), slice(2, 4)), strict=True):
        torch.testing.assert_close(c, F.mse_loss(x[half], y[half]))
    torch.testing.assert_close(loss.full_tensor(), F.mse_loss(x, y))


# ----- pending norms ---------------------------------------------------------------------------


@pytest.mark.parametrize("p", [2.0, 1.0, 3.0, 0.5, math.inf])
def test_vector_norm_is_a_pending_norm(p: float) -> None:
    x = _randn(5, 4, seed=7)
    d = sw.distribute_tensor(x, _mesh(2), [Shard(0)])
    with sw.debug.CommCounter() as counter:
        n = torch.linalg.vector_norm(d, p)
    assert counter.counts == {}
    assert n.placements == (norm_partial(p),)
    for c, half in zip(sw.local_components(n), (x[:3], x[3:]), strict=True):
        torch.testing.assert_close(c, torch.linalg.vector_norm(half, p))
    torch.testing.assert_close(n.full_tensor(), torch.linalg.vector_norm(x, p))


def test_pending_norm_semantics_and_redistribution() -> None:
    mesh = _mesh(2)
    assert norm_partial(2) == Partial("norm2") and norm_partial(math.inf) == Partial("norminf")
    assert norm_partial(0) == Partial() and norm_partial(-math.inf) == Partial("min")
    assert norm_partial(-1) is None
    with pytest.raises(sw.errors.InvalidPlacementError, match="norm<p>"):
        Partial("norm-2")
    a, b = torch.tensor([3.0, -1.0]), torch.tensor([4.0, 1.0])
    for op, want in [("norm2", (a**2 + b**2).sqrt()), ("norm1", a.abs() + b.abs()),
                     ("norminf", torch.maximum(a.abs(), b.abs())),
                     ("norm3", (a.abs()**3 + b.abs()**3) ** (1 / 3))]:
        d = sw.DTensor.from_local([a, b], mesh, [Partial(op)])
        torch.testing.assert_close(d.full_tensor(), want)
        scattered = d.redistribute(placements=[Shard(0)])
        torch.testing.assert_close(torch.cat(sw.local_components(scattered)), want)
        # Replicate -> pending norm moves nothing and keeps the value
        whole = scattered.redistribute(placements=[Replicate()])
        back = whole.redistribute(placements=[Partial(op)])
        torch.testing.assert_close(back.full_tensor(), want)
    with pytest.raises(sw.errors.InvalidPlacementError, match="floating"):
        sw.DTensor.from_local([torch.tensor([1]), torch.tensor([2])], mesh, [Partial("norm2")])


def test_norm_of_stacked_pending_norms_stays_pending() -> None:
    mesh = _mesh(2)
    xs = [_randn(4, 3, seed=s) for s in range(3)]
    ds = [sw.distribute_tensor(x, mesh, [Shard(i % 2)]) for i, x in enumerate(xs)]
    with sw.debug.CommCounter() as counter:
        total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(d) for d in ds]))
    assert counter.counts == {} and total.placements == (Partial("norm2"),)
    expected = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(x) for x in xs]))
    torch.testing.assert_close(total.full_tensor(), expected)


# ----- clip_grad_norm_ -------------------------------------------------------------------------


class MLP(nn.Module):
    def __init__(self, dim: int = 16, hidden: int = 64) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


def _clip(mesh_shape: tuple[int, ...], norm_type: float) -> tuple[dict, dict, bool]:
    """clip_grad_norm_ of a Colwise/Rowwise MLP against single-device PyTorch: the collectives
    it ran, their bytes, and whether norm and clipped gradients matched."""
    torch.manual_seed(0)
    model = MLP()
    sharded = copy.deepcopy(model)
    parallelize_module(sharded, _mesh(*mesh_shape),
                       {"up": ColwiseParallel(), "down": RowwiseParallel()})
    x = torch.randn(4, 16)
    model(x).pow(2).sum().backward()
    expected = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01, norm_type)
    out = sharded(x)  # a plain tensor where a process owns one device (use_local_output)
    (out.full_tensor() if isinstance(out, sw.DTensor) else out).pow(2).sum().backward()
    with sw.debug.CommCounter() as counter, sw.config.allow_implicit_redistribute():
        total = torch.nn.utils.clip_grad_norm_(sharded.parameters(), 0.01, norm_type)
    ok = torch.allclose(total.full_tensor(), expected, rtol=1e-5) and all(
        torch.allclose(p.grad.full_tensor(), r.grad, rtol=1e-5, atol=1e-7)
        for p, r in zip(sharded.parameters(), model.parameters(), strict=True)
    )
    return dict(counter.counts), dict(counter.bytes), ok


@pytest.mark.parametrize("mesh_shape", [(2,), (2, 2)])
@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf, 3.0])
def test_clip_grad_norm_reduces_once(mesh_shape, norm_type) -> None:
    counts, nbytes, ok = _clip(mesh_shape, norm_type)
    assert ok
    devices = math.prod(mesh_shape)
    # one float32 scalar all-reduced: each device receives 4 bytes (two halves of the ring)
    assert counts == {"all_reduce": 1} and nbytes == {"all_reduce": 4 * devices}


def _clip_in_processes() -> list:
    return [_clip(shape, p) for shape in [(2,), (2, 2)] for p in (2.0, math.inf)]


def _torch_encodings() -> dict:
    """What torch.distributed.tensor and shardwise give for the same per-rank program."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor as TorchDTensor
    from torch.distributed.tensor import Shard as TorchShard
    from torch.distributed.tensor import distribute_tensor

    tmesh, mesh = init_device_mesh("cpu", (2,)), _mesh(2)
    x, y = _randn(4, 6, seed=8), _randn(4, 6, seed=9)
    target = torch.tensor([0, 5, 2, 3])
    out = {}
    for name, fn in [
        ("mean", lambda d, e, t: d.mean()),
        ("mean0", lambda d, e, t: d.mean(0)),
        ("norm2", lambda d, e, t: torch.linalg.vector_norm(d)),
        ("norm3", lambda d, e, t: torch.linalg.vector_norm(d, 3)),
        ("mse", lambda d, e, t: F.mse_loss(d, e)),
        ("ce", lambda d, e, t: F.cross_entropy(d, t)),
    ]:
        theirs = fn(distribute_tensor(x, tmesh, [TorchShard(0)]),
                    distribute_tensor(y, tmesh, [TorchShard(0)]),
                    distribute_tensor(target, tmesh, [TorchShard(0)]))
        ours = fn(sw.distribute_tensor(x, mesh, [Shard(0)]),
                  sw.distribute_tensor(y, mesh, [Shard(0)]),
                  sw.distribute_tensor(target, mesh, [Shard(0)]))
        out[name] = (theirs.to_local(), ours.to_local(), str(theirs.placements[0]),
                     ours.placements[0])
    local = _randn(4, 3, 2, seed=10).permute(2, 0, 1)
    for dim in range(3):
        out[f"stride{dim}"] = (TorchDTensor.from_local(local, tmesh, [TorchShard(dim)]).stride(),
                               sw.DTensor.from_local(local, mesh, [Shard(dim)]).stride())
    return out


def test_across_processes_clip_and_pytorch_encodings() -> None:
    results = run_in_processes(_clip_in_processes, 2, timeout=180)
    for rank in results:
        for counts, nbytes, ok in rank:
            assert ok and counts == {"all_reduce": 1}, (counts, nbytes)
    pytorch = {"mean": "avg", "mean0": "avg", "norm2": "norm2", "norm3": "norm3", "mse": "avg",
               "ce": "avg"}
    for rank in run_in_processes(_torch_encodings, 2, timeout=180):
        for name, op in pytorch.items():
            theirs, ours, their_placement, our_placement = rank[name]
            torch.testing.assert_close(ours, theirs, msg=name)
            assert our_placement == Partial(op), (name, their_placement)
        for dim in range(3):
            theirs, ours = rank[f"stride{dim}"]
            assert tuple(ours) == tuple(theirs), dim


def test_from_local_stride_of_a_permuted_tensor() -> None:
    """Embedded: the global stride is the local one with the shard dim's stride order kept."""
    mesh = _mesh(2)
    local = [_randn(4, 3, 2, seed=s).permute(2, 0, 1) for s in range(2)]  # stride (1, 6, 2)
    d = sw.DTensor.from_local(local, mesh, [Shard(0)])
    assert d.shape == (4, 4, 3) and d.stride() == (1, 12, 4)
    assert sw.DTensor.from_local(local, mesh, [Shard(2)]).stride() == (1, 12, 2)
    assert sw.DTensor.from_local(local, mesh, [Replicate()]).stride() == (1, 6, 2)
    full = torch.cat(local, 0)
    torch.testing.assert_close((d * 2).full_tensor(), full * 2)
