"""The execution context (``shardwise.execution``): declared once per mode by whoever makes it
(the process, rank threads, ``Strategy.run``), shown in the mesh's repr and in errors about
plain tensors, carried by one setting that no thread or ``with`` block leaks, and holding the
one transport its point-to-point messages take."""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch

import shardwise as sw
import shardwise.distribute as swd
from mp_harness import run_in_processes
from shardwise import comm, execution, settings
from shardwise.comm import transport, wire
from shardwise.execution import Kind, View
from shardwise.placements import Partial, Replicate, Shard
from shardwise.rank_threads import run_threads

TIMEOUT = 120.0


def test_embedded_context_acts_for_every_device_in_the_global_view() -> None:
    mesh = sw.DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=("dp", "tp"))
    ctx = execution.of(mesh)
    assert (ctx.kind, ctx.rank, ctx.world) == (Kind.EMBEDDED, 0, 1)
    assert ctx.devices == (0, 1, 2, 3) and ctx.view is View.GLOBAL
    assert ctx.transport is None and wire.transport() is wire.BACKEND
    assert repr(mesh) == (
        "DeviceMesh('cpu', [[0, 1], [2, 3]], mesh_dim_names=('dp', 'tp')) "
        "[embedded, acting for devices [0, 1, 2, 3], global view]"
    )
    # a mesh of one device: the plain tensor is that device's data (DESIGN.md's rule)
    assert execution.plain_view(sw.DeviceMesh("cpu", [0])) is View.PER_RANK
    # a plain tensor beside DTensors: the error says who this program is
    dt = sw.distribute_tensor(torch.ones(4, 2), mesh, [sw.Shard(0), sw.Replicate()])
    with pytest.raises(sw.errors.MeshError) as err:
        dt + torch.ones(4, 2)
    assert (f"this program acts for devices [0, 1, 2, 3] of {mesh!r}" in str(err.value)
            and "global view" in str(err.value))


def test_a_declared_context_stays_in_its_thread_and_with_block() -> None:
    made = execution.ExecutionContext(Kind.RANK_THREAD, 3, 4)
    seen: dict[str, execution.ExecutionContext] = {}

    def other_thread() -> None:
        seen["thread"] = execution.current()

    with settings.EXECUTION.override(made):
        assert execution.current() is made
        t = threading.Thread(target=other_thread)
        t.start()
        t.join()
    assert seen["thread"].kind is Kind.EMBEDDED  # a new thread sees the process's context
    assert execution.current().kind is Kind.EMBEDDED  # the block undid it


def test_replica_threads_declare_their_device_and_the_per_rank_view() -> None:
    s = swd.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"])
    mesh = s.extended.mesh

    def fn() -> tuple:
        ctx = execution.of(mesh)
        i = swd.get_replica_context().replica_id_in_sync_group
        return (i, ctx.kind, ctx.devices, ctx.view, execution.plain_view(mesh), repr(mesh))

    results = s.experimental_local_results(s.run(fn))
    local = mesh.local_device_ids
    for i, (index, kind, devices, view, plain, text) in enumerate(results):
        assert index == i and kind is Kind.REPLICA_THREAD
        assert devices == (local[i],) and view is plain is View.PER_RANK
        assert f"[replica thread {i} of 3, embedded, acting for devices [{local[i]}], " \
               f"per-rank view]" in text
    # the caller's context is its own again
    assert execution.of(mesh).kind is Kind.EMBEDDED and execution.of(mesh).view is View.GLOBAL


class _Counting:
    """A transport that counts the messages it carries for the one it wraps."""

    name = "counting"

    def __init__(self, inner: execution.Transport) -> None:
        self.inner, self.sent, self.received = inner, 0, 0

    def send(self, tensor, peer, ranks, tag):
        self.sent += 1
        return self.inner.send(tensor, peer, ranks, tag)

    def receive(self, buffer, peer, ranks, tag):
        self.received += 1
        return self.inner.receive(buffer, peer, ranks, tag)

    def wait(self, work, timeout) -> None:
        self.inner.wait(work, timeout)


def _rank_thread_program() -> dict:
    mesh = sw.init_device_mesh("cpu", (2,))
    ctx = execution.of(mesh)
    rank = torch.distributed.get_rank()
    # four devices over two ranks: two each, so a plain tensor is global there, and a
    # collective over all four goes point to point, through the context's transport
    wide = sw.DeviceMesh("cpu", [0, 1, 2, 3])
    counting = _Counting(ctx.transport)
    mine = [torch.full((3,), 10.0 * d) for d in wide.local_device_ids]
    with settings.EXECUTION.override(
            execution.rank_thread(ctx.rank, ctx.world, counting)):
        summed = comm.all_reduce(wide, 0, mine)
    first = sw.DeviceMesh("cpu", [0])  # rank 0's device only: rank 1 acts for none of it
    try:
        outside = execution.plain_view(first, "a plain batch").value
    except sw.errors.MeshError as err:
        outside = str(err)
    return {
        "outside": outside,
        "kind": ctx.kind, "rank": (ctx.rank, rank), "world": ctx.world,
        "devices": ctx.devices, "view": ctx.view, "transport": ctx.transport,
        "wide": (execution.of(wide).devices, execution.plain_view(wide)),
        "repr": repr(mesh), "summed": [t.tolist() for t in summed],
        "messages": (counting.sent, counting.received),
        "group transports": [[t.name for t, _ in transport.routes(m, 0)] for m in (mesh, wide)],
    }


def test_rank_threads_declare_their_rank_and_share_the_mailbox_transport() -> None:
    out = run_threads(_rank_thread_program, 2, timeout=TIMEOUT)
    oracle = sum(10.0 * d for d in range(4))
    for r, got in enumerate(out):
        assert got["kind"] is Kind.RANK_THREAD and got["rank"] == (r, r) and got["world"] == 2
        assert got["devices"] == (r,) and got["view"] is View.PER_RANK
        assert got["transport"].name == "mailbox"
        assert got["wide"] == ((2 * r, 2 * r + 1), View.GLOBAL)
        assert got["repr"] == (f"DeviceMesh('cpu', [0, 1]) [rank thread {r} of 2, acting for "
                               f"devices [{r}], per-rank view]")
        assert got["summed"] == [[oracle] * 3, [oracle] * 3]
        assert got["messages"][0] > 0 and got["messages"][1] > 0
        assert got["group transports"] == [["backend"], ["point to point"]]
    assert out[0]["outside"] == "per-rank view"
    assert out[1]["outside"].startswith(
        "a plain batch given for DeviceMesh('cpu', [0]): this program acts for no device of "
        "DeviceMesh('cpu', [0]) [rank thread 1 of 2, acting for no device of it]")
    # one mailbox, made once for the run
    assert out[0]["transport"].mailbox is out[1]["transport"].mailbox
    assert execution.current().kind is Kind.EMBEDDED  # nothing leaked into the caller


def _process_program() -> dict:
    mesh = sw.init_device_mesh("cpu", (2,))
    ctx = execution.of(mesh)
    dt = sw.distribute_tensor(torch.ones(4, 2), mesh, [sw.Shard(0)])
    try:
        dt + torch.ones(2, 2)
        message = ""
    except sw.errors.MeshError as err:
        message = str(err)
    wide = sw.DeviceMesh("cpu", [0, 1, 2, 3])
    return {
        "kind": ctx.kind.value, "rank": ctx.rank, "world": ctx.world, "devices": ctx.devices,
        "view": ctx.view.value, "backend": wire.transport() is wire.BACKEND,
        "wide": (execution.of(wide).devices, execution.plain_view(wide).value),
        "repr": repr(mesh), "str": str(mesh), "message": message,
    }


@pytest.mark.slow
def test_per_rank_processes_declare_their_rank_and_the_backend_transport() -> None:
    out = run_in_processes(_process_program, 2, timeout=TIMEOUT)
    for r, got in enumerate(out):
        assert (got["kind"], got["rank"], got["world"]) == ("per-rank process", r, 2)
        assert got["devices"] == (r,) and got["view"] == "per-rank view" and got["backend"]
        assert got["wide"] == ((2 * r, 2 * r + 1), "global view")
        assert got["repr"] == (f"DeviceMesh('cpu', [0, 1]) [per-rank process {r} of 2, acting "
                               f"for devices [{r}], per-rank view]")
        assert f"this program acts for devices [{r}] of {got['repr']}" in got["message"]
        # messages name the mesh alike in every process (their descriptions are compared)
        assert got["str"] == "DeviceMesh('cpu', [0, 1])"


class _CountingGroups:
    """A group transport that notes every collective it carries (its name, the method, the
    mesh dim) for the one it wraps."""

    def __init__(self, inner: transport.GroupTransport, seen: list) -> None:
        self.inner, self.name, self.seen = inner, inner.name, seen

    def __getattr__(self, method: str):
        carry = getattr(self.inner, method)

        def counted(mesh, mesh_dim, *args):
            self.seen.append((self.name, method, mesh_dim))
            return carry(mesh, mesh_dim, *args)

        return counted


_RECORDED_AS = {"all_gather_tensor": "all_gather", "all_to_all_tensor": "all_to_all"}


def _redistributions_through_the_context() -> dict:
    """Redistributions on a 1-D mesh of four devices and a 2 x 2 mesh, under a context whose
    group transports count what they carry, beside a ``CommCounter``."""
    seen: list = []
    counting = transport.Transports(*(_CountingGroups(t, seen) for t in (
        transport.IN_PROCESS, transport.BACKEND, transport.POINT_TO_POINT)))
    x = torch.arange(96, dtype=torch.float64).reshape(8, 12)
    moves = [(Shard(0), Shard(1)), (Shard(1), Replicate()), (Partial(), Replicate()),
             (Partial(), Shard(0))]
    todo = []
    for mesh in (sw.DeviceMesh("cpu", [0, 1, 2, 3]), sw.DeviceMesh("cpu", [[0, 1], [2, 3]])):
        for before, after in moves:
            for m in range(mesh.ndim):
                src, dst = [Replicate()] * mesh.ndim, [Replicate()] * mesh.ndim
                src[m], dst[m] = before, after
                todo.append((sw.distribute_tensor(x, mesh, src), dst))
    context = dataclasses.replace(execution.current(), group_transports=counting)
    with settings.EXECUTION.override(context), comm.CommCounter() as counter:
        outs = [dt.redistribute(placements=dst) for dt, dst in todo]
    return {
        "seen": seen, "records": [(r.kind, r.mesh_dim) for r in counter.records],
        "equal": [torch.equal(out.full_tensor(), x) for out in outs],
    }


def _check_counted(got: dict, names: set[str]) -> None:
    assert all(got["equal"]) and len(got["equal"]) == 12
    # every collective of the redistributions went through the context's group transports
    assert [(_RECORDED_AS.get(method, method), dim) for _, method, dim in got["seen"]] == \
        got["records"]
    assert {name for name, _, _ in got["seen"]} == names


def test_every_collective_goes_through_the_contexts_group_transports_embedded() -> None:
    _check_counted(_redistributions_through_the_context(), {"in process"})


def test_every_collective_goes_through_the_contexts_group_transports_in_rank_threads() -> None:
    for got in run_threads(_redistributions_through_the_context, 2, timeout=TIMEOUT):
        _check_counted(got, {"in process", "backend", "point to point"})


@pytest.mark.slow
def test_every_collective_goes_through_the_contexts_group_transports_in_processes() -> None:
    for got in run_in_processes(_redistributions_through_the_context, 2, timeout=TIMEOUT):
        _check_counted(got, {"in process", "backend", "point to point"})
