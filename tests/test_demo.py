"""The demo end to end, with few steps: sharded training equals single-device training in one
process (replicate and fully_shard) and over two gloo processes, and its exit code says so."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from shardwise import demo

SRC = str(Path(__file__).resolve().parents[1] / "src")


def _args(*extra: str):  # noqa: ANN202
    return demo.build_parser().parse_args(["--steps", "2", "--no-progress", *extra])


def _losses(text: str) -> list[tuple[float, float]]:
    rows = re.findall(r"^\s+(\d+)\s+(\d+\.\d+)\s+(\d+\.\d+)\s+\S+$", text, flags=re.M)
    return [(float(a), float(b)) for _, a, b in rows]


def test_demo_in_one_process_matches_single_device(tmp_path: Path) -> None:
    out = io.StringIO()
    plot = tmp_path / "curves.png"
    result = demo.run(_args("--plot", str(plot)), out)
    text = out.getvalue()
    assert result.max_difference <= result.tolerance < 1e-3
    assert len(result.losses_sharded) == 2
    assert _losses(text) == [(round(a, 6), round(b, 6)) for a, b in
                             zip(result.losses_sharded, result.losses_single, strict=True)]
    kinds = set(result.comm_per_step)
    assert ("all_reduce", "dp") in kinds  # replicate's bucketed gradient reduction
    assert ("reduce_scatter", "tp") in kinds  # sequence parallel after row-parallel layers
    # per step: the loss's mean (one scalar) and one bucket holding every gradient
    assert result.comm_per_step[("all_reduce", "dp")][0] == 2
    assert "InterleavedShard(dim=0, interleaved_size=3)" in text and "dp=1" in text
    memory = result.memory
    assert memory["sharded_per_device"] < memory["single_model"]
    assert memory["sharded_peak"] <= memory["sharded_all_devices"] + memory["largest_parameter"]
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_demo_with_fully_shard_matches_single_device() -> None:
    out = io.StringIO()
    result = demo.run(_args("--fsdp", "--mesh", "2x2"), out)
    assert result.max_difference <= result.tolerance
    kinds = set(result.comm_per_step)
    assert {("all_gather", "dp"), ("reduce_scatter", "dp")} <= kinds
    assert result.comm_per_step[("all_reduce", "dp")][0] == 1  # the loss's mean only


def test_demo_exits_non_zero_when_losses_differ(monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    assert demo.main(["--steps", "1", "--mesh", "1x2", "--no-progress"]) == 0
    monkeypatch.setattr(demo, "_tolerance", lambda losses: -1.0)
    assert demo.main(["--steps", "1", "--mesh", "1x2", "--no-progress"]) == 1
    assert "MISMATCH" in capsys.readouterr().out


def test_demo_over_two_processes_prints_the_same_losses() -> None:
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(
        [sys.executable, "-m", "shardwise", "demo", "--nproc", "2", "--steps", "2",
         "--no-progress"],
        capture_output=True, text=True, timeout=240, env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "2 processes" in proc.stdout
    losses = _losses(proc.stdout)  # rank 0's table: sharded over both processes vs one device
    assert len(losses) == 2
    for sharded, single in losses:
        assert abs(sharded - single) <= 2e-6
