"""No silent wrong answer, no raw error (issue 7), in one process: the reduction rules (avg,
max/min, half-precision accumulation, casts under Partial), ambient settings and dispatch under
threads, bad input, serialization and accounting. The property test over dtypes and placement
pairs is in ``test_reliability_property.py``."""

from __future__ import annotations

import asyncio
import io
import threading
from collections.abc import Callable

import pytest
import torch

import shardwise as sw
from shardwise import DTensor, Partial, Replicate, Shard
from shardwise import dispatch as sw_dispatch
from shardwise.comm import safety
from shardwise.comm.reduction import cast_keeps_partial

MESH4 = sw.init_device_mesh("cpu", (4,))
MESH2 = sw.init_device_mesh("cpu", (2,))
f16, bf16, f32, f64 = torch.float16, torch.bfloat16, torch.float32, torch.float64


def _raises(call: Callable[[], object], cls: type[Exception], *fragments: str) -> None:
    with pytest.raises(cls) as info:
        call()
    assert isinstance(info.value, sw.errors.ShardwiseError), type(info.value)
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))


# ----- 1, 2: avg needs a floating dtype; max/min need an ordered one ------------------------


def test_avg_of_bool_or_integers_is_refused() -> None:
    flags = sw.distribute_tensor(torch.tensor([True, False, True, True]), MESH4, [Shard(0)])
    _raises(lambda: flags.redistribute(placements=[Partial("avg")]),
            sw.errors.InvalidPlacementError,
            "Partial('avg')", "torch.bool", "[4]")
    bools = [torch.tensor([True]), torch.tensor([False])] * 2
    _raises(lambda: DTensor.from_local(bools, MESH4, [Partial("avg")]),
            sw.errors.InvalidPlacementError)
    ints = [torch.tensor([v]) for v in (1, 2, 2, 2)]
    _raises(lambda: DTensor.from_local(ints, MESH4, [Partial("avg")]),
            sw.errors.InvalidPlacementError,
            "torch.int64")
    _raises(lambda: sw.distribute_tensor(torch.arange(4), MESH4, [Partial("avg")]),
            sw.errors.InvalidPlacementError)
    _raises(lambda: sw.ones(4, dtype=torch.int8, device_mesh=MESH4, placements=[Partial("avg")]),
            sw.errors.InvalidPlacementError)


def test_avg_of_floats_is_the_mean() -> None:
    avg = DTensor.from_local([torch.tensor([v]) for v in (1.0, 2.0, 2.0, 2.0)], MESH4,
                             [Partial("avg")])
    assert avg.full_tensor().item() == 1.75
    assert avg.redistribute(placements=[Shard(0)]).full_tensor().item() == 1.75
    with sw.config.allow_implicit_redistribute():
        assert (avg + avg).full_tensor().item() == 3.5


def test_max_min_of_complex_is_refused() -> None:
    z = [torch.ones(2, dtype=torch.complex64)] * 4
    for op in ("max", "min"):
        _raises(lambda op=op: DTensor.from_local(z, MESH4, [Partial(op)]),
                sw.errors.InvalidPlacementError, "complex")


# ----- 3: casts under Partial -------------------------------------------------------------


def test_narrowing_cast_of_a_partial_sum_reduces_first() -> None:
    parts = [torch.tensor([v]) for v in (70000.0, -70000.0, 1.0, 0.0)]
    p = DTensor.from_local(parts, MESH4, [Partial()])
    with pytest.raises(sw.errors.ImplicitRedistributeError):
        p.half()  # the cast needs the reduction first, which explicit mode refuses
    with sw.config.allow_implicit_redistribute():
        half = p.half()
    assert not half.placements[0].is_partial() and half.full_tensor().item() == 1.0
    with sw.config.allow_implicit_redistribute():
        assert p.long().full_tensor().item() == 1
    wide = p.to(f64)  # widening keeps the pending sum: no communication
    assert wide.placements == (Partial(),) and wide.full_tensor().item() == 1.0
    halves = DTensor.from_local([torch.tensor([0.5])] * 2, MESH2, [Partial()])
    with sw.config.allow_implicit_redistribute():
        assert halves.int().full_tensor().item() == 1  # not 0 + 0


def test_cast_rule() -> None:
    assert cast_keeps_partial("sum", f16, f32) and cast_keeps_partial("sum", f32, f64)
    assert cast_keeps_partial("sum", f32, torch.complex64)
    assert not cast_keeps_partial("sum", f32, f16) and not cast_keeps_partial("sum", f16, bf16)
    assert not cast_keeps_partial("sum", torch.int8, torch.int64)  # int8 sums wrap
    assert not cast_keeps_partial("sum", torch.int64, f64) and not cast_keeps_partial(
        "sum", f32, torch.int32)
    assert not cast_keeps_partial("avg", f32, torch.int64)
    assert cast_keeps_partial("max", f32, f16) and cast_keeps_partial("max", torch.int8, f32)
    assert cast_keeps_partial("min", torch.uint8, torch.int16)
    assert not cast_keeps_partial("max", torch.int16, torch.int8)  # wraps
    assert not cast_keeps_partial("max", f32, torch.int64) and not cast_keeps_partial(
        "max", f32, torch.bool)


# ----- 4: half precision accumulates in float32 and rounds once ----------------------------


def test_half_mean_does_not_overflow() -> None:
    x = torch.full((5,), 60000.0, dtype=f16)
    got = sw.distribute_tensor(x, MESH4, [Shard(0)]).mean()
    assert got.dtype == f16 and got.full_tensor().item() == x.mean().item() == 60000.0
    rows = torch.full((5, 3), 60000.0, dtype=bf16)
    got = sw.distribute_tensor(rows, MESH4, [Shard(0)]).mean(0)
    assert torch.equal(got.full_tensor(), rows.mean(0))


def test_half_sums_round_once() -> None:
    x = torch.tensor([1] + [2**-9] * 6, dtype=bf16)
    dt = sw.distribute_tensor(x, MESH4, [Shard(0)])
    with sw.debug.CommCounter() as counter:
        total = dt.sum()
    assert counter.counts["all_reduce"] == 0 and total.placements == (Partial(),)
    with sw.debug.CommCounter() as counter:
        assert total.full_tensor().item() == x.sum().item() == 1.015625
    assert counter.counts["all_reduce"] == 1  # the float32 pieces, reduced at once
    assert counter.total_bytes == 2 * 3 * 4  # 4 bytes each: pieces held in float32
    parts = [torch.tensor([v], dtype=f16) for v in (1.0, 3000.0, -3000.0, 2**-11)]
    pending = DTensor.from_local(parts, MESH4, [Partial()])
    for got, want in [(pending.sum(), torch.stack(parts).float().sum().half()),
                      (pending.mean(), torch.stack(parts).float().sum().half())]:
        assert torch.equal(got.full_tensor(), want)
    assert pending.sum(dtype=f32).placements == (Partial(),)  # float32 pieces stay pending


@pytest.mark.parametrize("dtype", [f16, bf16])
def test_partial_sums_accumulate_like_torch(dtype: torch.dtype) -> None:
    parts = [torch.tensor([v], dtype=dtype) for v in (1.0, 2**-8, 2**-8, 2**-9)]
    want = torch.stack(parts).sum(0)  # torch: float32 accumulation, one rounding
    got = DTensor.from_local(parts, MESH4, [Partial()])
    assert torch.equal(got.full_tensor(), want)
    assert torch.equal(got.redistribute(placements=[Shard(0)]).full_tensor(), want)
    big = [torch.tensor([v], dtype=f16) for v in (60000.0, 60000.0, -60000.0, -59000.0)]
    want = torch.stack(big).sum(0)
    assert torch.equal(DTensor.from_local(big, MESH4, [Partial()]).full_tensor(), want)


# ----- 12: settings are per thread / per context -------------------------------------------


def test_implicit_redistribute_is_per_thread() -> None:
    a = sw.distribute_tensor(torch.ones(4, 4), MESH2, [Shard(0)])
    b = sw.distribute_tensor(torch.ones(4, 4), MESH2, [Shard(1)])
    inside, other = threading.Event(), threading.Event()
    seen: dict = {}

    def explicit_thread() -> None:
        inside.wait(10)
        try:
            a + b
            seen["other"] = "ran"
        except sw.errors.ImplicitRedistributeError:
            seen["other"] = "refused"
        other.set()

    t = threading.Thread(target=explicit_thread)
    t.start()
    with sw.config.allow_implicit_redistribute():
        inside.set()
        other.wait(10)
        assert torch.equal((a + b).full_tensor(), torch.full((4, 4), 2.0))
    t.join(10)
    assert seen["other"] == "refused"
    with pytest.raises(sw.errors.ImplicitRedistributeError):
        a + b  # nothing stays on after the block


def test_counters_and_descriptions_are_per_context() -> None:
    x = sw.distribute_tensor(torch.ones(4), MESH2, [Shard(0)])

    async def task(counter: sw.debug.CommCounter, moves: int, name: str) -> list:
        seen = []
        with counter, safety.moving(name):
            for _ in range(moves):
                await asyncio.sleep(0)
                seen.append(safety.current_description())
                x.redistribute(placements=[Replicate()])
        return seen

    async def both() -> tuple:
        c1, c2 = sw.debug.CommCounter(), sw.debug.CommCounter()
        s1, s2 = await asyncio.gather(task(c1, 1, "one"), task(c2, 3, "two"))
        return c1, c2, s1, s2

    c1, c2, s1, s2 = asyncio.run(both())
    assert c1.counts["all_gather"] == 1 and c2.counts["all_gather"] == 3
    assert s1 == ["one"] and s2 == ["two"] * 3
    assert safety.current_description() == ""


def test_debug_and_timeout_settings_are_process_wide() -> None:
    old = sw.config.get_collective_timeout()
    try:
        sw.config.set_collective_timeout(12)
        got = []
        t = threading.Thread(target=lambda: got.append(sw.config.get_collective_timeout()))
        t.start()
        t.join(10)
        assert got == [12.0]
    finally:
        sw.config.set_collective_timeout(old)


# ----- 13: dispatch under threads ----------------------------------------------------------


def test_a_decision_published_meanwhile_by_another_thread_is_not_half_used(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The race behind the raw ``'NoneType' object has no attribute 'shape'``: thread A misses
    the cache, thread B publishes the same key, A must still fill in its own decision."""
    sw.rules.clear_sharding_cache()
    x = sw.distribute_tensor(torch.arange(6.0).reshape(3, 2), MESH2, [Shard(0)])
    real = sw_dispatch.decide
    entered = []

    def decide_while_another_thread_publishes(*args: object) -> object:
        decision = real(*args)
        if not entered:
            entered.append(1)
            t = threading.Thread(target=lambda: x.transpose(0, 1))
            t.start()
            t.join(10)
        return decision

    monkeypatch.setattr(sw_dispatch, "decide", decide_while_another_thread_publishes)
    out = x.transpose(0, 1)
    assert entered and torch.equal(out.full_tensor(), torch.arange(6.0).reshape(3, 2).T)


def test_concurrent_dispatch_on_different_meshes() -> None:
    meshes = [sw.init_device_mesh("cpu", (n,)) for n in (2, 3)]
    errors: list = []
    start = threading.Barrier(2)

    def work(mesh: sw.DeviceMesh) -> None:
        try:
            start.wait(10)
            for i in range(60):
                if i % 7 == 0:
                    sw.rules.clear_sharding_cache()
                x = sw.distribute_tensor(torch.arange(12.0).reshape(6, 2), mesh, [Shard(0)])
                y = (x * 2).transpose(0, 1).sum(0)
                assert torch.equal(y.full_tensor(), (torch.arange(12.0).reshape(6, 2) * 2).sum(1))
        except Exception as err:
            errors.append(err)

    threads = [threading.Thread(target=work, args=(m,)) for m in meshes]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors


# ----- 14, 15: bad input raises a shardwise error ------------------------------------------


MESH22 = sw.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
BAD_INPUT = [
    (lambda: sw.distribute_tensor(torch.ones(4), MESH4, Shard(0)), sw.errors.InvalidPlacementError,
     "one placement per mesh dim"),
    (lambda: sw.init_device_mesh("cpu", 4), sw.errors.MeshError, "(4,)"),
    (lambda: sw.DeviceMesh("cpu", [[0, 1], [2]]), sw.errors.MeshError, "rectangular"),
    (lambda: sw.DeviceMesh("cpu", ["a", "b"]), sw.errors.MeshError, "int device ids"),
    (lambda: sw.DeviceMesh("cpu", [0.5, 1.5]), sw.errors.MeshError, "must be ints"),
    (lambda: sw.tf.create_mesh([("x", 2)], devices=[1, 1]), sw.errors.MeshError, "unique"),
    (lambda: DTensor.from_local([torch.ones(2, 2)] * 4, MESH4, [Shard(0)], stride=(1,)),
     sw.errors.PackError, "[8, 2]"),
    (lambda: DTensor.from_local([torch.ones(2, 2)] * 4, MESH4, [Shard(0)], stride=(-1, 5)),
     sw.errors.PackError, "stride"),
    (lambda: DTensor.from_local([torch.ones(2, 2)] * 4, MESH4, [Shard(0)], stride=(0, 0)),
     sw.errors.PackError, "stride"),
    (lambda: sw.full((2,), "x", device_mesh=MESH4), sw.errors.InvalidArgumentError, "fill value"),
    (lambda: sw.full((2,), 1, dtype="float32", device_mesh=MESH4), sw.errors.InvalidArgumentError,
     "dtype"),
    (lambda: sw.zeros(2, dtype="float32", device_mesh=MESH4), sw.errors.InvalidArgumentError,
     "dtype"),
    (lambda: sw.config.set_collective_timeout("abc"), sw.errors.InvalidArgumentError, "'abc'"),
    (lambda: sw.config.set_collective_timeout(float("inf")), sw.errors.InvalidArgumentError, "inf"),
    (lambda: sw.config.set_collective_timeout(float("nan")), sw.errors.InvalidArgumentError, "nan"),
    (lambda: MESH22[0], sw.errors.ShardwiseTypeError, "mesh dim names"),
    (lambda: MESH22.groups("pp"), sw.errors.MeshError, "'pp'"),
    (lambda: sw.distribute_tensor(torch.ones(4), MESH4, [Shard(0)], src_data_rank=4),
     sw.errors.InvalidArgumentError, "src_data_rank=4"),
    (lambda: sw.distribute_tensor([1.0, 2.0], MESH4, [Shard(0)]), sw.errors.InvalidArgumentError,
     "list"),
]
if not torch.cuda.is_available():
    BAD_INPUT.append((lambda: sw.init_device_mesh("cuda", (2,)), sw.errors.MeshError, "CUDA"))


@pytest.mark.parametrize(("call", "cls", "fragment"), BAD_INPUT)
def test_bad_input_raises_a_shardwise_error(call: Callable, cls: type, fragment: str) -> None:
    _raises(call, cls, fragment)


def test_mesh_dims_by_name_and_any_ids_in_one_process() -> None:
    assert MESH22.groups("tp") == MESH22.groups(1) == [(0, 1), (2, 3)]
    assert MESH22.group_of(3, "dp") == (1, 3)
    mesh = sw.DeviceMesh("cpu", [5, 9])  # one process owns every id, whatever they are
    assert mesh.local_device_ids == (5, 9)
    x = sw.distribute_tensor(torch.arange(4.0), mesh, [Shard(0)])
    assert torch.equal(x.full_tensor(), torch.arange(4.0))
    named = sw.tf.create_mesh([("x", 2)], devices=[1, 0])
    assert named.mesh.tolist() == [1, 0]
    transposed = DTensor.from_local([torch.ones(2, 2)] * 4, MESH4, [Shard(0)], stride=(1, 8))
    assert transposed.stride() == (1, 8)


# ----- 16: torch.load with weights_only (the default) --------------------------------------


def test_saved_dtensor_loads_with_weights_only() -> None:
    x = sw.distribute_tensor(torch.arange(8.0).reshape(4, 2), MESH22, [Shard(0), Partial()])
    buffer = io.BytesIO()
    torch.save({"w": x, "mesh": MESH22}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer)  # weights_only=True
    assert loaded["mesh"] == MESH22 and loaded["mesh"].groups("tp") == MESH22.groups("tp")
    assert loaded["w"].placements == (Shard(0), Partial())
    assert torch.equal(loaded["w"].full_tensor(), torch.arange(8.0).reshape(4, 2))


def test_a_loaded_spec_hashes_like_a_fresh_one() -> None:
    """Spec hashes cache string hashes, salted per process: a saved one must not travel."""
    x = sw.distribute_tensor(torch.ones(4, 2), MESH22, [Shard(0), Partial()])
    object.__setattr__(x._spec, "_hash", 12345)  # as if computed by another process
    buffer = io.BytesIO()
    torch.save(x, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer)
    fresh = sw.distribute_tensor(torch.ones(4, 2), MESH22, [Shard(0), Partial()])
    assert loaded._spec == fresh._spec and hash(loaded._spec) == hash(fresh._spec)


# ----- 17: accounting fields ----------------------------------------------------------------


def test_comm_counter_fields_are_consistent() -> None:
    x = sw.distribute_tensor(torch.ones(4), MESH2, [Shard(0)])
    with sw.debug.CommCounter() as c:
        x.redistribute(placements=[Replicate()])
    for per_kind in (c.counts, c.bytes, c.cross_process_bytes, c.meta_bytes):
        assert isinstance(per_kind, dict)
    for total in (c.total_bytes, c.total_cross_process_bytes, c.total_meta_bytes):
        assert isinstance(total, int)
    assert c.total_bytes == 16 and c.total_cross_process_bytes == 0 and c.total_meta_bytes == 0
    assert not c.cross_process_bytes and not c.meta_bytes  # nothing crossed processes
