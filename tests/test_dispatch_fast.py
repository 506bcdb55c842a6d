"""The fast warm path: local kernels through checked Python bindings (``fast_call``), hooks
resolved once per sharding decision, and the results still equal single-device torch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import shardwise as sw
from shardwise import Replicate, Shard
from shardwise import dispatch as sw_dispatch
from shardwise.fast_call import binding, checked_call

aten = torch.ops.aten
MESH1 = sw.init_device_mesh("cpu", (1,))
MESH2 = sw.init_device_mesh("cpu", (2,))


def _entry(func):
    (entry,) = sw_dispatch._OPS[id(func)].decisions.values()
    return entry


class _Seen(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


def test_a_binding_that_makes_exactly_the_call_is_used() -> None:
    x = torch.randn(5, 3)
    for func, args, expected in (
        (aten.sum.dim_IntList, (x, [0]), x.sum(0)),
        (aten.t.default, (x,), x.t()),
        (aten.view.default, (x, [-1]), x.view(-1)),
        (aten._softmax.default, (x, 1, False), torch.softmax(x, 1)),
    ):
        with _Seen() as seen:
            result, bound = checked_call(func, binding(func), args, {})
        assert bound, func
        assert seen.ops == [func]  # the kernel ran once, as the op itself
        assert torch.equal(result, expected)


def test_a_binding_that_dispatches_something_else_runs_nothing_and_falls_back() -> None:
    x = torch.randn(4, 4)
    # torch.mul with a scalar passes the scalar, but mul.Scalar's binding is mul.Tensor
    with _Seen() as seen:
        result, bound = checked_call(aten.mul.Scalar, binding(aten.mul.Scalar), (x, 3), {})
    assert not bound
    assert seen.ops == [aten.mul.Scalar]  # only the fallback ran
    assert torch.equal(result, x * 3)


def test_ops_that_write_or_draw_random_numbers_get_no_binding() -> None:
    assert binding(aten.add_.Tensor) is None
    assert binding(aten.bernoulli.default) is None
    assert binding(aten.split.Tensor) is None  # several outputs
    assert binding(aten.add.Tensor) is not None


def test_warm_calls_through_the_binding_equal_torch() -> None:
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    a = sw.distribute_tensor(x, MESH1, [Shard(0)])
    b = sw.distribute_tensor(y, MESH1, [Replicate()])
    sw.rules.clear_sharding_cache()
    for _ in range(2):
        assert torch.equal((a + b).full_tensor(), x + y)
        assert torch.equal(torch.mm(a, b).full_tensor(), torch.mm(x, y))
        assert torch.equal(a.t().full_tensor(), x.t())
    assert _entry(aten.mm.default).call is torch.mm
    assert _entry(aten.mm.default).direct


def test_a_torch_function_mode_sees_no_local_kernel_call() -> None:
    """A binding would call into an active TorchFunctionMode with the components; the boxed
    call does not, so the mode sees only the user's own call."""

    class Calls(TorchFunctionMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: list = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.names.append(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))

    x, y = torch.randn(4, 4), torch.randn(4, 4)
    a = sw.distribute_tensor(x, MESH1, [Shard(0)])
    b = sw.distribute_tensor(y, MESH1, [Replicate()])
    torch.mm(a, b)  # warm, through the binding
    with Calls() as mode:
        out = torch.mm(a, b)
    assert mode.names == ["mm"]
    assert torch.equal(out.full_tensor(), torch.mm(x, y))


@pytest.mark.parametrize("placements", [[Replicate()], [Shard(1)], [Shard(0)]])
def test_embedding_hooks_apply_only_to_a_vocabulary_split(placements: list) -> None:
    weight, idx = torch.randn(10, 4), torch.tensor([[0, 9, 3], [5, 5, 1]])
    w = sw.distribute_tensor(weight, MESH2, placements)
    i = sw.distribute_tensor(idx, MESH2, [Replicate()])
    sw.rules.clear_sharding_cache()
    with sw.config.allow_implicit_redistribute():
        for _ in range(2):  # cold, then warm
            assert torch.equal(F.embedding(i, w).full_tensor(), F.embedding(idx, weight))
    entry = _entry(aten.embedding.default)
    vocabulary = placements == [Shard(0)]
    assert (entry.local_args is not None) == vocabulary
    assert (entry.post is not None) == vocabulary


def test_a_replicated_embedding_on_one_device_is_one_kernel_call() -> None:
    weight, idx = torch.randn(10, 4), torch.tensor([1, 2, 9])
    w = sw.distribute_tensor(weight, MESH1, [Shard(0)])  # split over one device: whole
    i = sw.distribute_tensor(idx, MESH1, [Replicate()])
    sw.rules.clear_sharding_cache()
    for _ in range(2):
        assert torch.equal(F.embedding(i, w).full_tensor(), F.embedding(idx, weight))
    assert _entry(aten.embedding.default).direct


def test_a_post_patch_with_a_predicate_runs_only_where_it_applies() -> None:
    op = aten.neg.default
    calls: list = []

    def patch(func, result, args, kwargs):
        calls.append(result.placements)
        return result

    x = torch.randn(4, 2)
    sw.rules.register_post_patch(
        op, patch, applies=lambda specs, out: specs[0].placements[0].is_shard()
    )
    try:
        for placements in ([Shard(0)], [Replicate()], [Shard(0)]):
            d = sw.distribute_tensor(x, MESH2, placements)
            assert torch.equal((-d).full_tensor(), -x)
    finally:
        sw.rules.remove_hooks(op)
    assert calls == [(Shard(0),), (Shard(0),)]


def test_view_size_hook_on_several_devices_equals_torch() -> None:
    x = torch.randn(8, 6)
    a = sw.distribute_tensor(x, MESH2, [Shard(0)])
    for _ in range(2):  # the second call takes the local sizes from the cache
        assert torch.equal(a.view(4, 12).full_tensor(), x.view(4, 12))
        assert torch.equal(a.view(-1).full_tensor(), x.view(-1))


def test_dispatch_is_the_classmethod_itself() -> None:
    assert sw.DTensor.__torch_dispatch__.__func__ is sw_dispatch._torch_dispatch


def test_ops_on_a_list_of_dtensors_take_the_direct_path() -> None:
    x, y = torch.randn(6, 4), torch.randn(6, 4)
    a = sw.distribute_tensor(x, MESH1, [Shard(0)])
    b = sw.distribute_tensor(y, MESH1, [Shard(0)])
    sw.rules.clear_sharding_cache()
    for _ in range(2):  # the cold call, then the cached one
        assert torch.equal(torch.cat([a, a], 1).full_tensor(), torch.cat([x, x], 1))
        assert torch.equal(torch.cat((a, b), 0).full_tensor(), torch.cat((x, y), 0))
        assert torch.equal(torch.stack([a, b, a]).full_tensor(), torch.stack([x, y, x]))
    assert all(e.direct for e in sw_dispatch._OPS[id(aten.cat.default)].decisions.values())


def test_ops_on_a_list_of_dtensors_on_several_devices_equal_torch() -> None:
    x, y = torch.randn(6, 4), torch.randn(6, 4)
    a = sw.distribute_tensor(x, MESH2, [Shard(0)])
    b = sw.distribute_tensor(y, MESH2, [Replicate()])
    with sw.config.allow_implicit_redistribute():
        for _ in range(2):
            assert torch.equal(torch.cat([a, a], 1).full_tensor(), torch.cat([x, x], 1))
            assert torch.equal(torch.cat((a, b), 0).full_tensor(), torch.cat((x, y), 0))
            assert torch.equal(torch.stack([a, b]).full_tensor(), torch.stack([x, y]))


@pytest.mark.parametrize("mesh", [MESH1, MESH2], ids=["1 device", "2 devices"])
def test_foreach_ops_over_several_lists_of_dtensors_equal_torch(mesh) -> None:
    """An optimizer's foreach ops (several lists of DTensors and a scalar): on one device one
    kernel call on the components (the direct path), on several one per device."""
    g = torch.Generator().manual_seed(3)
    plain = [[torch.randn(4, 6, generator=g), torch.randn(8, generator=g)] for _ in range(3)]
    placements = [[Shard(0)], [Replicate()]]
    lists = [[sw.distribute_tensor(t, mesh, p) for t, p in zip(ts, placements, strict=True)]
             for ts in plain]
    sw.rules.clear_sharding_cache()
    for _ in range(2):  # the cold call, then the cached one
        torch._foreach_addcmul_(lists[0], lists[1], lists[2], value=0.5)
        torch._foreach_addcmul_(plain[0], plain[1], plain[2], value=0.5)
        torch._foreach_lerp_(lists[1], lists[2], 0.25)
        torch._foreach_lerp_(plain[1], plain[2], 0.25)
        for ds, ts in zip(lists, plain, strict=True):
            for d, t in zip(ds, ts, strict=True):
                assert torch.equal(d.full_tensor(), t)
    entries = sw_dispatch._OPS[id(aten._foreach_addcmul_.Scalar)].decisions.values()
    assert entries and all(e.direct == (mesh is MESH1) for e in entries)
