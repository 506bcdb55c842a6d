"""Checkpoints of shardwise DTensors on torch.distributed.checkpoint, in one process: plain
``dcp.save``/``dcp.load`` resharding between meshes and placements, and the training-state
helpers ``shardwise.checkpoint.save/load``. Values must come back bit for bit."""

from __future__ import annotations

import copy
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

import shardwise as sw
import shardwise.checkpoint as ckpt
from shardwise import InterleavedShard, Partial, Replicate, Shard

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _values() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return {
        "w": torch.randn(7, 9, generator=g, dtype=torch.float64),  # uneven on 2x2 and on 3
        "ids": torch.randint(-(2**40), 2**40, (8, 6), generator=g),  # int64, interleaved
        "b": torch.randn(5, generator=g),  # fewer rows than some meshes' devices
        "scalar": torch.tensor(3.25),
    }


def _mesh(n: int) -> sw.DeviceMesh:
    return sw.DeviceMesh("cpu", list(range(n)))


def test_dcp_save_on_2x2_loads_resharded_everywhere(tmp_path: Path) -> None:
    v = _values()
    m22 = sw.DeviceMesh("cpu", [[0, 1], [2, 3]])
    saved = {
        "w": sw.distribute_tensor(v["w"], m22, [Shard(0), Shard(1)]),
        "ids": sw.distribute_tensor(v["ids"], m22, [InterleavedShard(0, 2), Shard(1)]),
        "b": sw.distribute_tensor(v["b"], m22, [Replicate(), Shard(0)]),
        "scalar": sw.distribute_tensor(v["scalar"], m22, [Replicate(), Replicate()]),
        "plain": torch.arange(4.0),
        "meta": {"epoch": 3},
    }
    dcp.save(saved, checkpoint_id=tmp_path)
    targets = [
        (_mesh(3), {"w": [Shard(1)], "ids": [Shard(1)], "b": [Shard(0)], "scalar": [Replicate()]}),
        (_mesh(1), dict.fromkeys(v, [Replicate()])),
        (_mesh(4), {"w": [Shard(0)], "ids": [InterleavedShard(0, 2)], "b": [Shard(0)],
                    "scalar": [Replicate()]}),
    ]
    for mesh, placements in targets:
        into = {
            k: sw.distribute_tensor(torch.zeros_like(t), mesh, placements[k]) for k, t in v.items()
        }
        into |= {"plain": torch.zeros(4), "meta": {"epoch": 0}}
        dcp.load(into, checkpoint_id=tmp_path)
        for key, want in v.items():
            got = into[key]
            assert got.placements == tuple(placements[key]) and got.device_mesh == mesh
            assert got.dtype == want.dtype and torch.equal(got.full_tensor(), want), (mesh, key)
        assert torch.equal(into["plain"], torch.arange(4.0)) and into["meta"] == {"epoch": 3}
    plain = {k: torch.zeros_like(t) for k, t in v.items()}
    dcp.load(plain, checkpoint_id=tmp_path)
    assert all(torch.equal(plain[k], v[k]) for k in v)


def test_plain_tensor_checkpoint_loads_into_dtensors(tmp_path: Path) -> None:
    v = _values()
    dcp.save(dict(v), checkpoint_id=tmp_path)
    m22 = sw.DeviceMesh("cpu", [[0, 1], [2, 3]])
    into = {
        "w": sw.distribute_tensor(torch.zeros_like(v["w"]), m22, [Shard(1), Shard(0)]),
        "ids": sw.distribute_tensor(torch.zeros(8, 6, dtype=torch.int64), m22,
                                    [Replicate(), InterleavedShard(0, 4)]),
    }
    dcp.load(into, checkpoint_id=tmp_path, planner=dcp.DefaultLoadPlanner(allow_partial_load=True))
    assert torch.equal(into["w"].full_tensor(), v["w"])
    assert torch.equal(into["ids"].full_tensor(), v["ids"])


def test_partial_dtensors_save_reduced_and_load_into_partial(tmp_path: Path) -> None:
    m22 = sw.DeviceMesh("cpu", [[0, 1], [2, 3]])
    g = torch.Generator().manual_seed(4)
    parts = [torch.randn(5, 3, generator=g, dtype=torch.float64) for _ in range(4)]
    summed = sw.DTensor.from_local(parts, m22, [Partial(), Partial()], shape=(5, 3))
    maxed = sw.DTensor.from_local(parts, m22, [Shard(0), Partial("max")], shape=(10, 3))
    want = {"sum": summed.full_tensor(), "max": maxed.full_tensor()}
    dcp.save({"sum": summed, "max": maxed}, checkpoint_id=tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(sw.local_components(summed), parts, strict=True))
    mesh = _mesh(2)
    plain = {k: torch.zeros_like(v) for k, v in want.items()}
    dcp.load(plain, checkpoint_id=tmp_path)
    assert torch.equal(plain["sum"], want["sum"]) and torch.equal(plain["max"], want["max"])
    for placements in ([Partial()], [Partial("avg")], [Partial("min")], [Shard(0)]):
        into = {k: sw.distribute_tensor(torch.ones_like(v), mesh, placements)
                for k, v in want.items()}
        dcp.load(into, checkpoint_id=tmp_path)
        for key, value in want.items():
            assert into[key].placements == tuple(placements)
            assert torch.equal(into[key].full_tensor(), value), (placements, key)


# ----- the training-state helpers ----------------------------------------------------------


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(6, 12)
        self.down = nn.Linear(12, 4)
        self.register_buffer("count", torch.tensor([0, 0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.tanh(self.up(x)))


def _sharded(net: Net, mesh: sw.DeviceMesh, up: list, down: list) -> Net:
    for layer, placements in ((net.up, up), (net.down, down)):
        for name, p in list(layer.named_parameters()):
            pl = placements if p.ndim == 2 else [Replicate()] * mesh.ndim
            setattr(layer, name, nn.Parameter(sw.distribute_tensor(p.detach(), mesh, pl)))
    return net


def _train_step(net: Net, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    mesh = net.up.weight.device_mesh
    dx = sw.distribute_tensor(x, mesh, [Replicate()] * mesh.ndim)
    opt.zero_grad()
    with sw.config.allow_implicit_redistribute():
        net(dx).full_tensor().pow(2).sum().backward()
        opt.step()


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, sw.DTensor) else t


def test_training_state_round_trip_reshards_and_training_continues_identically(
    tmp_path: Path,
) -> None:
    torch.manual_seed(0)
    base = Net()
    x = torch.randn(5, 6)
    m22 = sw.DeviceMesh("cpu", [[0, 1], [2, 3]])
    net = _sharded(copy.deepcopy(base), m22, [Replicate(), Shard(0)], [Shard(1), Replicate()])
    net.count += 7
    opt = torch.optim.AdamW(net.parameters(), lr=0.01, weight_decay=0.1)
    _train_step(net, opt, x)
    ckpt.save(tmp_path / "ck", net, opt, step=1, extra={"tokens": 1234})
    rng_after_save = torch.rand(3)

    m3 = _mesh(3)
    other = _sharded(copy.deepcopy(base), m3, [Shard(0)], [Shard(1)])
    other_opt = torch.optim.AdamW(other.parameters(), lr=0.5, weight_decay=0.0)
    info = ckpt.load(tmp_path / "ck", other, other_opt)
    assert info == {"step": 1, "extra": {"tokens": 1234}}
    assert torch.equal(torch.rand(3), rng_after_save)  # the RNG state came back
    assert other_opt.param_groups[0]["lr"] == 0.01
    assert other_opt.param_groups[0]["weight_decay"] == 0.1
    assert torch.equal(other.count, torch.tensor([7, 7]))
    for (name, a), (_, b) in zip(net.named_parameters(), other.named_parameters(), strict=True):
        assert b.device_mesh == m3 and torch.equal(_full(a), _full(b)), name
    for state_a, state_b in zip(opt.state.values(), other_opt.state.values(), strict=True):
        for key in state_a:
            assert torch.equal(_full(state_a[key]), _full(state_b[key])), key
    _train_step(net, opt, x)
    _train_step(other, other_opt, x)
    for a, b in zip(net.parameters(), other.parameters(), strict=True):
        assert torch.allclose(_full(a), _full(b), rtol=1e-6, atol=1e-7)


def test_raw_dcp_on_model_and_optimizer_state_dicts(tmp_path: Path) -> None:
    """``dcp.save``/``dcp.load`` unchanged on ``state_dict()``s holding DTensors: the load
    lands in place in the parameters and optimizer state, resharded."""
    torch.manual_seed(3)
    base, x = Net(), torch.randn(4, 6)
    net = _sharded(copy.deepcopy(base), sw.DeviceMesh("cpu", [[0, 1], [2, 3]]),
                   [Shard(0), Shard(1)], [Replicate(), Shard(0)])
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    _train_step(net, opt, x)
    dcp.save({"model": net.state_dict(), "optim": opt.state_dict()}, checkpoint_id=tmp_path)

    other = _sharded(copy.deepcopy(base), _mesh(2), [Shard(1)], [Shard(0)])
    other_opt = torch.optim.SGD(other.parameters(), lr=0.1, momentum=0.9)
    _train_step(other, other_opt, torch.zeros(4, 6))  # creates the momentum buffers
    state = {"model": other.state_dict(), "optim": other_opt.state_dict()}
    dcp.load(state, checkpoint_id=tmp_path)
    for (name, a), (_, b) in zip(net.named_parameters(), other.named_parameters(), strict=True):
        assert b.device_mesh.shape == (2,) and torch.equal(_full(a), _full(b)), name
    for sa, sb in zip(opt.state.values(), other_opt.state.values(), strict=True):
        assert torch.equal(_full(sa["momentum_buffer"]), _full(sb["momentum_buffer"]))


def test_mismatched_model_raises_naming_keys_and_loads_nothing(tmp_path: Path) -> None:
    torch.manual_seed(1)
    ckpt.save(tmp_path / "ck", Net())
    wrong = Net()
    wrong.down = nn.Linear(12, 5)  # a different shape
    wrong.extra = nn.Linear(2, 2)  # keys the checkpoint lacks
    del wrong.count  # a key the model lacks
    before = {k: v.clone() for k, v in wrong.state_dict().items()}
    with pytest.raises(sw.errors.CheckpointMismatchError) as err:
        ckpt.load(tmp_path / "ck", wrong)
    message = str(err.value)
    assert "missing from the checkpoint (2): model.extra.bias, model.extra.weight" in message
    assert "unexpected in the checkpoint (1): model.count" in message
    assert "model.down.weight: saved shape [4, 12]" in message and "[5, 12]" in message
    assert "model.down.bias: saved shape [4]" in message
    assert "nothing was loaded" in message
    assert all(torch.equal(before[k], v) for k, v in wrong.state_dict().items())


def test_progress_bar_for_large_states(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    pytest.importorskip("tqdm")
    net = Net()
    ckpt.save(tmp_path / "ck", net, progress=True)
    ckpt.load(tmp_path / "ck", Net(), progress=True)
    err = capsys.readouterr().err
    assert "checkpoint save" in err and "checkpoint load" in err
    ckpt.save(tmp_path / "ck", net)  # small: no bar by default
    assert "checkpoint" not in capsys.readouterr().err


KILLED_SAVE = """
import os, signal, sys, torch
import shardwise as sw, shardwise.checkpoint as ckpt
from torch import nn
from torch.distributed.checkpoint import DefaultSavePlanner
written = []
original = DefaultSavePlanner.resolve_data
def resolve_then_die(self, item):
    written.append(item)
    if len(written) == 3:  # part-way through writing the new checkpoint
        os.kill(os.getpid(), signal.SIGKILL)
    return original(self, item)
DefaultSavePlanner.resolve_data = resolve_then_die
net = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
for p in net.parameters():
    torch.nn.init.constant_(p, 9.0)
ckpt.save(sys.argv[1], net)
"""


def test_a_killed_save_leaves_the_previous_checkpoint_loadable(tmp_path: Path) -> None:
    torch.manual_seed(2)
    net = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    path = tmp_path / "ck"
    ckpt.save(path, net)
    proc = subprocess.run(
        [sys.executable, "-c", KILLED_SAVE, str(path)],
        env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"},
        capture_output=True, timeout=120,
    )
    assert proc.returncode == -9, proc.stderr.decode()[-2000:]
    leftover, = tmp_path.glob("ck.saving-*")  # the interrupted save's directory
    fresh = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    ckpt.load(path, fresh)
    for a, b in zip(net.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b)
    # killed between the two renames of the fallback (no atomic exchange): still found
    path.rename(leftover.with_name(leftover.name + "-old"))
    other = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    ckpt.load(path, other)
    assert all(torch.equal(a, b) for a, b in zip(net.parameters(), other.parameters(), strict=True))
    ckpt.save(path, net)  # the next save cleans up
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


def test_loading_a_missing_checkpoint_says_where(tmp_path: Path) -> None:
    with warnings.catch_warnings(), pytest.raises(FileNotFoundError, match="nowhere"):
        ckpt.load(tmp_path / "nowhere", Net())
