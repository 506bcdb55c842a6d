"""The engine on a cluster's terms, counted: one training step of a tensor-parallel MLP and of
FSDP (x TP) under the launcher's per-rank model, every ``torch.distributed`` entry and every
functional collective wrapped. shardwise issues the same backend collectives per step as
``torch.distributed.tensor`` / FSDP2 on the same program, no point-to-point message, and no
host read on the communication path (the agreement posts one word per collective on the
shared-memory board of processes on one host, or gathers one CPU word on its gloo side group,
never reading the data's device). By default the losses equal torch's within float rounding."""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist
from torch import nn

from mp_harness import run_in_processes

pytestmark = pytest.mark.slow

# torch.distributed's point-to-point and collective entries
_P2P = ("isend", "irecv", "send", "recv", "batch_isend_irecv")
_COLLECTIVES = ("all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_coalesced",
                "all_gather_into_tensor", "all_gather_single", "_all_gather_base",
                "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single",
                "_reduce_scatter_base", "reduce", "all_to_all", "all_to_all_single", "broadcast",
                "scatter", "gather", "all_gather_object", "broadcast_object_list")
_FUNCTIONAL = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor",
               "all_to_all_single", "broadcast", "all_reduce_coalesced",
               "all_gather_into_tensor_coalesced", "reduce_scatter_tensor_coalesced")
_COMM_PATH = ("/shardwise/comm/", "/shardwise/redistribute/")


def _caller() -> str:
    """Where a counted call came from: the agreement (its innermost shardwise frame), else
    shardwise's communication path (any frame on the stack), else elsewhere (torch's own
    DTensor and FSDP2 included)."""
    frame = sys._getframe(2)
    innermost = None
    while frame is not None:
        name = frame.f_code.co_filename
        if "/shardwise/" in name and innermost is None:
            innermost = name
        if any(part in name for part in _COMM_PATH):
            return "agreement" if innermost.endswith("/comm/agreement.py") else "comm"
        frame = frame.f_back
    return "other"


@contextmanager
def counting() -> Iterator[Counter]:
    """Count every torch.distributed entry, functional collective and host read (``item``,
    ``tolist``, ``__bool__``, ``numpy``) while inside, by caller."""
    counts: Counter = Counter()
    saved: list[tuple[object, str, object]] = []

    def wrap(owner: object, name: str, label: str) -> None:
        real = getattr(owner, name, None)
        if real is None:
            return

        def counted(*args: object, **kwargs: object) -> object:
            counts[label, _caller()] += 1

            return real(*args, **kwargs)

        saved.append((owner, name, real))
        setattr(owner, name, counted)

    for name in _P2P + _COLLECTIVES:
        wrap(dist, name, f"dist.{name}")
    functional = torch.ops._c10d_functional
    for name in _FUNCTIONAL:
        wrap(functional, name, f"functional.{name}")
    for name in ("item", "tolist", "__bool__", "numpy"):
        wrap(torch.Tensor, name, f"read.{name}")
    from shardwise.comm.board import Board
    wrap(Board, "post", "board.post")
    try:
        yield counts
    finally:
        for owner, name, real in reversed(saved):
            setattr(owner, name, real)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor) -> torch.Tensor:
    loss = model(x).pow(2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach()


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _run(build: Callable[[], tuple[nn.Module, torch.Tensor]]) -> dict:
    """Two warm-up steps, then one counted step; the losses and the counts."""
    model, x = build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, foreach=False)
    losses = [_full(_step(model, optimizer, x)) for _ in range(2)]
    with counting() as counts:
        loss = _step(model, optimizer, x)
    losses.append(_full(loss))
    return {"counts": dict(counts), "losses": torch.stack([torch.as_tensor(v) for v in losses])}


def _tp(lib: str) -> dict:
    """The TP MLP (Colwise, Rowwise) over every process."""
    if lib == "torch":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )
    else:
        from shardwise import init_device_mesh
        from shardwise.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    world = dist.get_world_size()

    def build() -> tuple[nn.Module, torch.Tensor]:
        mesh = init_device_mesh("cpu", (world,))
        model = parallelize_module(_mlp(), mesh, {"0": ColwiseParallel(),
                                                  "2": RowwiseParallel()})
        return model, torch.randn(8, 16, generator=torch.Generator().manual_seed(1))

    return _run(build)


def _fsdp_tp(lib: str) -> dict:
    """FSDP over "dp" (each linear and the root its unit) x TP over "tp" (all processes on
    "dp" when there are two)."""
    if lib == "torch":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )
    else:
        from shardwise import init_device_mesh
        from shardwise.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            fully_shard,
            parallelize_module,
        )
    world = dist.get_world_size()
    tp = world // 2

    def build() -> tuple[nn.Module, torch.Tensor]:
        mesh = init_device_mesh("cpu", (2, tp), mesh_dim_names=("dp", "tp"))
        model = _mlp()
        if tp > 1:
            model = parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(),
                                                           "2": RowwiseParallel()})
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        rows = torch.randn(16, 16, generator=torch.Generator().manual_seed(1))
        return model, rows.chunk(2)[mesh.get_coordinate()[0]]

    return _run(build)


def counted_steps(program: str, board: bool = True) -> dict:
    from shardwise import settings
    settings.AGREE_IN_SHARED_MEMORY.set_default(board)
    fn = {"tp": _tp, "fsdp_tp": _fsdp_tp}[program]
    return {lib: fn(lib) for lib in ("torch", "shardwise")}


def _by_kind(counts: dict, caller: str | None = None) -> Counter:
    out: Counter = Counter()
    for (label, who), n in counts.items():
        if caller is None or who == caller:
            out[label] += n
    return out


def _backend_collectives(counts: dict, kind: str = "") -> int:
    """Collective calls that move data (their name containing ``kind``): functional or not,
    agreements apart."""
    return sum(n for (label, who), n in counts.items()
               if who != "agreement" and not label.startswith("read.")
               and label.split(".")[1] not in _P2P and kind in label)


@pytest.mark.parametrize("program,world,board", [
    ("tp", 2, True), ("tp", 4, True), ("fsdp_tp", 2, True), ("fsdp_tp", 4, True),
    ("tp", 2, False)])
def test_engine_calls_per_step(program: str, world: int, board: bool) -> None:
    per_rank = run_in_processes(counted_steps, world, program, board, timeout=240)
    for rank, result in enumerate(per_rank):
        ours, theirs = result["shardwise"], result["torch"]
        counts = ours["counts"]
        p2p = sum(n for (label, _), n in counts.items()
                  if label.startswith("dist.") and label.split(".")[1] in _P2P)
        assert p2p == 0, f"rank {rank}: point-to-point calls {counts}"
        reads = _by_kind(counts, "comm")
        assert not any(k.startswith("read.") for k in reads), f"rank {rank}: host reads {reads}"
        # the same reductions; gathers no more than torch's (FSDP2 gathers each unit again
        # for its backward; shardwise may keep one gathered, as it does the root's)
        seen = f"rank {rank}: shardwise {_by_kind(counts)} torch {_by_kind(theirs['counts'])}"
        for kind in ("all_reduce", "reduce_scatter", "all_to_all", "broadcast"):
            assert _backend_collectives(counts, kind) == _backend_collectives(
                theirs["counts"], kind), seen
        assert _backend_collectives(counts, "gather") <= _backend_collectives(
            theirs["counts"], "gather"), seen
        # the agreement: one word per collective, posted on the board of processes on one
        # host (these), else one CPU word gathered on the side group
        agreements = _by_kind(counts, "agreement")
        posts = agreements.pop("board.post", 0)
        gathers = sum(n for label, n in agreements.items() if not label.startswith("read."))
        assert (posts, gathers) == ((_backend_collectives(counts), 0) if board else
                                    (0, _backend_collectives(counts))), agreements
        torch.testing.assert_close(ours["losses"], theirs["losses"], rtol=1e-5, atol=1e-6)
