"""``python -m shardwise.launch`` stops what it started: a signal to the launcher reaches every
rank and what the ranks started, ``--timeout`` ends a hung run and names the ranks still
running, and bad arguments are refused in one line."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, PYTHONPATH=str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))

# each rank starts a grandchild that sleeps, writes both pids to a file, then sleeps (or, rank 0
# under HUNG_EXCEPT_0, exits at once)
PROGRAM = """
import os, subprocess, sys, time
grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
rank = os.environ["RANK"]
path = os.path.join(sys.argv[1], f"pids{rank}")
with open(path + ".tmp", "w") as f:
    f.write(f"{os.getpid()} {grandchild.pid}")
os.replace(path + ".tmp", path)
if os.environ.get("HUNG_EXCEPT_0") and rank == "0":
    sys.exit(0)
time.sleep(120)
"""


def _alive(pid: int) -> bool:
    """Running, not a zombie (an orphan's zombie waits for a reaper this test does not own)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def _pids(folder: Path, nproc: int, timeout: float = 60) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        files = [folder / f"pids{r}" for r in range(nproc)]
        if all(f.exists() for f in files):
            return [int(p) for f in files for p in f.read_text().split()]
        time.sleep(0.05)
    raise AssertionError(f"the ranks did not start within {timeout} s")


def _launcher(tmp_path: Path, nproc: int, *options: str, env: dict | None = None):
    script = tmp_path / "program.py"
    script.write_text(PROGRAM)
    return subprocess.Popen(
        [sys.executable, "-m", "shardwise.launch", "--nproc", str(nproc), *options, str(script),
         str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env or ENV, cwd=ROOT,
    )


def _gone_within(pids: list[int], seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if _alive(p)]


def _cleanup(launcher: subprocess.Popen, pids: list[int]) -> None:
    """Kill what this test started, whatever the launcher did."""
    for pid in [launcher.pid, *pids]:
        if _alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    launcher.communicate(timeout=30)


@pytest.mark.parametrize(
    ("nproc", "signum"), [(2, signal.SIGTERM), (4, signal.SIGHUP), (2, signal.SIGINT)]
)
def test_a_signal_to_the_launcher_stops_every_rank_and_grandchild(
    tmp_path: Path, nproc: int, signum: int
) -> None:
    launcher = _launcher(tmp_path, nproc)
    pids: list[int] = []
    try:
        pids = _pids(tmp_path, nproc)
        assert all(_alive(p) for p in pids)
        launcher.send_signal(signum)
        _, err = launcher.communicate(timeout=20)
        assert launcher.returncode == 128 + signum, err
        assert _gone_within(pids, 5) == []
        assert err.strip().splitlines()[-1] == (
            f"shardwise.launch: received {signal.Signals(signum).name}; stopped the processes"
        )
    finally:
        _cleanup(launcher, pids)


@pytest.mark.parametrize("nproc", [2, 4])
def test_timeout_stops_a_hung_run_and_names_the_ranks_still_running(
    tmp_path: Path, nproc: int
) -> None:
    launcher = _launcher(tmp_path, nproc, "--timeout", "3", env=dict(ENV, HUNG_EXCEPT_0="1"))
    pids: list[int] = []
    try:
        pids = _pids(tmp_path, nproc)
        start = time.monotonic()
        _, err = launcher.communicate(timeout=30)
        assert launcher.returncode == 124, err
        assert time.monotonic() - start < 3 + 10
        assert _gone_within(pids, 5) == []
        still = list(range(1, nproc))
        assert err.strip().splitlines()[-1] == (
            f"shardwise.launch: timed out after 3 s; stopped the processes still running: {still}"
        )
    finally:
        _cleanup(launcher, pids)


@pytest.mark.parametrize(
    ("options", "said"),
    [
        (["--nproc", "2", "--master-port", "70000"], "--master-port: a port is 1 to 65535"),
        (["--nproc", "2", "--master-port", "-1"], "--master-port: a port is 1 to 65535"),
        (["--nproc", "2", "--master-port", "http"], "--master-port: wants a port number"),
        (["--nproc", "0"], "--nproc/--nproc-per-node: must be at least 1, got 0"),
        (["--nproc", "two"], "--nproc/--nproc-per-node: wants a whole number"),
        (["--nproc", "2", "--timeout", "0"], "--timeout: must be a positive number of seconds"),
        (["--nproc", "2", "--timeout", "nan"], "--timeout: must be a positive number of seconds"),
        (["--nproc", "2", "--threads", "--timeout", "5"], "--timeout applies to processes"),
    ],
)
def test_bad_arguments_are_refused_in_one_line(options: list[str], said: str) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "shardwise.launch", *options, "never_run.py"],
        capture_output=True, text=True, timeout=60, env=ENV, cwd=ROOT,
    )
    assert run.returncode == 2, run.stderr
    assert "Traceback" not in run.stderr
    errors = [line for line in run.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and said in errors[0], run.stderr


# ----- the launcher's own end: killed, its output closed, ranks it could not start ----------


def test_ranks_and_their_children_die_with_a_killed_launcher(tmp_path: Path) -> None:
    """SIGKILL leaves the launcher no chance to stop anything: the ranks die by the kernel's
    parent-death signal, their children by the launcher's watchdog."""
    launcher = _launcher(tmp_path, 2)
    pids: list[int] = []
    try:
        pids = _pids(tmp_path, 2)
        assert all(_alive(p) for p in pids)
        launcher.kill()
        launcher.wait(timeout=30)
        assert _gone_within(pids, 5) == []
    finally:
        _cleanup(launcher, pids)


CHATTY = """
import sys, time
for i in range(200000):
    print(f"line {i} " + "x" * 100)
time.sleep(120)
"""


def _running_with(marker: str) -> list[int]:
    """Live processes (not this one) whose command line holds ``marker``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                command = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if marker.encode() in command and _alive(int(entry.name)):
                found.append(int(entry.name))
    return found


def test_a_closed_output_stops_the_ranks_instead_of_hanging(tmp_path: Path) -> None:
    """As ``launch ... | head -1``: the reader leaves after one line while the ranks print."""
    script = tmp_path / "chatty.py"
    script.write_text(CHATTY)
    launcher = subprocess.Popen(
        [sys.executable, "-m", "shardwise.launch", "--nproc", "2", str(script), str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV, cwd=ROOT,
    )
    try:
        assert launcher.stdout.readline().startswith("[")
        launcher.stdout.close()
        launcher.wait(timeout=30)
        err = launcher.stderr.read()
        assert launcher.returncode == 128 + signal.SIGPIPE, err
        assert err.strip().splitlines()[-1] == (
            "shardwise.launch: its output was closed; stopped the processes")
        assert "Traceback" not in err
        assert _gone_within(_running_with(str(tmp_path)), 5) == []
    finally:
        _cleanup(launcher, _running_with(str(tmp_path)))


def test_a_launcher_that_cannot_start_every_rank_stops_those_it_started(tmp_path: Path) -> None:
    script = tmp_path / "sleeps.py"
    script.write_text("import time\ntime.sleep(120)\n")

    def few_open_files() -> None:  # room for some of the 16 ranks' pipes, not all
        import resource

        resource.setrlimit(resource.RLIMIT_NOFILE,
                           (24, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))

    launcher = subprocess.Popen(
        [sys.executable, "-m", "shardwise.launch", "--nproc", "16", str(script), str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV, cwd=ROOT,
        preexec_fn=few_open_files,
    )
    try:
        _, err = launcher.communicate(timeout=60)
        assert launcher.returncode == 1, err
        last = err.strip().splitlines()[-1]
        assert re.fullmatch(r"shardwise\.launch: could not start process (\d+) of 16 \(\[Errno "
                            r"24\] Too many open files\); stopped the \1 already started", last)
        assert int(last.split("process ")[1].split()[0]) > 0  # some did start
        assert _gone_within(_running_with(str(tmp_path)), 5) == []
    finally:
        _cleanup(launcher, _running_with(str(tmp_path)))
