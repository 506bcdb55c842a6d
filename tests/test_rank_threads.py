"""Threads mode: the same per-rank program as N rank threads of one process and as N gloo
processes gives the same bits; single-device PyTorch is the oracle for the training loss."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import shardwise
from mp_harness import run_in_processes
from shardwise import Replicate, Shard
from shardwise.comm.wire import Mailbox, Turns
from shardwise.errors import CollectiveTimeoutError, InvalidArgumentError
from shardwise.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from shardwise.rank_threads import RankFailedError, run_threads

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = 120.0


def _init() -> int:
    """What a per-rank program does first: join the world (mp_harness has already)."""
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    return dist.get_rank()


def program_collectives(n: int) -> dict:
    rank = _init()
    assert int(os.environ["RANK"]) == rank and int(os.environ["WORLD_SIZE"]) == n
    assert dist.get_world_size() == n and dist.is_initialized()
    torch.manual_seed(100 + rank)  # each rank its own stream, as in processes
    mine = torch.randn(5, 7)
    summed = mine.clone()
    dist.all_reduce(summed)
    dist.barrier()
    mesh = shardwise.init_device_mesh("cpu", (n,))
    assert mesh.num_local_devices() == 1 and mesh.get_rank() == rank
    assert mesh.get_coordinate() == (rank,)
    d = shardwise.DTensor.from_local(mine, mesh, [Shard(0)])
    rounds = [d.redistribute(mesh, [Shard(1)]), d.redistribute(mesh, [Replicate()])]
    partial = shardwise.DTensor.from_local(mine, mesh, [shardwise.Partial()])
    rounds.append(partial.redistribute(mesh, [Shard(0)]))
    return {
        "drawn": mine, "all_reduce": summed,
        "rounds": [r.to_local() for r in rounds], "full": rounds[1].to_local(),
    }


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 16, generator=g), torch.randn(4, 8, generator=g)) for _ in range(3)]


def program_mlp(n: int) -> dict:
    _init()
    mesh = shardwise.init_device_mesh("cpu", (n,))
    model = parallelize_module(_mlp(), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for x, y in _batches():
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return {"losses": losses, "weights": [p.to_local().detach() for p in model.parameters()]}


def _single_device_losses() -> list[float]:
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for x, y in _batches():
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _same_bits(a: object, b: object) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _same_bits(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _same_bits(x, y)
    else:
        assert a == b


@pytest.mark.parametrize("n", [2, 4])
def test_collectives_and_redistribute_match_processes(n):
    threads = run_threads(program_collectives, n, n, timeout=TIMEOUT)
    procs = run_in_processes(program_collectives, n, n, timeout=TIMEOUT)
    _same_bits(threads, procs)
    # the oracle: each rank drew torch.manual_seed(100 + r); torch.randn(5, 7)
    drawn = [torch.Generator().manual_seed(100 + r) for r in range(n)]
    expected = [torch.randn(5, 7, generator=g) for g in drawn]
    for r in range(n):
        assert torch.equal(threads[r]["drawn"], expected[r])
        assert torch.allclose(threads[r]["all_reduce"], sum(expected))
        assert torch.equal(threads[r]["full"], torch.cat(expected))


@pytest.mark.parametrize("n", [2, 4])
def test_tensor_parallel_mlp_matches_processes_and_single_device(n):
    threads = run_threads(program_mlp, n, n, timeout=TIMEOUT)
    procs = run_in_processes(program_mlp, n, n, timeout=TIMEOUT)
    _same_bits(threads, procs)
    reference = _single_device_losses()
    for r in range(n):
        got = [float(v) for v in threads[r]["losses"]]
        assert got == pytest.approx(reference, rel=1e-5, abs=1e-6)


def program_random_on_a_2d_mesh() -> dict:
    """Random DTensor ops and collectives over sub-meshes (groups {0, 2} and {1, 3} made at the
    same time by different ranks), as torchtitan's dp x tp init does them."""
    _init()
    mesh = shardwise.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(7)  # the same seed on every rank, as random DTensor ops require
    w = shardwise.distribute_tensor(torch.zeros(8, 6), mesh, [Shard(0), Shard(1)])
    nn.init.normal_(w)
    w.uniform_()
    return {"w": w.full_tensor(), "after": torch.rand(3)}


def test_random_dtensor_ops_and_sub_mesh_groups_in_rank_threads():
    """Used to hang: the rank's generator was swapped in under one lock for the whole op,
    across the generator check's collective, and group creation took one lock for all ranks
    while a group's members met."""
    threads = run_threads(program_random_on_a_2d_mesh, 4, timeout=60)
    # the oracle: the same ops in the embedded mode (each shard drawn from its own stream)
    mesh = shardwise.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(7)
    w = shardwise.distribute_tensor(torch.zeros(8, 6), mesh, [Shard(0), Shard(1)])
    nn.init.normal_(w)
    w.uniform_()
    after = torch.rand(3)  # each rank's generator advanced as the embedded one does
    for r in range(4):
        assert torch.equal(threads[r]["w"], w.full_tensor())
        assert torch.equal(threads[r]["after"], after)


def _fails_on_rank_one(n: int) -> int:
    rank = _init()
    if rank == 1:
        raise ValueError("rank one broke")
    t = torch.ones(2)
    dist.all_reduce(t)  # rank 1 never comes: its closed group makes this fail, not hang
    return rank


def test_a_failing_rank_raises_in_the_caller():
    start = time.monotonic()
    with pytest.raises(RankFailedError, match="rank 1 of 3") as info:
        run_threads(_fails_on_rank_one, 3, 3, timeout=TIMEOUT)
    assert isinstance(info.value.__cause__, ValueError)
    assert time.monotonic() - start < 60


def _fails_before_a_redistribution(n: int) -> int:
    rank = _init()
    mesh = shardwise.init_device_mesh("cpu", (n,))
    d = shardwise.DTensor.from_local(torch.ones(2, 3), mesh, [Shard(0)])
    if rank == 1:
        raise ValueError("rank one broke")
    d.redistribute(mesh, [Replicate()])  # waits on rank 1's piece: fails when it leaves
    return rank


@pytest.mark.slow  # waits for the peers to notice (about 6 s)
def test_a_rank_failing_before_a_redistribution_stops_its_peers_at_once():
    start = time.monotonic()
    with pytest.raises(RankFailedError, match="rank 1 of 3") as info:
        run_threads(_fails_before_a_redistribution, 3, 3, timeout=TIMEOUT)
    assert isinstance(info.value.__cause__, ValueError)
    assert time.monotonic() - start < 30  # the collective timeout is far longer


def test_shardwise_messages_between_rank_threads_do_not_use_the_backend(monkeypatch):
    """Between rank threads shardwise's collectives hand their bytes over in memory
    (``comm.wire.Mailbox``), with the bits processes get (the tests above)."""

    def refuse(*args, **kwargs):
        raise AssertionError("a point-to-point message went through the backend")

    monkeypatch.setattr(dist, "isend", refuse)
    monkeypatch.setattr(dist, "irecv", refuse)
    threads = run_threads(program_collectives, 4, 4, timeout=TIMEOUT)
    background = run_threads(_redistribute_in_the_background, 4, timeout=TIMEOUT)
    drawn = [torch.randn(5, 7, generator=torch.Generator().manual_seed(100 + r))
             for r in range(4)]
    for r in range(4):
        assert torch.equal(threads[r]["full"], torch.cat(drawn))
        assert torch.equal(threads[r]["rounds"][0], torch.cat(drawn)[:, _cols(r)])
        assert torch.equal(background[r], torch.arange(24.0).view(4, 6) * 4)


def _redistribute_in_the_background() -> torch.Tensor:
    """An async redistribution runs on the rank's background worker, in the rank's context."""
    _init()
    mesh = shardwise.init_device_mesh("cpu", (4,))
    mine = shardwise.DTensor.from_local(torch.arange(24.0).view(4, 6), mesh, [shardwise.Partial()])
    return mine.redistribute(mesh, [Replicate()], async_op=True).to_local().wait()


def _cols(r: int) -> slice:
    """Rank ``r``'s columns of 7 split over 4 ranks (torch.chunk's sizes: 2, 2, 2, 1)."""
    return slice(2 * r, min(2 * r + 2, 7))


def test_mailbox_matches_in_posting_order_and_refuses_a_wrong_size():
    box = Mailbox()
    key = ((0, 1), 0, 1, 5)
    first, second = torch.arange(3.0), torch.arange(3.0) + 10
    sends = [box.send(first, key), box.send(second, key)]  # posted before any receive
    got = [torch.empty(3), torch.empty(3)]
    receives = [box.receive(g, key) for g in got]
    for work in sends + receives:
        assert work.wait(timedelta(seconds=1))
    assert torch.equal(got[0], first) and torch.equal(got[1], second)
    small = box.receive(torch.empty(2), key)  # posted first: the send completes it
    wrong = box.send(torch.ones(3), key)
    for work in (small, wrong):
        with pytest.raises(RuntimeError, match="12 bytes met a receive of 8 bytes"):
            work.wait(timedelta(seconds=1))


def test_mailbox_fails_what_waits_on_a_rank_that_left():
    box = Mailbox()
    waiting = box.receive(torch.empty(2), ((0, 1), 1, 0, 5))
    box.leave(1)
    with pytest.raises(RuntimeError, match="rank 1 has left without sending"):
        waiting.wait(timedelta(seconds=1))
    with pytest.raises(RuntimeError, match="rank 1 has left"):
        box.send(torch.ones(2), ((0, 1), 0, 1, 5)).wait(timedelta(seconds=1))
    with pytest.raises(RuntimeError, match="timed out"):
        box.receive(torch.empty(2), ((0, 1), 0, 1, 5)).wait(timedelta(seconds=0.05))


def test_turns_pass_between_ranks_and_never_wait_on_a_stuck_holder():
    """One rank runs at a time; one that waits for a turn while the holder keeps it (blocked
    where shardwise cannot see, say in the program's own gloo collective) runs after the
    patience instead of waiting forever."""
    turns = Turns(patience=0.05)
    order: list[str] = []
    first_holds = threading.Event()

    def first() -> None:
        turns.enroll()
        first_holds.set()
        time.sleep(0.3)  # keeps its turn, as if blocked in a collective
        order.append("first done")
        turns.leave()

    def second() -> None:
        first_holds.wait()
        start = time.monotonic()
        turns.enroll()  # no turn comes: runs anyway after the patience
        order.append(f"second ran after {time.monotonic() - start:.2f} s")
        turns.leave()

    threads = [threading.Thread(target=f) for f in (first, second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert order[0].startswith("second ran after 0.0") and order[1] == "first done", order
    # a turn given up goes to the rank waiting for one, at once
    turns = Turns(patience=5.0)
    turns.enroll()
    start = time.monotonic()
    got: list[float] = []
    waiter = threading.Thread(
        target=lambda: (turns.enroll(), got.append(time.monotonic() - start), turns.leave()))
    waiter.start()
    time.sleep(0.2)
    assert not got  # the turn is held
    turns.give()
    waiter.join(timeout=10)
    assert got and 0.15 < got[0] < 2.0, got
    turns.leave()


def _hangs(n: int) -> None:
    rank = _init()
    if rank == 0:
        time.sleep(30)


@pytest.mark.slow  # waits out a timeout
def test_a_hang_times_out_naming_the_ranks():
    with pytest.raises(CollectiveTimeoutError, match=r"rank threads \[0\] of 2"):
        run_threads(_hangs, 2, 2, timeout=3)


def test_threads_mode_refuses_a_multiprocess_world(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(InvalidArgumentError, match="does not combine with several processes"):
        run_threads(_init, 2)


def _intra_op() -> tuple[int, str | None]:
    return torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")


def test_rank_threads_get_one_intra_op_thread_as_torchrun_gives_processes(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert run_threads(_intra_op, 2, timeout=TIMEOUT) == [(1, "1")] * 2
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the user's choice stays
    threads = torch.get_num_threads()
    assert run_threads(_intra_op, 2, timeout=TIMEOUT) == [(threads, "3")] * 2


def test_rank_threads_leave_the_process_as_it_was():
    before, threads = torch.get_rng_state(), torch.get_num_threads()
    run_threads(program_collectives, 2, 2, timeout=TIMEOUT)
    assert torch.equal(torch.get_rng_state(), before)
    assert torch.get_num_threads() == threads
    assert not dist.is_initialized() and "RANK" not in os.environ


def test_launcher_threads_flag_runs_a_script(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(
        "import os, torch, torch.distributed as dist\n"
        "import shardwise\n"
        "mesh = shardwise.init_device_mesh('cpu', (int(os.environ['WORLD_SIZE']),))\n"
        "t = torch.tensor([float(dist.get_rank() + 1)])\n"
        "dist.all_reduce(t)\n"
        "print(f'rank {dist.get_rank()} sum {t.item():g} local {mesh.num_local_devices()}')\n"
    )
    run = subprocess.run(
        [sys.executable, "-m", "shardwise.launch", "--nproc", "3", "--threads", str(script)],
        capture_output=True, text=True, timeout=TIMEOUT, cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT / "src")),
    )
    assert run.returncode == 0, run.stderr
    assert sorted(run.stdout.splitlines()) == [f"rank {r} sum 6 local 1" for r in range(3)]
    failing = tmp_path / "fail.py"
    failing.write_text("import os\nif os.environ['RANK'] == '2':\n    raise KeyError('boom')\n")
    run = subprocess.run(
        [sys.executable, "-m", "shardwise.launch", "--nproc", "3", "--threads", str(failing)],
        capture_output=True, text=True, timeout=TIMEOUT, cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT / "src")),
    )
    assert run.returncode == 1 and "rank 2 of 3" in run.stderr and "boom" in run.stderr
