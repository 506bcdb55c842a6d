"""shardwise.distribute against the tf.distribute contract (spec 1B.0-1B.7), in one process
with 1, 2 and 3 replicas on simulated CPU devices. Expected numbers are computed by hand or
with plain torch on the full values."""

from __future__ import annotations

import copy
import threading

import pytest
import torch

import shardwise.distribute as swd
from shardwise import DTensor, Replicate, Shard, settings
from shardwise.debug import CommCounter
from shardwise.distribute import ReduceOp
from shardwise.distribute import VariableAggregation as VA
from shardwise.distribute import VariableSynchronization as VS
from shardwise.errors import (
    DistributeContextError,
    DistributeTypeError,
    DistributeValueError,
    ReplicaSyncError,
    ShardwiseError,
)

NS = (1, 2, 3)


def mirrored(n: int) -> swd.MirroredStrategy:
    return swd.MirroredStrategy([f"cpu:{i}" for i in range(n)])


def rid() -> torch.Tensor:
    """This replica's id as a float tensor (a distinct object per replica)."""
    return swd.get_replica_context().replica_id_in_sync_group.float()


def local(strategy: swd.Strategy, value: object) -> list:
    return list(strategy.experimental_local_results(value))


# ----- 1B.0 contexts ---------------------------------------------------------------------------


def test_default_context() -> None:
    s = swd.get_strategy()
    assert s is swd.get_strategy() and not swd.has_strategy()
    assert not swd.in_cross_replica_context() and swd.get_cross_replica_context() is None
    rc = swd.get_replica_context()
    assert rc.replica_id_in_sync_group == 0 and isinstance(rc.replica_id_in_sync_group, int)
    assert rc.num_replicas_in_sync == 1 and s.num_replicas_in_sync == 1
    assert swd.get_update_replica_id() is None
    with pytest.raises(DistributeContextError):
        type(s)()  # the default strategy is a singleton
    with pytest.raises(RuntimeError):
        copy.deepcopy(s)


@pytest.mark.parametrize("n", NS)
def test_scope_run_merge_and_update_contexts(n: int) -> None:
    s = mirrored(n)
    with s.scope() as entered:
        assert entered is s and swd.get_strategy() is s and swd.has_strategy()
        assert swd.in_cross_replica_context() and swd.get_replica_context() is None
        assert swd.get_cross_replica_context() is s
        with s.scope():  # re-entry is counted, the outer scope survives the inner exit
            pass
        assert swd.get_strategy() is s
        v = swd.Variable(torch.zeros(n))
    assert not swd.has_strategy()
    seen = []

    def fn() -> None:
        rc = swd.get_replica_context()
        seen.append(
            (
                swd.get_strategy() is s,
                swd.in_cross_replica_context(),
                int(rc.replica_id_in_sync_group),
            )
        )

        def merge_fn(strategy: swd.Strategy) -> None:
            seen.append(
                ("merge", strategy is s, swd.in_cross_replica_context(), swd.get_replica_context())
            )

        rc.merge_call(merge_fn)

    s.run(fn)
    assert seen[:n] == [(True, False, r) for r in range(n)]
    assert seen[n:] == [("merge", True, True, None)]  # merge_fn runs once
    ids = []

    def update_fn(component: swd.Variable) -> None:
        ids.append((swd.get_update_replica_id(), swd.in_cross_replica_context()))
        component.assign_add(torch.ones(n) * swd.get_update_replica_id())

    s.extended.update(v, update_fn)
    assert ids == [(i, True) for i in range(n)] and swd.get_update_replica_id() is None
    assert [c.value().tolist() for c in v.values] == [[float(i)] * n for i in range(n)]


def test_scope_nesting_errors() -> None:
    s, s2 = mirrored(2), mirrored(2)
    default = swd.get_strategy()
    with default.scope(), default.scope():  # the default scope nests in itself
        assert swd.in_cross_replica_context()
    with s.scope():
        with pytest.raises(RuntimeError, match="Mixing different"), s2.scope():
            pass
        with pytest.raises(RuntimeError, match="Must not nest"), default.scope():
            pass
    with pytest.raises(RuntimeError, match="cross-replica context"):
        s.run(lambda: s.scope().__enter__())


def test_experimental_set_strategy() -> None:
    s = mirrored(2)
    swd.experimental_set_strategy(s)
    try:
        assert swd.get_strategy() is s and swd.in_cross_replica_context()
        with s.scope(), pytest.raises(RuntimeError):
            swd.experimental_set_strategy(None)
    finally:
        swd.experimental_set_strategy(None)
    assert not swd.has_strategy()


@pytest.mark.parametrize("n", (2, 3))
def test_cross_replica_only_methods(n: int) -> None:
    s = mirrored(n)
    with s.scope():
        v = swd.Variable(1.0)
    pr = swd.PerReplica([torch.tensor([float(i)]) for i in range(n)])
    calls = {
        "reduce": lambda: s.reduce("sum", pr, axis=None),
        "gather": lambda: s.gather(pr, 0),
        "reduce_to": lambda: s.extended.reduce_to("sum", pr, v),
        "batch_reduce_to": lambda: s.extended.batch_reduce_to("sum", [(pr, v)]),
        "update_non_slot": lambda: s.extended.update_non_slot(
            s.extended.non_slot_devices([v]), lambda: None
        ),
        "run": lambda: s.run(lambda: None),
    }
    for call in calls.values():
        with pytest.raises(RuntimeError, match="cross-replica"):
            s.run(call)
        call()  # the default context (no scope) is fine: the method enters the scope itself
    with s.scope():  # allowed in the cross-replica context and inside merge_fn
        assert s.reduce("sum", pr, axis=None).item() == sum(range(n))
    got = s.run(
        lambda: swd.get_replica_context().merge_call(
            lambda st: st.reduce("sum", pr, axis=None).item()
        )
    )
    assert got == sum(range(n))
    other = mirrored(n)
    with other.scope(), pytest.raises(RuntimeError, match="Mixing|mixing"):
        s.reduce("sum", pr, axis=None)


def test_replica_context_checks() -> None:
    s = mirrored(2)
    contexts = s.run(lambda: swd.get_replica_context())
    with pytest.raises(RuntimeError, match="Need to be inside"):
        contexts.values[0].merge_call(lambda st: None)
    with pytest.raises(RuntimeError, match="Mismatching ReplicaContext"):
        s.run(lambda: contexts.values[0].merge_call(lambda st: None))
    with pytest.raises(RuntimeError, match="Need to be inside"):
        s.run(
            lambda: swd.get_replica_context().merge_call(
                lambda st: swd.get_replica_context() or contexts.values[0].merge_call(lambda _: 0)
            )
        )


# ----- 1B.1 values -----------------------------------------------------------------------------


@pytest.mark.parametrize("n", NS)
def test_run_regroups_by_identity(n: int) -> None:
    s = mirrored(n)
    shared = torch.tensor(7.0)
    with s.scope():
        v = swd.Variable(2.0)
    out = s.run(lambda: (shared, rid() * 10, v, v.values[int(rid())], {"k": [rid()]}))
    assert out[0] is shared and out[2] is v and out[3] is v
    if n == 1:  # a single replica returns plain values
        assert out[1].item() == 0.0 and out[4]["k"][0].item() == 0.0
        return
    assert isinstance(out[1], swd.PerReplica)
    assert [t.item() for t in out[1].values] == [10.0 * r for r in range(n)]
    assert [t.item() for t in local(s, out[4]["k"][0])] == [float(r) for r in range(n)]
    # two equal tensors computed separately are still different objects
    equal = s.run(lambda: torch.tensor(1.0))
    assert isinstance(equal, swd.PerReplica)


@pytest.mark.parametrize("n", (2, 3))
def test_run_unwraps_arguments(n: int) -> None:
    s = mirrored(n)
    with s.scope():
        v = swd.Variable(1.0)
    pr = swd.PerReplica([torch.tensor(float(10 * i)) for i in range(n)])
    mirrored_value = swd.Mirrored([torch.tensor(5.0)] * n)
    plain = torch.tensor(3.0)
    got = s.run(
        lambda a, b, c, *, d: (a, b is v, c is plain, d + 1),
        args=(pr, v, plain),
        kwargs={"d": mirrored_value},
    )
    assert [t.item() for t in got[0].values] == [10.0 * i for i in range(n)]
    assert got[1] is True and got[2] is True
    assert [t.item() for t in local(s, got[3])] == [6.0] * n
    with pytest.raises(DistributeValueError, match="positional args must be a list or tuple"):
        s.run(lambda x: x, args=pr)
    with pytest.raises(DistributeValueError, match="components"):
        s.run(lambda x: x, args=(swd.PerReplica([torch.tensor(1.0)] * (n + 1)),))
    with pytest.raises(DistributeValueError, match="different keys"):
        s.run(lambda: {"a": 1} if int(rid()) == 0 else {"b": 1})


@pytest.mark.parametrize("n", (2, 3))
def test_mirrored_value_acts_as_closest_component(n: int) -> None:
    s = mirrored(n)
    m = swd.Mirrored([torch.tensor([1.0, 2.0]) * (i + 1) for i in range(n)])
    got = s.run(lambda x: m + 1, args=(0,))  # in run: this replica's component
    assert [t.tolist() for t in got.values] == [
        [(i + 1) + 1.0, 2 * (i + 1) + 1.0] for i in range(n)
    ]
    assert (m * 2).tolist() == [2.0, 4.0] and m[1].item() == 2.0  # cross-replica: primary
    assert torch.add(m, 1).tolist() == [2.0, 3.0] and m.shape == torch.Size([2])


def test_local_results_and_value_container() -> None:
    s = mirrored(2)
    with s.scope():
        v = swd.Variable(1.0)
    pr = swd.PerReplica([torch.tensor(1.0), torch.tensor(2.0)])
    assert local(s, pr) == list(pr.values)
    assert local(s, v) == list(v.values)
    nested = local(s, {"a": pr, "b": 5})
    assert [d["a"].item() for d in nested] == [1.0, 2.0] and [d["b"] for d in nested] == [5, 5]
    t = torch.tensor(3.0)
    assert s.experimental_local_results(t) == (t,)
    for x in (*v.values, t):
        container = s.extended.value_container(x)
        assert any(x is y for y in s.experimental_local_results(container))
    assert s.extended.value_container(v.values[1]) is v and s.extended.value_container(t) is t


def test_merge_call_example_from_the_spec() -> None:
    s = mirrored(2)

    def fn(three: torch.Tensor) -> torch.Tensor:
        v = three + swd.get_replica_context().replica_id_in_sync_group
        total = swd.get_replica_context().merge_call(
            lambda st, x: sum(st.experimental_local_results(x)), args=(v,)
        )
        return total + v

    assert [t.item() for t in s.run(fn, args=(torch.tensor(3),)).values] == [10, 11]


def test_merge_call_returns_each_replica_its_component() -> None:
    s = mirrored(3)

    def fn() -> tuple:
        return swd.get_replica_context().merge_call(
            lambda st, x: (swd.PerReplica([t * 2 for t in x.values]), "same", x), args=(rid(),)
        )

    out = s.run(fn)
    assert [t.item() for t in out[0].values] == [0.0, 2.0, 4.0] and out[1] == "same"
    assert [t.item() for t in out[2].values] == [0.0, 1.0, 2.0]


# ----- 1B.2 variables --------------------------------------------------------------------------


@pytest.mark.parametrize("n", NS)
def test_variable_creation(n: int) -> None:
    s = mirrored(n)
    plain = swd.Variable(torch.tensor([1.0, 2.0]), name="p")
    assert type(plain) is swd.LocalVariable and plain.distribute_strategy is None
    with s.scope():
        m = swd.Variable(lambda: torch.tensor([1.0, 2.0]), name="w")
        r = swd.Variable(1.0, synchronization=VS.ON_READ, aggregation=VA.SUM)
        with pytest.raises(DistributeValueError, match="NONE variable synchronization"):
            swd.Variable(1.0, synchronization=VS.NONE)
        with pytest.raises(ValueError, match="synchronization"):
            swd.Variable(1.0, synchronization=7)
        with pytest.raises(ValueError, match="aggregation"):
            swd.Variable(1.0, aggregation=9)
    assert isinstance(m, swd.MirroredVariable) and isinstance(r, swd.SyncOnReadVariable)
    assert isinstance(m, swd.Variable) and m.synchronization == VS.ON_WRITE
    assert r.aggregation == VA.SUM and m.distribute_strategy is s
    assert len(m.values) == n and m.primary is m.values[0]
    assert [c.name for c in m.values] == ["w"] + [f"w/replica_{i}" for i in range(1, n)]
    assert m.name == "w" and m.shape == torch.Size([2]) and m.dtype == torch.float32
    assert m.devices == tuple(f"cpu:{i}" for i in range(n))
    assert all(c.value().tolist() == [1.0, 2.0] for c in m.values)
    assert r.read_value().item() == float(n)  # every copy starts with the full initial value
    assert m.dtensor.placements == (Replicate(),) and r.dtensor.placements[0].is_partial()
    assert s.extended.variable_created_in_scope(m)
    assert not s.extended.variable_created_in_scope(plain)
    assert not mirrored(n).extended.variable_created_in_scope(m)
    assert swd.get_strategy().extended.variable_created_in_scope(plain)
    assert int(VS.AUTO) == 0 and int(VS.ON_READ) == 3 and int(VA.ONLY_FIRST_REPLICA) == 3
    assert ReduceOp.from_variable_aggregation(VA.MEAN) is ReduceOp.MEAN
    with pytest.raises(ValueError):
        ReduceOp.from_variable_aggregation(VA.NONE)


@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize(
    "aggregation", (VA.SUM, VA.MEAN, VA.ONLY_FIRST_REPLICA), ids=("sum", "mean", "first")
)
def test_mirrored_variable_replica_updates(n: int, aggregation: VA) -> None:
    """Replica r calls v.assign_add(r + 1.0) (a distinct tensor per replica)."""
    s = mirrored(n)
    with s.scope():
        v = swd.Variable(0.0, aggregation=aggregation)
    s.run(lambda: v.assign_add(rid() + 1.0))
    expected = {VA.SUM: n * (n + 1) / 2, VA.MEAN: (n + 1) / 2, VA.ONLY_FIRST_REPLICA: 1.0}
    assert [c.value().item() for c in v.values] == [expected[aggregation]] * n
    s.run(lambda: v.assign(rid() * 2.0))  # assign: SUM -> sum, MEAN -> mean, first -> 0
    expected = {VA.SUM: n * (n - 1), VA.MEAN: n - 1.0, VA.ONLY_FIRST_REPLICA: 0.0}
    assert [c.value().item() for c in v.values] == [expected[aggregation]] * n
    s.run(lambda: v.assign_sub(rid() + 1.0))
    assert len({c.value().item() for c in v.values}) == 1


@pytest.mark.parametrize("n", NS)
def test_mirrored_variable_same_object_rule(n: int) -> None:
    s = mirrored(n)
    with s.scope():
        total = swd.Variable(0.0, aggregation=VA.SUM)
        mean = swd.Variable(0.0, aggregation=VA.MEAN)
        none = swd.Variable(0.0)
    if n > 1:  # TF issue #31852: the same Python object cannot be SUM-reduced
        with pytest.raises(DistributeValueError, match="non-DistributedValues"):
            s.run(lambda: total.assign_add(1.0))
    else:
        s.run(lambda: total.assign_add(1.0))
        assert total.read_value().item() == 1.0
    s.run(lambda: mean.assign_add(1.0))
    assert [c.value().item() for c in mean.values] == [1.0] * n
    if n > 1:
        with pytest.raises(ValueError, match="You must specify an aggregation method"):
            s.run(lambda: none.assign(rid()))
    s.run(lambda: total.assign_add(torch.tensor(0.5) * 1))  # distinct tensors: summed
    assert total.read_value().item() == pytest.approx(0.5 * n + (1.0 if n == 1 else 0.0))


@pytest.mark.parametrize("n", (2, 3))
def test_mirrored_variable_cross_replica_and_update_context(n: int) -> None:
    s = mirrored(n)
    with s.scope():
        v = swd.Variable(torch.tensor([1.0, 1.0]))
        w = swd.Variable(0.0)
        v.assign(torch.tensor([3.0, 4.0]))
        v.assign(swd.PerReplica([torch.tensor([3.0 + i, 4.0]) for i in range(n)]))  # TF 2.21
        assert [c.value().tolist() for c in v.values] == [[3.0 + i, 4.0] for i in range(n)]
        v.assign(torch.tensor([3.0, 4.0]))
        v.assign_add(swd.Mirrored([torch.ones(2)] * n))
    assert [c.value().tolist() for c in v.values] == [[4.0, 5.0]] * n
    v.assign_sub(torch.tensor([1.0, 1.0]))  # outside the scope: re-enters its strategy
    assert v.read_value().tolist() == [3.0, 4.0]
    s.extended.update(v, lambda c: w.assign(float(swd.get_update_replica_id())))
    assert [c.value().item() for c in w.values] == [float(i) for i in range(n)]  # local only
    with mirrored(n).scope(), pytest.raises(RuntimeError, match="mixing"):
        v.read_value()


def test_variables_act_as_tensors_and_train_per_replica() -> None:
    s = mirrored(2)
    with s.scope():
        v = swd.Variable(torch.tensor([1.0, 2.0]))
    assert (v + 1).tolist() == [2.0, 3.0] and (2 * v).tolist() == [2.0, 4.0]
    assert torch.dot(v, torch.ones(2)).tolist() == 3.0 and v[1].tolist() == 2.0

    def fn() -> torch.Tensor:
        loss = (v * (rid() + 1)).sum()
        loss.backward()
        return loss

    s.run(fn)  # each replica's gradient lands in its own copy
    assert [c.grad.tolist() for c in v.values] == [[1.0, 1.0], [2.0, 2.0]]


@pytest.mark.parametrize("n", NS)
def test_sync_on_read_variable(n: int) -> None:
    s = mirrored(n)
    with s.scope():
        total = swd.Variable(1.0, synchronization=VS.ON_READ, aggregation=VA.SUM)
        mean = swd.Variable(0.0, synchronization=VS.ON_READ, aggregation=VA.MEAN)
        first = swd.Variable(0.0, synchronization=VS.ON_READ, aggregation=VA.ONLY_FIRST_REPLICA)
        none = swd.Variable(0.0, synchronization=VS.ON_READ)
        ints = swd.Variable(0, synchronization=VS.ON_READ, aggregation=VA.SUM)
    local_read = s.run(lambda: total + 10)  # replica context: the local copy, no communication
    assert [t.item() for t in local(s, local_read)] == [11.0] * n
    with swd.variable_sync_on_read_context():
        assert [t.item() for t in local(s, s.run(lambda: total + 10))] == [10.0 + n] * n

    def accumulate() -> None:
        for var in (total, mean, first):
            var.assign_add(rid() + 1.0)

    s.run(accumulate)
    assert total.read_value().item() == n + n * (n + 1) / 2
    assert mean.read_value().item() == pytest.approx((n + 1) / 2)
    assert first.read_value().item() == 1.0
    with pytest.raises(ValueError, match="aggregation is NONE"):
        none.read_value()
    with CommCounter() as c:
        total.assign(8.0)
        assert [x.value().item() for x in total.values] == pytest.approx([8.0 / n] * n)
        assert total.read_value().item() == pytest.approx(8.0)
    assert c.counts["all_reduce"] == (n > 1)  # the Partial resolved once, on the read
    ints.assign(10)  # SUM over n: 10 / n truncated per copy
    assert [x.value().item() for x in ints.values] == [int(10 / n)] * n
    assert ints.read_value().item() == int(10 / n) * n
    with pytest.raises(ValueError, match="does not support `assign_add`"):
        total.assign_add(1.0)
    mean.assign_add(1.0)  # MEAN / ONLY_FIRST_REPLICA: applied to every copy
    assert mean.read_value().item() == pytest.approx((n + 1) / 2 + 1)


# ----- 1B.3 Strategy ---------------------------------------------------------------------------


def test_strategy_copying() -> None:
    s = mirrored(2)
    with pytest.raises(RuntimeError, match="deepcopy"):
        copy.copy(s)
    c = copy.deepcopy(s)
    assert c is not s and c.extended._strategy is c and c.num_replicas_in_sync == 2


def test_run_executes_replicas_in_order() -> None:
    s = mirrored(3)
    order = []
    s.run(lambda: order.append(int(rid())))
    assert order == [0, 1, 2]


@pytest.mark.parametrize("n", NS)
def test_reduce(n: int) -> None:
    s = mirrored(n)
    comps = [torch.arange(4.0) + 4 * r for r in range(n)]
    pr = swd.PerReplica(comps) if n > 1 else comps[0]
    full = torch.stack(comps)
    assert torch.equal(s.reduce(ReduceOp.SUM, pr, axis=None), full.sum(0))
    assert torch.allclose(s.reduce("Mean", pr, axis=None), full.mean(0))
    assert s.reduce("sum", pr, axis=0).item() == full.sum().item()
    assert s.reduce("mean", pr, axis=-1).item() == pytest.approx(full.mean().item())
    assert s.reduce("mean", pr, axis=(0,)).item() == pytest.approx(full.mean().item())
    with pytest.raises(ValueError, match="not a valid ReduceOp"):
        s.reduce("max", pr, axis=None)
    with pytest.raises(ValueError, match="out of range"):
        s.reduce("sum", pr, axis=1)
    with pytest.raises(TypeError, match="axis"):
        s.reduce("sum", pr, axis="0")


def test_reduce_uneven_and_non_distributed() -> None:
    s = mirrored(2)
    uneven = swd.PerReplica([torch.tensor([0.0, 1, 2, 3]), torch.tensor([4.0, 5])])
    assert s.reduce("mean", uneven, axis=0).item() == 2.5  # not the mean of means (3.0)
    assert s.reduce("sum", uneven, axis=0).item() == 15.0
    ints = swd.PerReplica([torch.tensor([1, 2]), torch.tensor([4])])
    assert s.reduce("mean", ints, axis=0).item() == pytest.approx(7 / 3)
    with pytest.raises(ValueError, match="different shapes"):
        s.reduce("sum", uneven, axis=None)
    m = swd.Mirrored([torch.tensor(2.0), torch.tensor(2.0)])
    assert s.reduce("mean", m, axis=None).item() == 2.0
    with pytest.raises(ValueError, match="mirrored value"):
        s.reduce("sum", m, axis=None)
    t = torch.tensor([1.0, 3.0])
    assert s.reduce("mean", t, axis=None) is t
    with pytest.raises(ValueError, match="non-DistributedValues"):
        s.reduce("sum", t, axis=None)
    one = swd.OneDeviceStrategy("cpu:0")
    assert one.reduce("sum", t, axis=None) is t and one.reduce("sum", t, axis=0).item() == 4.0


@pytest.mark.parametrize("n", (2, 3))
def test_gather_and_values_from_function(n: int) -> None:
    s = mirrored(n)
    pr = swd.PerReplica([torch.tensor([[1], [2]]) * (i + 1) for i in range(n)])
    expected = torch.cat([torch.tensor([[1], [2]]) * (i + 1) for i in range(n)])
    assert torch.equal(s.gather(pr, 0), expected)
    with pytest.raises(RuntimeError, match="all_gather"):
        s.run(lambda: s.gather(pr, 0))
    values = s.experimental_distribute_values_from_function(
        lambda ctx: (ctx.num_replicas_in_sync, ctx.replica_id_in_sync_group)
    )
    assert local(s, values) == [(n, i) for i in range(n)]


# ----- 1B.4 distributed datasets ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("n", "size", "batch", "expected"),
    [
        (2, 8, 8, [[[0, 1, 2, 3], [4, 5, 6, 7]]]),
        (2, 7, 7, [[[0, 1, 2, 3], [4, 5, 6]]]),
        (3, 4, 4, [[[0, 1], [2, 3], []]]),
        (2, 10, 8, [[[0, 1, 2, 3], [4, 5, 6, 7]], [[8], [9]]]),
        (3, 10, 6, [[[0, 1], [2, 3], [4, 5]], [[6, 7], [8, 9], []]]),
    ],
)
def test_distribute_dataset_split(n: int, size: int, batch: int, expected: list) -> None:
    s = mirrored(n)
    data = [torch.arange(size)[i : i + batch] for i in range(0, size, batch)]
    dist = s.experimental_distribute_dataset(data)
    for _ in range(2):  # each iter() restarts
        steps = [[t.tolist() for t in local(s, b)] for b in dist]
        assert steps == expected
    last = list(dist)[-1]
    assert all(
        t.shape[1:] == data[0].shape[1:] and t.dtype == data[0].dtype for t in local(s, last)
    )


def test_distribute_dataset_structure_mean_and_errors() -> None:
    s = mirrored(2)
    xs = torch.arange(10.0).reshape(10, 1)
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(xs, xs * 2), batch_size=8, shuffle=False
    )
    steps = list(s.experimental_distribute_dataset(loader))
    x, y = steps[1]
    assert [t.flatten().tolist() for t in x.values] == [[8.0], [9.0]]
    assert s.reduce("mean", x, axis=0).item() == 8.5
    assert [t.flatten().tolist() for t in y.values] == [[16.0], [18.0]]
    with pytest.raises(ValueError, match="batch"):
        list(s.experimental_distribute_dataset([torch.tensor(1.0)]))
    one = swd.OneDeviceStrategy("cpu:0")
    assert [b.tolist() for b in one.experimental_distribute_dataset([torch.arange(3)])] == [
        [0, 1, 2]
    ]
    assert [b.item() for b in one.experimental_distribute_dataset([torch.tensor(5)])] == [5]
    plain = [torch.arange(3)]
    assert swd.get_strategy().experimental_distribute_dataset(plain) is plain


def test_distribute_datasets_from_function() -> None:
    s = mirrored(2)
    contexts = []

    def dataset_fn(ctx: swd.InputContext) -> list:
        contexts.append(ctx)
        per_replica = ctx.get_per_replica_batch_size(4)
        return [torch.arange(i, i + per_replica) for i in range(0, 10, per_replica)]

    steps = [
        [t.tolist() for t in local(s, b)] for b in s.distribute_datasets_from_function(dataset_fn)
    ]
    assert contexts == [swd.InputContext(1, 0, 2)]
    assert steps == [[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[8, 9], []]]
    with pytest.raises(ValueError, match="not divisible"):
        swd.InputContext(1, 0, 3).get_per_replica_batch_size(8)
    assert (
        swd.get_strategy().distribute_datasets_from_function(lambda ctx: ctx) == swd.InputContext()
    )


# ----- 1B.5 StrategyExtended -------------------------------------------------------------------


@pytest.mark.parametrize("n", NS)
def test_reduce_to_and_batch_reduce_to(n: int) -> None:
    s = mirrored(n)
    with s.scope():
        v = swd.Variable(0.0)

    def merge_fn(strategy: swd.Strategy, value: object) -> None:
        reduced = strategy.extended.reduce_to(ReduceOp.SUM, value, destinations=v)
        strategy.extended.update(v, lambda c, x: c.assign(x), args=(reduced,))

    s.run(lambda: swd.get_replica_context().merge_call(merge_fn, args=(torch.tensor(1.0) * 1,)))
    assert [c.value().item() for c in v.values] == [float(n)] * n  # TF doc: 2.0 on 2 replicas
    pr = swd.PerReplica([torch.full((3,), float(i)) for i in range(n)]) if n > 1 else torch.zeros(3)
    to_device = s.extended.reduce_to("mean", pr, "cpu:0")
    assert isinstance(to_device, torch.Tensor) and to_device.tolist() == [(n - 1) / 2] * 3
    with pytest.raises(TypeError, match="ReduceOp"):
        s.extended.reduce_to(VA.SUM, pr, v)
    with pytest.raises(TypeError, match="destinations"):
        s.extended.reduce_to("sum", pr, ["cpu:0"])
    with pytest.raises(ValueError, match="can not be empty"):
        s.extended.reduce_to("sum", pr, "")
    with pytest.raises(ValueError, match="destinations must be one of"):
        s.extended.reduce_to("sum", pr, 3)
    if n == 1:
        assert s.extended.reduce_to("sum", 0, v) == 0
    else:  # TF 2.21: AttributeError ('int' object has no attribute 'shape')
        with pytest.raises(AttributeError, match="Python number 0"):
            s.extended.reduce_to("sum", 0, v)
    grads = [swd.PerReplica([torch.full((k,), float(i + k)) for i in range(n)]) for k in (1, 2, 3)]
    if n == 1:
        grads = [g.values[0] for g in grads]
    with CommCounter() as c:
        out = s.extended.batch_reduce_to("sum", [(g, v) for g in grads])
    if n > 1:
        assert c.counts["all_reduce"] == 1  # the whole batch in one fused collective
    for k, result in zip((1, 2, 3), out, strict=True):
        expected = [float(sum(i + k for i in range(n)))] * k
        assert [t.tolist() for t in local(s, result)] == [expected] * n


@pytest.mark.parametrize("n", (2, 3))
def test_update_and_update_non_slot(n: int) -> None:
    s = mirrored(n)
    with s.scope():
        v = swd.Variable(1.0)
    m = swd.Mirrored([torch.tensor(float(10 * i)) for i in range(n)])
    grouped = s.extended.update(v, lambda c, x: c.value() + x, args=(m,))
    assert isinstance(grouped, swd.Mirrored)
    assert [t.item() for t in grouped.values] == [1.0 + 10 * i for i in range(n)]
    ungrouped = s.extended.update(v, lambda c: c.value() * 2, group=False)
    assert isinstance(ungrouped, tuple) and [t.item() for t in ungrouped] == [2.0] * n
    per_replica = swd.PerReplica([float(i) for i in range(n)])  # TF 2.21: copy i gets value i
    assert local(s, s.extended.update(v, lambda c, x: x, args=(per_replica,))) == list(range(n))
    # from a replica context: a merge point, each replica gets its own result
    got = s.run(lambda: s.extended.update(v, lambda c: c.assign_add(1.0) and c.value().item()))
    assert local(s, got) == [2.0] * n and v.read_value().item() == 2.0
    devices = s.extended.non_slot_devices([v])
    assert devices == tuple(f"cpu:{i}" for i in range(n))
    with s.scope(), s.extended.colocate_vars_with(v):
        step = swd.Variable(0.0)
    s.extended.update_non_slot(devices, lambda: step.assign_add(1.0 + swd.get_update_replica_id()))
    assert [c.value().item() for c in step.values] == [1.0 + i for i in range(n)]
    out = s.extended.update_non_slot(devices, lambda: swd.get_update_replica_id(), group=False)
    assert out == tuple(range(n))


def test_colocate_vars_with_and_devices() -> None:
    s = mirrored(2)
    with s.scope():
        v = swd.Variable(1.0)
        with s.extended.colocate_vars_with(v):
            slot = swd.Variable(0.0)
        with pytest.raises(ValueError, match="colocate_vars_with"):
            s.extended.colocate_vars_with(swd.LocalVariable(torch.tensor(1.0))).__enter__()
    assert len(slot.values) == 2
    with pytest.raises(RuntimeError, match="strategy.scope"):
        s.extended.colocate_vars_with(v).__enter__()
    assert s.extended.worker_devices == s.extended.parameter_devices == ("cpu:0", "cpu:1")
    assert s.extended.experimental_require_static_shapes is False
    default = swd.get_strategy()
    with pytest.raises(RuntimeError, match="worker_devices"):
        _ = default.extended.worker_devices
    with pytest.raises(RuntimeError, match="parameter_devices"):
        _ = default.extended.parameter_devices
    a, b = swd.Variable(1.0, name="b"), swd.Variable(1.0, name="a")
    assert default.extended.non_slot_devices([a, b]) is b
    with pytest.raises(ValueError):
        default.extended.non_slot_devices([])


# ----- 1B.6 ReplicaContext ---------------------------------------------------------------------


@pytest.mark.parametrize("n", NS)
def test_replica_context_properties_and_all_reduce(n: int) -> None:
    s = mirrored(n)

    def fn() -> tuple:
        rc = swd.get_replica_context()
        r = int(rc.replica_id_in_sync_group)
        value = {"a": torch.tensor(1.0 + 2 * r), "b": [torch.tensor([40.0, 1.0]) + r]}
        return (
            rc.num_replicas_in_sync,
            rc.replica_id_in_sync_group.dtype,
            rc.devices,
            rc.strategy is s,
            rc.all_reduce("sum", value),
            rc.all_reduce(ReduceOp.MEAN, value),
        )

    with CommCounter() as c:
        out = local(s, s.run(fn))
    if n > 1:
        assert c.counts["all_reduce"] == 2  # one fused collective per all_reduce call
    for r, (num, dtype, devices, same, total, mean) in enumerate(out):
        assert (num, dtype, devices, same) == (n, torch.int32, (f"cpu:{r}",), True)
        assert total["a"].item() == sum(1.0 + 2 * i for i in range(n))
        assert total["b"][0].tolist() == [40.0 * n + sum(range(n)), 1.0 * n + sum(range(n))]
        assert mean["a"].item() == pytest.approx(sum(1.0 + 2 * i for i in range(n)) / n)


def test_all_reduce_gradient_and_all_gather() -> None:
    s = mirrored(2)
    xs = [
        torch.tensor([1.0, 2.0], requires_grad=True),
        torch.tensor([3.0, 5.0], requires_grad=True),
    ]

    def fn(x: torch.Tensor) -> torch.Tensor:
        r = int(rid())
        total = swd.get_replica_context().all_reduce("sum", x * (r + 1))
        (total * torch.tensor([1.0, 10.0])).sum().backward()
        return total

    s.run(fn, args=(swd.PerReplica(xs),))
    # d/dx_r of sum_r' w * all_reduce(...): the upstream gradients of both replicas, summed
    assert xs[0].grad.tolist() == [2.0, 20.0] and xs[1].grad.tolist() == [4.0, 40.0]
    got = s.run(lambda: swd.get_replica_context().all_gather(torch.tensor([1, 2, 3]), axis=0))
    assert [t.tolist() for t in got.values] == [[1, 2, 3, 1, 2, 3]] * 2
    uneven = s.run(
        lambda: swd.get_replica_context().all_gather(torch.arange(int(rid()) + 1), axis=0)
    )
    assert [t.tolist() for t in uneven.values] == [[0, 0, 1]] * 2


def test_merge_call_count_mismatch_and_timeout_are_errors() -> None:
    s = mirrored(3)

    def uneven() -> None:
        if int(rid()) != 1:
            swd.get_replica_context().merge_call(lambda st: None)

    with pytest.raises(ReplicaSyncError, match=r"different number of .*merge_call\(\).*\[1\]"):
        s.run(uneven)
    release = threading.Event()

    def stuck() -> None:
        if int(rid()) == 2:
            release.wait(30)
        swd.get_replica_context().merge_call(lambda st: None)

    try:
        with settings.REPLICA_TIMEOUT.override(0.3):
            with pytest.raises(ReplicaSyncError, match="replica 2 .* within 0.3 s"):
                s.run(stuck)
    finally:
        release.set()
    assert isinstance(ReplicaSyncError("x"), RuntimeError)

    class Boom(Exception):
        pass

    def fails() -> None:
        if int(rid()) == 1:
            raise Boom("replica 1 failed")
        swd.get_replica_context().merge_call(lambda st: None)

    with pytest.raises(Boom):
        s.run(fails)
    assert s.run(lambda: 5) == 5  # the strategy still works


# ----- per-replica view of DTensor -------------------------------------------------------------


def test_dtensor_per_replica_view() -> None:
    s = mirrored(3)
    mesh = s.extended.mesh
    full = torch.arange(12.0).reshape(6, 2)

    def per_rank(x: torch.Tensor) -> tuple:
        # the code one rank would run: its local piece in, a DTensor out, its component back
        dt = DTensor.from_local(x * 10, mesh, [Shard(0)])
        return dt, dt.to_local()

    pieces = swd.PerReplica(list(full.chunk(3)))
    dt, comps = s.run(per_rank, args=(pieces,))
    assert isinstance(dt, DTensor) and torch.equal(dt.full_tensor(), full * 10)
    assert [c.tolist() for c in comps.values] == [c.tolist() for c in (full * 10).chunk(3)]
    assert torch.equal(pieces.as_dtensor(mesh).full_tensor(), full)  # batch slices: Shard(0)
    replicated = DTensor.from_local(torch.ones(2), mesh, [Replicate()])
    ones = s.run(lambda: replicated.to_local() + rid())
    assert [t.tolist() for t in ones.values] == [[1.0 + r] * 2 for r in range(3)]


# ----- 1B.7 strategy classes -------------------------------------------------------------------


def test_mirrored_strategy_devices() -> None:
    assert (
        swd.MirroredStrategy().extended.worker_devices in (("cpu:0",),) or torch.cuda.is_available()
    )
    with pytest.raises(ValueError, match="duplicate"):
        swd.MirroredStrategy(["cpu:0", "cpu:0"])
    default = swd.MirroredStrategy().extended.worker_devices
    assert swd.MirroredStrategy([]).extended.worker_devices == default
    assert isinstance(DistributeValueError("x"), (ShardwiseError, ValueError))
    assert issubclass(DistributeTypeError, TypeError)


def test_one_device_strategy() -> None:
    s = swd.OneDeviceStrategy("cpu:0")
    assert s.num_replicas_in_sync == 1 and s.extended.worker_devices == ("cpu:0",)
    assert s.extended.non_slot_devices([]) == ("cpu:0",)
    with s.scope():
        v = swd.Variable(1.0)
    assert type(v) is swd.LocalVariable and s.extended.variable_created_in_scope(v)
    out = s.run(lambda: (v.assign_add(1.0), swd.get_replica_context().replica_id_in_sync_group))
    assert v.read_value().item() == 2.0 and int(out[1]) == 0  # NONE aggregation: allowed
    t = torch.tensor(1.0)
    assert s.extended.reduce_to("sum", t, v) is t  # no copy
    assert s.extended.update(v, lambda c: c.value() * 3).item() == 6.0


def test_central_storage_strategy() -> None:
    s = swd.CentralStorageStrategy(["cpu:0", "cpu:1"])
    assert s.num_replicas_in_sync == 2 and s.extended.parameter_devices == ("cpu:0",)
    with s.scope():
        v = swd.Variable(0.0, aggregation=VA.SUM, name="v")
        none = swd.Variable(0.0, name="a", synchronization=VS.ON_READ)
    assert isinstance(v, swd.AggregatingVariable) and len(v.values) == 1
    assert s.extended.value_container(v.values[0]) is v
    s.run(lambda: v.assign_add(rid() + 1.0))
    assert v.read_value().item() == 3.0
    with pytest.raises(ValueError, match="aggregation method"):
        s.run(lambda: none.assign(rid()))
    assert s.extended.non_slot_devices([v, none]) is none
    s.extended.update(v, lambda c, x: c.assign(x), args=(swd.Mirrored([torch.tensor(7.0)] * 2),))
    assert v.read_value().item() == 7.0
    with pytest.raises(ValueError, match="must be a Variable"):
        s.extended.update(torch.tensor(1.0), lambda c: None)
    per = s.run(lambda: rid() * 2)
    assert isinstance(per, swd.PerReplica) and s.reduce("sum", per, axis=None).item() == 2.0


# ----- data-parallel training ------------------------------------------------------------------


def _model() -> torch.nn.Module:
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def _data() -> list:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(30, 4, generator=g)
    y = x @ torch.tensor([[1.0], [2.0], [-1.0], [0.5]])
    return [(x[i : i + 6], y[i : i + 6]) for i in range(0, 30, 6)]


def _single_device_losses(data: list) -> tuple[list, torch.nn.Module]:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for x, y in data:
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, model


@pytest.mark.parametrize("n", NS)
def test_training_matches_single_device(n: int) -> None:
    data = _data()
    expected, reference = _single_device_losses(data)
    s = mirrored(n)
    with s.scope():
        model = s.distribute_module(_model())
        opt = swd.Optimizer(torch.optim.SGD, model.variables(), lr=0.1, momentum=0.9)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        per_example = ((model(x) - y) ** 2).mean(dim=1)
        loss = swd.compute_average_loss(per_example, global_batch_size=6)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    losses = []
    with CommCounter() as c:
        for batch in s.experimental_distribute_dataset(data):
            losses.append(s.reduce("sum", s.run(step, args=batch), axis=None).item())
    assert losses == pytest.approx(expected, rel=1e-5, abs=1e-6)
    if n > 1:  # per step: one fused gradient all-reduce and the loss reduction
        assert c.counts["all_reduce"] == 2 * len(data)
    for var, p in zip(model.variables(), reference.parameters(), strict=True):
        for copy_ in var.values:
            assert torch.allclose(copy_.value(), p, atol=1e-6)
    state = model.state_dict()
    assert state.keys() == reference.state_dict().keys()
    assert all(torch.allclose(state[k], v, atol=1e-6) for k, v in reference.state_dict().items())
    assert len(opt.state_dict()) == n and opt.variables == model.variables()


def test_training_mean_reduction_and_cross_replica_step() -> None:
    data = _data()
    expected, _ = _single_device_losses(data)
    s = mirrored(2)
    with s.scope():
        model = s.distribute_module(_model())
        opt = swd.Optimizer(
            torch.optim.SGD, model.variables(), lr=0.1, momentum=0.9, gradient_reduction="mean"
        )

    def forward_backward(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = torch.nn.functional.mse_loss(model(x), y)  # per-replica mean: equal batches
        loss.backward()
        return loss

    losses = []
    for batch in s.experimental_distribute_dataset(data):
        losses.append(s.reduce("mean", s.run(forward_backward, args=batch), axis=None).item())
        opt.step()  # cross-replica: the same fused reduction, then every copy
        opt.zero_grad()
    assert losses == pytest.approx(expected, rel=1e-5, abs=1e-6)


def test_variable_created_in_run_is_shared_and_extended_helpers() -> None:
    s = mirrored(3)
    created = s.run(lambda: swd.Variable(torch.tensor([1.0, 2.0]), name="made_in_run"))
    assert isinstance(created, swd.MirroredVariable) and len(created.values) == 3  # created once
    assert created.name == "made_in_run" and s.extended.variable_created_in_scope(created)
    with s.scope():
        total = swd.Variable(0.0, synchronization=VS.ON_READ, aggregation=VA.SUM)
    s.run(lambda: total.assign(rid()))
    assert s.extended.read_var(total).item() == 3.0  # 0 + 1 + 2
    assert [int(i) for i in local(s, s.extended.call_for_each_replica(rid))] == [0, 1, 2]
    assert s.extended.broadcast_to(2.5, created) == 2.5
    spread = s.extended.broadcast_to(torch.tensor(1.0), created)
    assert [t.item() for t in spread.values] == [1.0] * 3

    def bad_merge() -> None:
        swd.get_replica_context().merge_call(lambda st: 1 / 0)

    with pytest.raises(ZeroDivisionError):
        s.run(bad_merge)


def test_central_storage_training_matches_single_device() -> None:
    data = _data()
    expected, reference = _single_device_losses(data)
    s = swd.CentralStorageStrategy(["cpu:0", "cpu:1", "cpu:2"])
    with s.scope():
        model = s.distribute_module(_model())
        opt = swd.Optimizer(torch.optim.SGD, model.variables(), lr=0.1, momentum=0.9)
    assert all(isinstance(v, swd.AggregatingVariable) for v in model.variables())

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad()  # at the start: only the first replica clears the shared gradient
        loss = swd.compute_average_loss(((model(x) - y) ** 2).mean(dim=1), global_batch_size=6)
        loss.backward()
        opt.step()
        return loss

    losses = [
        s.reduce("sum", s.run(step, args=batch), axis=None).item()
        for batch in s.experimental_distribute_dataset(data)
    ]
    assert losses == pytest.approx(expected, rel=1e-5, abs=1e-6)
    for var, p in zip(model.variables(), reference.parameters(), strict=True):
        assert torch.allclose(var.value(), p, atol=1e-6)


def test_replica_threads_are_reused_and_stop_with_their_strategy() -> None:
    import gc

    def replica_threads() -> set:
        return {t for t in threading.enumerate() if t.name.startswith("shardwise-replica")}

    gc.collect()
    before = replica_threads()
    s = mirrored(3)
    names = [s.run(lambda: threading.current_thread()) for _ in range(3)]
    assert all(local(s, n) == local(s, names[0]) for n in names)  # the same threads each run
    assert len(replica_threads() - before) == 3
    del s, names
    gc.collect()
    for _ in range(100):
        if not replica_threads() - before:
            break
        threading.Event().wait(0.01)
    assert not replica_threads() - before
