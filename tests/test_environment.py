"""The environment shardwise reads fails loudly: every ``SHARDWISE_*`` variable takes its
documented values (docs/multiprocess.md) and anything else raises naming the variable and the
values; a half-set torchrun environment (``RANK``/``WORLD_SIZE`` of several processes without
``MASTER_ADDR``/``MASTER_PORT``) raises instead of running as one process owning every
device."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch.distributed as dist

import shardwise as sw
from shardwise.errors import MeshError

ROOT = Path(__file__).resolve().parents[1]

# each value read afresh (the settings module reloaded in a fresh process per run)
READ = """
    import importlib, json, os, sys
    import shardwise.settings as settings
    from shardwise.ops import validate
    out = []
    for name, value in json.loads(sys.argv[1]):
        os.environ[name] = value
        try:
            importlib.reload(settings)
            got = {"SHARDWISE_DEBUG_CHECKS": settings.DEBUG_CHECKS,
                   "SHARDWISE_IMPLICIT_REDISTRIBUTE": settings.IMPLICIT_REDISTRIBUTE,
                   "SHARDWISE_COLLECTIVE_TIMEOUT": settings.COLLECTIVE_TIMEOUT,
                   "SHARDWISE_REPLICA_TIMEOUT": settings.REPLICA_TIMEOUT}.get(name)
            out.append(got.get() if got is not None else validate.exhaustive_by_default())
        except Exception as exc:
            out.append(f"{type(exc).__name__}: {exc}")
        del os.environ[name]
    print(json.dumps(out))
"""

FLAGS = ["SHARDWISE_DEBUG_CHECKS", "SHARDWISE_IMPLICIT_REDISTRIBUTE", "SHARDWISE_VALIDATE_ALL"]
ON = ["1", "true", "TRUE", "yes", "On"]
OFF = ["", "0", "false", "No", "off", "OFF"]
BAD_FLAGS = [" ", "0.0", "2", "enable", "y", "-1"]
SECONDS = ["SHARDWISE_COLLECTIVE_TIMEOUT", "SHARDWISE_REPLICA_TIMEOUT"]
BAD_SECONDS = ["0", "-3", "nan", "inf", "30s", " "]


def _read(cases: list[tuple[str, str]]) -> list:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDWISE_")}
    env["PYTHONPATH"] = str(ROOT / "src")
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(READ), json.dumps(cases)],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)


def test_every_shardwise_variable_takes_its_documented_values_only() -> None:
    good = [(n, v) for n in FLAGS for v in ON + OFF] + [
        (n, v) for n in SECONDS for v in ("30", "2.5", "")]
    bad = [(n, v) for n in FLAGS for v in BAD_FLAGS] + [
        (n, v) for n in SECONDS for v in BAD_SECONDS]
    got = _read(good + bad)
    want = [v in ON for n in FLAGS for v in ON + OFF] + [
        {"30": 30.0, "2.5": 2.5, "": 300.0 if "COLLECTIVE" in n else 120.0}[v]
        for n in SECONDS for v in ("30", "2.5", "")]
    assert got[:len(good)] == want
    for (name, value), message in zip(bad, got[len(good):], strict=True):
        assert isinstance(message, str) and message.startswith("InvalidArgumentError"), (
            name, value, message)
        assert f"{name}={value!r}" in message, message
        assert ("1, true, yes, on (on) or 0, false, no, off (off)" if name in FLAGS
                else "a finite positive number") in message


def test_a_bad_value_stops_the_first_use_naming_the_variable() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "SHARDWISE_DEBUG_CHECKS": "no way"}
    proc = subprocess.run([sys.executable, "-c", "import shardwise; shardwise.DTensor"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "SHARDWISE_DEBUG_CHECKS='no way' is not an on/off value" in proc.stderr


@pytest.mark.parametrize("unset", [["MASTER_ADDR", "MASTER_PORT"], ["MASTER_PORT"], ["RANK"]])
def test_a_half_set_torchrun_environment_is_an_error(
    monkeypatch: pytest.MonkeyPatch, unset: list[str]
) -> None:
    env = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    for name in unset:
        monkeypatch.delenv(name)
    with pytest.raises(MeshError, match="WORLD_SIZE=2 names a world of several processes") as err:
        sw.DeviceMesh("cpu", [0, 1])
    assert f"{', '.join(unset)} {'is' if len(unset) == 1 else 'are'} not set" in str(err.value)
    assert not dist.is_initialized()


@pytest.mark.parametrize(("name", "value", "message"), [
    ("WORLD_SIZE", "two", "WORLD_SIZE='two' is not an integer"),
    ("RANK", "2", "RANK=2 is not a rank of WORLD_SIZE=2"),
])
def test_a_malformed_torchrun_environment_is_an_error(
    monkeypatch: pytest.MonkeyPatch, name: str, value: str, message: str
) -> None:
    env = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"}
    for key, val in (env | {name: value}).items():
        monkeypatch.setenv(key, val)
    with pytest.raises(MeshError, match=message):
        sw.DeviceMesh("cpu", [0, 1])
    assert not dist.is_initialized()
