"""torchtitan's Llama 3, parallelized by torchtitan's own code, ported to shardwise by rewriting
imports only, trains as single-device PyTorch does: dp=2 x tp=2 on 4 gloo processes and on 4
rank threads of one process (``shardwise.rank_threads``).

torchtitan's files (0.2.2's model, args, ``parallelize_llama`` with ``apply_tp`` and
``apply_fsdp``, ``ParallelDims`` and its mesh builder) are copied at test time from the installed
torchtitan of ``SHARDWISE_LIBRARY_PYTHON`` (the venv ``scripts/library_venv.sh`` makes; else this
interpreter), each checked against the wheel's RECORD hash, into a temporary folder beside the
stand-ins for its infrastructure and the per-rank program ``train_llama.py`` of
``tests/torchtitan_programs/`` (``titan_harness.py``); without torchtitan the tests skip saying
why. The program needs only torch: this interpreter runs it.
Every rank starts from the weights torchtitan's ``init_weights`` gives a plain model after one
seed, trains on its dp rank's rows of each global batch, and the losses summed over dp (as
torchtitan logs them) and the final parameters must equal the plain model trained on the whole
batch. torch.distributed.tensor running the unported copies is held to the same oracle.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from mp_harness import run_in_processes
from shardwise.rank_threads import run_threads

PROGRAMS = Path(__file__).resolve().parent / "torchtitan_programs"
sys.path.insert(0, str(PROGRAMS))
import titan_harness as harness  # noqa: E402

sys.path.remove(str(PROGRAMS))

WORLD = 4  # dp=2 x tp=2
LOSS_RTOL = 1e-5  # float32: the sharded runs sum partial products in other orders
# AdamW's first steps move every entry by about lr whatever its gradient's size; an entry whose
# gradient is ~0 may get rounding of either sign in the two runs
PARAM_ATOL = 1e-4


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    python = harness.library_python()
    torchtitan = harness.installed_torchtitan(python)
    if torchtitan is None:
        pytest.skip(f"no torchtitan installed for {python} (set SHARDWISE_LIBRARY_PYTHON to a "
                    "venv with torchtitan 0.2.2: scripts/library_venv.sh)")
    root = tmp_path_factory.mktemp("torchtitan")
    out = {}
    for variant in ("torch", "shardwise"):
        out[variant] = root / variant
        assert harness.prepare(variant, out[variant], torchtitan) == 0  # imports only
    return out


@pytest.fixture(scope="module")
def shardwise_program(folders: dict[str, Path]) -> Iterator[object]:
    """The ported ``train_llama`` module, imported in this process (threads mode, reference)."""
    sys.path.insert(0, str(folders["shardwise"]))
    try:
        import train_llama

        yield train_llama
    finally:
        sys.path.remove(str(folders["shardwise"]))
        for name in [n for n in sys.modules if n == "train_llama" or n.startswith("torchtitan")]:
            del sys.modules[name]


@pytest.fixture(scope="module")
def reference(shardwise_program: object) -> dict:
    return shardwise_program.train_reference()  # type: ignore[attr-defined]


def _train_rank(folder: str) -> dict:
    """One rank of ``train_llama`` from ``folder`` (a spawned process imports it afresh)."""
    if folder not in sys.path:
        sys.path.insert(0, folder)
    import train_llama

    return train_llama.train_rank()


def _check(results: list[dict], reference: dict) -> None:
    by_dp: dict[int, list[dict]] = {}
    for r in results:
        by_dp.setdefault(r["dp_rank"], []).append(r)
    assert sorted(by_dp) == [0, 1] and all(len(g) == 2 for g in by_dp.values())
    for group in by_dp.values():  # the tp ranks of a dp rank see one loss
        assert group[0]["losses"] == group[1]["losses"]
    summed = [sum(step) for step in zip(*(g[0]["losses"] for g in by_dp.values()), strict=True)]
    assert summed == pytest.approx(reference["losses"], rel=LOSS_RTOL)
    for r in results:
        assert r["params"].keys() == reference["params"].keys()
        for name, value in reference["params"].items():
            torch.testing.assert_close(r["params"][name], value, rtol=0, atol=PARAM_ATOL,
                                       msg=lambda m, name=name: f"{name}: {m}")


def test_copies_are_torchtitans_and_the_port_rewrites_imports_only(folders):
    for rel, digest in harness.COPIED.items():
        assert harness.record_digest((folders["torch"] / rel).read_bytes()) == digest, rel
    ported = "".join(path.read_text() for path in sorted(folders["shardwise"].rglob("*.py")))
    assert "from shardwise.parallel import CPUOffloadPolicy, fully_shard" in ported
    for torch_api in ("torch.distributed.tensor", "torch.distributed.device_mesh",
                      "torch.distributed.fsdp", "torch.distributed._composable"):
        assert f"from {torch_api}" not in ported


def test_prepare_refuses_a_file_that_is_not_torchtitan_022s(tmp_path):
    fake = tmp_path / "site" / "torchtitan"
    for rel in harness.COPIED:
        (tmp_path / "site" / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "site" / rel).write_text("# not torchtitan's\n")
    with pytest.raises(harness.NotTorchtitan022, match="components/loss.py is not torchtitan"):
        harness.prepare("torch", tmp_path / "out", fake)


def test_no_torchtitan_where_there_is_no_interpreter(tmp_path):
    assert harness.installed_torchtitan(str(tmp_path / "no-python")) is None


def test_reference_trains(reference):
    losses = reference["losses"]
    assert len(losses) == 3 and losses[-1] < losses[0]


@pytest.mark.timeout(300)
def test_torch_dtensor_runs_the_copies_like_one_device(folders, reference):
    results = run_in_processes(_train_rank, WORLD, str(folders["torch"]), timeout=240)
    _check(results, reference)


@pytest.mark.timeout(300)
def test_shardwise_four_processes_train_like_one_device(folders, reference):
    results = run_in_processes(_train_rank, WORLD, str(folders["shardwise"]), timeout=240)
    _check(results, reference)


def test_shardwise_four_rank_threads_train_like_one_device(folders, shardwise_program, reference):
    results = run_threads(_train_rank, WORLD, str(folders["shardwise"]), timeout=100)
    _check(results, reference)
