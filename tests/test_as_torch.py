"""The drop-in switch (``shardwise.as_torch``): code that imports PyTorch's DTensor modules and
cannot be edited runs on shardwise. Each run is its own Python process (the switch is global).
The training program (``as_torch_programs/tp_train.py``: TP, ``clip_grad_norm_``, torchtitan's
``funcol.all_reduce(x, "sum", mesh)``) must give each rank what one device gives."""

from __future__ import annotations

import functools
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
import torch.distributed.tensor._random as torch_random
try:
    torch_random._rng_tracker
except AttributeError as err:
    print("answers only _PhiloxState, is_rng_supported_mesh, manual_seed" in str(err),
          "answers ;" in str(err))
print(torch_random.is_rng_supported_mesh(shardwise.init_device_mesh("cpu", (2,))))
# torch's philox state accessor passes through: a uint64 seed with its top bit set round-trips
import torch
state = torch_random._PhiloxState(torch.zeros(16, dtype=torch.uint8))
state.seed = torch.tensor([2**63 + 42], dtype=torch.uint64)
state.offset = torch.tensor([7])
print(state.seed.item() == 2**63 + 42, state.offset.item(), state.state[8].item())
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
        "True False",
        "True",
        "True 7 7",
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


def test_torchs_submodules_of_a_shimmed_package_still_import(tmp_path: Path) -> None:
    """A submodule of a shimmed package that no one imported before the switch (FSDP's
    sharded grad scaler, which torch's FSDP test harness imports; FSDP2's private collectives)
    is torch's own module, as the names shardwise lacks are torch's."""
    script = tmp_path / "submodules.py"
    script.write_text(
        "from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler\n"
        "from torch.distributed.fsdp._fully_shard import _fsdp_collectives\n"
        "from torch.distributed.fsdp import fully_shard\n"
        "print(ShardedGradScaler.__module__, _fsdp_collectives.__name__, fully_shard.__module__)\n"
    )
    result = _python("-m", "shardwise.as_torch", str(script))
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == [
        "torch.distributed.fsdp.sharded_grad_scaler",
        "torch.distributed.fsdp._fully_shard._fsdp_collectives",
        "shardwise.parallel.fully_shard",
    ]


CACHE_STATS = """
import torch
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.debug import (
    _clear_sharding_prop_cache, _get_fast_path_sharding_prop_cache_stats,
)
mesh = init_device_mesh("cpu", (4,))
half = distribute_tensor(torch.randn(8, 8, dtype=torch.bfloat16), mesh, [Shard(0)])
_clear_sharding_prop_cache()
full = half.float()
print(_get_fast_path_sharding_prop_cache_stats())
again = full.type_as(half)
print(_get_fast_path_sharding_prop_cache_stats())
again.float()
print(_get_fast_path_sharding_prop_cache_stats())
_clear_sharding_prop_cache()
print(_get_fast_path_sharding_prop_cache_stats())
"""


def test_torchs_sharding_cache_statistics_are_shardwises_decision_cache(tmp_path: Path) -> None:
    """torch's private ``debug._clear_sharding_prop_cache`` and
    ``_get_fast_path_sharding_prop_cache_stats`` (PyTorch's test_dtensor_dtype_conversion):
    shardwise's decision cache, one miss per new (op, specs), one hit per repeat."""
    script = tmp_path / "stats.py"
    script.write_text(CACHE_STATS)
    result = _python("-m", "shardwise.as_torch", str(script))
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.splitlines() == ["(0, 1)", "(0, 2)", "(1, 2)", "(0, 0)"]


def test_torch_compile_loads_torchs_sharding_rules_under_the_switch(tmp_path: Path) -> None:
    # torch.compile first loads inductor, whose prims register torch's DTensor sharding rules
    # through a lazy import of torch.distributed.tensor._api (torchtitan compiles at import)
    script = tmp_path / "compile.py"
    script.write_text(
        "import torch\n"
        "import torch._inductor.inductor_prims\n"
        "from torch.distributed.tensor import DTensor\n"
        "print(torch.compile(torch.sin) is not None, DTensor.__module__)\n"
    )
    result = _python("-m", "shardwise.as_torch", str(script))
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["True", "shardwise.dtensor"]


def test_distributed_checkpoint_loaded_before_the_switch_sees_shardwise_dtensors(
    tmp_path: Path,
) -> None:
    # the switch imports torch's FSDP, which loads DCP's helpers bound to torch's DTensor; they
    # must take shardwise's for its DTensors (Lightning's load_raw: set_model_state_dict)
    script = tmp_path / "dcp.py"
    script.write_text(
        "import shardwise\n"
        "import torch.distributed._state_dict_utils as sd\n"
        "import torch.distributed.checkpoint.planner_helpers as ph\n"
        "import torch.distributed.fsdp._fully_shard._fsdp_param as fsdp2\n"
        "print(sd.DTensor is ph.DTensor is shardwise.DTensor, sd.distribute_tensor is "
        "shardwise.distribute_tensor, fsdp2.DTensor is shardwise.DTensor)\n"
    )
    result = _python("-m", "shardwise.as_torch", str(script))
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["True", "True", "False"]  # torch's own FSDP2 stays torch's


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


# the libraries are no dependency of shardwise: a venv that has them (with the same torch;
# scripts/library_venv.sh makes one) is named by SHARDWISE_LIBRARY_PYTHON, else this interpreter
# is tried, and a test whose library does not import there skips saying why
LIBRARY_PYTHON = os.environ.get("SHARDWISE_LIBRARY_PYTHON", sys.executable)
PROGRAMS = HERE / "as_torch_programs"
RUNS = [(2, False), (4, False), (2, True)]
RUN_IDS = ["2proc", "4proc", "2threads"]


@functools.cache
def _import_error(modules: str) -> str:
    """Why ``modules`` do not import in LIBRARY_PYTHON ("" when they do)."""
    found = subprocess.run([LIBRARY_PYTHON, "-c", f"import {modules}"], capture_output=True,
                           text=True, timeout=300, env=ENV)
    return found.stderr[-300:] if found.returncode else ""


def _library(modules: str) -> None:
    """Skip unless ``modules`` import in LIBRARY_PYTHON."""
    if error := _import_error(modules):
        pytest.skip(f"{modules} do not import in {LIBRARY_PYTHON} (set SHARDWISE_LIBRARY_PYTHON "
                    f"to a venv with them: scripts/library_venv.sh): {error}")


def _setup(program: str, folder: Path, *args: str) -> None:
    """``program setup folder [args]``: what the ranks read, and the reference run if any."""
    setup = subprocess.run([LIBRARY_PYTHON, program, "setup", str(folder), *args],
                           capture_output=True, text=True, timeout=300, env=ENV)
    assert setup.returncode == 0, setup.stderr[-3000:]


def _launch(nproc: int, threads: bool, as_torch: bool, *program: str) -> None:
    """Run ``program`` on ``nproc`` ranks with LIBRARY_PYTHON (torch's own modules unless
    ``as_torch``), asserting it succeeds."""
    mode = ["--threads"] if threads else ["--timeout", "400"]
    run = subprocess.run(
        [LIBRARY_PYTHON, "-m", "shardwise.launch", "--nproc", str(nproc), *mode,
         *(["--as-torch"] if as_torch else []), *program],
        capture_output=True, text=True, timeout=500, env=ENV,
    )
    assert run.returncode == 0, run.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize(("model", "nproc", "threads"),
                         [*(("llama", *run) for run in RUNS), ("mixtral", 2, False)],
                         ids=[*(f"llama-{i}" for i in RUN_IDS), "mixtral-2proc"])
def test_transformers_tensor_parallel_through_the_switch_equals_one_device(
    tmp_path_factory: pytest.TempPathFactory, model: str, nproc: int, threads: bool
) -> None:
    _library("transformers, accelerate")
    program = str(PROGRAMS / "hf_llama_tp.py")
    folder = tmp_path_factory.getbasetemp() / f"hf_{model}"
    if not (folder / "reference.json").exists():  # one checkpoint and reference per model
        folder.mkdir(exist_ok=True)
        _setup(program, folder, model)
    tag = f"sw{nproc}{'t' if threads else 'p'}"
    _launch(nproc, threads, True, program, "rank", str(folder), tag, model)
    reference = json.loads((folder / "reference.json").read_text())["losses"]
    for rank in range(nproc):
        got = json.loads((folder / f"{tag}_rank{rank}.json").read_text())
        assert "shardwise.dtensor.DTensor" in got["classes"]
        assert got["losses"] == pytest.approx(reference, rel=1e-5)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize(("nproc", "threads"), RUNS, ids=RUN_IDS)
def test_lightning_model_parallel_through_the_switch_equals_one_device(
    tmp_path: Path, nproc: int, threads: bool
) -> None:
    _library("lightning")
    program = str(PROGRAMS / "lightning_mp.py")
    _setup(program, tmp_path)
    dp = nproc // 2  # tensor parallel on 2 ranks, FSDP2 x TP on 4
    _launch(nproc, threads, True, program, "rank", str(tmp_path), "sw", str(dp), "2")
    reference = json.loads((tmp_path / "reference.json").read_text())["losses"]
    for rank in range(nproc):
        got = json.loads((tmp_path / f"sw_rank{rank}.json").read_text())
        assert "shardwise.dtensor" in got["classes"] and got["load_exact"]
        assert got["losses"] == pytest.approx(reference, rel=1e-5)  # the last after the load


# torchtitan's parallelisms per run: tensor parallel on 2 ranks, FSDP2 x TP on 4
TITAN_ARGS = {2: ["--parallelism.tensor_parallel_degree=2"],
              4: ["--parallelism.tensor_parallel_degree=2",
                  "--parallelism.data_parallel_shard_degree=2"]}


@pytest.fixture(scope="module")
def titan(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[int, dict]]:
    """torchtitan's assets and seed checkpoint, and its losses on torch per rank count (filled
    as the tests ask)."""
    _library("torchtitan.train")
    folder = tmp_path_factory.mktemp("titan")
    program = str(PROGRAMS / "titan_train.py")
    _setup(program, folder)
    _launch(1, False, False, program, "rank", str(folder), "seed")
    return folder, {}


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize(("nproc", "threads"), RUNS, ids=RUN_IDS)
def test_torchtitan_trains_through_the_switch_as_on_torch(
    titan: tuple[Path, dict[int, dict]], nproc: int, threads: bool
) -> None:
    folder, references = titan
    program = str(PROGRAMS / "titan_train.py")
    if nproc not in references:  # the same program and arguments on torch, as processes
        _launch(nproc, False, False, program, "rank", str(folder), f"torch{nproc}",
                *TITAN_ARGS[nproc])
        references[nproc] = json.loads((folder / f"torch{nproc}_rank0.json").read_text())
    reference = references[nproc]
    assert reference["dtensor"] == "torch.distributed.tensor" and len(reference["losses"]) == 3
    tag = f"sw{nproc}{'t' if threads else 'p'}"
    _launch(nproc, threads, True, program, "rank", str(folder), tag, *TITAN_ARGS[nproc])
    for rank in range(nproc):
        got = json.loads((folder / f"{tag}_rank{rank}.json").read_text())
        assert got["dtensor"] == "shardwise.dtensor"
        assert got["losses"] == pytest.approx(reference["losses"], rel=1e-5)
        assert got["grad_norms"] == pytest.approx(reference["grad_norms"], rel=1e-5)
