"""Data parallel (``replicate``, ``fully_shard``) trains like one device, alone and with
tensor parallel placements on a 2-D mesh, with the communication each promises."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise import InterleavedShard, Replicate, Shard
from shardwise.errors import DataParallelError
from shardwise.parallel import fully_shard, replicate


class MLP(nn.Module):
    def __init__(self, dim: int = 6, hidden: int = 10, out: int = 3) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


def _batches(steps: int, rows: int = 7) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(rows, 6, generator=g), torch.randn(rows, 3, generator=g))
            for _ in range(steps)]


def _train(model, params, batches, target_placements=None, mesh=None):
    opt = torch.optim.AdamW(params, lr=0.02, weight_decay=0.1)
    losses, counters = [], []
    for x, y in batches:
        with sw.config.allow_implicit_redistribute(), sw.debug.CommCounter() as counter:
            if target_placements is not None:
                y = sw.distribute_tensor(y, mesh, target_placements)
            loss = F.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        losses.append(loss.full_tensor() if isinstance(loss, sw.DTensor) else loss.detach())
        counters.append(counter)
    return losses, counters


def _reference(model: nn.Module, batches) -> tuple[list[torch.Tensor], nn.Module]:
    ref = copy.deepcopy(model)
    losses, _ = _train(ref, ref.parameters(), batches)
    return losses, ref


def _assert_same(losses, ref_losses, model, ref) -> None:
    for got, want in zip(losses, ref_losses, strict=True):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.full_tensor(), q.detach(), atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.parametrize("n", [2, 3])
def test_replicate_trains_like_one_device_with_one_bucketed_reduction(n: int) -> None:
    torch.manual_seed(0)
    model, batches = MLP(), _batches(3)
    ref_losses, ref = _reference(model, batches)
    mesh = sw.init_device_mesh("cpu", (n,), mesh_dim_names=("dp",))
    dp_model = replicate(copy.deepcopy(model), mesh)
    assert all(p.placements == (Replicate(),) for p in dp_model.parameters())
    losses, counters = _train(dp_model, dp_model.parameters(), batches, [Shard(0)], mesh)
    _assert_same(losses, ref_losses, dp_model, ref)
    grads = [r for r in counters[0].records if r.kind == "all_reduce"]
    assert len(grads) == 1  # the whole model fits one bucket
    numel = sum(p.numel() for p in model.parameters())
    assert grads[0].bytes == sum(
        2 * (numel - min(-(-numel // n), numel - k * -(-numel // n))) * 4 for k in range(n)
    )


def test_replicate_buckets_follow_the_cap() -> None:
    torch.manual_seed(0)
    model, batches = MLP(), _batches(1)
    mesh = sw.init_device_mesh("cpu", (2,))
    dp_model = replicate(copy.deepcopy(model), mesh, bucket_cap_mb=100 / 2**20)  # 100 bytes
    _, counters = _train(dp_model, dp_model.parameters(), batches, [Shard(0)], mesh)
    sizes = [p.numel() * 4 for p in model.parameters()]  # 240, 40, 120, 12 bytes
    # reversed order, a new bucket when the cap would overflow: [12], [120], [40], [240]
    assert counters[0].counts["all_reduce"] == len(sizes)


@pytest.mark.parametrize("reshard", [True, False])
def test_fully_shard_keeps_params_and_optimizer_state_sharded(reshard: bool) -> None:
    torch.manual_seed(0)
    model, batches = MLP(), _batches(3)
    ref_losses, ref = _reference(model, batches)
    mesh = sw.init_device_mesh("cpu", (3,))
    fs_model = copy.deepcopy(model)
    fully_shard(fs_model.up, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(fs_model, mesh=mesh, reshard_after_forward=reshard)
    params = list(fs_model.parameters())
    assert all(p.placements == (Shard(0),) for p in params)
    opt_losses, counters = _train(fs_model, params, batches, [Shard(0)], mesh)
    _assert_same(opt_losses, ref_losses, fs_model, ref)
    kinds = counters[-1].counts
    units = 2  # each unit's parameters travel packed, as FSDP2's (uneven up.weight padded)
    assert kinds["reduce_scatter"] == units  # one per unit
    # down.weight is saved for backward: the root unit is re-gathered there when resharded
    # after forward (one packed gather)
    assert kinds["all_gather"] == units + (1 if reshard else 0)
    assert kinds["all_reduce"] == 0


def test_fully_shard_rejects_a_sharded_data_dim() -> None:
    mesh = sw.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = MLP()
    model.up.weight = nn.Parameter(sw.distribute_tensor(model.up.weight.detach(), mesh,
                                                        [Shard(1), Shard(0)]))
    with pytest.raises(DataParallelError, match=r"mesh dim 0 \(data parallel\) must be Replicate"):
        fully_shard(model, mesh=mesh["dp"])
    with pytest.raises(DataParallelError, match="not a disjoint sibling"):
        replicate(model, sw.init_device_mesh("cpu", (2,)))


TP_PLAN = {"up.weight": Shard(0), "up.bias": Shard(0), "down.weight": Shard(1)}


def _tensor_parallel(model: nn.Module, mesh: sw.DeviceMesh) -> nn.Module:
    """Megatron MLP on the 'tp' dim (column then row parallel), Replicate on 'dp'."""
    for name, param in list(model.named_parameters()):
        owner, attr = name.rsplit(".", 1)
        placements = [Replicate(), TP_PLAN.get(name, Replicate())]
        dparam = sw.distribute_tensor(param.detach(), mesh, placements)
        setattr(model.get_submodule(owner), attr, nn.Parameter(dparam))
    return model


@pytest.mark.parametrize("data_parallel", ["replicate", "fully_shard"])
def test_data_parallel_composes_with_tensor_parallel_on_2d_mesh(data_parallel: str) -> None:
    torch.manual_seed(0)
    model, batches = MLP(dim=6, hidden=10, out=3), _batches(3, rows=5)
    ref_losses, ref = _reference(model, batches)
    mesh = sw.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model2d = _tensor_parallel(copy.deepcopy(model), mesh)
    if data_parallel == "replicate":
        replicate(model2d, mesh["dp"])
    else:
        fully_shard(model2d.up, mesh=mesh["dp"])
        fully_shard(model2d, mesh=mesh["dp"])
    for name, p in model2d.named_parameters():
        tp = TP_PLAN.get(name, Replicate())
        dp_placement = Replicate() if data_parallel == "replicate" else Shard(0)
        if data_parallel == "fully_shard" and tp == Shard(0):  # FSDP2's strided shard
            dp_placement = InterleavedShard(0, interleaved_size=2)
        assert p.placements == (dp_placement, tp), name
    losses, counters = _train(model2d, model2d.parameters(), batches, [Shard(0), Replicate()],
                              mesh)
    _assert_same(losses, ref_losses, model2d, ref)
    dims = {(r.kind, r.mesh_dim) for r in counters[-1].records}
    if data_parallel == "replicate":
        assert ("all_reduce", 0) in dims and ("all_gather", 0) not in dims
    else:
        assert {("all_gather", 0), ("reduce_scatter", 0)} <= dims


def test_replicate_reduces_gradients_pending_over_tp_in_its_bucket() -> None:
    """The demo's GPT (sequence-parallel norms: their weights' gradients are pending over 'tp'
    and stored replicated) under replicate on 'dp': after the bucket's all-reduce over 'dp',
    one all-reduce over 'tp' for all of those gradients, not one per parameter; the trained
    parameters equal one device's."""
    from shardwise import demo

    cfg = demo.GPTConfig()
    mesh = sw.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = demo.sharded_model(cfg, mesh, 0)
    single = demo.GPT(cfg)
    demo.start_alike(single, model)  # the sharded model drew its shards: start from them
    pending = [n for n, p in model.named_parameters() if p.placements == (Replicate(),) * 2]
    assert len(pending) > 2  # the norms' weights and biases, the row-parallel biases
    # SGD: AdamW would blow the noise of the key bias's zero gradient up to a whole step
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt_single = torch.optim.SGD(single.parameters(), lr=0.1)
    for step in range(2):
        ids, targets = demo.make_batch(step, 8, cfg, 0)
        demo.single_step(single, opt_single, ids, targets)
        with sw.debug.CommCounter() as counter:
            demo.sharded_step(model, opt, mesh, ids, targets)
    for (name, p), q in zip(model.named_parameters(), single.parameters(), strict=True):
        torch.testing.assert_close(p.full_tensor(), q.detach(), atol=1e-5, rtol=1e-4, msg=name)
    records = counter.records
    bucket = max((i for i, r in enumerate(records) if r.kind == "all_reduce" and r.mesh_dim == 0),
                 key=lambda i: records[i].bytes)  # the gradients' bucket: the largest
    after = [r.mesh_dim for r in records[bucket + 1:] if r.kind == "all_reduce"]
    assert after == [1], records  # (the positions' gradient, sequence-sharded, is gathered)
