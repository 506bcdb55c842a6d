"""The warm dispatch path: cached decisions keyed by input specs and static arguments, the
one-device direct call, precompiled local moves, and concurrent dispatch from threads."""

from __future__ import annotations

import itertools
import threading

import pytest
import torch

import shardwise as sw
from shardwise import InterleavedShard, Partial, Replicate, Shard
from shardwise import dispatch as sw_dispatch
from shardwise.redistribute import compile_plan, execute_plan, plan_redistribute

MESH1 = sw.init_device_mesh("cpu", (1,))
MESH2 = sw.init_device_mesh("cpu", (2,))
MESH22 = sw.init_device_mesh("cpu", (2, 2))


@pytest.fixture()
def decisions(monkeypatch: pytest.MonkeyPatch) -> list:
    """The ops that reached ``_decide`` (missed the cache) since the fixture started."""
    seen: list = []
    real = sw_dispatch.decide

    def counting(func, *args):
        seen.append(func)
        return real(func, *args)

    sw.rules.clear_sharding_cache()
    monkeypatch.setattr(sw_dispatch, "decide", counting)
    return seen


def test_a_repeated_call_is_decided_once(decisions: list) -> None:
    x = torch.randn(6, 4)
    a = sw.distribute_tensor(x, MESH2, [Shard(0)])
    for _ in range(3):
        assert torch.equal((a * 2.0).full_tensor(), x * 2.0)
        torch.testing.assert_close(a.sum(0).full_tensor(), x.sum(0))
    assert decisions == [torch.ops.aten.mul.Tensor, torch.ops.aten.sum.dim_IntList]


def test_scalars_before_static_argnum_share_a_decision_and_static_ones_do_not(
    decisions: list,
) -> None:
    x = torch.randn(6, 4)
    a = sw.distribute_tensor(x, MESH2, [Shard(0)])
    for value in (2.0, 3.0, -1.5):  # the scalar's value does not change the sharding
        assert torch.equal((a * value).full_tensor(), x * value)
    assert len(decisions) == 1
    torch.testing.assert_close(a.sum(1).full_tensor(), x.sum(1))  # the dim does
    torch.testing.assert_close(a.sum(0).full_tensor(), x.sum(0))
    assert len(decisions) == 3


def test_scalar_tensors_of_other_dtypes_get_their_own_output_dtype() -> None:
    """A 0-d plain tensor promotes by dtype: 1 and 1.5 give an int and a float result (one
    decision for both gave the second result the first one's dtype)."""
    x = torch.arange(4)
    a = sw.distribute_tensor(x, MESH2, [Shard(0)])
    for scalar in (torch.tensor(1), torch.tensor(1.5), torch.tensor(True)):
        out = a + scalar
        want = x + scalar
        assert out.dtype == want.dtype == out._components[0].dtype
        assert torch.equal(out.full_tensor(), want)


def test_static_numbers_of_other_types_are_other_keys() -> None:
    key = sw_dispatch.scan
    a = sw.distribute_tensor(torch.ones(4), MESH2, [Shard(0)])
    keys = {key((a, v), {}, 1)[0] for v in (1, 1.0, True)}
    assert len(keys) == 3


def test_warm_in_place_write_into_view_of_moved_input_still_raises() -> None:
    x = torch.randn(4, 6)
    for _ in range(2):  # the first round decides, the second is served from the cache
        dx = sw.distribute_tensor(x, MESH2, [Shard(0)])
        column = dx.select(1, 2)  # rows stay sharded: the view aliases dx's pieces
        column.fill_(1.0)
        expected = x.clone()
        expected[:, 2] = 1.0
        assert torch.equal(dx.full_tensor(), expected)
        with sw.config.allow_implicit_redistribute():
            row = dx.select(0, 1)  # a sharded dim: the view is of a gathered copy
            with pytest.raises(sw.errors.UnsupportedOpError, match="would not see the write"):
                row.fill_(2.0)
        assert torch.equal(dx.full_tensor(), expected)


def test_warm_in_place_op_on_one_device_mesh_takes_the_op_placements() -> None:
    x = torch.randn(4, 4)
    for _ in range(2):
        a = sw.distribute_tensor(x.clone(), MESH1, [Shard(0)])
        b = sw.distribute_tensor(x.clone(), MESH1, [Replicate()])
        b.add_(a)
        assert torch.equal(b.full_tensor(), 2 * x)
        assert b.placements == (Replicate(),)


@pytest.mark.parametrize("mesh", [MESH2, MESH22], ids=["2", "2x2"])
def test_compiled_local_plans_equal_execute_plan(mesh: sw.DeviceMesh) -> None:
    options = [Replicate(), Shard(0), Shard(1), InterleavedShard(0, 2), Partial()]
    x = torch.randn(8, 6)
    checked = 0
    for src, dst in itertools.product(itertools.product(options, repeat=mesh.ndim), repeat=2):
        dt = sw.distribute_tensor(x, mesh, list(src))
        plan = plan_redistribute(dt._spec, dst)
        got = compile_plan(plan, dt._spec)(dt._components)
        want = execute_plan(plan, mesh, dt._components)
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            assert g.shape == w.shape and torch.equal(g, w), (src, dst)
        checked += bool(plan.steps) and all(s.collective == "local" for s in plan.steps)
    assert checked >= 4


def test_local_moves_on_several_devices_equal_torch() -> None:
    x, y = torch.randn(8, 6), torch.randn(8, 6)
    for mesh, placements in ((MESH2, [Shard(0)]), (MESH22, [Shard(0), Shard(1)])):
        a = sw.distribute_tensor(x, mesh, placements)
        b = sw.distribute_tensor(y, mesh, [Replicate()] * mesh.ndim)
        for _ in range(2):
            out = a + b  # b is cut locally to a's placements
            assert out.placements == a.placements
            assert torch.equal(out.full_tensor(), x + y)


def test_concurrent_warm_and_cold_dispatch_from_threads() -> None:
    """Threads run views, in-place ops, reductions and local moves while another clears the
    cache: every result equals torch's."""
    x = torch.arange(24.0).reshape(6, 4)
    errors: list = []
    start = threading.Barrier(4)

    def work(mesh: sw.DeviceMesh) -> None:
        try:
            start.wait(10)
            rest = [Replicate()] * (mesh.ndim - 1)
            for _ in range(40):
                a = sw.distribute_tensor(x, mesh, [Shard(0), *rest])
                b = sw.distribute_tensor(x, mesh, [Replicate(), *rest])
                c = (a + b).t().sum(1)
                d = a.clone()
                d.mul_(2.0)
                assert torch.equal(c.full_tensor(), (2 * x).t().sum(1))
                assert torch.equal(d.full_tensor(), 2 * x)
                assert torch.equal(a.view(-1).full_tensor(), x.view(-1))
        except Exception as err:
            errors.append(err)

    def clear() -> None:
        start.wait(10)
        for _ in range(40):
            sw.rules.clear_sharding_cache()

    threads = [threading.Thread(target=work, args=(m,)) for m in (MESH1, MESH2, MESH22)]
    threads.append(threading.Thread(target=clear))
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors


def test_numbers_in_keyword_arguments_that_do_not_shard_share_a_decision(
    decisions: list,
) -> None:
    """AdamW passes ``value=-step_size``, a new number every step: the steps after the first
    reuse its decisions, and the parameters equal plain torch's."""
    weight = torch.randn(6, 4)
    plain = weight.clone().requires_grad_()
    sharded = torch.nn.Parameter(sw.distribute_tensor(weight, MESH2, [Shard(0)]))
    opts = [torch.optim.AdamW([plain], lr=0.1), torch.optim.AdamW([sharded], lr=0.1)]
    missed = []
    for step in range(4):
        grad = torch.randn(6, 4, generator=torch.Generator().manual_seed(step))
        plain.grad = grad.clone()
        sharded.grad = sw.distribute_tensor(grad, MESH2, [Shard(0)])
        for opt in opts:
            opt.step()
        missed.append(len(decisions))
    assert torch.equal(sharded.detach().full_tensor(), plain.detach())
    assert missed[3] == missed[2] == missed[1], missed


def test_keyword_numbers_that_shard_are_still_keys() -> None:
    """``alpha`` decides whether ``add`` keeps a Partial (0 makes it constant): by value."""
    x = torch.randn(4, 3)
    p = sw.distribute_tensor(x, MESH2, [Partial()])
    y = torch.randn(4, 3)
    r = sw.distribute_tensor(y, MESH2, [Replicate()])
    for alpha in (0.0, 2.0, -1.5):
        got = torch.add(r, p, alpha=alpha).full_tensor()
        assert torch.equal(got, torch.add(y, x, alpha=alpha))


def test_a_replicated_input_is_cut_once_while_unchanged() -> None:
    """The views a local Replicate -> Shard move cuts are kept with the DTensor: the next op
    reuses them while the components are the same and unchanged, and they go with it."""
    import gc

    from shardwise import op_inputs

    x, y = torch.randn(8, 6), torch.randn(8, 6)
    a = sw.distribute_tensor(x, MESH2, [Shard(1)])
    b = sw.distribute_tensor(y, MESH2, [Replicate()])
    assert torch.equal((a + b).full_tensor(), x + y)
    cut = op_inputs._CUTS[id(b)][4]
    assert torch.equal((a * b).full_tensor(), x * y)
    assert op_inputs._CUTS[id(b)][4] is cut  # the same views, not cut again
    b.mul_(2)  # written in place: the views see the new values
    assert torch.equal((a + b).full_tensor(), x + 2 * y)
    for c, z in zip(b._components, (torch.ones(8, 6), torch.zeros(8, 6)), strict=True):
        c.set_(z)  # a component given other memory in place: cut again
    expected = x + torch.cat([torch.ones(8, 3), torch.zeros(8, 3)], 1)
    assert torch.equal((a + b).full_tensor(), expected)
    assert op_inputs._CUTS[id(b)][4] is not cut
    key = id(b)
    del b
    gc.collect()
    assert key not in op_inputs._CUTS


def test_hits_and_misses_are_counted_per_decision() -> None:
    """``debug.sharding_cache_stats``: a call that decides is a miss, a call that finds its
    decision a hit; a new spec decides again; clearing restarts the counts."""
    mesh = sw.init_device_mesh("cpu", (2,))
    x = sw.distribute_tensor(torch.randn(4, 6), mesh, [Shard(0)])
    y = sw.distribute_tensor(torch.randn(4, 6), mesh, [Shard(1)])
    sw.debug.clear_sharding_cache()
    assert sw.debug.sharding_cache_stats() == (0, 0)
    x + x
    assert sw.debug.sharding_cache_stats() == (0, 1)
    for _ in range(3):
        x + x
    assert sw.debug.sharding_cache_stats() == (3, 1)
    y + y
    assert sw.debug.sharding_cache_stats() == (3, 2)
    sw.debug.clear_sharding_cache()
    assert sw.debug.sharding_cache_stats() == (0, 0)
    x + x
    assert sw.debug.sharding_cache_stats() == (0, 1)
