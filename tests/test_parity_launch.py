"""``python -m shardwise.launch``: rank-prefixed output, exit codes, and start-up no slower
than ``torchrun`` for the same empty program in the same run."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _launch(tmp_path: Path, program: str, nproc: int = 2, timeout: float = 90):
    script = tmp_path / "program.py"
    script.write_text(program)
    start = time.perf_counter()
    run = subprocess.run(
        [sys.executable, "-m", "shardwise.launch", "--nproc", str(nproc), str(script)],
        capture_output=True, text=True, timeout=timeout, cwd=ROOT,
    )
    return run, time.perf_counter() - start


def test_every_line_is_prefixed_with_its_rank(tmp_path):
    program = (
        "import os, sys\n"
        "r = os.environ['RANK']\n"
        "print(f'out {r} a'); print(f'out {r} b')\n"
        "print(f'err {r}', file=sys.stderr)\n"
    )
    run, _ = _launch(tmp_path, program, nproc=3)
    assert run.returncode == 0, run.stderr
    out = sorted(run.stdout.splitlines())
    assert out == sorted(f"[{r}] out {r} {x}" for r in range(3) for x in "ab")
    assert sorted(run.stderr.splitlines()) == [f"[{r}] err {r}" for r in range(3)]


def test_the_launcher_does_not_import_torch(tmp_path):
    run, _ = _launch(tmp_path, "print('ok')\n", nproc=1)
    assert run.stdout == "[0] ok\n"
    probe = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "shardwise.launch", "--nproc", "1",
         str(tmp_path / "program.py")],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )
    launcher_imports = [ln for ln in probe.stderr.splitlines() if "import time:" in ln]
    assert launcher_imports and not any(ln.rstrip().endswith("| torch") for ln in launcher_imports)


def test_failure_stops_the_others_quickly(tmp_path):
    program = "import os, sys, time\nif os.environ['RANK'] == '0':\n    sys.exit(5)\n"
    program += "time.sleep(60)\n"
    run, seconds = _launch(tmp_path, program)
    assert run.returncode == 5 and "process 0 exited with code 5" in run.stderr
    assert seconds < 30


@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun is not installed")
def test_empty_program_starts_no_slower_than_torchrun(tmp_path):
    empty = tmp_path / "empty.py"
    empty.write_text("")
    timings = {}
    for name, command in (
        ("launch", [sys.executable, "-m", "shardwise.launch", "--nproc", "2", str(empty)]),
        ("torchrun", [shutil.which("torchrun"), "--nproc_per_node", "2", str(empty)]),
    ):
        start = time.perf_counter()
        subprocess.run(command, check=True, capture_output=True, timeout=120, cwd=ROOT)
        timings[name] = time.perf_counter() - start
    assert timings["launch"] <= timings["torchrun"], timings
