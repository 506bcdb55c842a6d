"""The same programs across processes: redistribution, pack/unpack, autograd and safety on gloo.

Each configuration spawns its processes once and runs many checks inside (spawning and gloo
setup cost seconds); the parent runs the same functions in embedded mode and compares every
device's component bit for bit. Modes covered: one device per process (mesh 2 on 2 processes,
4 and 2x2 on 4) and several (mesh 4 and 2x2 and 2x3 on 2 processes, 2x4 on 4).
"""

from __future__ import annotations

import itertools
import random
import subprocess
import sys
import time
from math import prod
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import shardwise as sw
from mp_harness import run_in_processes
from shardwise import DTensor, InterleavedShard, Partial, Replicate, Shard
from shardwise.debug import CommCounter
from shardwise.errors import CollectiveMismatchError, CollectiveTimeoutError, InvalidPlacementError
from shardwise.spec import DTensorSpec, contiguous_meta
from shardwise.tf import Layout

ROOT = Path(__file__).resolve().parents[1]
P1 = [
    Shard(0),
    Shard(1),
    Replicate(),
    Partial("sum"),
    Partial("avg"),
    Partial("max"),
    Partial("min"),
    InterleavedShard(0, 2),
]
P2 = [Shard(0), Shard(1), Replicate(), Partial("sum"), Partial("max"), InterleavedShard(0, 2)]
PAIRS_2D = 160  # sampled from the 36 x 36 placement pairs of a 2-D mesh
SHAPES = [(6, 5), (2, 3)]  # uneven for every mesh here; (2, 3) leaves some shards empty


# ----- jobs (module level: spawned processes import them by name) ---------------------------


def _pairs(ndim: int) -> list[tuple[tuple, tuple]]:
    if ndim == 1:
        return [((a,), (b,)) for a in P1 for b in P1]
    states = list(itertools.product(P2, repeat=2))
    return random.Random(0).sample(list(itertools.product(states, states)), PAIRS_2D)


def _source(mesh: sw.DeviceMesh, shape: tuple, placements: tuple) -> list[torch.Tensor]:
    """Components of a test tensor: slices of a fixed tensor, or for Partial placements a
    different random tensor per device (seeded by device id, so every mode draws the same)."""
    if not any(p.is_partial() for p in placements):
        full = torch.arange(prod(shape), dtype=torch.float32).reshape(shape) / 7
        pieces = sw.local_components(sw.distribute_tensor(full, mesh, placements))
        return [c.clone() for c in pieces]
    spec = DTensorSpec(mesh, placements, contiguous_meta(shape, torch.float32))
    return [
        torch.randn(spec.local_shape(d), generator=torch.Generator().manual_seed(1000 + d))
        for d in mesh.local_device_ids
    ]


def redistribution_checks(mesh_shape: tuple[int, ...]) -> dict:
    """Every placement pair (sampled on 2-D meshes) and test shape: the components after
    redistributing there and back, and the counted, planned and cross-process bytes."""
    mesh = sw.init_device_mesh("cpu", mesh_shape)
    values, counts = {}, []
    for shape in SHAPES:
        for src, dst in _pairs(len(mesh_shape)):
            try:
                comps = _source(mesh, shape, src)
                x = DTensor.from_local(comps, mesh, src, shape=shape)
                plan = sw.debug.explain_redistribute(x, dst)
            except InvalidPlacementError:
                continue  # an interleave that does not divide: invalid in every mode
            with CommCounter() as counter:
                y = x.redistribute(placements=dst)
            z = y.redistribute(placements=src)
            key = f"{mesh_shape} {shape} {list(src)} -> {list(dst)}"
            pairs = zip(sw.local_components(y), sw.local_components(z), strict=True)
            values[key] = dict(zip(mesh.local_device_ids, pairs, strict=True))
            counts.append(
                (
                    key,
                    counter.total_bytes,
                    plan.bytes,
                    counter.total_cross_process_bytes,
                    plan.global_bytes,
                )
            )
    return {"values": values, "bytes": counts}


AUTOGRAD_PAIRS = {
    1: [
        ((Shard(0),), (Replicate(),)),
        ((Shard(0),), (Shard(1),)),
        ((Partial(),), (Shard(0),)),
        ((Partial("avg"),), (Replicate(),)),
        ((InterleavedShard(0, 2),), (Shard(1),)),
    ],
    2: [
        ((Shard(0), Shard(1)), (Replicate(), Replicate())),
        ((Partial(), Shard(0)), (Shard(1), Replicate())),
        ((Replicate(), Partial("avg")), (Shard(0), Shard(1))),
    ],
}


def autograd_checks(mesh_shape: tuple[int, ...]) -> dict:
    """Gradients of the components through redistribute and full_tensor."""
    mesh = sw.init_device_mesh("cpu", mesh_shape)
    shape = (6, 5)
    weight = torch.arange(30, dtype=torch.float32).reshape(shape).sin()
    out = {}
    for src, dst in AUTOGRAD_PAIRS[len(mesh_shape)]:
        comps = [c.requires_grad_() for c in _source(mesh, shape, src)]
        x = DTensor.from_local(comps, mesh, src, shape=shape)
        full = x.redistribute(placements=dst).full_tensor()
        (full * weight).sum().backward()
        out[f"{list(src)} -> {list(dst)}"] = {
            d: (full.detach(), c.grad) for d, c in zip(mesh.local_device_ids, comps, strict=True)
        }
    return out


def tf_seed_examples() -> dict:
    """The four pack examples of the TF DTensor seed (mesh x=2, y=3), each process packing
    only its own components (multi-client)."""
    mesh = sw.tf.create_mesh([("x", 2), ("y", 3)])
    local = mesh.local_device_ids
    x_of = {d: mesh.coordinate_of(d)[0] for d in local}
    examples = {
        "vector": ([torch.arange(64.0) + 64 * x_of[d] for d in local], ["x"]),
        "matrix": ([torch.tensor([[float(d)]]) for d in local], ["x", "y"]),
        "scalar": ([torch.tensor(123.0) for _ in local], []),
        "3d": (
            [torch.arange(6.0).reshape(1, 2, 3) + 6 * x_of[d] for d in local],
            ["x", "unsharded", "unsharded"],
        ),
    }
    out = {}
    for name, (comps, specs) in examples.items():
        packed = sw.tf.pack(comps, Layout(specs, mesh))
        unpacked = sw.tf.unpack(packed)
        again = sw.tf.pack(unpacked, Layout(specs, mesh))
        out[name] = {
            "shape": tuple(packed.shape),
            "full": packed.full_tensor(),
            "unpack_is_input": all(torch.equal(a, b) for a, b in zip(unpacked, comps, strict=True)),
            "n_unpacked": len(unpacked),
            "round_trip": torch.equal(again.full_tensor(), packed.full_tensor()),
        }
    return out


def from_group_checks() -> dict:
    """A mesh built from the world group is the 1-D mesh of the world's processes."""
    mesh = sw.DeviceMesh.from_group(dist.group.WORLD, "cpu")
    full = torch.arange(12.0).reshape(4, 3)
    y = sw.distribute_tensor(full, mesh, [Shard(0)]).redistribute(placements=[Shard(1)])
    return {
        "ids": mesh.local_device_ids,
        "same_as_init": mesh == sw.init_device_mesh("cpu", (dist.get_world_size(),)),
        "full": y.full_tensor(),
    }


def _op_cases(ndim: int) -> list:
    """(name, fn, inputs, placements) for a representative subset of the op oracle."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(6, 5, generator=g), torch.randn(5, 7, generator=g)
    gamma, beta = torch.randn(5, generator=g), torch.randn(5, generator=g)
    labels = torch.randint(0, 5, (6,), generator=g)
    table, ids = torch.randn(9, 4, generator=g), torch.randint(0, 9, (6, 3), generator=g)
    rep = Replicate()
    if ndim == 1:
        s0, s1, part = (Shard(0),), (Shard(1),), (Partial(),)
        r = (rep,)
    else:
        s0, s1, part = (Shard(0), Shard(1)), (Shard(1), Shard(0)), (Partial(), Shard(0))
        r = (rep, rep)
    F = torch.nn.functional
    return [
        ("mm", torch.mm, [x, w], [s1, (Shard(0),) + r[1:]]),
        ("add_broadcast", torch.add, [x, gamma], [s0, r]),
        ("sum_dim", lambda t: t.sum(0), [x], [s0]),
        ("partial_mul", lambda t: t * 3, [x], [part]),
        ("softmax", lambda t: t.softmax(1), [x], [(Shard(0),) + r[1:]]),
        ("layer_norm", lambda t, a, b: F.layer_norm(t, (5,), a, b), [x, gamma, beta], [s0, r, r]),
        ("cross_entropy", F.cross_entropy, [x, labels], [(Shard(0),) + r[1:]] * 2),
        ("embedding", F.embedding, [ids, table], [r, (Shard(0),) + r[1:]]),
        ("argmax", lambda t: t.argmax(0), [x], [s0]),
        ("cumsum", lambda t: t.cumsum(1), [x], [s1]),
        ("nonzero", lambda t: torch.nonzero(t > 0), [x], [s0]),
    ]


def op_checks(mesh_shape: tuple[int, ...]) -> dict:
    """Global results of a representative subset of ops (implicit moves allowed)."""
    mesh = sw.init_device_mesh("cpu", mesh_shape)
    out = {}
    with sw.config.allow_implicit_redistribute():
        for name, fn, inputs, placements in _op_cases(mesh.ndim):
            pairs = zip(inputs, placements, strict=True)
            args = [sw.distribute_tensor(t, mesh, list(p)) for t, p in pairs]
            out[name] = fn(*args).full_tensor()
    return out


def tp_mlp_checks(mesh_shape: tuple[int, ...]) -> dict:
    """Two Adam steps of the data x tensor parallel MLP of test_training on a 2-D mesh."""
    from test_training import MLP, shard_module

    mesh = sw.init_device_mesh("cpu", mesh_shape)
    torch.manual_seed(0)
    model = MLP(8, 12)
    shard_module(model, mesh)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(3)
    losses = []
    for _ in range(2):
        x, y = torch.randn(6, 8, generator=g), torch.randn(6, 8, generator=g)
        dx = sw.distribute_tensor(x, mesh, [Shard(0), Replicate()])
        dy = sw.distribute_tensor(y, mesh, [Shard(0), Replicate()])
        with sw.config.allow_implicit_redistribute():
            loss = torch.nn.functional.mse_loss(model(dx), dy)
            opt.zero_grad()
            loss.backward()
            opt.step()
        losses.append(loss.full_tensor())
    params = {n: p.full_tensor().detach() for n, p in model.named_parameters()}
    return {"losses": losses, "params": params}


def random_checks(mesh_shape: tuple[int, ...]) -> dict:
    """Seeded random DTensors, initializers and dropout, replicated and sharded: each device
    draws its own shard; the global values must not depend on the mode."""
    mesh = sw.init_device_mesh("cpu", mesh_shape)
    placements = [Shard(0)] + [Shard(1)] * (len(mesh_shape) - 1)
    replicated = [Replicate()] * len(mesh_shape)
    sw.manual_seed(11)
    randn = sw.randn(7, 5, device_mesh=mesh, placements=placements).full_tensor()
    w = sw.zeros(9, 4, device_mesh=mesh, placements=placements)
    torch.nn.init.kaiming_uniform_(w)
    x = sw.distribute_tensor(torch.ones(7, 5), mesh, replicated)
    sw.manual_seed(12)
    dropped = torch.nn.functional.dropout(x, 0.5).full_tensor()
    xs = sw.distribute_tensor(torch.ones(7, 5), mesh, placements)
    dropped_sharded = torch.nn.functional.dropout(xs, 0.5).full_tensor()
    return {"randn": randn, "init": w.full_tensor(), "dropout": dropped,
            "dropout_sharded": dropped_sharded, "after": torch.rand(3)}


def job(mesh_shapes: list[tuple[int, ...]], extras: list[str]) -> dict:
    """One spawned job: redistribution and autograd checks on each mesh, plus named extras
    ("deterministic": reductions in coordinate order throughout)."""
    sw.config.set_deterministic("deterministic" in extras)
    result = {
        shape: {"redistribute": redistribution_checks(shape), "autograd": autograd_checks(shape)}
        for shape in mesh_shapes
    }
    for name in extras:
        if name == "deterministic":
            continue
        if name == "random":
            result[name] = {shape: random_checks(shape) for shape in mesh_shapes}
        elif name in ("ops", "tp_mlp"):
            fn = op_checks if name == "ops" else tp_mlp_checks
            result[name] = {shape: fn(shape) for shape in mesh_shapes if len(shape) == 2
                            or name == "ops"}
        else:
            result[name] = {"tf_seed": tf_seed_examples, "from_group": from_group_checks}[name]()
    return result


def _check_ops_and_training(per_rank: list[dict], mesh_shapes: list[tuple[int, ...]]) -> None:
    """Every rank's random values, op results and trained parameters equal the embedded run
    bit for bit."""
    for shape in mesh_shapes:
        want_random = random_checks(shape)
        torch.manual_seed(12)  # replicated dropout: one shard, the single-device mask
        assert torch.equal(want_random["dropout"],
                           torch.nn.functional.dropout(torch.ones(7, 5), 0.5))
        for rank, result in enumerate(per_rank):
            for name, value in want_random.items():
                got = result["random"][shape][name]
                assert torch.equal(got, value), f"{name} on mesh {shape}, rank {rank}"
        want_ops = op_checks(shape)
        for rank, result in enumerate(per_rank):
            for name, value in want_ops.items():
                got = result["ops"][shape][name]
                assert torch.equal(got, value), f"{name} on mesh {shape}, rank {rank}"
        if len(shape) != 2:
            continue
        want = tp_mlp_checks(shape)
        for rank, result in enumerate(per_rank):
            got = result["tp_mlp"][shape]
            for a, b in zip(got["losses"], want["losses"], strict=True):
                assert torch.equal(a, b), f"loss on mesh {shape}, rank {rank}"
            for name, value in want["params"].items():
                assert torch.equal(got["params"][name], value), f"{name} on {shape}, rank {rank}"


def divergent_program() -> dict:
    """Rank 1 moves a tensor of another shape (debug checks on), then skips a collective."""
    rank = dist.get_rank()
    mesh = sw.init_device_mesh("cpu", (4,))
    sw.config.set_collective_timeout(10)
    out: dict = {}
    rows = 8 if rank == 0 else 6
    x = sw.distribute_tensor(torch.ones(rows, 4), mesh, [Shard(0)], src_data_rank=None)
    sw.config.set_debug_checks(True)
    start = time.monotonic()
    try:
        x.redistribute(placements=[Replicate()])
    except CollectiveMismatchError as err:
        out["mismatch"] = str(err)
    out["mismatch_s"] = time.monotonic() - start
    full = torch.arange(21.0).reshape(7, 3)
    agreed = sw.distribute_tensor(full, mesh, [Shard(0)]).redistribute(placements=[Replicate()])
    out["agreed_ok"] = torch.equal(agreed.full_tensor(), full)
    sw.config.set_debug_checks(False)
    sw.config.set_collective_timeout(2)
    start = time.monotonic()
    if rank == 0:
        try:
            x = sw.distribute_tensor(full, mesh, [Shard(0)], src_data_rank=None)
            x.redistribute(placements=[Replicate()])
        except CollectiveTimeoutError as err:
            out["timeout"] = str(err)
    else:
        time.sleep(4)  # skips the collective, but stays alive past rank 0's timeout
    out["timeout_s"] = time.monotonic() - start
    return out


# ----- comparison with the embedded run --------------------------------------------------------


def _merge(per_rank: list[dict]) -> dict:
    """Merge the per-device dicts the ranks returned (each holds its own devices)."""
    if isinstance(per_rank[0], dict) and all(isinstance(k, int) for k in per_rank[0]):
        merged = {}
        for part in per_rank:
            merged.update(part)
        return merged
    return {k: _merge([r[k] for r in per_rank]) for k in per_rank[0]}


def _assert_same_components(got: dict, want: dict, where: str) -> None:
    assert got.keys() == want.keys(), where
    for key in want:
        if isinstance(want[key], dict) and not all(isinstance(k, int) for k in want[key]):
            _assert_same_components(got[key], want[key], f"{where} {key}")
            continue
        assert sorted(got[key]) == sorted(want[key]), f"{where} {key}: devices differ"
        for device, expected in want[key].items():
            for a, b in zip(got[key][device], expected, strict=True):
                assert a.dtype == b.dtype and a.shape == b.shape, f"{where} {key} dev {device}"
                assert torch.equal(a, b), f"{where} {key} device {device}: values differ"


def _check_job(per_rank: list[dict], mesh_shapes: list[tuple[int, ...]]) -> None:
    for shape in mesh_shapes:
        embedded_values = redistribution_checks(shape)["values"]
        got = _merge([r[shape]["redistribute"]["values"] for r in per_rank])
        _assert_same_components(got, embedded_values, f"mesh {shape}")
        _assert_same_components(
            _merge([r[shape]["autograd"] for r in per_rank]),
            autograd_checks(shape),
            f"autograd mesh {shape}",
        )
        rows = zip(*(r[shape]["redistribute"]["bytes"] for r in per_rank), strict=True)
        for per_process in rows:
            key, _, _, _, global_bytes = per_process[0]
            for _, counted, planned, _, _ in per_process:
                assert counted == planned, f"{key}: CommCounter {counted} != plan {planned}"
            assert sum(p[2] for p in per_process) == global_bytes, key
            crossed = sum(p[3] for p in per_process)
            assert crossed <= global_bytes, f"{key}: {crossed} bytes crossed, plan {global_bytes}"


def test_two_processes() -> None:
    """World size 2: mesh 2 (one device each), mesh 4 and 2x2 (two devices each), the TF seed
    examples on 2x3 (three each), a mesh from the world group; debug checks on throughout."""
    shapes = [(2,), (4,), (2, 2)]
    per_rank = run_in_processes(
        job,
        2,
        shapes,
        ["tf_seed", "from_group", "ops", "tp_mlp", "random"],
        timeout=150,
        env={"SHARDWISE_DEBUG_CHECKS": "1", "SHARDWISE_COLLECTIVE_TIMEOUT": "60"},
    )
    _check_job(per_rank, shapes)
    _check_ops_and_training(per_rank, shapes)
    for rank, result in enumerate(per_rank):
        tf = result["tf_seed"]
        assert torch.equal(tf["vector"]["full"], torch.arange(128.0))
        assert torch.equal(tf["matrix"]["full"], torch.arange(6.0).reshape(2, 3))
        assert torch.equal(tf["scalar"]["full"], torch.tensor(123.0))
        assert torch.equal(tf["3d"]["full"], torch.arange(12.0).reshape(2, 2, 3))
        assert [tf[k]["shape"] for k in tf] == [(128,), (2, 3), (), (2, 2, 3)]
        assert all(tf[k]["n_unpacked"] == 3 and tf[k]["unpack_is_input"] for k in tf)
        assert all(tf[k]["round_trip"] for k in tf)
        fg = result["from_group"]
        assert fg["ids"] == (rank,) and fg["same_as_init"]
        assert torch.equal(fg["full"], torch.arange(12.0).reshape(4, 3))


def test_four_processes() -> None:
    """World size 4: mesh 4 and 2x2 (one device each), mesh 2x4 (two devices each); in
    deterministic mode, the embedded run's bits (the default reduces in the backend's order:
    ``test_engine_calls``)."""
    shapes = [(4,), (2, 2), (2, 4)]
    per_rank = run_in_processes(
        job,
        4,
        shapes,
        ["ops", "tp_mlp", "random", "deterministic"],
        timeout=150,
        env={"SHARDWISE_COLLECTIVE_TIMEOUT": "60"},
    )
    _check_job(per_rank, shapes)
    _check_ops_and_training(per_rank, shapes)


def test_divergent_program_fails_fast() -> None:
    """The debug checks turn a divergent program into CollectiveMismatchError naming what
    differs per rank; without them a skipped collective raises CollectiveTimeoutError."""
    first, second = run_in_processes(divergent_program, 2, timeout=60)
    for result in (first, second):
        message = result["mismatch"]
        assert "moving:" in message and "rank 0:" in message and "rank 1:" in message
        assert "shape=[8, 4]" in message and "shape=[6, 4]" in message
        assert result["mismatch_s"] < 10 and result["agreed_ok"]
    timeout = first["timeout"]
    assert "all_gather" in timeout and "mesh dim 0" in timeout and "Shard(dim=0)" in timeout
    assert "shape=[7, 3]" in timeout and 2 <= first["timeout_s"] < 4
    assert "timeout" not in second


# ----- in-process pieces ------------------------------------------------------------------


def test_meta_mesh_plans_without_devices() -> None:
    mesh = sw.init_device_mesh("meta", (2, 4))
    assert mesh.local_device_ids == tuple(range(8))
    x = sw.distribute_tensor(torch.empty(1024, 512, device="meta"), mesh, [Shard(0), Shard(1)])
    assert sw.tf.unpack(x)[0].shape == (512, 128) and sw.tf.unpack(x)[0].is_meta
    plan = sw.debug.explain_redistribute(x, [Replicate(), Shard(0)])
    assert plan.bytes == plan.global_bytes > 0
    y = x.redistribute(placements=[Replicate(), Shard(0)])
    assert y.placements == (Replicate(), Shard(0)) and sw.tf.unpack(y)[0].shape == (256, 512)


def test_collective_timeout_setting() -> None:
    old = sw.config.get_collective_timeout()
    try:
        sw.config.set_collective_timeout(7.5)
        assert sw.config.get_collective_timeout() == 7.5
        with pytest.raises(sw.errors.InvalidArgumentError, match="positive"):
            sw.config.set_collective_timeout(0)
    finally:
        sw.config.set_collective_timeout(old)


SPMD_SCRIPT = """
import torch, shardwise as sw
mesh = sw.init_device_mesh("cpu", (4,))
x = sw.distribute_tensor(torch.arange(8.0), mesh, [sw.Shard(0)])
total = x.redistribute(placements=[sw.Replicate()]).full_tensor().sum()
print(f"rank {torch.distributed.get_rank()} devices {mesh.local_device_ids} sum {total.item()}")
"""


def test_script_runs_unchanged_under_torchrun(tmp_path: Path) -> None:
    script = tmp_path / "spmd.py"
    script.write_text(SPMD_SCRIPT)
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert run.returncode == 0, run.stderr
    assert "rank 0 devices (0, 1) sum 28.0" in run.stdout
    assert "rank 1 devices (2, 3) sum 28.0" in run.stdout


def test_launcher_runs_a_script_and_propagates_failures(tmp_path: Path) -> None:
    script = tmp_path / "spmd.py"
    script.write_text(SPMD_SCRIPT)
    run = subprocess.run(
        [sys.executable, "-m", "shardwise.launch", "--nproc", "2", str(script)],
        capture_output=True,
        text=True,
        timeout=90,
        cwd=ROOT,
    )
    assert run.returncode == 0, run.stderr
    assert "rank 0 devices (0, 1) sum 28.0" in run.stdout
    assert "rank 1 devices (2, 3) sum 28.0" in run.stdout

    failing = tmp_path / "failing.py"
    failing.write_text(
        "import os, sys, time\nif os.environ['RANK'] == '1':\n    sys.exit(3)\ntime.sleep(60)\n"
    )
    start = time.monotonic()
    run = subprocess.run(
        [sys.executable, "-m", "shardwise.launch", "--nproc", "2", str(failing)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert run.returncode == 3 and "process 1 exited with code 3" in run.stderr
    assert time.monotonic() - start < 30
