"""The demo end to end, with few steps: sharded training equals single-device training in one
process (replicate and fully_shard) and over two gloo processes, and its exit code says so; it
prints nothing stray, and arguments it cannot run with are refused in one line."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from shardwise import demo, demo_cli

SRC = str(Path(__file__).resolve().parents[1] / "src")


def _args(*extra: str):
    return demo_cli.build_parser().parse_args(["--steps", "2", "--no-progress", *extra])


def _same_loss(a: float, b: float) -> bool:
    """Equal within float32 rounding (two units in the last place, as a sum reduced in another
    order by the backend may land) and the printed precision (six decimals)."""
    return abs(a - b) <= 2 * abs(b) * 2.0**-23 + 1e-6


def _losses(text: str) -> list[tuple[float, float]]:
    # across processes the launcher prefixes each line with its rank: "[0] "
    rows = re.findall(
        r"^(?:\[\d+\] )?\s+(\d+)\s+(\d+\.\d+)\s+(\d+\.\d+)\s+\S+$", text, flags=re.M
    )
    return [(float(a), float(b)) for _, a, b in rows]


def test_demo_in_one_process_matches_single_device(tmp_path: Path) -> None:
    out = io.StringIO()
    plot = tmp_path / "curves.png"
    replicated = demo.run(_args("--plot", str(plot)), out)
    text = out.getvalue()
    assert replicated.max_difference <= replicated.tolerance < 1e-3
    assert len(replicated.losses_sharded) == 2
    assert _losses(text) == [(round(a, 6), round(b, 6)) for a, b in
                             zip(replicated.losses_sharded, replicated.losses_single, strict=True)]
    kinds = set(replicated.comm_per_step)
    assert ("all_reduce", "dp") in kinds  # replicate's bucketed gradient reduction
    assert ("reduce_scatter", "tp") in kinds  # sequence parallel after row-parallel layers
    assert "InterleavedShard(dim=0, interleaved_size=3)" in text and "dp=1" in text
    memory = replicated.memory
    assert memory["sharded_per_device"] < memory["single_model"]
    assert memory["sharded_peak"] <= memory["materialized"] + memory["largest_parameter"]
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    fsdp = demo.run(_args("--fsdp"), io.StringIO())
    assert fsdp.max_difference <= fsdp.tolerance
    assert {("all_gather", "dp"), ("reduce_scatter", "dp")} <= set(fsdp.comm_per_step)
    # the loss's reductions over 'dp' are common to both; replicate adds one gradient bucket
    count, _ = fsdp.comm_per_step[("all_reduce", "dp")]
    assert replicated.comm_per_step[("all_reduce", "dp")][0] == count + 1
    assert fsdp.memory["sharded_per_device"] < memory["sharded_per_device"]


def test_demo_exits_non_zero_when_losses_differ(monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(demo, "_tolerance", lambda losses: -1.0)
    assert demo_cli.main(["--steps", "1", "--mesh", "1x2", "--no-progress"]) == 1
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
    assert "USDT" not in proc.stdout + proc.stderr  # kineto's trace lines from the memory table
    losses = _losses(proc.stdout)  # rank 0's table: sharded over both processes vs one device
    assert len(losses) == 2
    for sharded, single in losses:
        assert _same_loss(sharded, single), (sharded, single)


@pytest.mark.parametrize(
    "command",
    [
        ["demo", "--nproc", "4"],  # README: the same run over 4 gloo processes
        ["demo", "--nproc", "4", "--mesh", "4x1", "--fsdp"],  # a plain parameter beside TP
        ["demo", "--nproc", "4", "--mesh", "1x4", "--tied"],
    ],
    ids=" ".join,
)
def test_demo_over_four_processes_prints_the_same_losses(command: list[str]) -> None:
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(
        [sys.executable, "-m", "shardwise", *command, "--steps", "1", "--batch", "8",
         "--no-progress"],
        capture_output=True, text=True, timeout=240, env=env,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "4 processes" in proc.stdout
    losses = _losses(proc.stdout)
    assert len(losses) == 1 and _same_loss(*losses[0]), losses


def test_demo_in_four_rank_threads_prints_the_same_losses() -> None:
    """``python -m shardwise.launch --threads``: a rank thread owns one device, as a process."""
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(
        [sys.executable, "-m", "shardwise.launch", "--nproc", "4", "--threads", "-m",
         "shardwise", "demo", "--steps", "1", "--batch", "8", "--no-progress"],
        capture_output=True, text=True, timeout=240, env=env,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "4 rank threads of one process" in proc.stdout
    assert "peak not measured in rank threads" in proc.stdout
    losses = _losses(proc.stdout)
    assert len(losses) == 1 and _same_loss(*losses[0]), losses


def _demo(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "shardwise", "demo", *args],
                          capture_output=True, text=True, timeout=timeout, env=env)


def test_a_demo_run_prints_its_report_and_nothing_else() -> None:
    proc = _demo("--steps", "1", "--mesh", "1x2", "--no-progress")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "sharded training matches" in proc.stdout
    assert "USDT" not in proc.stdout
    assert proc.stderr == ""  # kineto's profiler_start/stop lines held back


def test_nproc_that_does_not_divide_the_mesh_is_refused_before_starting() -> None:
    proc = _demo("--nproc", "3", "--steps", "1", "--no-progress", timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and "[0]" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert errors == [
        "shardwise demo: error: --nproc 3 does not divide the 4 devices of --mesh 2x2: use "
        "--nproc 1, 2 or 4, or a mesh whose size is a multiple of 3 (such as --mesh 3x1)"
    ]


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--steps", "0"], "argument --steps: must be at least 1, got 0"),
        (["--steps", "-3"], "argument --steps: must be at least 1, got -3"),
        (["--batch", "0"], "argument --batch: must be at least 1, got 0"),
        (["--layers", "0"], "argument --layers: must be at least 1, got 0"),
        (["--nproc", "0"], "argument --nproc: must be at least 1, got 0"),
        (["--lr", "-1"], "argument --lr: must be a positive number, got -1"),
        (["--lr", "nan"], "argument --lr: must be a positive number, got nan"),
        (["--mesh", "1x3"], "--mesh 1x3: the tensor-parallel size must divide the model's 4 "
                            "attention heads, so TP is one of [1, 2, 4]"),
        (["--mesh", "2x2", "--nproc", "8"], "--nproc 8 does not divide the 4 devices"),
    ],
)
def test_arguments_the_demo_cannot_run_with_are_refused_in_one_line(
    args: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        demo_cli.main([*args, "--no-progress"])
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    errors = [line for line in captured.err.splitlines() if "error:" in line]
    assert len(errors) == 1 and said in errors[0], captured.err
    assert "matches" not in captured.out


@pytest.mark.parametrize(
    ("name", "said"),
    [
        ("missing/curves.png", "the directory"),
        ("curves.pngx", "matplotlib cannot tell the image format from .pngx; end the name with "
                        "one of"),
        ("curves", "a name without an extension"),
    ],
)
def test_a_plot_that_could_not_be_written_is_refused_before_training(
    name: str, said: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setattr(demo, "run", lambda *a, **k: pytest.fail("training started"))
    with pytest.raises(SystemExit) as exit_info:
        demo_cli.main(["--plot", str(tmp_path / name), "--steps", "1", "--no-progress"])
    assert exit_info.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1 and said in errors[0], errors


def test_plot_without_matplotlib_is_refused_before_training(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real = demo_cli.importlib.util.find_spec
    monkeypatch.setattr(demo_cli.importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else real(name, *a))
    monkeypatch.setattr(demo, "run", lambda *a, **k: pytest.fail("training started"))
    with pytest.raises(SystemExit) as exit_info:
        demo_cli.main(["--plot", str(tmp_path / "c.png"), "--no-progress"])
    assert exit_info.value.code == 2
    assert "--plot needs matplotlib: pip install 'shardwise[demo]'" in capsys.readouterr().err


def test_the_option_checks_know_the_models_head_count() -> None:
    assert demo.GPTConfig().heads == demo_cli.HEADS
