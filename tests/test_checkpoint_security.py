"""Hostile and damaged checkpoints for ``shardwise.checkpoint.load``: crafted pickles run no
code, data paths stay inside the checkpoint, damaged or swapped data files are refused with a
``ShardwiseError`` and leave the model, optimizer and RNG bit for bit as they were (in one
process and across 2 and 4), and ``extra`` round-trips exactly or is refused at save."""

from __future__ import annotations

import copy
import json
import math
import os
import pickle
import shlex
import shutil
from hashlib import sha256
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

import shardwise as sw
import shardwise.checkpoint as ckpt
from mp_harness import run_in_processes
from shardwise import Replicate, Shard
from shardwise.checkpoint import training_state
from shardwise.errors import CheckpointCorruptError, UnsafeCheckpointError

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class WritesMarker:
    """A pickle payload: unpickling it runs ``touch marker`` through ``os.system``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return os.system, (f"touch {shlex.quote(str(self.marker))}",)


SYSTEM = f"{os.system.__module__}.system"  # how pickle names os.system (posix.system)


def test_the_payload_runs_code_under_plain_pickle(tmp_path: Path) -> None:
    """The payload of these tests is live: plain unpickling creates the marker."""
    marker = tmp_path / "ran"
    pickle.loads(pickle.dumps(WritesMarker(marker)))
    assert marker.exists()


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(6, 12)
        self.down = nn.Linear(12, 4)
        self.register_buffer("count", torch.tensor([3, 4]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.tanh(self.up(x)))


def _trained(seed: int, mesh: sw.DeviceMesh, lr: float = 0.01) -> tuple[Net, torch.optim.Optimizer]:
    """A Net sharded on ``mesh`` with an AdamW that took one step (so it has state)."""
    torch.manual_seed(seed)
    net = Net()
    for layer, placements in ((net.up, [Shard(0)]), (net.down, [Shard(1)])):
        for name, p in list(layer.named_parameters()):
            pl = placements if p.ndim == 2 else [Replicate()]
            setattr(layer, name, nn.Parameter(sw.distribute_tensor(p.detach(), mesh, pl)))
    opt = torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=0.1)
    x = sw.distribute_tensor(torch.randn(5, 6), mesh, [Replicate()])
    with sw.config.allow_implicit_redistribute():
        net(x).full_tensor().pow(2).sum().backward()
        opt.step()
    return net, opt


def _bits(t: torch.Tensor) -> list[bytes]:
    parts = sw.tf.unpack(t) if isinstance(t, sw.DTensor) else [t]
    return [p.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes() for p in parts]


def _snapshot(net: Net, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """Every bit of the model, the optimizer state and hyper-parameters, and the RNG."""
    out: dict[str, Any] = {f"model.{k}": _bits(v) for k, v in net.state_dict().items()}
    for i, state in enumerate(opt.state.values()):
        out |= {f"optim.{i}.{k}": _bits(v) for k, v in state.items()}
    out["groups"] = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    out["rng"] = _bits(torch.get_rng_state())
    return out


def _record(ck: Path) -> dict:
    return json.loads((ck / "shardwise.json").read_text())


def _write_metadata(ck: Path, data: bytes) -> None:
    """Replace ``.metadata`` and record its digest, as a crafter who knows the format would."""
    (ck / ".metadata").write_bytes(data)
    record = _record(ck)
    record["metadata_sha256"] = sha256(data).hexdigest()
    (ck / "shardwise.json").write_text(json.dumps(record))


def _metadata(ck: Path) -> Any:
    with open(ck / ".metadata", "rb") as f:
        return pickle.load(f)  # our own checkpoint, trusted here


def _saved(tmp_path: Path, seed: int = 0, name: str = "ck") -> Path:
    mesh = sw.DeviceMesh("cpu", [0, 1])
    net, opt = _trained(seed, mesh)
    ckpt.save(tmp_path / name, net, opt, step=7, extra={"tokens": 12})
    return tmp_path / name


def _target() -> tuple[Net, torch.optim.Optimizer]:
    return _trained(99, sw.DeviceMesh("cpu", [0, 1, 2]), lr=0.5)


# ----- 1. nothing in a checkpoint runs code ------------------------------------------------


@pytest.mark.parametrize("where", ["whole file", "inside Metadata"])
def test_crafted_metadata_is_refused_and_runs_nothing(tmp_path: Path, where: str) -> None:
    ck = _saved(tmp_path)
    marker = tmp_path / "ran"
    if where == "whole file":
        payload: Any = WritesMarker(marker)
    else:
        payload = _metadata(ck)
        payload.planner_data = {"model.up.weight": WritesMarker(marker)}
    _write_metadata(ck, pickle.dumps(payload))
    net, opt = _target()
    before = _snapshot(net, opt)
    with pytest.raises(UnsafeCheckpointError) as err:
        ckpt.load(ck, net, opt)
    assert str(ck / ".metadata") in str(err.value) and SYSTEM in str(err.value)
    assert not marker.exists()
    assert _snapshot(net, opt) == before


def test_crafted_value_is_refused_and_runs_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A saved value (DCP stores non-tensors with torch.save) that pickles os.system, in a
    checkpoint whose digests are all consistent."""
    marker = tmp_path / "ran"
    net, opt = _trained(0, sw.DeviceMesh("cpu", [0, 1]))
    with monkeypatch.context() as m:
        m.setattr(training_state, "_header", lambda step, extra: (WritesMarker(marker), []))
        ckpt.save(tmp_path / "ck", net, opt)
    assert not marker.exists()
    target, target_opt = _target()
    before = _snapshot(target, target_opt)
    with pytest.raises(UnsafeCheckpointError) as err:
        ckpt.load(tmp_path / "ck", target, target_opt)
    assert str(tmp_path / "ck" / "__0_0.distcp") in str(err.value) and SYSTEM in str(err.value)
    assert not marker.exists()
    assert _snapshot(target, target_opt) == before


def test_a_value_that_is_not_plain_data_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch's weights-only loader accepts a DeviceMesh (shardwise registers it); a value
    where plain data belongs is refused all the same."""
    with monkeypatch.context() as m:
        m.setattr(training_state, "_header",
                  lambda step, extra: (sw.DeviceMesh("cpu", [0, 1]), []))
        ckpt.save(tmp_path / "ck", Net())
    with pytest.raises(UnsafeCheckpointError, match="DeviceMesh where plain data was saved"):
        ckpt.load(tmp_path / "ck", Net())


# ----- 2. data files stay inside the checkpoint directory ----------------------------------


@pytest.mark.parametrize("how", ["../secret.bin", "absolute", "symlink"])
def test_data_file_outside_the_checkpoint_is_refused(tmp_path: Path, how: str) -> None:
    ck = _saved(tmp_path)
    secret = tmp_path / "secret.bin"
    shutil.copy(ck / "__0_0.distcp", secret)  # same bytes: the digests would match
    name = {"../secret.bin": "../secret.bin", "absolute": str(secret),
            "symlink": "link.distcp"}[how]
    if how == "symlink":
        (ck / name).symlink_to(secret)
    metadata = _metadata(ck)
    for info in metadata.storage_data.values():
        info.relative_path = name
    record = _record(ck)
    record["items"][name] = record["items"].pop("__0_0.distcp")
    (ck / "shardwise.json").write_text(json.dumps(record))
    _write_metadata(ck, pickle.dumps(metadata))
    net, opt = _target()
    before = _snapshot(net, opt)
    with pytest.raises(UnsafeCheckpointError) as err:
        ckpt.load(ck, net, opt)
    assert repr(name) in str(err.value) and "outside the checkpoint" in str(err.value)
    assert _snapshot(net, opt) == before


# ----- 3. all or nothing --------------------------------------------------------------------


@pytest.mark.parametrize("damage", ["truncate 0.1", "truncate 0.5", "truncate 0.9",
                                    "flip 0.3", "flip 0.6", "flip 0.95"])
def test_damaged_data_file_loads_nothing(tmp_path: Path, damage: str) -> None:
    ck = _saved(tmp_path)
    data_file = ck / "__0_0.distcp"
    data = bytearray(data_file.read_bytes())
    kind, fraction = damage.split()
    at = int(len(data) * float(fraction))
    if kind == "truncate":
        del data[at:]
    else:
        data[at] ^= 0x40
    data_file.write_bytes(bytes(data))
    net, opt = _target()
    before = _snapshot(net, opt)
    with pytest.raises(CheckpointCorruptError) as err:
        ckpt.load(ck, net, opt)
    assert isinstance(err.value, Exception) and isinstance(err.value, sw.errors.ShardwiseError)
    assert str(data_file) in str(err.value)
    assert _snapshot(net, opt) == before


def test_a_fresh_optimizer_stays_fresh_when_the_load_fails(tmp_path: Path) -> None:
    ck = _saved(tmp_path)
    (ck / "__0_0.distcp").write_bytes(b"")
    net = _trained(99, sw.DeviceMesh("cpu", [0, 1, 2]))[0]
    opt = torch.optim.AdamW(net.parameters())
    with pytest.raises(CheckpointCorruptError, match="truncated"):
        ckpt.load(ck, net, opt)
    assert not opt.state


@pytest.mark.parametrize("which", ["missing", "truncated"])
def test_damaged_metadata_is_a_corrupt_checkpoint(tmp_path: Path, which: str) -> None:
    ck = _saved(tmp_path)
    if which == "missing":
        (ck / ".metadata").unlink()
    else:
        _write_metadata(ck, (ck / ".metadata").read_bytes()[:100])
    with pytest.raises(CheckpointCorruptError, match=r"\.metadata"):
        ckpt.load(ck, *_target())


def test_a_plain_dcp_checkpoint_is_not_taken_for_ours(tmp_path: Path) -> None:
    dcp.save({"model": Net().state_dict()}, checkpoint_id=tmp_path / "plain")
    with pytest.raises(CheckpointCorruptError, match="no shardwise.json"):
        ckpt.load(tmp_path / "plain", Net())


# ----- 4. data belongs to its metadata ------------------------------------------------------


@pytest.mark.parametrize("swapped", [["__0_0.distcp"], ["__0_0.distcp", "shardwise.json"]])
def test_another_checkpoints_files_are_refused(tmp_path: Path, swapped: list[str]) -> None:
    a, b = _saved(tmp_path, seed=1, name="a"), _saved(tmp_path, seed=2, name="b")
    assert (a / "__0_0.distcp").stat().st_size == (b / "__0_0.distcp").stat().st_size
    for name in swapped:
        shutil.copy(b / name, a / name)
    net, opt = _target()
    before = _snapshot(net, opt)
    with pytest.raises(CheckpointCorruptError, match="another checkpoint") as err:
        ckpt.load(a, net, opt)
    named = "__0_0.distcp" if len(swapped) == 1 else ".metadata"
    assert str(a / named) in str(err.value)
    assert _snapshot(net, opt) == before


# ----- 5. extra round-trips exactly or is refused at save -----------------------------------


def _same(a: Any, b: Any) -> bool:
    """Equal values of identical types all the way down (tuple is no list, 1 no 1.0 or True,
    dict keys in order, tensors of one dtype and requires_grad, -0.0 no 0.0)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return (a.dtype == b.dtype and a.requires_grad == b.requires_grad
                and torch.equal(a.detach(), b.detach()))
    if type(a) is dict:
        return (len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
                and all(_same(a[k], b[k]) for k in a))
    if type(a) in (list, tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if type(a) is float:
        return (math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1, a)
                                                     == math.copysign(1, b))
    return a == b


def test_extra_round_trips_exactly(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    extra = {
        "a.b": 1, "a": {"b": 2, "c.d": {"e": [3]}}, 1: "x", "1": "y", 2.5: None, None: True,
        (1, "t"): [1, 2.5, None, True, False, "s", b"\x00\xff"], "": [],
        "nested": {"l": [(1, 2), [3, {"k": torch.arange(3)}]], "empty": {}, "t": ()},
        "floats": [float("inf"), -float("inf"), float("nan"), -0.0, 0.1, 1e-310],
        "ints": [2**70, -(2**63), 0], "str": "é\n\"{}\"",
        "t64": torch.randn(2, 3, generator=g, dtype=torch.float64),
        "half": torch.randn(4, generator=g).half(), "bool": torch.tensor([True, False]),
        "scalar": torch.tensor(7), "grad": torch.ones(2, requires_grad=True),
        "same": [torch.zeros(1)] * 2,
    }
    ckpt.save(tmp_path / "ck", Net(), extra=copy.deepcopy(extra))
    info = ckpt.load(tmp_path / "ck", Net())
    assert set(info) == {"extra"} and _same(info["extra"], extra)


def test_extra_dtensor_comes_back_as_its_full_value(tmp_path: Path) -> None:
    full = torch.arange(12.0).reshape(4, 3)
    dt = sw.distribute_tensor(full, sw.DeviceMesh("cpu", [0, 1]), [Shard(0)])
    ckpt.save(tmp_path / "ck", step=np.int64(5), extra={"w": dt})
    info = ckpt.load(tmp_path / "ck")
    assert type(info["step"]) is int and info["step"] == 5
    assert type(info["extra"]["w"]) is torch.Tensor and torch.equal(info["extra"]["w"], full)


def _cyclic() -> list:
    out: list = [1]
    out.append(out)
    return out


@pytest.mark.parametrize(("kwargs", "fragments"), [
    ({"extra": {"s": {1, 2}}}, ["extra['s']", "builtins.set"]),
    ({"extra": {"ok": [1, object()]}}, ["extra['ok'][1]", "builtins.object"]),
    ({"extra": {"x": np.float64(1.0)}}, ["extra['x']", "numpy.float64"]),
    ({"extra": {"p": nn.Parameter(torch.ones(1))}}, ["extra['p']", "Parameter"]),
    ({"extra": {torch.ones(1): 1}}, ["tensor used as a dict key"]),
    ({"extra": {"c": _cyclic()}}, ["extra['c'][1]", "contains itself"]),
    ({"step": "3"}, ["step='3'", "integer"]),
    ({"step": 2.0}, ["step=2.0", "integer"]),
])
def test_unsupported_extra_is_refused_at_save(
    tmp_path: Path, kwargs: dict, fragments: list[str]
) -> None:
    net = Net()
    ckpt.save(tmp_path / "ck", net, step=1)
    with pytest.raises(sw.errors.ShardwiseTypeError) as err:
        ckpt.save(tmp_path / "ck", Net(), **kwargs)
    assert all(f in str(err.value) for f in fragments), str(err.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]  # nothing written
    other = Net()
    assert ckpt.load(tmp_path / "ck", other) == {"step": 1}  # the previous one stays
    assert all(torch.equal(a, b) for a, b in zip(net.state_dict().values(),
                                                 other.state_dict().values(), strict=True))


# ----- across processes: one rank's damaged file, nothing loaded on any rank --------------


def damaged_load_job(ckdir: str) -> dict[str, Any]:
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = sw.DeviceMesh("cpu", list(range(world)))
    net, opt = _trained(0, mesh)
    ck = Path(ckdir) / "ck"
    ckpt.save(ck, net, opt, step=3)
    net, opt = _trained(1, mesh, lr=0.5)  # other values to load into
    torch.manual_seed(100 + rank)
    before = _snapshot(net, opt)
    if rank == 0:  # the last rank's file loses its second half
        last = ck / f"__{world - 1}_0.distcp"
        last.write_bytes(last.read_bytes()[: last.stat().st_size // 2])
    dist.barrier()
    out: dict[str, Any] = {}
    try:
        ckpt.load(ck, net, opt)
    except Exception as exc:
        out["error"] = (type(exc).__name__, str(exc))
    out["unchanged"] = _snapshot(net, opt) == before
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_a_damaged_file_of_one_rank_loads_nothing_on_any_rank(tmp_path: Path, world: int) -> None:
    results = run_in_processes(damaged_load_job, world, str(tmp_path), timeout=150,
                               env={"SHARDWISE_COLLECTIVE_TIMEOUT": "60"})
    for rank, result in enumerate(results):
        assert result["unchanged"], rank
        name, message = result["error"]
        assert name == "CheckpointCorruptError", (rank, message)
        assert f"__{world - 1}_0.distcp" in message and "truncated" in message, (rank, message)
