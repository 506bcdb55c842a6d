"""The README's demo runs and checks itself (round trips, sharded training = single device)."""

import io

from shardwise.cli import demo, training_demo


def test_demo_round_trips() -> None:
    out = io.StringIO()
    demo(out)
    text = out.getvalue()
    assert "round trip equals the original: True" in text
    assert "all_to_all" in text and "all_gather" in text


def test_training_demo_matches_single_device() -> None:
    out = io.StringIO()
    training_demo(out, steps=2)
    assert "largest parameter difference" in out.getvalue()
