"""The command line: the data-model tour checks its round trips; commands dispatch."""

import io

import pytest

from shardwise.cli import main, tour


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
