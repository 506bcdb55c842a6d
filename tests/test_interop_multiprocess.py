"""Interop across gloo processes: asynchronous collectives equal the blocking ones bit for bit
and report their errors at ``wait()``; DCP checkpoints saved by 2 processes load in 1 and in 4
processes on other meshes and placements, bit for bit."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

import shardwise as sw
import shardwise.checkpoint as ckpt
from mp_harness import run_in_processes
from shardwise import InterleavedShard, Partial, Replicate, Shard
from shardwise.comm.call import _span

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

SAVED = {  # name: (placements on the 2x2 mesh of the saving processes)
    "w": [Shard(0), Shard(1)],
    "ids": [InterleavedShard(0, 2), Shard(1)],
    "b": [Replicate(), Shard(0)],
}
ASYNC_CASES = [
    ((2,), (7, 3), [Shard(0)], [Replicate()]),
    ((2,), (6, 4), [Partial()], [Shard(1)]),
    ((2, 2), (7, 5), [Shard(0), Shard(1)], [Replicate(), Shard(0)]),
    ((2, 2), (8, 3), [InterleavedShard(0, 2), Partial()], [Shard(1), Replicate()]),
]

GATHER_CASES = [  # (mesh devices, global shape, dtype, placements) gathered to Replicate
    ([0, 1], (7, 3), torch.float32, [Shard(0)]),  # uneven pieces, received in place
    ([0, 1], (5, 7), torch.float64, [Shard(1)]),  # column pieces: through a buffer
    ([0, 1], (1, 3), torch.bool, [Shard(0)]),  # an empty piece
    ([0, 1, 2, 3], (10, 3), torch.int64, [Shard(0)]),  # two local devices, two from the peer
    ([[0, 2], [1, 3]], (6, 5), torch.float32, [Shard(1), Shard(0)]),  # two groups per peer
]


def _values() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return {
        "w": torch.randn(7, 9, generator=g, dtype=torch.float64),
        "ids": torch.randint(-(2**40), 2**40, (8, 6), generator=g),
        "b": torch.randn(5, generator=g),
    }


def _model() -> nn.Module:
    torch.manual_seed(12)
    return nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 4))


def _shard_model(model: nn.Module, mesh: sw.DeviceMesh, placements: list) -> nn.Module:
    for layer in (model[0], model[2]):
        for name, p in list(layer.named_parameters()):
            setattr(layer, name, nn.Parameter(sw.distribute_tensor(p.detach(), mesh, placements)))
    return model


def _mesh(shape: tuple[int, ...]) -> sw.DeviceMesh:
    n = 1
    for s in shape:
        n *= s
    return sw.DeviceMesh("cpu", torch.arange(n).reshape(shape))


def save_job(ckdir: str) -> dict:
    """2 processes: async collectives, then DCP saves, then an async error surfacing."""
    out: dict = {"async_equal": [], "gathered": []}
    for devices, shape, dtype, placements in GATHER_CASES:
        mesh = sw.DeviceMesh("cpu", devices)
        full = (torch.randn(shape, generator=torch.Generator().manual_seed(5)) * 100).to(dtype)
        dt = sw.distribute_tensor(full, mesh, placements)
        target = [Replicate()] * mesh.ndim
        for got in (dt.redistribute(placements=target),
                    dt.redistribute(placements=target, async_op=True).wait()):
            pieces = sw.local_components(got)
            out["gathered"].append(
                all(p.dtype == dtype and torch.equal(p, full) for p in pieces)
                and len({p.data_ptr() for p in pieces if p.numel()}) == len(pieces)
            )
    for mesh_shape, shape, source, target in ASYNC_CASES:
        mesh = _mesh(mesh_shape)
        torch.manual_seed(3)
        full = torch.randn(shape)
        placements = [Replicate() if p.is_partial() else p for p in source]
        dt = sw.distribute_tensor(full, mesh, placements)
        if placements != source:  # distinct local values under Partial
            pieces = sw.local_components(dt)
            dt = sw.DTensor.from_local([c * (1 + d) for c, d in zip(
                pieces, mesh.local_device_ids, strict=True)], mesh, source, shape=shape)
        want = sw.local_components(dt.redistribute(placements=target))
        pending = dt.redistribute(placements=target, async_op=True)
        got = sw.local_components(pending.wait())
        out["async_equal"].append(all(torch.equal(a, b) for a, b in zip(got, want, strict=True)))
    mesh = _mesh((2,))
    dt = sw.distribute_tensor(torch.arange(10.0).reshape(5, 2), mesh, [Shard(0)])
    out["messages"] = _messages_sent(lambda: dt.redistribute(placements=[Replicate()]))
    local = dt.redistribute(placements=[Replicate()], async_op=True).to_local()
    out["to_local_type"] = type(local).__name__
    out["to_local_plus_one"] = local + 1

    m22 = _mesh((2, 2))
    values = _values()
    state = {k: sw.distribute_tensor(values[k], m22, SAVED[k]) for k in SAVED}
    state["meta"] = {"epoch": 4}
    ids = values["ids"]  # a Partial sum across processes (saved reduced): 3 * ids
    state["partial"] = sw.DTensor.from_local(
        [ids * (1 + m22.coordinate_of(d)[1]) for d in m22.local_device_ids], m22,
        [Replicate(), Partial()],
    )
    dcp.save(state, checkpoint_id=Path(ckdir) / "dcp")
    model = _shard_model(_model(), _mesh((2,)), [Shard(0)])
    ckpt.save(Path(ckdir) / "train", model, step=3)

    sw.config.set_collective_timeout(2.0)  # last: rank 0 skips the collective rank 1 waits on
    if dist_rank() == 1:
        pending = dt.redistribute(placements=[Replicate()], async_op=True)
        try:
            pending.wait()
        except sw.errors.CollectiveTimeoutError as err:
            out["error"] = str(err)
    return out


def _messages_sent(fn: Callable[[], object]) -> int:
    """How many point-to-point messages this process sends during ``fn()``."""
    import torch.distributed as dist

    sent, isend = [], dist.isend

    def counting(*args: object, **kwargs: object) -> object:
        sent.append(args)
        return isend(*args, **kwargs)

    dist.isend = counting
    try:
        fn()
    finally:
        dist.isend = isend
    return len(sent)


def dist_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank()


def _load_everywhere(ckdir: str, targets: list) -> dict:
    """Load the DCP checkpoint into each (mesh shape, placements per key); full values back."""
    out = {}
    for mesh_shape, placements in targets:
        mesh = _mesh(mesh_shape)
        into: dict = {
            k: sw.distribute_tensor(torch.zeros_like(v), mesh, placements[k])
            for k, v in _values().items()
        }
        into["meta"] = {"epoch": 0}
        into["partial"] = sw.distribute_tensor(torch.zeros(8, 6, dtype=torch.int64), mesh,
                                               placements["ids"])
        dcp.load(into, checkpoint_id=Path(ckdir) / "dcp")
        out[mesh_shape] = {k: into[k].full_tensor() for k in [*placements, "partial"]}
        out[mesh_shape]["meta"] = into["meta"]
    return out


LOAD_TARGETS = [
    ((4,), {"w": [Shard(1)], "ids": [InterleavedShard(0, 2)], "b": [Shard(0)]}),
    ((2, 2), {"w": [Replicate(), Shard(0)], "ids": [Shard(1), Shard(0)], "b": [Replicate()] * 2}),
]


def load_job(ckdir: str) -> dict:
    """4 processes, one device each (and two meshes): the 2-process checkpoints resharded."""
    out = {"dcp": _load_everywhere(ckdir, LOAD_TARGETS)}
    model = _shard_model(nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 4)),
                         _mesh((4,)), [Replicate()])
    out["step"] = ckpt.load(Path(ckdir) / "train", model)["step"]
    out["params"] = [p.full_tensor() for p in model.parameters()]
    return out


def _check_loaded(loaded: dict) -> None:
    values = _values()
    for mesh_shape, got in loaded.items():
        assert got["meta"] == {"epoch": 4}, mesh_shape
        assert torch.equal(got["partial"], 3 * values["ids"]), mesh_shape
        for key, want in values.items():
            assert got[key].dtype == want.dtype and torch.equal(got[key], want), (mesh_shape, key)


ENV = {"SHARDWISE_COLLECTIVE_TIMEOUT": "60"}


@pytest.fixture(scope="module")
def saved_by_two(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list]:
    """The 2-process job, run once: its checkpoints directory and per-rank results."""
    ckdir = str(tmp_path_factory.mktemp("two_processes"))
    return ckdir, run_in_processes(save_job, 2, ckdir, timeout=100, env=ENV)


def test_async_across_processes_and_loading_in_one_process(saved_by_two: tuple) -> None:
    ckdir, saved = saved_by_two
    for rank, result in enumerate(saved):
        assert result["async_equal"] == [True] * len(ASYNC_CASES), rank
        assert result["gathered"] == [True] * 2 * len(GATHER_CASES), rank
        assert result["to_local_type"] == "AsyncCollectiveTensor"
        assert result["messages"] == 0  # uneven pieces: one padded all_gather, no message
        assert torch.equal(result["to_local_plus_one"], torch.arange(10.0).reshape(5, 2) + 1)
    error = saved[1]["error"]
    assert "background collective" in error and "redistribute of" in error
    assert "all_gather" in error and "Shard(dim=0)" in error and "wait()" in error

    # the 2-process checkpoint in this one process: 3 devices, 1 device, plain tensors
    _check_loaded(_load_everywhere(ckdir, [
        ((3,), {"w": [Shard(1)], "ids": [Shard(1)], "b": [Shard(0)]}),
        ((1,), dict.fromkeys(SAVED, [Replicate()])),
    ]))
    plain = {k: torch.zeros_like(v) for k, v in _values().items()}
    dcp.load(plain, checkpoint_id=Path(ckdir) / "dcp",
             planner=dcp.DefaultLoadPlanner(allow_partial_load=True))
    assert all(torch.equal(plain[k], v) for k, v in _values().items())


def test_checkpoint_of_two_processes_loads_in_four(saved_by_two: tuple) -> None:
    ckdir, _ = saved_by_two
    loaded = run_in_processes(load_job, 4, ckdir, timeout=100, env=ENV)
    reference = [p.detach() for p in _model().parameters()]
    for result in loaded:
        _check_loaded(result["dcp"])
        assert result["step"] == 3
        assert all(torch.equal(a, b) for a, b in zip(result["params"], reference, strict=True))


def test_all_gather_receives_into_the_result_when_its_slices_are_back_to_back() -> None:
    whole = torch.zeros(6, 4)
    rows = [whole[0:2], whole[2:5], whole[5:6]]
    span = _span(rows[1:], 4 * 4 * 4)
    assert span is not None and span.dtype == torch.uint8 and span.numel() == 64
    span.view(torch.float32).fill_(7.0)  # what the transport writes lands in the result
    assert torch.equal(whole, torch.cat([torch.zeros(2, 4), torch.full((4, 4), 7.0)]))
    assert _span([whole[:, :2], whole[:, 2:]], 6 * 4 * 4) is None  # columns: not contiguous
    assert _span([rows[0], rows[2]], 3 * 4 * 4) is None  # not adjacent
    assert _span([rows[0], None], 2 * 4 * 4) is None  # a piece without a place
    assert _span([rows[0], torch.zeros(1, 4)], 3 * 4 * 4) is None  # another storage
