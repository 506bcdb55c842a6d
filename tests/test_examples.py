"""Every script in ``examples/`` runs to completion (each accepts ``--steps N``; a few steps
here) and exits 0, which each does only when its sharded run matches its single-device run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))


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


@pytest.mark.timeout(300)
def test_tp_tutorial_runs_over_two_processes() -> None:
    """The same script, one device per process: module outputs are local tensors there."""
    script = str(ROOT / "examples" / "tp_tutorial.py")
    result = _run(["-m", "shardwise.launch", "--nproc", "2", script, "--tp", "2", "--steps", "2"])
    assert result.returncode == 0, result.stdout + result.stderr
    assert "largest difference" in result.stdout
