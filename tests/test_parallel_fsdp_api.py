"""FSDP2's surface on shardwise's ``fully_shard``: the module methods, grouping, shard
placements and gradient accumulation without sync. Single-device PyTorch is the oracle."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise import Replicate, Shard
from shardwise.errors import DataParallelError
from shardwise.parallel import FSDPModule, fully_shard


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.Linear(8, 3))


def _data(steps: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g))
            for _ in range(steps)]


def test_gradient_accumulation_without_sync_equals_the_summed_batches() -> None:
    mesh = sw.init_device_mesh("cpu", (2,))
    ref, model = _model(), _model()
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    (x0, y0), (x1, y1) = _data()
    dy0, dy1 = (sw.distribute_tensor(y, mesh, [Shard(0)]) for y in (y0, y1))
    model.set_requires_gradient_sync(False)
    with sw.debug.CommCounter() as quiet:
        F.mse_loss(model(x0), dy0).backward()
    assert "reduce_scatter" not in quiet.counts and "all_reduce" not in quiet.counts
    assert all(p.grad.placements == (sw.Partial(),) for p in model.parameters())
    model.set_requires_gradient_sync(True)
    with sw.config.allow_implicit_redistribute():
        F.mse_loss(model(x1), dy1).backward()
    (F.mse_loss(ref(x0), y0) + F.mse_loss(ref(x1), y1)).backward()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert p.grad.placements == p.placements
        torch.testing.assert_close(p.grad.full_tensor(), q.grad, atol=1e-6, rtol=1e-5)


def test_unshard_gathers_once_and_reshard_frees() -> None:
    mesh = sw.init_device_mesh("cpu", (2,))
    ref, model = _model(), _model()
    fully_shard(model, mesh=mesh)
    assert isinstance(model, FSDPModule) and isinstance(model, nn.Sequential)
    assert type(model).__name__ == "FSDPSequential"
    x, _ = _data()[0]
    model.unshard()
    with sw.debug.CommCounter() as counter:
        out = model(x)
    assert "all_gather" not in counter.counts  # the held parameters were used
    torch.testing.assert_close(out.full_tensor(), ref(x), atol=1e-6, rtol=1e-5)
    model.reshard()
    with sw.debug.CommCounter() as counter:
        model(x)
    assert counter.counts["all_gather"] > 0


def test_a_group_of_modules_and_shard_placement_fn() -> None:
    mesh = sw.init_device_mesh("cpu", (2,))
    ref, model = _model(), _model()
    first, last = fully_shard([model[0], model[2]], mesh=mesh,
                              shard_placement_fn=lambda p: Shard(p.ndim - 1))
    assert first is model[0] and isinstance(last, FSDPModule)
    assert model[0].weight.placements == (Shard(1),) and model[2].bias.placements == (Shard(0),)
    x, y = _data()[0]
    with sw.config.allow_implicit_redistribute():
        loss = F.mse_loss(model(sw.distribute_tensor(x, mesh, [Shard(0)])),
                          sw.distribute_tensor(y, mesh, [Shard(0)]))
        loss.backward()
    ref_loss = F.mse_loss(ref(x), y)
    ref_loss.backward()
    torch.testing.assert_close(loss.full_tensor(), ref_loss.detach())
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad.full_tensor(), q.grad, atol=1e-6, rtol=1e-5)
    with pytest.raises(DataParallelError, match="Shard"):
        fully_shard(_model(), mesh=mesh, shard_placement_fn=lambda p: Replicate())
    with pytest.raises(DataParallelError, match="smaller world size"):
        fully_shard(_model(), mesh=mesh, reshard_after_forward=2)



@pytest.mark.parametrize("from_dtensor", [False, True], ids=["plain", "replicated DTensor"])
def test_a_stored_shard_owns_its_memory(from_dtensor: bool) -> None:
    """Each device keeps only its chunk: no stored piece is a slice of the whole parameter's
    storage (FSDP2 frees the unsharded parameter), and the values are the whole's chunks."""
    mesh = sw.init_device_mesh("cpu", (4,))
    ref, model = _model(), _model()
    if from_dtensor:
        for lin in (model[0], model[2]):
            for name, p in list(lin.named_parameters()):
                setattr(lin, name, nn.Parameter(sw.distribute_tensor(p.detach(), mesh,
                                                                     [Replicate()])))
    fully_shard(model, mesh=mesh)
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        for c in sw.local_components(p):
            assert c.untyped_storage().nbytes() == c.nbytes, (list(q.shape), list(c.shape))
        torch.testing.assert_close(p.full_tensor(), q)


@pytest.mark.parametrize("rows", [12, 10], ids=["even chunks", "uneven chunks"])
def test_fsdp_over_tensor_parallel_shards_packs_and_trains_like_one_device(rows: int) -> None:
    """FSDP x TP on a (dp, tp) mesh: the column-parallel weight is stored InterleavedShard
    (each device a dp chunk of its tp shard, uneven ones padded) and still travels in the
    unit's one packed all_gather and reduce_scatter, not moved one parameter at a time."""
    from shardwise.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    single = nn.Sequential(nn.Linear(6, rows), nn.ReLU(), nn.Linear(rows, 3))
    model = nn.Sequential(nn.Linear(6, rows), nn.ReLU(), nn.Linear(rows, 3))
    model.load_state_dict(single.state_dict())
    mesh = sw.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    assert type(model[0].weight.placements[0]).__name__ == "InterleavedShard"
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt_single = torch.optim.SGD(single.parameters(), lr=0.1)
    for x, y in _data(3):
        with sw.debug.CommCounter() as counter:
            loss = F.mse_loss(model(x).full_tensor(), y)
            loss.backward()
        opt.step()
        opt.zero_grad()
        want = F.mse_loss(single(x), y)
        want.backward()
        opt_single.step()
        opt_single.zero_grad()
        torch.testing.assert_close(loss, want)
        assert "exchange" not in counter.counts, dict(counter.counts)
        assert counter.counts["reduce_scatter"] == 1, dict(counter.counts)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.full_tensor(), single.get_parameter(name), msg=name)


class _Interrupting(nn.Module):
    """Raises ``error`` from its forward while ``armed``."""

    def __init__(self) -> None:
        super().__init__()
        self.error: BaseException | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.error is not None:
            raise self.error
        return x


@pytest.mark.parametrize("how", ["fully_shard", "replicate"])
@pytest.mark.parametrize(
    "error", [KeyboardInterrupt(), pytest.fail.Exception("timeout"), RuntimeError("boom")],
    ids=["KeyboardInterrupt", "test timeout", "RuntimeError"],
)
def test_an_interrupted_forward_restores_what_its_hooks_set(how: str, error: BaseException
                                                            ) -> None:
    """Ctrl-C, a test's timeout (a BaseException) or an error inside the forward: the next
    forward runs as if it never happened (same view, same stored parameters)."""
    mesh = sw.init_device_mesh("cpu", (2,))
    ref, inner = _model(), _model()
    stop = _Interrupting()
    model = nn.Sequential(inner, stop)
    if how == "fully_shard":
        fully_shard(inner[0], mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        sw.parallel.replicate(model, mesh)
    stored = [p for p in model.parameters()]
    x, _ = _data()[0]
    stop.error = error
    with pytest.raises(type(error)):
        model(x)
    stop.error = None
    assert [p for p in model.parameters()] == stored  # the stored parameters are back
    torch.testing.assert_close(model(x).full_tensor(), ref(x), atol=1e-6, rtol=1e-5)
