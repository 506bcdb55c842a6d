"""The backend path's redistribution (one device per process). ``async_op=True`` issues the
collectives at once on the calling thread (no worker thread) and the result waits at its first
use, not at issue, so an op between issue and use runs before the wait; views of its local
tensor stay unwaited (torch's AsyncCollectiveTensor); the values are the blocking run's and the
single-process oracle's. No copy is made beside the collective where the data already lies as
it is sent and received."""

from __future__ import annotations

import threading

import pytest
import torch

import shardwise as sw
from mp_harness import run_in_processes
from shardwise.placements import Partial, Replicate, Shard

pytestmark = pytest.mark.slow

CASES = [("S0", "R"), ("S0", "S1"), ("P", "R"), ("P", "S0")]
_PLACE = {"S0": Shard(0), "S1": Shard(1), "R": Replicate(), "P": Partial()}


def _async_program() -> dict:
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = sw.init_device_mesh("cpu", (world,))
    # small integers: sums are exact whatever order the backend adds in
    full = torch.randint(-8, 8, (4 * world, 6 * world),
                         generator=torch.Generator().manual_seed(0)).float()
    functional = torch.ops._c10d_functional
    real_wait = functional.wait_tensor
    out: dict = {}
    for src, dst in CASES:
        if src == "P":  # rank r holds (r + 1) * full: the sum is full * world(world+1)/2
            dt = sw.DTensor.from_local(full * (rank + 1), mesh, [Partial()])
            value = full * (world * (world + 1) // 2)
        else:
            dt = sw.distribute_tensor(full, mesh, [_PLACE[src]])
            value = full
        target = [_PLACE[dst]]
        blocking = dt.redistribute(placements=target).to_local()
        events: list[str] = []

        def counted(t: torch.Tensor, events: list[str] = events) -> torch.Tensor:
            events.append("wait")
            return real_wait(t)

        functional.wait_tensor = counted
        try:
            pending = dt.redistribute(placements=target, async_op=True)
            events.append("issued")
            torch.ones(3).add_(1)  # an op between issue and use
            events.append("between")
            used = pending * 1  # the first use
            events.append("used")
            used * 1
            events.append("again")
            local = dt.redistribute(placements=target, async_op=True).to_local()
            flat = local.view(-1)  # a view: not waited
            events.append("viewed")
            summed = flat.sum()
            events.append("summed")
        finally:
            functional.wait_tensor = real_wait
        if dst == "R":
            oracle = value
        else:
            dim = _PLACE[dst].dim
            oracle = value.chunk(world, dim)[rank]
        out[src, dst] = {
            "events": events,
            "pending_type": type(pending).__name__,
            "equal_oracle": torch.equal(used.to_local(), oracle),
            "equal_blocking": torch.equal(pending.to_local(), blocking),
            "local_sum": torch.equal(summed, oracle.sum()),
        }
    out["copies"] = _copies(mesh, full)
    out["worker_thread"] = any(t.name == "shardwise-collectives" for t in threading.enumerate())
    return out


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _copies(mesh: sw.DeviceMesh, full: torch.Tensor) -> dict:
    """Per transition, whether the collective's input is the component's own memory (no pack
    copy before it) and the result is the collective's output (no join copy after it)."""
    functional = torch.ops._c10d_functional
    seen: dict = {}
    saved = {}
    for name in ("all_gather_into_tensor", "all_to_all_single", "reduce_scatter_tensor"):
        real = saved[name] = getattr(functional, name)

        def wrapped(inp: torch.Tensor, *args: object, real=real, name=name) -> torch.Tensor:
            result = real(inp, *args)
            seen[name] = (_storage(inp), _storage(result))
            return result

        setattr(functional, name, wrapped)
    out = {}
    try:
        for src, dst, name in [("S0", "R", "all_gather_into_tensor"),
                               ("S0", "S1", "all_to_all_single"),
                               ("P", "S0", "reduce_scatter_tensor")]:
            dt = sw.distribute_tensor(full, mesh, [_PLACE[src]])
            if src == "P":
                dt = sw.DTensor.from_local(full.clone(), mesh, [Partial()])
            got = dt.redistribute(placements=[_PLACE[dst]]).to_local()
            sent, received = seen.pop(name)
            out[src, dst] = (sent == _storage(dt.to_local()), received == _storage(got))
    finally:
        for name, real in saved.items():
            setattr(functional, name, real)
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_async_redistribute_waits_at_first_use(world: int) -> None:
    for rank, result in enumerate(run_in_processes(_async_program, world, timeout=180)):
        assert result.pop("worker_thread") is False, f"rank {rank}: a worker thread ran"
        # sent from the component itself where it lies as sent (S0: rows); S0 -> S1 lays its
        # columns out once; every result is the collective's own output
        assert result.pop("copies") == {("S0", "R"): (True, True), ("S0", "S1"): (False, True),
                                        ("P", "S0"): (True, True)}, rank
        for case, got in result.items():
            # nothing waited at issue, the op between ran first, the first use waited once
            assert got["events"] == ["issued", "between", "wait", "used", "again",
                                     "viewed", "wait", "summed"], (rank, case, got)
            assert got["pending_type"] == "AsyncDTensor", (rank, case, got)
            assert got["equal_oracle"] and got["equal_blocking"], (rank, case, got)
            assert got["local_sum"], (rank, case, got)


def _overlapping_gathers() -> dict:
    """Three S0 -> R redistributions issued before any is used, as fully_shard's prefetch and
    a program's own async_op calls overlap them: how many collectives were in flight at each
    gather's issue, and the values."""
    import torch.distributed as dist

    world = dist.get_world_size()
    mesh = sw.init_device_mesh("cpu", (world,))
    functional = torch.ops._c10d_functional
    real = functional.all_gather_into_tensor
    in_flight: list[int] = []

    def counted(*args: object) -> torch.Tensor:
        in_flight.append(torch._C._distributed_c10d._get_work_registry_size())
        return real(*args)

    fulls = [torch.arange(float(4 * world * (k + 1))).view(-1, 2) for k in range(3)]
    functional.all_gather_into_tensor = counted
    try:
        pending = [sw.distribute_tensor(f, mesh, [Shard(0)]).redistribute(
            placements=[Replicate()], async_op=True) for f in fulls]
        equal = [torch.equal(p.to_local() * 1, f) for p, f in zip(pending, fulls, strict=True)]
    finally:
        functional.all_gather_into_tensor = real
    return {"in_flight": in_flight, "equal": equal}


def test_gloo_gathers_never_overlap_on_one_group() -> None:
    """gloo corrupts the heap when two all_gather_into_tensor are in flight on one group
    (torch 2.13: malloc aborts within seconds of overlapping gathers, as one CI run did in
    fully_shard's prefetch): each gather on a gloo group waits for the one before it, so none
    is in flight at the next's issue; the results are still the oracle's."""
    for rank, got in enumerate(run_in_processes(_overlapping_gathers, 2, timeout=120)):
        assert got["equal"] == [True] * 3, rank
        assert got["in_flight"] == [0, 0, 0], (rank, got["in_flight"])


def _fsdp_backward() -> dict:
    """Three fully_shard units (no prefetch, parameters kept gathered after forward, so
    backward issues reduce-scatters only): the collectives in flight when the first layer's
    gradient arrives (the later units' reduce-scatters, issued mid-backward), the same after
    backward, and the gradients against one device's."""
    import torch.distributed as dist
    from torch import nn

    from shardwise.parallel import fully_shard

    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = sw.init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(),
                              nn.Linear(8, 4))
    model = nn.Sequential(*[m for m in __import__("copy").deepcopy(reference)])
    for layer in model[::2]:
        fully_shard(layer, mesh=mesh, reshard_after_forward=False)
    fully_shard(model, mesh=mesh, reshard_after_forward=False)
    model.set_implicit_prefetch(0, 0)
    batch = torch.randn(4 * world, 6, generator=torch.Generator().manual_seed(1))
    in_flight: list[int] = []
    registry = torch._C._distributed_c10d._get_work_registry_size
    model[0].weight.register_hook(lambda g: in_flight.append(registry()))
    model(batch.chunk(world)[rank]).pow(2).mean().backward()
    after = registry()
    reference(batch).pow(2).mean().backward()
    close = [torch.allclose(p.grad.full_tensor(), q.grad, atol=1e-6)
             for p, q in zip(model.parameters(), reference.parameters(), strict=True)]
    plain = [type(p.grad.to_local()) is torch.Tensor for p in model.parameters()]
    return {"in_flight": in_flight, "after": after, "close": close, "plain": plain}


@pytest.mark.parametrize("world", [2, 4])
def test_fully_shard_leaves_gradient_reduce_scatters_in_flight(world: int) -> None:
    """As FSDP2's reduce-scatter stream: a unit's packed gradient reduce-scatter is issued
    when its last gradient arrives and left in flight while backward computes the earlier
    units' gradients (the blocking reduction had none in flight there); when backward ends
    every one is waited and each gradient is a plain local tensor with one device's value."""
    for rank, got in enumerate(run_in_processes(_fsdp_backward, world, timeout=180)):
        assert got["in_flight"] and got["in_flight"][0] >= 2, (rank, got["in_flight"])
        assert got["after"] == 0, (rank, got)
        assert all(got["close"]) and all(got["plain"]), (rank, got)


def _views_of_pending_dtensors() -> dict:
    """PyTorch's test_dtensor_async_output: a view of the pending DTensor itself stays
    unwaited too, its ``to_local()`` torch's ``AsyncCollectiveTensor``."""
    import torch.distributed as dist
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = sw.init_device_mesh("cpu", (world,))
    full = torch.arange(8.0 * world * world).reshape(4 * world, 2 * world)
    dt = sw.distribute_tensor(full, mesh, [Shard(0)])
    pending = dt.redistribute(mesh, [Replicate()], async_op=True)
    viewed = pending.view(pending.shape)
    local = viewed.to_local()
    found = {
        "local": type(local) is AsyncCollectiveTensor,
        "completed": local.completed,
        "flat": type(local.view(-1)) is AsyncCollectiveTensor,
        "transposed": pending.t().placements == (Replicate(),),
    }
    used = local.view(-1) + 1  # the first use that is not a view waits
    found["used"] = type(used) is torch.Tensor and torch.equal(used, full.view(-1) + 1)
    found["pending_value"] = torch.equal(pending.to_local(), full)
    sharded = dt.redistribute(mesh, [Shard(1)], async_op=True).view(4 * world, 2 * world)
    found["sharded"] = torch.equal(sharded.to_local(), full.chunk(world, 1)[rank])
    found["sync"] = type(dt.redistribute(mesh, [Replicate()]).to_local()) is torch.Tensor
    return found


def test_a_view_of_a_pending_dtensor_stays_unwaited() -> None:
    for found in run_in_processes(_views_of_pending_dtensors, 4, timeout=120):
        assert found == {"local": True, "completed": False, "flat": True, "transposed": True,
                         "used": True, "pending_value": True, "sharded": True, "sync": True}
