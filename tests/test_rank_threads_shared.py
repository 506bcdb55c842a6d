"""Rank threads fail loudly: a signal to ``python -m shardwise.launch --threads`` stops ranks
stuck in collectives at once, a failing rank exits 1 with its traceback (never an abort at
interpreter exit), a rank thread cannot change what its process holds once for every rank
(the working directory, torch's default dtype...), and a thread a rank starts acts for that
rank."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from shardwise import process_wide
from shardwise.errors import ProcessStateError
from shardwise.rank_threads import RankFailedError, run_threads

ROOT = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
TIMEOUT = 120.0

COLLECTIVES = """
import torch, torch.distributed as dist
import shardwise as sw
mesh = sw.init_device_mesh("cpu", (2,))
x = sw.distribute_tensor(torch.arange(8.0), mesh, [sw.Shard(0)])
print("started", flush=True)
while True:
    dist.all_reduce(torch.ones(100))
    x = x.redistribute(mesh, [sw.Replicate()]).redistribute(mesh, [sw.Shard(0)])
"""

FAILS = """
import torch, torch.distributed as dist
import shardwise as sw
mesh = sw.init_device_mesh("cpu", (2,))
x = sw.distribute_tensor(torch.arange(8.0), mesh, [sw.Shard(0)]).full_tensor()
if dist.get_rank() == 1:
    raise ValueError("rank 1 is broken")
dist.all_reduce(torch.ones(3))
"""


def _threads_launcher(script: Path, ignore_sigint: bool = False) -> subprocess.Popen:
    def ignored() -> None:  # as a shell starts a background job: SIGINT ignored
        signal.signal(signal.SIGINT, signal.SIG_IGN)

    return subprocess.Popen(
        [sys.executable, "-m", "shardwise.launch", "--nproc", "2", "--threads", str(script)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV, cwd=ROOT,
        preexec_fn=ignored if ignore_sigint else None,
    )


@pytest.mark.parametrize(("signum", "ignore_sigint"), [
    (signal.SIGINT, True), (signal.SIGINT, False), (signal.SIGTERM, False)],
    ids=["SIGINT-background", "SIGINT", "SIGTERM"])
def test_a_signal_stops_rank_threads_in_collectives(
    tmp_path: Path, signum: int, ignore_sigint: bool
) -> None:
    script = tmp_path / "loop.py"
    script.write_text(COLLECTIVES)
    proc = _threads_launcher(script, ignore_sigint)
    try:
        for _ in range(2):
            assert proc.stdout.readline() == "started\n", proc.stderr.read()[-2000:]
        time.sleep(0.5)  # well inside the collectives
        proc.send_signal(signum)
        sent = time.monotonic()
        proc.wait(timeout=15)
        took = time.monotonic() - sent
    finally:
        proc.kill()
        proc.wait()
    err = proc.stderr.read()
    assert proc.returncode == 128 + signum, err[-2000:]
    assert f"received {signal.Signals(signum).name}; stopped the rank threads" in err
    assert took < 5.0, took


def test_a_failing_rank_exits_1_with_its_traceback_every_time(tmp_path: Path) -> None:
    script = tmp_path / "fails.py"
    script.write_text(FAILS)
    for _ in range(3):  # the abort at exit came in most runs
        proc = _threads_launcher(script)
        _, err = proc.communicate(timeout=TIMEOUT)
        assert proc.returncode == 1, err[-2000:]
        assert "rank 1 of 2 rank threads failed with ValueError: rank 1 is broken" in err
        assert f'File "{script}", line 7, in <module>' in err
        assert "terminate called" not in err


# ----- process-wide state ---------------------------------------------------------------------


def _change(what: str, where: str) -> str:
    """Rank 1 changes ``what``; both ranks first set it to its current value (allowed)."""
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ["RANK"])
    same, other = {
        "chdir": (lambda: os.chdir(os.getcwd()), lambda: os.chdir(where)),
        "default_dtype": (lambda: torch.set_default_dtype(torch.get_default_dtype()),
                          lambda: torch.set_default_dtype(torch.float64)),
        "default_device": (lambda: torch.set_default_device("cpu"),
                           lambda: torch.set_default_device("meta")),
        "num_threads": (lambda: torch.set_num_threads(torch.get_num_threads()),
                        lambda: torch.set_num_threads(torch.get_num_threads() + 1)),
        "deterministic": (lambda: torch.use_deterministic_algorithms(False),
                          lambda: torch.use_deterministic_algorithms(True)),
        "matmul_precision": (lambda: torch.set_float32_matmul_precision("highest"),
                             lambda: torch.set_float32_matmul_precision("medium")),
    }[what]
    same()
    if rank == 1:
        other()
    return str(torch.zeros(1).dtype)


WHAT = ["chdir", "default_dtype", "default_device", "num_threads", "deterministic",
        "matmul_precision"]


@pytest.mark.parametrize("what", WHAT)
def test_a_rank_thread_cannot_change_process_wide_state(tmp_path: Path, what: str) -> None:
    before = (os.getcwd(), torch.get_default_dtype(), torch.get_default_device(),
              torch.get_num_threads(), torch.are_deterministic_algorithms_enabled(),
              torch.get_float32_matmul_precision())
    with pytest.raises(RankFailedError, match="rank 1 of 2") as info:
        run_threads(_change, 2, what, str(tmp_path), timeout=TIMEOUT)
    error = info.value.__cause__
    assert isinstance(error, ProcessStateError), error
    assert "rank thread 1 of 2" in str(error) and "one per process" in str(error)
    after = (os.getcwd(), torch.get_default_dtype(), torch.get_default_device(),
             torch.get_num_threads(), torch.are_deterministic_algorithms_enabled(),
             torch.get_float32_matmul_precision())
    assert after == before


def test_the_guards_are_gone_after_the_run() -> None:
    originals = [getattr(m, n) for m, n, _, _ in process_wide._GUARDED]
    start = threading.Thread.start
    assert run_threads(_change, 2, "chdir", os.getcwd(), timeout=TIMEOUT) == ["torch.float32"] * 2
    assert [getattr(m, n) for m, n, _, _ in process_wide._GUARDED] == originals
    assert threading.Thread.start is start


def _helper_sees() -> dict:
    dist.init_process_group("gloo")
    seen: dict = {}

    def helper() -> None:
        seen["RANK"] = os.environ.get("RANK")
        seen["initialized"] = dist.is_initialized()
        seen["rank"] = dist.get_rank() if dist.is_initialized() else None
        torch.manual_seed(int(os.environ.get("RANK", "9")))

    thread = threading.Thread(target=helper)
    thread.start()
    thread.join()
    seen["own_rank"] = dist.get_rank()
    seen["seeded"] = torch.initial_seed()  # the helper seeded this rank's generator
    return seen


def test_a_thread_started_by_a_rank_acts_for_that_rank() -> None:
    seen = run_threads(_helper_sees, 2, timeout=TIMEOUT)
    assert seen == [{"RANK": str(r), "initialized": True, "rank": r, "own_rank": r, "seeded": r}
                    for r in range(2)]


def _settings_per_rank() -> tuple:
    import shardwise as sw

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if rank == 1:
        sw.config.set_collective_timeout(7.0)
        sw.config.set_debug_checks(True)
    dist.barrier()  # rank 0 reads after rank 1 set its own
    seen: list = []
    thread = threading.Thread(target=lambda: seen.append(sw.config.get_collective_timeout()))
    thread.start()
    thread.join()
    from shardwise import settings

    return sw.config.get_collective_timeout(), settings.DEBUG_CHECKS.get(), seen[0]


def test_shardwise_settings_set_in_a_rank_thread_are_that_ranks() -> None:
    import shardwise as sw
    from shardwise import settings

    before = (sw.config.get_collective_timeout(), settings.DEBUG_CHECKS.get())
    got = run_threads(_settings_per_rank, 2, timeout=TIMEOUT)
    assert got == [(before[0], before[1], before[0]), (7.0, True, 7.0)]
    assert (sw.config.get_collective_timeout(), settings.DEBUG_CHECKS.get()) == before
