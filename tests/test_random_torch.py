"""Random DTensor values beside the real ``torch.distributed.tensor`` on CPU, both per rank in
gloo processes after the same ``torch.manual_seed``, and shardwise's embedded mode: equal where
torch's are well defined (one shard per tensor); where torch repeats its numbers on every shard
(it has no RNG tracker on CPU), shardwise draws distinct shards, the same in both modes
(docs/index.md, "Random numbers")."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed import tensor as tdt

import shardwise as sw
from mp_harness import run_in_processes
from shardwise import Replicate, Shard

INITS = {
    "normal_": lambda w: nn.init.normal_(w, 0.0, 0.02),
    "uniform_": lambda w: nn.init.uniform_(w, -0.1, 0.1),
    "kaiming_uniform_": nn.init.kaiming_uniform_,
    "trunc_normal_": lambda w: nn.init.trunc_normal_(w, std=0.02),
    "rand_like": torch.rand_like,
    "dropout": lambda x: F.dropout(x, 0.3, training=True),
}


def _beside_torch() -> dict:
    """One rank: each init on a replicated (8, 6) parameter under torch's DTensor and under
    shardwise after the same seed, then sharded ones."""
    n = dist.get_world_size()
    tmesh = tdt.DeviceMesh("cpu", list(range(n)))
    smesh = sw.init_device_mesh("cpu", (n,))
    out: dict = {}
    for name, init in INITS.items():
        for lib, mesh, place, make in (
            ("torch", tmesh, tdt.Replicate(), tdt.distribute_tensor),
            ("shardwise", smesh, Replicate(), sw.distribute_tensor),
        ):
            torch.manual_seed(5)
            w = make(torch.ones(8, 6), mesh, [place])
            with torch.no_grad():
                drawn = init(w)
            out[lib, name] = (drawn if drawn is not None else w).to_local()
            out[lib, name, "after"] = torch.rand(2)
    torch.manual_seed(5)
    w = tdt.distribute_tensor(torch.zeros(8, 6), tmesh, [tdt.Shard(0)])
    nn.init.normal_(w)
    out["torch", "sharded"] = w.to_local()
    torch.manual_seed(5)
    w = sw.distribute_tensor(torch.zeros(8, 6), smesh, [Shard(0)])
    nn.init.normal_(w)
    out["shardwise", "sharded"] = w.to_local()
    return out


def test_random_values_beside_torch_dtensor_on_cpu() -> None:
    ranks = run_in_processes(_beside_torch, 2, timeout=120)
    for rank, out in enumerate(ranks):
        for name in INITS:
            assert torch.equal(out["shardwise", name], out["torch", name]), (name, rank)
            assert torch.equal(out["shardwise", name, "after"], out["torch", name, "after"])
    torch_shards = [out["torch", "sharded"] for out in ranks]
    ours = [out["shardwise", "sharded"] for out in ranks]
    assert torch.equal(torch_shards[0], torch_shards[1])  # torch on CPU: the same numbers
    assert not torch.equal(ours[0], ours[1])  # shardwise: each shard its own
    # the embedded mode (one process, two simulated devices) gives what the processes gave
    mesh = sw.init_device_mesh("cpu", (2,))
    for name, init in INITS.items():
        torch.manual_seed(5)
        w = sw.distribute_tensor(torch.ones(8, 6), mesh, [Replicate()])
        with torch.no_grad():
            drawn = init(w)
        assert torch.equal((drawn if drawn is not None else w).full_tensor(),
                           ranks[0]["torch", name]), name
    torch.manual_seed(5)
    w = sw.distribute_tensor(torch.zeros(8, 6), mesh, [Shard(0)])
    nn.init.normal_(w)
    assert torch.equal(w.full_tensor(), torch.cat(ours))
