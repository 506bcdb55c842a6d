"""The agreement board (``comm/board.py``): processes of one host post their agreement
fingerprints in shared memory. A board over one process's memory checks the protocol (equal
and different words, a member not yet there, a lapped ring, a dead member, the timeout); two
and four processes check the setup (nothing left in /dev/shm, processes of other hosts agreeing
by the host tree with the same results) and a peer that dies while the others wait."""

from __future__ import annotations

import mmap
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import shardwise as sw
from mp_harness import run_in_processes
from shardwise import Replicate, Shard, settings
from shardwise.comm import board
from shardwise.errors import CollectiveError, CollectiveTimeoutError

ROOT = Path(__file__).resolve().parents[1]


def _board(pids: tuple[int, ...]) -> board.Board:
    words = memoryview(bytearray(8 * (board.HEADER + len(pids) * board.SLOTS))).cast("Q")
    return board.Board(words, 0, pids)


def _what() -> str:
    return "all_gather on mesh dim 0"


def test_posted_words_agree_or_differ() -> None:
    b = _board((os.getpid(), os.getpid()))
    peer = board.Board(b.words, 1, b.pids)
    for word in (5, 7, (1 << 56) - 1):
        n = b.post(word)
        assert peer.post(word) == n
        assert b.wait(n, word, (0, 1), _what) and peer.wait(n, word, (0, 1), _what)
    n = b.post(11)
    peer.post(12)
    assert not b.wait(n, 11, (0, 1), _what)
    assert not peer.wait(n, 12, (0, 1), _what)


def test_a_member_not_there_times_out_naming_it() -> None:
    b = _board((os.getpid(), os.getpid(), os.getpid()))
    board.Board(b.words, 2, b.pids).post(3)
    n = b.post(3)
    start = time.monotonic()
    with settings.COLLECTIVE_TIMEOUT.override(0.3), pytest.raises(
            CollectiveTimeoutError, match=r"rank\(s\) \[11\] did not take part"):
        b.wait(n, 3, (10, 11, 12), _what)
    assert time.monotonic() - start < 5


def test_a_dead_member_fails_the_wait_at_once() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    b = _board((os.getpid(), child.pid))
    n = b.post(3)
    start = time.monotonic()
    with pytest.raises(CollectiveError, match=f"rank 1 \\(pid {child.pid}\\) exited"):
        b.wait(n, 3, (0, 1), _what)
    assert time.monotonic() - start < 5


def test_a_lapped_ring_raises() -> None:
    b = _board((os.getpid(), os.getpid()))
    peer = board.Board(b.words, 1, b.pids)
    first = b.post(1)
    for _ in range(board.SLOTS + 1):
        peer.post(1)
    with pytest.raises(CollectiveError, match="lapped"):
        b.wait(first, 1, (0, 1), _what)


@pytest.mark.skipif(board._SYS_FUTEX is None, reason="no futex system call known here")
def test_a_waiter_sleeps_in_the_kernel_until_the_last_word_is_posted() -> None:
    """The waiter takes (almost) no CPU while its peer is late and returns at the post; the
    polling it replaced (a sleep of up to 0.1 ms between looks) took about 80 ms of CPU in
    this wait."""
    pids = (os.getpid(), os.getpid())
    shared = mmap.mmap(-1, 8 * (board.HEADER + 2 * board.SLOTS))
    words = memoryview(shared).cast("Q")
    waiter = board.Board(words, 0, pids, wake=board.Futex(shared, 8))
    late = board.Board(words, 1, pids, wake=board.Futex(shared, 8))
    n = waiter.post(9)
    seen: dict = {}

    def wait() -> None:
        cpu = time.thread_time()
        seen["same"] = waiter.wait(n, 9, (0, 1), _what)
        seen["cpu"], seen["at"] = time.thread_time() - cpu, time.monotonic()

    thread = threading.Thread(target=wait)
    thread.start()
    time.sleep(0.5)
    posted = time.monotonic()
    late.post(9)
    thread.join(10)
    assert seen["same"]
    assert seen["at"] - posted < 0.05, seen
    assert seen["cpu"] < 0.01, seen


def _boards_and_values(other_host: bool) -> dict:
    """A few redistributions; whether the agreement went through a board and what /dev/shm
    holds of shardwise afterwards. ``other_host``: rank 1 says it runs on another host."""
    if other_host and dist.get_rank() == 1:
        board._host = lambda: "elsewhere"
    mesh = sw.init_device_mesh("cpu", (dist.get_world_size(),))
    full = torch.arange(48.0).reshape(8, 6)
    x = sw.distribute_tensor(full, mesh, [Shard(0)])
    got = [x.redistribute(placements=[Shard(1)]).full_tensor(),
           x.redistribute(placements=[Replicate()]).to_local(),
           sw.DTensor.from_local(full, mesh, [sw.Partial()]).full_tensor()]
    from shardwise.comm import agreement
    made = [b for _, b in agreement._boards.get().values()]
    boards = [getattr(b, "board", b) for b in made]
    left = [b.path for b in boards if b is not None and os.path.exists(b.path)]
    return {"got": got, "kinds": [type(b).__name__ for b in made], "left": left}


@pytest.mark.slow
@pytest.mark.parametrize("world,other_host", [(2, False), (4, False), (2, True)])
def test_processes_of_one_host_share_a_board(world: int, other_host: bool) -> None:
    full = torch.arange(48.0).reshape(8, 6)
    for rank, out in enumerate(run_in_processes(_boards_and_values, world, other_host,
                                                timeout=120)):
        # on two hosts, one process each: the host tree, with no board
        assert out["kinds"] == ["HostTree" if other_host else "Board"], f"rank {rank}: {out}"
        assert out["left"] == [], f"rank {rank}: {out['left']}"
        torch.testing.assert_close(out["got"], [full, full, full * world], rtol=0, atol=0)


_DIES = """
import os, time, torch, torch.distributed as dist
import shardwise as sw
from shardwise import Replicate, Shard
from shardwise.errors import CollectiveError
dist.init_process_group("gloo")
mesh = sw.init_device_mesh("cpu", (2,))
x = sw.distribute_tensor(torch.ones(4, 2), mesh, [Shard(0)])
x.redistribute(placements=[Replicate()])  # the board is set up
if dist.get_rank() == 1:
    os._exit(0)
sw.config.set_collective_timeout(60)
start = time.monotonic()
try:
    x.redistribute(placements=[Replicate()])
except CollectiveError as err:
    print(f"{type(err).__name__} after {time.monotonic() - start:.1f} s: {err}")
"""


@pytest.mark.slow
def test_a_peer_that_dies_fails_the_wait_long_before_the_timeout(tmp_path: Path) -> None:
    script = tmp_path / "dies.py"
    script.write_text(_DIES)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), "WORLD_SIZE": "2"}
    ranks = [subprocess.Popen([sys.executable, str(script)], env={**env, "RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(2)]
    try:
        text = ranks[0].communicate(timeout=90)[0]
    finally:
        for rank in ranks:
            rank.kill()
    assert "CollectiveError after" in text and "exited while rank 0 waited" in text, text
    seconds = float(text.split("after ")[1].split(" s")[0])
    assert seconds < 10, text
