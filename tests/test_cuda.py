"""CUDA paths: meshes with device_type="cuda" (simulated devices sharing one GPU, and the
NCCL world of one process) give what plain PyTorch gives on that GPU. These run only where CUDA
is available (``bench/gpu_check.sh`` runs them on a GPU machine); CI has no GPU."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise import Partial, Replicate, Shard
from shardwise.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

PLACEMENTS = {"S0": Shard(0), "S1": Shard(1), "R": Replicate()}


def _randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).cuda()


@pytest.mark.parametrize("src", ["S0", "S1", "R", "P"])
@pytest.mark.parametrize("dst", ["S0", "S1", "R"])
def test_redistribute_on_simulated_gpu_devices(src: str, dst: str) -> None:
    mesh = sw.DeviceMesh("cuda", list(range(4)))
    full = _randn(10, 7)
    if src == "P":
        pieces = [full * (k + 1) / 10 for k in range(4)]  # sums to full
        dt = sw.DTensor.from_local(pieces, mesh, [Partial()])
    else:
        dt = sw.distribute_tensor(full, mesh, [PLACEMENTS[src]])
    out = dt.redistribute(placements=[PLACEMENTS[dst]])
    assert out.full_tensor().device.type == "cuda"
    torch.testing.assert_close(out.full_tensor(), full)


def test_ops_on_gpu_match_plain_torch() -> None:
    mesh = sw.DeviceMesh("cuda", [[0, 1], [2, 3]])
    a, b, idx = _randn(8, 6, seed=1), _randn(6, 4, seed=2), torch.arange(5).cuda()
    da = sw.distribute_tensor(a, mesh, [Shard(0), Shard(1)])
    db = sw.distribute_tensor(b, mesh, [Replicate(), Shard(0)])
    emb = sw.distribute_tensor(a, mesh, [Replicate(), Shard(1)])
    with sw.config.allow_implicit_redistribute():
        got = {
            "mm": (da @ db).full_tensor(),
            "add": (da + da * 2).full_tensor(),
            "sum": da.sum(0).full_tensor(),
            "softmax": torch.softmax(da, -1).full_tensor(),
            "cat": torch.cat([da, da], 1).full_tensor(),
            "embedding": F.embedding(sw.distribute_tensor(idx, mesh, [Replicate()] * 2),
                                     emb).full_tensor(),
        }
    want = {
        "mm": a @ b, "add": a + a * 2, "sum": a.sum(0), "softmax": torch.softmax(a, -1),
        "cat": torch.cat([a, a], 1), "embedding": F.embedding(idx, a),
    }
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, msg=name)


class _MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(16, 44)
        self.down = nn.Linear(44, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


def test_tensor_parallel_training_on_gpu_matches_one_device() -> None:
    torch.manual_seed(0)
    plain = _MLP().cuda()
    sharded = copy.deepcopy(plain)
    mesh = sw.DeviceMesh("cuda", list(range(4)))
    parallelize_module(sharded, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (plain, sharded)]
    for step in range(3):
        x, y = _randn(8, 16, seed=10 + step), _randn(8, 16, seed=20 + step)
        losses = []
        for model, opt in zip((plain, sharded), opts, strict=True):
            opt.zero_grad()
            out = model(x)
            out = out.full_tensor() if isinstance(out, sw.DTensor) else out
            loss = F.mse_loss(out, y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        assert losses[1] == pytest.approx(losses[0], rel=1e-5, abs=1e-6)
    torch.testing.assert_close(sharded.up.weight.full_tensor(), plain.up.weight)


def _at_offset(increment: int) -> None:
    """What torch's OffsetBasedRNGTracker does on a rank before its draw: the GPU generator's
    (seed, offset) state with the offset advanced by the rank's start increment."""
    state = torch.cuda.get_rng_state()
    offset = int(state[8:].view(torch.int64)) + increment
    state[8:] = torch.tensor([offset], dtype=torch.int64).view(torch.uint8)
    torch.cuda.set_rng_state(state)


@pytest.mark.parametrize("name", ["S0", "S1", "R"])
def test_random_values_are_torch_trackers_on_gpu(name: str) -> None:
    """randn and dropout on 4 simulated devices of the GPU give, device by device, what torch's
    tracker draws on each rank (torch's own offsets, rng_oracle.torch_offsets, on the real
    CUDA generator), and the generator ends where torch's does."""
    from rng_oracle import torch_offsets

    placements, shape = [PLACEMENTS[name]], (9, 6)
    mesh = sw.DeviceMesh("cuda", list(range(4)))
    ones = sw.distribute_tensor(torch.ones(shape, device="cuda"), mesh, placements)
    torch.manual_seed(3)
    got = sw.randn(*shape, device_mesh=mesh, placements=placements)
    dropped = F.dropout(ones, 0.5)
    after = torch.cuda.get_rng_state()
    for i, device in enumerate(mesh.local_device_ids):
        start, end = torch_offsets((4,), placements, shape, mesh.coordinate_of(device))
        torch.manual_seed(3)
        base = torch.cuda.get_rng_state()
        _at_offset(start)
        assert torch.equal(got._components[i], torch.randn(got._components[i].shape, device="cuda"))
        torch.cuda.set_rng_state(base)
        _at_offset(end + start)  # the second op starts where the first left every rank
        local = torch.ones(dropped._components[i].shape, device="cuda")
        assert torch.equal(dropped._components[i], F.dropout(local, 0.5))
    torch.manual_seed(3)
    _at_offset(2 * end)
    assert torch.equal(after, torch.cuda.get_rng_state())
