"""``comm_budget`` in one process: limits met and exceeded by implicit and explicit moves, per
op, in total, per mesh dim, warn mode, nesting, threads, the error message, CommDebugMode.

Expected bytes are worked out here from the tensor sizes (bytes each device receives under the
ring model, summed over this process's devices), never read back from shardwise's output."""

from __future__ import annotations

import itertools
import threading
import warnings

import pytest
import torch

import shardwise as sw
from shardwise import Partial, Replicate, Shard, settings
from shardwise import comm as sw_comm
from shardwise.debug import CommDebugMode
from shardwise.errors import CommBudgetExceededError, CommBudgetWarning

N = 4
SHAPE = (8, 4)
FULL = 8 * 4 * 4  # bytes of the float32 global tensor
# Shard(0) -> Replicate on N devices: each receives the N - 1 pieces it lacks
GATHER = N * (N - 1) * FULL // N
# Partial -> Shard: ring reduce-scatter, each device receives a partial of every piece but its own
REDUCE_SCATTER = N * (FULL - FULL // N)


@pytest.fixture
def mesh() -> sw.DeviceMesh:
    return sw.init_device_mesh("cpu", (N,))


def _sharded(mesh: sw.DeviceMesh, seed: int = 0) -> tuple[torch.Tensor, sw.DTensor]:
    x = torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed))
    return x, sw.distribute_tensor(x, mesh, [Shard(0)])


def _partial(mesh: sw.DeviceMesh) -> tuple[torch.Tensor, sw.DTensor]:
    terms = [torch.randn(SHAPE, generator=torch.Generator().manual_seed(k)) for k in range(N)]
    return sum(terms), sw.DTensor.from_local(terms, mesh, [Partial()])


def test_implicit_move_within_budget_runs_and_is_charged(mesh: sw.DeviceMesh) -> None:
    total, p = _partial(mesh)
    with pytest.raises(sw.errors.ImplicitRedistributeError):  # explicit mode outside a budget
        torch.exp(p)
    with sw.debug.comm_budget(bytes=REDUCE_SCATTER) as budget, sw.debug.CommCounter() as counter:
        out = torch.exp(p)  # needs the pending sum reduced: a reduce-scatter is cheapest
    torch.testing.assert_close(out.full_tensor(), torch.exp(total))
    assert budget.used == counter.total_bytes == REDUCE_SCATTER
    assert budget.remaining() == 0


def test_exceeding_raises_before_moving_with_the_plan(mesh: sw.DeviceMesh) -> None:
    _, p = _partial(mesh)
    limit = REDUCE_SCATTER - 1
    with sw.debug.comm_budget(bytes=limit) as budget, sw.debug.CommCounter() as counter:
        with pytest.raises(CommBudgetExceededError) as info:
            torch.exp(p)
    assert counter.total_bytes == 0 and budget.used == 0  # nothing moved
    text = str(info.value)
    assert "aten.exp.default" in text
    assert "reduce_scatter on mesh dim 0" in text
    assert f"{REDUCE_SCATTER} bytes on this process's devices" in text
    assert f"lower bound {REDUCE_SCATTER}" in text  # Partial -> Shard at the bound
    assert f"> limit {limit}" in text and f"bytes={limit}" in text
    assert "used so far: 0 bytes used" in text and "nothing was moved" in text
    assert "[8, 4]" in text and "Partial" in text


def test_explicit_redistributions_count_against_the_total(mesh: sw.DeviceMesh) -> None:
    x, dx = _sharded(mesh)
    with sw.debug.comm_budget(bytes=GATHER + GATHER // 2) as budget:
        assert torch.equal(dx.full_tensor(), x)
        assert budget.used == GATHER
        with pytest.raises(CommBudgetExceededError) as info:
            dx.redistribute(placements=[Replicate()])
    assert budget.used == GATHER  # the refused one moved nothing
    text = str(info.value)
    assert "DTensor.redistribute" in text and "all_gather on mesh dim 0" in text
    assert f"used so far: {GATHER} bytes used of {GATHER + GATHER // 2}" in text


def test_async_redistribute_is_checked_when_asked(mesh: sw.DeviceMesh) -> None:
    x, dx = _sharded(mesh)
    with sw.debug.comm_budget(bytes=GATHER - 1), pytest.raises(CommBudgetExceededError):
        dx.redistribute(placements=[Replicate()], async_op=True)
    with sw.debug.comm_budget(bytes=GATHER) as budget:
        out = dx.redistribute(placements=[Replicate()], async_op=True)
        assert torch.equal(out.wait().full_tensor(), x)
    assert budget.used == GATHER


def test_a_budget_is_entered_once(mesh: sw.DeviceMesh) -> None:
    budget = sw.debug.comm_budget(bytes=10)
    with budget, pytest.raises(sw.errors.InvalidArgumentError, match="already active"), budget:
        pass


def test_per_op_limits_each_operation_not_the_sum(mesh: sw.DeviceMesh) -> None:
    x, dx = _sharded(mesh)
    with sw.debug.comm_budget(per_op=GATHER) as budget:
        for _ in range(3):
            assert torch.equal(dx.full_tensor(), x)
    assert budget.used == 3 * GATHER and budget.largest_op == GATHER
    with sw.debug.comm_budget(per_op=GATHER - 1), pytest.raises(CommBudgetExceededError) as info:
        dx.full_tensor()
    assert f"per op: {GATHER} bytes > limit {GATHER - 1}" in str(info.value)


def test_per_op_counts_all_inputs_of_one_op(mesh: sw.DeviceMesh) -> None:
    (_, p), (_, q) = _partial(mesh), _partial(mesh)
    # each operand is reduced on its own: an op moving both moves twice one's bytes
    with (
        sw.debug.comm_budget(per_op=2 * REDUCE_SCATTER - 1),
        pytest.raises(CommBudgetExceededError),
    ):
        torch.exp(p) + torch.exp(q)  # fine so far: one operand each
        torch.maximum(p, q)
    with sw.debug.comm_budget(per_op=2 * REDUCE_SCATTER) as budget:
        torch.maximum(p, q)
    assert budget.largest_op == 2 * REDUCE_SCATTER


def test_per_mesh_dim_by_name_and_index() -> None:
    mesh = sw.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    x = torch.randn(SHAPE)
    dx = sw.distribute_tensor(x, mesh, [Shard(0), Shard(1)])
    # gathering over tp: each device holds a [4, 2] piece and receives its tp partner's
    tp_bytes = 4 * (4 * 2 * 4)
    for per_dim in ({"tp": tp_bytes}, {1: tp_bytes}, {"dp": 0, "tp": tp_bytes}):
        with sw.debug.comm_budget(per_dim=per_dim) as budget:
            out = dx.redistribute(placements=[Shard(0), Replicate()])
        assert torch.equal(out.full_tensor(), x)
        assert budget.used == tp_bytes and budget.used_per_dim.get("dp", 0) == 0
    for per_dim in ({"tp": tp_bytes - 1}, {1: tp_bytes - 1}):
        with sw.debug.comm_budget(per_dim=per_dim), pytest.raises(CommBudgetExceededError) as info:
            dx.redistribute(placements=[Shard(0), Replicate()])
        key = next(iter(per_dim))
        assert f"mesh dim {key!r}: 0 used + {tp_bytes}" in str(info.value)
    with sw.debug.comm_budget(per_dim={"dp": 0}), pytest.raises(CommBudgetExceededError):
        dx.redistribute(placements=[Replicate(), Shard(1)])


def test_an_exchange_is_charged_to_every_dim_it_changes() -> None:
    mesh = sw.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    x = torch.randn(8, 8)
    dx = sw.distribute_tensor(x, mesh, [Shard(0), Shard(1)])
    # device (i, j) holds the [4, 4] block (i, j) and wants block (j, i): the two devices off
    # the diagonal swap theirs, point to point, changing both mesh dims at once
    swapped = 2 * 4 * 4 * 4
    target = [Shard(1), Shard(0)]
    with sw.debug.comm_budget(per_dim={"dp": swapped, "tp": swapped}) as budget:
        out = dx.redistribute(placements=target)
    assert torch.equal(out.full_tensor(), x)
    assert budget.used == swapped and budget.used_per_dim == {"dp": swapped, "tp": swapped}
    with sw.debug.comm_budget(per_dim={"tp": swapped - 1}), pytest.raises(CommBudgetExceededError):
        dx.redistribute(placements=target)


def test_the_check_ahead_matches_the_charge_over_placement_pairs() -> None:
    """A budget of exactly what a plan moves lets it through and is used up by it; one byte
    less refuses it before anything moves (uneven shape, every pair on a 2x2 mesh)."""
    mesh = sw.init_device_mesh("cpu", (2, 2))
    x = torch.randn(5, 3)
    options = [Replicate(), Shard(0), Shard(1)]
    tried = 0
    for source in itertools.product(options, repeat=2):
        dx = sw.distribute_tensor(x, mesh, list(source))
        for target in itertools.product(options, repeat=2):
            planned = sw.debug.explain_redistribute(dx, list(target)).bytes
            with sw.debug.comm_budget(bytes=planned) as budget, sw.debug.CommCounter() as counter:
                out = dx.redistribute(placements=list(target))
            assert torch.equal(out.full_tensor(), x)
            assert budget.used == counter.total_bytes == planned, (source, target)
            if planned:
                tried += 1
                with sw.debug.comm_budget(bytes=planned - 1), sw.debug.CommCounter() as counter:
                    with pytest.raises(CommBudgetExceededError):
                        dx.redistribute(placements=list(target))
                assert counter.total_bytes == 0
    assert tried > 40


def test_in_process_moves_are_not_cross_process(mesh: sw.DeviceMesh) -> None:
    x, dx = _sharded(mesh)
    with sw.debug.comm_budget(cross_process_bytes=0) as budget:
        assert torch.equal(dx.full_tensor(), x)
    assert budget.used == GATHER and budget.used_cross_process == 0


def test_warn_mode_goes_on(mesh: sw.DeviceMesh) -> None:
    total, p = _partial(mesh)
    with sw.debug.comm_budget(bytes=10, on_exceed="warn") as budget:
        with pytest.warns(CommBudgetWarning, match="aten.exp.default would exceed"):
            out = torch.exp(p)
    torch.testing.assert_close(out.full_tensor(), torch.exp(total))
    assert budget.used == REDUCE_SCATTER and budget.remaining() == 0
    assert issubclass(CommBudgetWarning, sw.errors.ShardwiseWarning)


def test_nested_budgets_both_charged_inner_limits_further(mesh: sw.DeviceMesh) -> None:
    _, dx = _sharded(mesh)
    with sw.debug.comm_budget(bytes=3 * GATHER) as outer:
        with sw.debug.comm_budget(bytes=GATHER) as inner:
            dx.full_tensor()
            with pytest.raises(CommBudgetExceededError) as info:
                dx.full_tensor()
            assert "bytes=" + str(GATHER) in str(info.value)
        assert inner.used == outer.used == GATHER
        dx.full_tensor()  # the outer one still has room
        assert outer.used == 2 * GATHER
        with sw.debug.comm_budget(bytes=100 * GATHER) as roomy:  # an inner budget cannot widen
            dx.full_tensor()
            with pytest.raises(CommBudgetExceededError) as info:
                dx.full_tensor()
        assert f"bytes={3 * GATHER}" in str(info.value) and roomy.used == GATHER
    assert outer.used == 3 * GATHER
    assert settings.COMM_BUDGETS.get() == ()


def test_threads_do_not_see_a_budget(mesh: sw.DeviceMesh) -> None:
    x, dx = _sharded(mesh)
    seen: list = []

    def other() -> None:
        seen.append(torch.equal(dx.full_tensor(), x))

    with sw.debug.comm_budget(bytes=0) as budget:
        thread = threading.Thread(target=other)
        thread.start()
        thread.join(timeout=60)
        with pytest.raises(CommBudgetExceededError):
            dx.full_tensor()
    assert seen == [True] and budget.used == 0


def test_a_collective_outside_a_plan_is_checked_after_it_runs(mesh: sw.DeviceMesh) -> None:
    pieces = [torch.ones(4) for _ in range(N)]  # 16 bytes each
    received = N * 2 * (16 - 4)  # ring all-reduce: each device lacks 3 of its 4 chunks, twice
    with sw.debug.comm_budget(bytes=received - 1) as budget, sw.debug.CommCounter() as counter:
        with pytest.raises(CommBudgetExceededError, match="has already run") as info:
            with sw_comm.moving("the test's pieces"):
                sw_comm.all_reduce(mesh, 0, pieces)
    assert "all_reduce on mesh dim 0" in str(info.value) and "the test's pieces" in str(info.value)
    assert counter.total_bytes == budget.used == received


def test_comm_debug_mode_table_shows_the_budget(mesh: sw.DeviceMesh) -> None:
    _, dx = _sharded(mesh)
    with sw.debug.comm_budget(bytes=1000, per_op=GATHER, per_dim={0: 2000}):
        with CommDebugMode() as debug:
            dx.full_tensor()
    table = debug.generate_comm_debug_tracing_table(noise_level=0)
    assert f"total: limit 1000, used {GATHER}, remaining {1000 - GATHER}" in table
    assert f"per op (largest): limit {GATHER}, used {GATHER}, remaining 0" in table
    assert f"mesh dim 0: limit 2000, used {GATHER}, remaining {2000 - GATHER}" in table
    with CommDebugMode() as debug:
        dx.full_tensor()
    assert "budget" not in debug.generate_comm_debug_tracing_table()


@pytest.mark.parametrize(
    "kwargs",
    [{"bytes": -1}, {"per_op": 1.5}, {"on_exceed": "ignore"}, {"per_dim": {"tp": -2}},
     {"per_dim": {1.0: 3}}],
)
def test_bad_limits(kwargs: dict) -> None:
    with pytest.raises(sw.errors.InvalidArgumentError, match="comm_budget"):
        sw.debug.comm_budget(**kwargs)


def test_no_warning_within_budget(mesh: sw.DeviceMesh) -> None:
    _, dx = _sharded(mesh)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with sw.debug.comm_budget(bytes=GATHER, on_exceed="warn"):
            dx.full_tensor()
