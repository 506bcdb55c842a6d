"""Checkpoints of RaggedShard DTensors: ``dcp.save`` ragged and ``dcp.load`` even (Shard) on
another mesh, and back; ``shardwise.checkpoint.save/load`` of a ragged-FSDP model and its
optimizer; in one process and on 2 and 4 processes. Values must come back bit for bit."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

import shardwise as sw
import shardwise.checkpoint as ckpt
from mp_harness import run_in_processes
from shardwise import RaggedShard, Replicate, Shard
from shardwise.parallel import fully_shard

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _values() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return {"w": torch.randn(10, 3, generator=g, dtype=torch.float64),
            "ids": torch.randint(-(2**40), 2**40, (3, 7), generator=g)}


def _ragged(n: int) -> dict[str, list]:
    if n == 4:
        return {"w": [RaggedShard(0, (3, 0, 5, 2))], "ids": [RaggedShard(1, (0, 0, 7, 0))]}
    return {"w": [RaggedShard(0, (10, 0))], "ids": [RaggedShard(1, (2, 5))]}


def _round_trip(directory: Path, n_save: int, n_load: int) -> None:
    """Save ragged on ``n_save`` devices, load even on ``n_load``; save that, load ragged."""
    v = _values()
    save_mesh = sw.init_device_mesh("cpu", (n_save,))
    load_mesh = sw.init_device_mesh("cpu", (n_load,))
    ragged = {k: sw.distribute_tensor(t, save_mesh, _ragged(n_save)[k]) for k, t in v.items()}
    dcp.save(ragged, checkpoint_id=directory / "ragged")
    even = {k: sw.distribute_tensor(torch.zeros_like(t), load_mesh, [Shard(0)])
            for k, t in v.items()}
    dcp.load(even, checkpoint_id=directory / "ragged")
    for k, t in v.items():
        assert even[k].placements == (Shard(0),) and torch.equal(even[k].full_tensor(), t), k
    dcp.save(even, checkpoint_id=directory / "even")
    back = {k: sw.distribute_tensor(torch.zeros_like(t), save_mesh, _ragged(n_save)[k])
            for k, t in v.items()}
    dcp.load(back, checkpoint_id=directory / "even")
    for k, t in v.items():
        assert back[k].placements == tuple(_ragged(n_save)[k])
        assert torch.equal(back[k].full_tensor(), t), k
        assert [c.shape for c in sw.local_components(back[k])] == [
            c.shape for c in sw.local_components(ragged[k])
        ]


def test_save_ragged_load_even_and_back(tmp_path: Path) -> None:
    _round_trip(tmp_path, 4, 2)
    _round_trip(tmp_path / "b", 2, 3)


def _fsdp_model(n: int) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 10), nn.Linear(10, 3))
    sizes = {10: (8, 2) if n == 2 else (4, 4, 2, 0), 3: (3, 0) if n == 2 else (0, 3, 0, 0)}
    return fully_shard(model, mesh=sw.init_device_mesh("cpu", (n,)),
                       shard_placement_fn=lambda p: RaggedShard(0, sizes[p.shape[0]]))


def _step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(1))
    with sw.config.allow_implicit_redistribute():
        out = model(x)
        loss = (out * out).mean()
        opt.zero_grad()
        loss.backward()
    opt.step()


def test_training_state_of_a_ragged_fsdp_model_loads_even(tmp_path: Path) -> None:
    model = _fsdp_model(4)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    _step(model, opt)
    ckpt.save(tmp_path / "ck", model, opt, step=1)
    torch.manual_seed(9)
    even = fully_shard(nn.Sequential(nn.Linear(6, 10), nn.Linear(10, 3)),
                       mesh=sw.init_device_mesh("cpu", (2,)))
    even_opt = torch.optim.AdamW(even.parameters(), lr=0.5)
    assert ckpt.load(tmp_path / "ck", even, even_opt)["step"] == 1
    for (name, a), b in zip(model.named_parameters(), even.parameters(), strict=True):
        assert b.placements == (Shard(0),) and torch.equal(a.full_tensor(), b.full_tensor()), name
    for sa, sb in zip(opt.state.values(), even_opt.state.values(), strict=True):
        assert torch.equal(sa["exp_avg"].full_tensor(), sb["exp_avg"].full_tensor())
    _step(model, opt)
    _step(even, even_opt)
    for a, b in zip(model.parameters(), even.parameters(), strict=True):
        torch.testing.assert_close(a.full_tensor(), b.full_tensor(), rtol=1e-6, atol=1e-7)


def _mp_job(directory: str) -> list[bool]:
    import torch.distributed as dist

    world = dist.get_world_size()
    v = _values()
    mesh = sw.init_device_mesh("cpu", (world,))
    ragged = {k: sw.distribute_tensor(t, mesh, _ragged(world)[k]) for k, t in v.items()}
    dcp.save(ragged, checkpoint_id=Path(directory) / "ragged")
    even = {k: sw.distribute_tensor(torch.zeros_like(t), mesh, [Shard(0)]) for k, t in v.items()}
    dcp.load(even, checkpoint_id=Path(directory) / "ragged")
    dcp.save(even, checkpoint_id=Path(directory) / "even")
    back = {k: sw.distribute_tensor(torch.zeros_like(t), mesh, _ragged(world)[k])
            for k, t in v.items()}
    dcp.load(back, checkpoint_id=Path(directory) / "even")
    rep = {k: sw.distribute_tensor(torch.zeros_like(t), mesh, [Replicate()]) for k, t in v.items()}
    dcp.load(rep, checkpoint_id=Path(directory) / "ragged")
    return [torch.equal(d[k].full_tensor(), t) for d in (even, back, rep) for k, t in v.items()] + [
        back[k].to_local().shape == ragged[k].to_local().shape for k in v
    ]


@pytest.mark.parametrize("world", [2, 4])
def test_save_ragged_load_even_and_back_on_processes(world: int) -> None:
    with tempfile.TemporaryDirectory() as directory:
        results = run_in_processes(_mp_job, world, directory, timeout=240)
    assert all(all(r) for r in results), results
