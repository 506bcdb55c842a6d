"""The command line: the data-model tour checks its round trips; commands dispatch; arguments
are parsed before torch is imported; ``--version``."""

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

import shardwise
from shardwise.cli import main
from shardwise.tour import tour

SRC = str(Path(__file__).resolve().parents[1] / "src")


def test_tour_round_trips() -> None:
    out = io.StringIO()
    tour(out)
    text = out.getvalue()
    assert "round trip equals the original: True" in text
    assert "all_to_all" in text and "all_gather" in text


def test_demo_help_documents_every_option(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for option in ("--mesh", "--steps", "--fsdp", "--nproc", "--plot", "--batch", "--seed",
                   "--lr", "--layers", "--tied", "--no-progress"):
        assert option in text, option


def test_bad_mesh_is_rejected(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--mesh", "2by2"])
    assert exit_info.value.code == 2
    assert "--mesh wants DPxTP" in capsys.readouterr().err


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    version = capsys.readouterr().out.split()
    assert version == ["shardwise", shardwise.__version__]
    assert all(part.isdigit() for part in shardwise.__version__.split(".")[:3])


def test_arguments_are_parsed_before_torch_is_imported() -> None:
    """Usage lines, --version and refused options come without importing torch (seconds to
    minutes on a loaded machine)."""
    script = (
        "import sys\n"
        "from shardwise.cli import main\n"
        "for argv in (['--help'], ['--version'], ['demo', '--help'], ['launch', '--help'],\n"
        "             ['demo', '--mesh', '1x3'], ['demo', '--plot', '/no/such/dir/x.png']):\n"
        "    try:\n"
        "        main(argv)\n"
        "    except SystemExit:\n"
        "        pass\n"
        "print('torch imported:', 'torch' in sys.modules)\n"
    )
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "torch imported: False" in proc.stdout
    assert "shardwise launch" in proc.stdout and "--nproc" in proc.stdout  # launch --help
    assert "the directory '/no/such/dir' does not exist" in proc.stderr
