"""The drop-in switch (``shardwise.as_torch``): code that imports PyTorch's DTensor modules and
cannot be edited runs on shardwise. Each run is its own Python process (the switch is global).
The training program (``as_torch_programs/tp_train.py``: TP, ``clip_grad_norm_``, torchtitan's
``funcol.all_reduce(x, "sum", mesh)``) must give each rank what one device gives."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
PROGRAM = HERE / "as_torch_programs" / "tp_train.py"
SRC = HERE.parent / "src"
ENV = {**os.environ, "PYTHONPATH": str(SRC)}


def _python(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=300, env=env or ENV
    )


NAMES = """
import warnings
import torch.distributed as dist
import torch.distributed.tensor as dt
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard
from torch.distributed.device_mesh import init_device_mesh, DeviceMesh
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
from torch.distributed.tensor.experimental import local_map, implicit_replication
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.fsdp import fully_shard, FSDPModule, FullyShardedDataParallel
import shardwise, shardwise.mesh
print(dt.DTensor is DTensor is shardwise.DTensor, _StridedShard is shardwise.InterleavedShard)
print(init_device_mesh is dist.init_device_mesh is shardwise.init_device_mesh)
print(fully_shard.__module__, FSDPModule.__module__, FullyShardedDataParallel.__module__)
print(compute_local_shape_and_global_offset.__module__, CommDebugMode.__module__)
try:
    dt.no_such_name
except AttributeError as err:
    print("AttributeError", "no shardwise counterpart" in str(err))
"""


def test_torch_names_resolve_to_shardwise_and_fsdp1_stays_torchs(tmp_path: Path) -> None:
    script = tmp_path / "names.py"
    script.write_text(NAMES)
    result = _python("-m", "shardwise.as_torch", str(script))
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "True True",
        "True",
        "shardwise.parallel.fully_shard shardwise.parallel.fully_shard "
        "torch.distributed.fsdp.fully_sharded_data_parallel",
        "shardwise.geometry shardwise.debug",
        "AttributeError True",
    ]


def test_the_environment_variable_and_an_early_import(tmp_path: Path) -> None:
    code = (
        "import torch.distributed.tensor\n"  # before the switch: a warning says so
        "import shardwise\n"
        "from torch.distributed.tensor import DTensor\n"
        "print(DTensor.__module__)\n"
    )
    result = _python("-c", code, env={**ENV, "SHARDWISE_AS_TORCH": "1"})
    assert result.returncode == 0, result.stderr
    assert result.stdout == "shardwise.dtensor\n"
    assert "imported before the switch" in result.stderr
    off = _python("-c", code, env={**ENV, "SHARDWISE_AS_TORCH": "0"})
    assert off.returncode == 0 and off.stdout.startswith("torch.distributed.tensor")


SHARD_TENSOR = """
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, Replicate
from torch.distributed.tensor._api import _shard_tensor
import shardwise
mesh = init_device_mesh("cpu", (2, 2))
full = torch.arange(24.0).reshape(4, 6)
with shardwise.debug.CommCounter() as counter:
    dt = _shard_tensor(full, [Shard(0), Shard(1)], mesh)
print(type(dt).__module__, dt.placements == (Shard(0), Shard(1)), len(counter.records))
print(torch.equal(dt.full_tensor(), full))
"""


def test_torchs_private_shard_tensor_keeps_each_shard_without_communication(
    tmp_path: Path,
) -> None:
    """torch's ``tensor._api._shard_tensor`` (PyTorch's test_dtensor.py imports it): the
    shards of a tensor every process holds, no collective."""
    script = tmp_path / "shard.py"
    script.write_text(SHARD_TENSOR)
    result = _python("-m", "shardwise.as_torch", str(script))
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.splitlines() == ["shardwise.dtensor True 0", "True"]


def _reference() -> dict:
    sys.path.insert(0, str(PROGRAM.parent))
    try:
        import tp_train
    finally:
        sys.path.remove(str(PROGRAM.parent))
    return tp_train.train(tp_train.build())


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("threads", [False, True], ids=["processes", "threads"])
def test_a_torch_program_trains_through_the_switch_as_on_one_device(
    tmp_path: Path, threads: bool
) -> None:
    mode = ["--threads"] if threads else ["--timeout", "240"]
    result = _python(
        "-m", "shardwise.launch", "--nproc", "2", *mode, "--as-torch", str(PROGRAM),
        str(tmp_path),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    ref = _reference()
    for rank in range(2):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got["dtensor"] == "shardwise.dtensor"
        assert got["losses"] == pytest.approx(ref["losses"], rel=1e-5)
        assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)
        assert got["dist_sum"] == pytest.approx([2 * x for x in ref["losses"]], rel=1e-5)
        for name, value in ref["params"].items():
            flat = [v for row in value for v in (row if isinstance(row, list) else [row])]
            mine = got["params"][name]
            mine = [v for row in mine for v in (row if isinstance(row, list) else [row])]
            assert mine == pytest.approx(flat, rel=1e-5, abs=1e-6), name


# transformers and accelerate are no dependency of shardwise: a venv that has them (with the same
# torch) is named by SHARDWISE_LIBRARY_PYTHON, else this interpreter is tried
LIBRARY_PYTHON = os.environ.get("SHARDWISE_LIBRARY_PYTHON", sys.executable)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize(("nproc", "threads"), [(2, False), (4, False), (2, True)],
                         ids=["2proc", "4proc", "2threads"])
def test_transformers_tensor_parallel_through_the_switch_equals_one_device(
    tmp_path: Path, nproc: int, threads: bool
) -> None:
    found = subprocess.run([LIBRARY_PYTHON, "-c", "import transformers, accelerate"],
                           capture_output=True, text=True, timeout=300, env=ENV)
    if found.returncode:
        pytest.skip(f"transformers and accelerate do not import in {LIBRARY_PYTHON} (set "
                    f"SHARDWISE_LIBRARY_PYTHON to a venv with them): {found.stderr[-200:]}")
    program = str(HERE / "as_torch_programs" / "hf_llama_tp.py")
    setup = subprocess.run([LIBRARY_PYTHON, program, "setup", str(tmp_path)],
                           capture_output=True, text=True, timeout=300, env=ENV)
    assert setup.returncode == 0, setup.stderr[-3000:]
    mode = ["--threads"] if threads else ["--timeout", "600"]
    run = subprocess.run(
        [LIBRARY_PYTHON, "-m", "shardwise.launch", "--nproc", str(nproc), *mode, "--as-torch",
         program, "rank", str(tmp_path), "sw"],
        capture_output=True, text=True, timeout=800, env=ENV,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    reference = json.loads((tmp_path / "reference.json").read_text())["losses"]
    for rank in range(nproc):
        got = json.loads((tmp_path / f"sw_rank{rank}.json").read_text())
        assert "shardwise.dtensor.DTensor" in got["classes"]
        assert got["losses"] == pytest.approx(reference, rel=1e-5)
