"""The package as a user installs it: built from this checkout (wheel and sdist), the wheel
installed, not editable, in a fresh virtual environment after ``torch==2.13.0``; there
``shardwise --version``, ``shardwise-run --help`` and the demo run from outside the checkout;
the sdist carries the docs and examples its own tests read; mypy (from PyPI) type-checks a user
script against shardwise's annotations (``py.typed``): the documented plan dict passes, a
wrong type is caught. Skipped, with the reason, where a virtual environment or the packages
cannot be had."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
VERSION = re.search(r'__version__ = "([^"]+)"', (ROOT / "src/shardwise/__init__.py").read_text())

USER_SCRIPT = '''\
import torch
import shardwise as sw
from shardwise import Replicate, Shard
from shardwise.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

mesh = sw.init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
dt = sw.distribute_tensor(torch.ones(4, 4), mesh, [Shard(0)])
whole: torch.Tensor = dt.redistribute(placements=[Replicate()]).full_tensor()
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 4))
parallelize_module(model, mesh, {"0": ColwiseParallel(), "1": RowwiseParallel()})
plan = {"0": ColwiseParallel()}
parallelize_module(model, mesh, plan)
'''
WRONG_SCRIPT = '''\
import shardwise as sw

size: int = sw.init_device_mesh("cpu", (2,))
'''
MYPY_INI = """\
[mypy]
python_version = 3.10
[mypy-torch.*]
follow_imports = skip
follow_imports_for_stubs = True
"""


def _run(args: list, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A fresh virtual environment (no system site-packages) with torch==2.13.0, then the
    wheel built from this checkout, plus ``build`` and ``mypy``; and the built files."""
    where = tmp_path_factory.mktemp("user")
    env_dir = where / "env"
    made = _run([sys.executable, "-m", "venv", env_dir], where, timeout=300)
    py = env_dir / "bin" / "python"
    if made.returncode or not py.exists():
        pytest.skip(f"cannot create a virtual environment here: {made.stderr.strip()[-500:]}")
    tools = _run([py, "-m", "pip", "install", "-q", "torch==2.13.0", "build", "mypy"], where,
                 timeout=900)
    if tools.returncode:
        pytest.skip(f"cannot install torch==2.13.0, build and mypy into the virtual "
                    f"environment: {tools.stderr.strip()[-500:]}")
    dist = where / "dist"
    built = _run([py, "-m", "build", "--sdist", "--wheel", "-o", dist, ROOT], where)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    wheel = next(dist.glob("shardwise-*.whl"))
    done = _run([py, "-m", "pip", "install", "-q", wheel], where)
    assert done.returncode == 0, done.stderr[-3000:]
    return {"env": env_dir, "py": py, "sdist": next(dist.glob("shardwise-*.tar.gz")),
            "wheel": wheel, "home": where}


@pytest.mark.timeout(1800)
def test_the_wheel_installs_and_runs_outside_the_checkout(installed: dict[str, Path]) -> None:
    home, bin_dir = installed["home"], installed["env"] / "bin"
    assert VERSION is not None
    version = _run([bin_dir / "shardwise", "--version"], home)
    assert version.returncode == 0 and version.stdout.split() == ["shardwise", VERSION[1]]
    where = _run([installed["py"], "-c", "import shardwise; print(shardwise.__file__)"], home)
    assert str(installed["env"]) in where.stdout  # the installed copy, not this checkout
    typed = _run([installed["py"], "-c", "import importlib.resources as r; "
                  "print(r.files('shardwise').joinpath('py.typed').is_file())"], home)
    assert typed.stdout.strip() == "True"
    launcher = _run([bin_dir / "shardwise-run", "--help"], home)
    assert launcher.returncode == 0 and "--nproc" in launcher.stdout
    demo = _run([bin_dir / "shardwise", "demo", "--steps", "2", "--mesh", "1x2",
                 "--no-progress"], home)
    assert demo.returncode == 0, demo.stdout[-2000:] + demo.stderr[-2000:]
    assert "sharded training matches single-device training" in demo.stdout
    metadata = _run([installed["py"], "-c", "import importlib.metadata as m; "
                     "d = m.metadata('shardwise'); print(d['License-Expression']); "
                     "print(m.requires('shardwise'))"], home).stdout.splitlines()
    assert metadata[0] == "MIT" and "torch>=2.4" in metadata[1], metadata


@pytest.mark.timeout(1800)
def test_the_sdist_carries_docs_examples_and_license(installed: dict[str, Path]) -> None:
    with tarfile.open(installed["sdist"]) as sdist:
        names = {Path(*Path(n).parts[1:]).as_posix() for n in sdist.getnames()}
    for wanted in ("LICENSE", "CHANGELOG.md", "docs/getting-started.md", "docs/index.md",
                   "examples/fsdp_tp.py", "tests/test_docs.py", "tests/test_examples.py",
                   "src/shardwise/py.typed"):
        assert wanted in names, wanted


@pytest.mark.timeout(1800)
def test_mypy_sees_shardwise_types(installed: dict[str, Path]) -> None:
    home = installed["home"]
    (home / "mypy.ini").write_text(MYPY_INI)
    (home / "user.py").write_text(USER_SCRIPT)
    (home / "wrong.py").write_text(WRONG_SCRIPT)
    ok = _run([installed["py"], "-m", "mypy", "--config-file", "mypy.ini", "user.py"], home)
    assert ok.returncode == 0, ok.stdout[-3000:] + ok.stderr[-3000:]
    wrong = _run([installed["py"], "-m", "mypy", "--config-file", "mypy.ini", "wrong.py"], home)
    assert wrong.returncode == 1
    assert 'expression has type "DeviceMesh", variable has type "int"' in wrong.stdout, (
        wrong.stdout
    )
