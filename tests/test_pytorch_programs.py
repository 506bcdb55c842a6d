"""Per-rank PyTorch programs written against torch.distributed.tensor's public API (a TP MLP, a
sequence-parallel MLP block, FSDP2 x TP on a small Llama-style decoder), ported to shardwise by
rewriting their imports only, train as they do on torch.distributed.tensor: the same per-step
loss on every rank, the same final parameters and gradients, under ``python -m shardwise.launch``
with 4 processes (gloo on 127.0.0.1).

The programs (our own), the port and the runner live in ``tests/pytorch_programs/``
(``harness.py``). Each rank seeds its generator differently (record.py), so in fsdp_tp the two
data-parallel groups start from different weights (the program's init is unseeded) and FSDP2
keeps on each rank its dp chunk of its own tensor-parallel shard: shardwise's fully_shard does
the same (InterleavedShard on "dp"). ``python tests/pytorch_programs/harness.py PROGRAM NPROC
[--same-seed]`` runs any of them; with ``--examples DIR`` PyTorch's own examples
(pytorch/examples' distributed/tensor_parallelism, checked out outside this repository) by hand.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "pytorch_programs"))
from harness import OURS, Run, examples, largest_difference, on_cpu, prepare, run
from port import UnportableImport, port

# (program, processes, shardwise's ranks as threads of one process): every program on 4
# processes, where every mesh dim is non-trivial, and the FSDP x TP one, which runs every layer
# the others do, as 4 rank threads too (against the same torch run). The suite's 10 minutes: 2
# processes run in tests/test_two_hosts.py (its one-host runs) and the launcher tests.
PASSING = [
    ("tensor_parallel", 4, False),
    ("sequence_parallel", 4, False),
    ("fsdp_tp", 4, False),
    ("fsdp_tp", 4, True),
]
RTOL = 1e-5  # float32: the runs reduce partial sums in different orders
# fsdp_tp: torch runs SDPA's math kernel (OURS.oracle_env), shardwise the CPU flash one, so
# gradients differ in float32 rounding; AdamW turns an entry whose gradient is ~0 in one run
# and of the other sign in the other into steps of lr (3e-3) in opposite directions
GRAD_RTOL = {"fsdp_tp": 1e-4}
PARAM_RTOL = {"fsdp_tp": 5e-3}


@pytest.mark.parametrize("program", sorted(OURS.steps))
def test_the_port_rewrites_imports_only(program: str, tmp_path: Path) -> None:
    path, beyond_imports = prepare(program, "shardwise", tmp_path)
    assert beyond_imports == 0
    source = path.read_text()
    assert "shardwise" in source
    for torch_api in ("torch.distributed.tensor", "torch.distributed._tensor",
                      "torch.distributed.device_mesh", "torch.distributed.fsdp"):
        assert torch_api not in source


def test_port_maps_modules_and_refuses_what_imports_cannot_port() -> None:
    source = (
        "import torch.distributed as dist\n"
        "import torch.distributed.tensor as dt\n"
        "from torch.distributed._composable.fsdp import fully_shard\n"
        "x = dt.Shard(0)\n"
    )
    result = port(source)
    assert result.source.splitlines()[:3] == [
        "import torch.distributed as dist",
        "import shardwise as dt",
        "from shardwise.parallel import fully_shard",
    ]
    assert (result.import_lines_changed, result.other_lines_changed) == (2, 0)
    with pytest.raises(UnportableImport, match="without 'as'"):
        port("import torch.distributed.tensor\n")
    with pytest.raises(UnportableImport, match="experimental"):
        port("from torch.distributed.tensor.experimental import local_map\n")


def test_examples_option_takes_pytorchs_files_from_the_folder_given(tmp_path: Path) -> None:
    """``--examples DIR``: the files are read from DIR, get the CPU substitution and the port
    (the real files are not in this repository: fake ones with the lines the harness edits)."""
    folder = tmp_path / "tensor_parallelism"
    folder.mkdir()
    (folder / "tensor_parallel_example.py").write_text(
        "import torch\n"
        "from torch.distributed._tensor.device_mesh import init_device_mesh\n"
        "device_type = torch.accelerator.current_accelerator().type\n"
    )
    (folder / "log_utils.py").write_text(
        "def verify_min_gpu_count(min_gpus):\n    return has_gpu and gpu_count >= min_gpus\n"
    )
    (folder / "llama2_model.py").write_text("import torch\n")
    programs = examples(folder)
    path, beyond = prepare("tensor_parallel_example", "shardwise", tmp_path / "out", programs)
    assert beyond == 0  # the CPU substitution precedes the port, alike for both runs
    assert path.read_text().splitlines()[1:] == [
        "from shardwise import init_device_mesh", 'device_type = "cpu"'
    ]
    assert "    return True" in (tmp_path / "out" / "log_utils.py").read_text()
    with pytest.raises(ValueError, match="expected the line"):
        on_cpu("tensor_parallel_example.py", "import torch\n", programs)


def test_largest_difference_sees_a_changed_gradient(tmp_path: Path) -> None:
    p = [torch.ones(3)]
    torch.save({"params": p, "grads": [torch.ones(3)]}, tmp_path / "a.pt")
    torch.save({"params": p, "grads": [torch.tensor([1.0, 1.0, 2.0])]}, tmp_path / "b.pt")
    assert largest_difference(tmp_path / "a.pt", tmp_path / "b.pt") == {"params": 0, "grads": 1}


_ORIGINALS: dict[tuple[str, int], Run] = {}  # torch's run, shared by both shardwise modes


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("program", "nproc", "threads"), PASSING)
def test_program_trains_as_on_torch_dtensor(
    program: str, nproc: int, threads: bool, tmp_path_factory: pytest.TempPathFactory
) -> None:
    if (program, nproc) not in _ORIGINALS:
        workdir = tmp_path_factory.mktemp(f"{program}-{nproc}")
        _ORIGINALS[program, nproc] = run(program, "torch", nproc, workdir, timeout=280)
    original = _ORIGINALS[program, nproc]
    assert original.returncode == 0, original.output[-4000:]
    workdir = tmp_path_factory.mktemp(f"{program}-{nproc}-{'threads' if threads else 'procs'}")
    ported = run(program, "shardwise", nproc, workdir, timeout=280, threads=threads)
    assert ported.returncode == 0, ported.output[-4000:]
    steps = OURS.steps[program]
    for r in (original, ported):
        assert sorted(r.losses) == list(range(nproc)), r.output[-4000:]
        assert all(len(losses) == steps for losses in r.losses.values())
    for rank in range(nproc):
        for step, (a, b) in enumerate(zip(original.losses[rank], ported.losses[rank], strict=True)):
            assert math.isclose(a, b, rel_tol=RTOL, abs_tol=1e-4), (rank, step, a, b)
    assert original.record is not None and ported.record is not None
    worst = largest_difference(original.record, ported.record)
    assert worst["params"] <= PARAM_RTOL.get(program, RTOL), worst
    assert worst["grads"] <= GRAD_RTOL.get(program, RTOL), worst
