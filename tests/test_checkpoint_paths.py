"""A checkpoint never deletes what it did not write: ``shardwise.checkpoint.save`` refuses a
path holding anything it did not write (a user's directory, a file, a checkpoint with the
user's notes added), leaves every other path alone (``<path>.old``, ``<path>.lock``...), and
``load`` refuses chunks that do not tile a tensor (a gap, an overlap) before touching the
model; in one process and across 2."""

from __future__ import annotations

import json
import pickle
from hashlib import sha256
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.metadata import MetadataIndex

import shardwise as sw
import shardwise.checkpoint as ckpt
from mp_harness import run_in_processes
from shardwise import Shard
from shardwise.checkpoint import directory, training_state
from shardwise.errors import CheckpointCorruptError, CheckpointPathError

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _net(seed: int, mesh: sw.DeviceMesh | None = None) -> nn.Module:
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 2))
    if mesh is not None:
        net[0].weight = nn.Parameter(sw.distribute_tensor(net[0].weight.detach(), mesh,
                                                          [Shard(0)]))
    return net


def _tree(root: Path) -> dict[str, bytes | None]:
    """Every path under ``root`` (relative) with its bytes (None for a directory)."""
    return {str(p.relative_to(root)): None if p.is_dir() else p.read_bytes()
            for p in sorted(root.rglob("*"))}


def _user_dir(root: Path) -> Path:
    run = root / "run"
    (run / "logs").mkdir(parents=True)
    (run / "notes.txt").write_text("my notes")
    (run / "logs" / "train.log").write_text("step 1 loss 2.0")
    return run


def test_save_into_a_users_directory_is_refused_and_deletes_nothing(tmp_path: Path) -> None:
    run = _user_dir(tmp_path)
    before = _tree(tmp_path)
    with pytest.raises(CheckpointPathError, match="did not write") as err:
        ckpt.save(run, _net(0))
    assert str(run) in str(err.value) and "notes.txt" in str(err.value)
    assert isinstance(err.value, FileExistsError)
    assert _tree(tmp_path) == before  # nothing deleted, nothing left beside


def test_save_into_a_file_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "ck"
    target.write_text("not a directory")
    with pytest.raises(CheckpointPathError, match="not a directory"):
        ckpt.save(target, _net(0))
    assert target.read_text() == "not a directory"


def test_paths_beside_the_checkpoint_are_never_touched(tmp_path: Path) -> None:
    """The user's ``ck.old`` (a manual backup), ``ck.saving`` and ``ck.lock`` survive saves."""
    for name in ("ck.old", "ck.saving"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "backup.pt").write_text(name)
    (tmp_path / "ck.lock").write_text("mine")
    beside = _tree(tmp_path)
    path = tmp_path / "ck"
    for seed in (0, 1, 2):
        ckpt.save(path, _net(seed))
    assert {k: v for k, v in _tree(tmp_path).items() if not k.startswith("ck/")} == beside | {
        "ck": None}
    target = _net(9)
    ckpt.load(path, target)
    assert all(torch.equal(a, b) for a, b in zip(target.parameters(), _net(2).parameters(),
                                                  strict=True))


def test_a_checkpoint_holding_a_users_file_is_not_replaced(tmp_path: Path) -> None:
    path = tmp_path / "ck"
    ckpt.save(path, _net(0))
    (path / "notes.txt").write_text("keep me")
    before = _tree(tmp_path)
    with pytest.raises(CheckpointPathError, match=r"\['notes.txt'\]"):
        ckpt.save(path, _net(1))
    assert _tree(tmp_path) == before
    target = _net(9)
    ckpt.load(path, target)  # still the first checkpoint
    assert all(torch.equal(a, b) for a, b in zip(target.parameters(), _net(0).parameters(),
                                                  strict=True))


def test_a_file_added_while_saving_is_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "ck"
    ckpt.save(path, _net(0))
    written = training_state.release_reduced  # runs once the data is written, before the swap

    def user_adds_a_file() -> None:
        (path / "notes.txt").write_text("written during the save")
        written()

    monkeypatch.setattr(training_state, "release_reduced", user_adds_a_file)
    with pytest.raises(CheckpointPathError, match="nothing was deleted; the new checkpoint is in"):
        ckpt.save(path, _net(1))
    assert (path / "notes.txt").read_text() == "written during the save"
    target = _net(9)
    ckpt.load(path, target)  # still the first checkpoint
    assert all(torch.equal(a, b) for a, b in zip(target.parameters(), _net(0).parameters(),
                                                  strict=True))


@pytest.mark.parametrize("exchange", [True, False], ids=["exchange", "two-renames"])
def test_replacing_a_checkpoint_removes_only_its_own_files(
    tmp_path: Path, exchange: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not exchange:
        monkeypatch.setattr(directory, "_exchange", lambda a, b: False)
    path = tmp_path / "ck"
    path.mkdir()  # an empty directory is fine
    ckpt.save(path, _net(0, sw.DeviceMesh("cpu", [0, 1])), step=1)
    ckpt.save(path, _net(1), step=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
    record = json.loads((path / "shardwise.json").read_text())
    assert sorted(p.name for p in path.iterdir()) == sorted(record["files"])
    target = _net(9)
    assert ckpt.load(path, target) == {"step": 2}
    assert all(torch.equal(a, b) for a, b in zip(target.parameters(), _net(1).parameters(),
                                                  strict=True))


# ----- load: the chunks of every tensor tile it ---------------------------------------------


def _rewrite_metadata(ck: Path, change: Any) -> None:
    """Change ``.metadata`` (our own file, trusted here) and record its new digest, as a
    crafter who knows the format would."""
    with open(ck / ".metadata", "rb") as f:
        metadata = pickle.load(f)
    change(metadata)
    data = pickle.dumps(metadata)
    (ck / ".metadata").write_bytes(data)
    record = json.loads((ck / "shardwise.json").read_text())
    record["metadata_sha256"] = sha256(data).hexdigest()
    (ck / "shardwise.json").write_text(json.dumps(record))


def _drop_second(metadata: Any) -> None:
    metadata.state_dict_metadata["model.0.weight"].chunks.pop(1)


def _overlap_second(metadata: Any) -> None:
    """The second chunk starts a row early (its bytes stored under the new offset)."""
    chunk = metadata.state_dict_metadata["model.0.weight"].chunks[1]
    index = MetadataIndex("model.0.weight", chunk.offsets)
    chunk.offsets = torch.Size([chunk.offsets[0] - 1, 0])
    metadata.storage_data[MetadataIndex("model.0.weight", chunk.offsets)] = (
        metadata.storage_data.pop(index))


CHANGES = {
    "gap": (_drop_second, r"leave a gap: the box at offsets \[3, 0\] sizes \[3, 4\]"),
    "overlap": (_overlap_second, r"overlap: the chunk at offsets \[0, 0\] sizes \[3, 4\] and"),
}


def _bits(net: nn.Module) -> list[bytes]:
    out = []
    for t in net.state_dict().values():
        for part in sw.tf.unpack(t) if isinstance(t, sw.DTensor) else [t]:
            out.append(part.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return out


@pytest.mark.parametrize("kind", sorted(CHANGES))
def test_chunks_that_do_not_tile_a_tensor_load_nothing(tmp_path: Path, kind: str) -> None:
    change, message = CHANGES[kind]
    path = tmp_path / "ck"
    ckpt.save(path, _net(0, sw.DeviceMesh("cpu", [0, 1])))
    _rewrite_metadata(path, change)
    target = _net(9, sw.DeviceMesh("cpu", [0, 1, 2]))
    before = _bits(target)
    with pytest.raises(CheckpointCorruptError, match=message) as err:
        ckpt.load(path, target)
    assert "model.0.weight" in str(err.value) and "[6, 4]" in str(err.value)
    assert _bits(target) == before


# ----- across 2 processes ---------------------------------------------------------------------


def paths_job(root: str) -> dict[str, Any]:
    import torch.distributed as dist

    rank = dist.get_rank()
    mesh = sw.DeviceMesh("cpu", [0, 1])
    out: dict[str, Any] = {}
    run = Path(root) / "run"
    try:
        ckpt.save(run, _net(0, mesh))
    except CheckpointPathError as exc:
        out["refused"] = str(exc)
    ck = Path(root) / "ck"
    ckpt.save(ck, _net(0, mesh))
    dist.barrier()
    if rank == 0:
        _rewrite_metadata(ck, _drop_second)
    dist.barrier()
    target = _net(9, mesh)
    before = _bits(target)
    try:
        ckpt.load(ck, target)
    except CheckpointCorruptError as exc:
        out["corrupt"] = str(exc)
    out["unchanged"] = _bits(target) == before
    return out


def test_two_processes_refuse_a_users_directory_and_a_gap(tmp_path: Path) -> None:
    _user_dir(tmp_path)
    before = _tree(tmp_path / "run")
    results = run_in_processes(paths_job, 2, str(tmp_path), timeout=150,
                               env={"SHARDWISE_COLLECTIVE_TIMEOUT": "60"})
    assert _tree(tmp_path / "run") == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "run"]
    for rank, result in enumerate(results):
        assert "notes.txt" in result["refused"], (rank, result)
        assert "model.0.weight" in result["corrupt"] and "leave a gap" in result["corrupt"]
        assert result["unchanged"], rank
