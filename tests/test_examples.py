"""Every script in ``examples/`` runs to completion (each accepts ``--steps N``; a few steps
here) and exits 0, which each does only when its sharded run matches its single-device run;
the same scripts under the launcher, as their docstrings run them: 2 and 4 processes and 4 rank
threads (one device per rank)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))
# 2 and 4 processes and 4 rank threads, as the docstrings say (tp_tutorial.py and
# distribute_mirrored.py at 2: test_tp_tutorial_runs_over_two_processes, test_example_runs)
LAUNCHED = [
    (script, mode)
    for script in EXAMPLES
    for mode in (["--nproc", "2"], ["--nproc", "4"], ["--nproc", "4", "--threads"])
    if mode != ["--nproc", "2"] or script.name not in ("distribute_mirrored.py", "tp_tutorial.py")
]


def _run(args: list[str]) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=280
    )


@pytest.mark.timeout(300)
@pytest.mark.parametrize("script", EXAMPLES, ids=lambda p: p.name)
def test_example_runs(script: Path) -> None:
    result = _run([str(script), "--steps", "2"])
    assert result.returncode == 0, result.stdout + result.stderr


def _losses(text: str) -> list[float]:
    line = next(x for x in text.splitlines() if "MirroredStrategy" in x)
    return [float(v) for v in line.split(":", 1)[1].split()]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("script", "mode"), LAUNCHED,
                         ids=[f"{s.name} {' '.join(m)}" for s, m in LAUNCHED])
def test_example_runs_under_the_launcher(script: Path, mode: list[str]) -> None:
    """One device per rank: module inputs and outputs are each rank's, as in PyTorch."""
    result = _run(["-m", "shardwise.launch", *mode, str(script), "--steps", "1"])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    if script.name == "distribute_mirrored.py":  # MultiWorkerMirrored: compared here
        one = _run([str(script), "--steps", "1", "--no-multiworker"])
        assert one.returncode == 0, one.stderr[-3000:]
        assert re.search(rf"\({mode[1]} processes x 2 devices\)", result.stdout)
        for a, b in zip(_losses(result.stdout), _losses(one.stdout), strict=True):
            assert abs(a - b) <= 1e-5
    else:  # the script compares every step with its single-device model and exits 1 if not
        assert "loss" in result.stdout


@pytest.mark.timeout(300)
def test_tp_tutorial_runs_over_two_processes() -> None:
    """The docstring's command, one device per process: module outputs are local tensors."""
    script = str(ROOT / "examples" / "tp_tutorial.py")
    result = _run(["-m", "shardwise.launch", "--nproc", "2", script, "--tp", "2", "--steps", "2"])
    assert result.returncode == 0, result.stdout + result.stderr
    assert "largest difference" in result.stdout


def _getting_started_program() -> str:
    """The program of docs/getting-started.md's "One program, three ways"."""
    text = (ROOT / "docs" / "getting-started.md").read_text()
    section = text.split("## One program, three ways", 1)[1]
    return re.search(r"^```python\n(.*?)^```", section, re.S | re.M)[1]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", [["--nproc", "2"], ["--nproc", "4"],
                                  ["--nproc", "4", "--threads"]], ids=" ".join)
def test_the_getting_started_program_runs_three_ways(mode: list[str], tmp_path: Path) -> None:
    """As the page says: in processes (one or two devices each) and in rank threads; in one
    process test_docs runs it."""
    script = tmp_path / "train.py"
    script.write_text(_getting_started_program())
    result = _run(["-m", "shardwise.launch", *mode, str(script)])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert len(re.findall(r"step \d: loss", result.stdout)) == 3
