"""Issue 20, "One process": deepcopy, bounded caches, loss_parallel labels, clear errors."""

from __future__ import annotations

import copy

import torch

from shardwise import DeviceMesh, Replicate, Shard, distribute_tensor
from shardwise.parallel import ColwiseParallel, RowwiseParallel, fully_shard, parallelize_module

# ----- deepcopy with several local devices ------------------------------------------------------


def test_deepcopy_dtensor_several_local_devices() -> None:
    mesh = DeviceMesh("cpu", [[0, 1], [2, 3]])
    x = torch.randn(8, 6)
    d = distribute_tensor(x, mesh, [Shard(0), Replicate()]).requires_grad_()
    e = copy.deepcopy(d)
    assert e.placements == d.placements and e.device_mesh is d.device_mesh
    assert e.requires_grad and e.is_leaf
    assert torch.equal(e.full_tensor(), x)
    with torch.no_grad():
        e.mul_(2)  # independent of the original
    assert torch.equal(d.full_tensor(), x)
    assert torch.equal(e.full_tensor(), x * 2)
    # a shared DTensor stays shared inside one deepcopy (memo), as for torch tensors
    a, b = copy.deepcopy([d, d])
    assert a is b


def test_deepcopy_parallelized_module_matches_torch() -> None:
    torch.manual_seed(0)
    mesh = DeviceMesh("cpu", [0, 1, 2, 3])
    ref = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 6))
    model = parallelize_module(
        copy.deepcopy(ref), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()}
    )
    clone = copy.deepcopy(model)
    x = torch.randn(5, 6)
    torch.testing.assert_close(clone(x), ref(x))
    for p, q in zip(clone.parameters(), model.parameters(), strict=True):
        assert isinstance(p, torch.nn.Parameter) or getattr(p, "_is_param", False)
        assert p.placements == q.placements
    with torch.no_grad():
        next(clone.parameters()).zero_()
    torch.testing.assert_close(model(x), ref(x))  # the original is untouched


def test_deepcopy_fully_sharded_module() -> None:
    torch.manual_seed(0)
    mesh = DeviceMesh("cpu", [0, 1, 2, 3])
    ref = torch.nn.Linear(8, 4)
    model = fully_shard(copy.deepcopy(ref), mesh=mesh)
    clone = copy.deepcopy(model)
    for p, q in zip(clone.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.full_tensor(), q)
    x = torch.randn(4, 8)
    out = clone(x)  # a plain batch in one process with 4 devices is global data, split on dim 0
    torch.testing.assert_close(out.full_tensor(), ref(x))
    torch.testing.assert_close(out.full_tensor(), model(x).full_tensor())


# ----- bounded caches ---------------------------------------------------------------------------


def _decisions() -> int:
    from shardwise import dispatch

    return sum(len(op.decisions) for op in dispatch._OPS.values())


def test_dispatch_decisions_bounded_with_variable_shapes(monkeypatch) -> None:
    from shardwise import dispatch

    monkeypatch.setattr(dispatch, "DECISION_CACHE_SIZE", 40)
    dispatch.clear_sharding_cache()
    mesh = DeviceMesh("cpu", [[0, 1], [2, 3]])
    w_full = torch.randn(6, 5)
    w = distribute_tensor(w_full, mesh, [Replicate(), Shard(1)])
    try:
        for length in range(1, 61):  # a variable sequence length: 60 shapes, 3 ops each
            x_full = torch.randn(length, 6)
            x = distribute_tensor(x_full, mesh, [Shard(0), Replicate()])
            y = (x @ w).relu().sum(0)
            torch.testing.assert_close(y.full_tensor(), (x_full @ w_full).relu().sum(0))
            assert _decisions() <= 40
        # an evicted decision is decided again, correctly
        x_full = torch.randn(1, 6)
        x = distribute_tensor(x_full, mesh, [Shard(0), Replicate()])
        torch.testing.assert_close((x @ w).full_tensor(), x_full @ w_full)
    finally:
        dispatch.clear_sharding_cache()
    assert dispatch.DECISION_CACHE_SIZE == 40  # the default (4096) is restored by monkeypatch


def test_redistribution_plan_caches_bounded(monkeypatch) -> None:
    import random

    from shardwise.redistribute import plan as plan_module

    monkeypatch.setattr(plan_module, "PLAN_CACHE_SIZE", 30)
    plan_module._PLANS.clear()
    mesh = DeviceMesh("cpu", [[0, 1], [2, 3]])
    rng = random.Random(0)
    choices = [Shard(0), Shard(1), Replicate()]
    for _ in range(80):
        full = torch.randn(rng.randint(1, 20), rng.randint(1, 20))
        d = distribute_tensor(full, mesh, [rng.choice(choices), rng.choice(choices)])
        e = d.redistribute(mesh, [rng.choice(choices), rng.choice(choices)])
        assert torch.equal(e.full_tensor(), full)
        assert len(plan_module._PLANS) <= 30
    plan_module._PLANS.clear()


def test_every_cache_has_a_bound() -> None:
    from shardwise import dispatch, geometry
    from shardwise.redistribute import plan as plan_module
    from shardwise.redistribute import traced

    assert 0 < dispatch.DECISION_CACHE_SIZE <= 65536
    assert 0 < plan_module.PLAN_CACHE_SIZE <= 65536
    assert 0 < traced.TRACED_CACHE_SIZE <= 65536
    for cached in (dispatch._is_view, dispatch._is_inplace, dispatch._written_arguments,
                   geometry.pieces,
                   geometry.shard_segments, plan_module._plan):
        assert cached.cache_parameters()["maxsize"] is not None


# ----- loss_parallel labels -------------------------------------------------------------------


def test_loss_parallel_out_of_range_label_raises_like_torch() -> None:
    import pytest
    import torch.nn.functional as F

    from shardwise.errors import LabelOutOfRangeError
    from shardwise.parallel import loss_parallel

    mesh = DeviceMesh("cpu", [0, 1, 2, 3])
    logits = torch.randn(4, 10)
    for bad in (10, 37, -3):
        labels = torch.tensor([1, bad, 2, 3])
        with pytest.raises(IndexError):  # torch's own behaviour
            F.cross_entropy(logits, labels)
        d = distribute_tensor(logits, mesh, [Shard(1)])
        match = f"label {bad} .*10 classes"
        with loss_parallel(), pytest.raises(LabelOutOfRangeError, match=match):
            F.cross_entropy(d, labels)
    # ignore_index stays allowed, and matches torch
    labels = torch.tensor([1, -100, 9, 0])
    d = distribute_tensor(logits, mesh, [Shard(1)])
    with loss_parallel():
        loss = F.cross_entropy(d, labels)
    torch.testing.assert_close(loss.full_tensor(), F.cross_entropy(logits, labels))
    labels = torch.tensor([1, 12, 9, 12])
    with loss_parallel():
        loss = F.cross_entropy(d, labels, ignore_index=12)
    torch.testing.assert_close(loss.full_tensor(), F.cross_entropy(logits, labels, ignore_index=12))


def _loss_label_job() -> str:
    import pytest
    import torch.distributed as dist
    import torch.nn.functional as F

    from shardwise.errors import LabelOutOfRangeError
    from shardwise.parallel import loss_parallel

    mesh = DeviceMesh("cpu", list(range(dist.get_world_size())))
    logits = torch.randn(3, 9, generator=torch.Generator().manual_seed(1))
    d = distribute_tensor(logits, mesh, [Shard(1)])
    with loss_parallel(), pytest.raises(LabelOutOfRangeError, match="label 9 "):
        F.cross_entropy(d, torch.tensor([0, 9, 2]))
    labels = torch.tensor([0, -100, 8])  # every rank goes on working after the error
    with loss_parallel():
        loss = F.cross_entropy(d, labels)
    torch.testing.assert_close(loss.full_tensor(), F.cross_entropy(logits, labels))
    return "ok"


def test_loss_parallel_out_of_range_label_two_processes() -> None:
    from mp_harness import run_in_processes

    assert run_in_processes(_loss_label_job, 2, timeout=120) == ["ok", "ok"]


# ----- shardwise errors instead of raw ones -----------------------------------------------------


def test_invalid_regex_plan_key_is_a_plan_error() -> None:
    import pytest

    from shardwise.errors import ParallelPlanError

    mesh = DeviceMesh("cpu", [0, 1])
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.raises(ParallelPlanError, match=r"'re:\['.*regular expression"):
        parallelize_module(model, mesh, {"re:[": ColwiseParallel()})


def test_mesh_argument_that_is_not_a_mesh() -> None:
    import pytest

    from shardwise import DTensor
    from shardwise.errors import ShardwiseTypeError
    from shardwise.parallel import replicate

    x = torch.randn(4, 4)
    calls = [
        ("distribute_tensor", "str 'notamesh'",
         lambda: distribute_tensor(x, "notamesh", [Shard(0)])),
        ("parallelize_module", "int 3",
         lambda: parallelize_module(torch.nn.Linear(4, 4), 3, {"": ColwiseParallel()})),
        ("from_local", r"list \[0, 1\]",
         lambda: DTensor.from_local(x, device_mesh=[0, 1], placements=[Shard(0)])),
        ("fully_shard", "int 2", lambda: fully_shard(torch.nn.Linear(4, 4), mesh=2)),
        ("replicate", "str 'x'", lambda: replicate(torch.nn.Linear(4, 4), device_mesh="x")),
    ]
    for what, given, call in calls:
        with pytest.raises(ShardwiseTypeError, match=f"{what}.*mesh must be .*got {given}"):
            call()


def test_mirrored_variable_wrong_shape_and_integer_mean() -> None:
    import pytest

    import shardwise.distribute as swd
    from shardwise.errors import DistributeValueError

    strategy = swd.MirroredStrategy(devices=["cpu:0", "cpu:1"])
    with strategy.scope():
        v = swd.Variable(torch.zeros(3))
        counter = swd.Variable(torch.zeros(3, dtype=torch.int64),
                               aggregation=swd.VariableAggregation.MEAN)
    with pytest.raises(DistributeValueError, match=r"shape \[4\].*shape \[3\]"):
        v.assign(torch.zeros(4))
    v.assign(torch.ones(3))  # a fitting value (and a broadcast scalar) still assigns
    v.assign_add(1.0)
    assert torch.equal(v.value(), torch.full((3,), 2.0))

    def step() -> None:
        counter.assign_add(torch.full((3,), 4, dtype=torch.int64))

    strategy.run(step)  # integer MEAN over two replicas: (4 + 4) / 2 added, no raw error
    assert counter.value().dtype == torch.int64
    assert torch.equal(counter.value(), torch.full((3,), 4, dtype=torch.int64))


def test_missing_checkpoint_is_a_file_not_found_shardwise_error(tmp_path) -> None:
    import pytest

    from shardwise import checkpoint
    from shardwise.errors import CheckpointCorruptError, ShardwiseError

    net = torch.nn.Linear(2, 2)
    for where in (tmp_path / "nowhere", tmp_path):  # missing, and a directory with nothing
        with pytest.raises(FileNotFoundError, match="no checkpoint at") as err:
            checkpoint.load(where, net)
        assert isinstance(err.value, ShardwiseError) and str(where) in str(err.value)
    saved = tmp_path / "ck"
    checkpoint.save(saved, net)
    (saved / ".metadata").unlink()
    with pytest.raises(FileNotFoundError, match=r"\.metadata") as err:
        checkpoint.load(saved, net)
    assert isinstance(err.value, CheckpointCorruptError)


# ----- concurrent saves to one path -------------------------------------------------------------


def _net(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 4))


def _save_repeatedly(path: str, seed: int, times: int, start, errors, net=None) -> None:
    from shardwise import checkpoint

    net = _net(seed) if net is None else net  # threads: made beforehand (one global generator)
    start.wait()
    for step in range(times):
        try:
            checkpoint.save(path, net, step=step, extra={"seed": seed})
        except BaseException as exc:
            errors.put(f"{type(exc).__name__}: {exc}"[:300])


def _check_final(path) -> None:
    from shardwise import checkpoint

    target = _net(99)
    info = checkpoint.load(path, target)
    reference = _net(info["extra"]["seed"])  # the last save is one whole save
    for p, q in zip(target.parameters(), reference.parameters(), strict=True):
        assert torch.equal(p, q)
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]


def test_concurrent_saves_from_two_processes_serialize(tmp_path) -> None:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    start, errors = ctx.Event(), ctx.Queue()
    path = tmp_path / "ck"
    procs = [ctx.Process(target=_save_repeatedly, args=(str(path), seed, 6, start, errors))
             for seed in (1, 2)]
    for p in procs:
        p.start()
    start.set()
    for p in procs:
        p.join(timeout=240)
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
    failures = []
    while not errors.empty():
        failures.append(errors.get())
    assert not alive and not failures, failures
    assert all(p.exitcode == 0 for p in procs)
    _check_final(path)


def test_concurrent_saves_from_two_threads_serialize(tmp_path) -> None:
    import queue
    import threading

    start, errors = threading.Event(), queue.Queue()
    path = tmp_path / "ck"
    threads = [threading.Thread(target=_save_repeatedly,
                                args=(str(path), seed, 4, start, errors, _net(seed)))
               for seed in (1, 2)]
    for t in threads:
        t.start()
    start.set()
    for t in threads:
        t.join(timeout=240)
    failures = []
    while not errors.empty():
        failures.append(errors.get())
    assert not any(t.is_alive() for t in threads) and not failures, failures
    _check_final(path)
