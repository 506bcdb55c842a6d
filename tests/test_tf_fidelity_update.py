"""TF 2.21's answers for updates with PerReplica arguments, reductions of plain tensors, nests
and integers, and a mirrored variable's synchronization (spec 1B.2, 1B.3, 1B.5). Expected
numbers come from TF's semantics computed with plain single-device torch."""

from __future__ import annotations

import pytest
import torch

import shardwise.distribute as swd
from mp_harness import run_in_processes
from shardwise.distribute import VariableAggregation as VA
from shardwise.distribute import VariableSynchronization as VS
from shardwise.errors import DistributeValueError


def mirrored(n: int) -> swd.MirroredStrategy:
    return swd.MirroredStrategy([f"cpu:{i}" for i in range(n)])


def central(n: int) -> swd.CentralStorageStrategy:
    return swd.CentralStorageStrategy([f"cpu:{i}" for i in range(n)])


def local(strategy: swd.Strategy, value: object) -> list:
    return list(strategy.experimental_local_results(value))


# ----- 1. PerReplica arguments of update / cross-replica assign ---------------------------------


@pytest.mark.parametrize("n", (2, 3))
def test_update_gives_copy_i_component_i(n: int) -> None:
    s = mirrored(n)
    with s.scope():
        v = swd.Variable(torch.zeros(2))
    per_replica = swd.PerReplica([torch.tensor([1.0, 2.0]) * (i + 1) for i in range(n)])
    s.extended.update(v, lambda var, x: var.assign_add(x), args=(per_replica,))
    assert [c.value().tolist() for c in v.values] == [[i + 1.0, 2.0 * (i + 1)] for i in range(n)]
    kw = s.extended.update(v, lambda var, x=None: var.value() - x, kwargs={"x": per_replica})
    assert [t.tolist() for t in local(s, kw)] == [[0.0, 0.0]] * n
    with pytest.raises(DistributeValueError, match=f"1 components for {n} copies"):
        s.extended.update(v, lambda var, x: None, args=(swd.PerReplica([torch.zeros(2)]),))


@pytest.mark.parametrize("n", (2, 3))
def test_cross_replica_assign_of_per_replica(n: int) -> None:
    s = mirrored(n)
    with s.scope():
        v = swd.Variable(torch.ones(3))
    v.assign(swd.PerReplica([torch.full((3,), 10.0 * i) for i in range(n)]))
    assert [c.value().tolist() for c in v.values] == [[10.0 * i] * 3 for i in range(n)]
    v.assign_sub(swd.PerReplica([torch.full((3,), float(i)) for i in range(n)]))
    assert [c.value().tolist() for c in v.values] == [[9.0 * i] * 3 for i in range(n)]


def test_central_storage_update_takes_the_primary() -> None:
    s = central(2)
    with s.scope():
        v = swd.Variable(torch.zeros(2))
    per_replica = swd.PerReplica([torch.tensor([1.0, 2.0]), torch.tensor([5.0, 7.0])])
    got = s.extended.update(v, lambda var, x: var.assign_add(x) and var.value().clone(),
                            args=(per_replica,))
    assert got.tolist() == [1.0, 2.0] and v.read_value().tolist() == [1.0, 2.0]
    v.assign(per_replica)
    assert v.read_value().tolist() == [1.0, 2.0]


def _reference_sgd(x: torch.Tensor, y: torch.Tensor, steps: int) -> torch.Tensor:
    """Single-device full-batch gradient descent on sum((x w - y)^2) / batch."""
    w = torch.zeros(x.shape[1], dtype=torch.float64)
    for _ in range(steps):
        grad = 2 * x.T @ (x @ w - y) / x.shape[0]
        w = w - 0.1 * grad
    return w


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(12, 3, generator=g, dtype=torch.float64),
            torch.randn(12, generator=g, dtype=torch.float64))


def _train(s: swd.Strategy, xs: object, ys: object, batch: int) -> object:
    """TF's usual training step, 4 times: grads per replica, all_reduce, merge_call -> update."""
    with s.scope():
        w = swd.Variable(torch.zeros(3, dtype=torch.float64))

    def replica_fn(xb: torch.Tensor, yb: torch.Tensor) -> None:
        ctx = swd.get_replica_context()
        grad = 2 * xb.T @ (xb @ w.value() - yb) / batch
        grad = ctx.all_reduce("SUM", grad)
        ctx.merge_call(
            lambda st, gr: st.extended.update(
                w, lambda var, gg: var.assign_sub(0.1 * gg), args=(gr,)
            ),
            args=(grad,),
        )

    for _ in range(4):
        s.run(replica_fn, args=(xs, ys))
    return w


@pytest.mark.parametrize("make", (mirrored, central), ids=("mirrored", "central"))
@pytest.mark.parametrize("n", (1, 2, 3))
def test_all_reduce_merge_call_update_loop(make, n: int) -> None:
    x, y = _data()
    s = make(n)
    per = x.shape[0] // n
    xs = swd.PerReplica([x[i * per : (i + 1) * per] for i in range(n)])
    ys = swd.PerReplica([y[i * per : (i + 1) * per] for i in range(n)])
    w = _train(s, xs, ys, x.shape[0])
    expected = _reference_sgd(x, y, 4)
    copies = local(s, w)
    assert len(copies) == (n if make is mirrored else 1)
    for c in copies:
        torch.testing.assert_close(c.value(), expected)


def _multi_worker_program() -> dict:
    """The update loop and the reductions under 2 workers x 2 devices (4 replicas)."""
    s = swd.MultiWorkerMirroredStrategy(["cpu:0", "cpu:1"])
    x, y = _data()
    per = x.shape[0] // 4
    xs = s.experimental_distribute_values_from_function(
        lambda c: x[int(c.replica_id_in_sync_group) * per :][:per]
    )
    ys = s.experimental_distribute_values_from_function(
        lambda c: y[int(c.replica_id_in_sync_group) * per :][:per]
    )
    ints = s.experimental_distribute_values_from_function(
        lambda c: torch.tensor([int(c.replica_id_in_sync_group), 1], dtype=torch.int32)
    )
    w = _train(s, xs, ys, x.shape[0])
    return {
        "w": [c.value().tolist() for c in local(s, w)],
        "plain_sum": s.reduce("SUM", torch.arange(6.0).reshape(3, 2), axis=0).tolist(),
        "int_mean": s.reduce("MEAN", ints, axis=None).tolist(),
        "int_dtype": str(s.reduce("MEAN", ints, axis=None).dtype),
        "int_reduce_to": [
            c.tolist() for c in local(s, s.extended.reduce_to("MEAN", ints, destinations=ints))
        ],
    }


def test_multi_worker_matches_tf() -> None:
    per_rank = run_in_processes(
        _multi_worker_program, 2, timeout=120, env={"SHARDWISE_COLLECTIVE_TIMEOUT": "60"}
    )
    x, y = _data()
    expected = _reference_sgd(x, y, 4)
    for got in per_rank:
        assert len(got["w"]) == 2
        for copy in got["w"]:
            torch.testing.assert_close(torch.tensor(copy, dtype=torch.float64), expected)
        assert got["plain_sum"] == (4 * torch.arange(6.0).reshape(3, 2).sum(0)).tolist()
        assert got["int_mean"] == [(0 + 1 + 2 + 3) / 4, 1.0]
        assert got["int_dtype"] == "torch.float64"
        assert got["int_reduce_to"] == [[(0 + 1 + 2 + 3) / 4, 1.0]] * 2


# ----- 2. reduce of plain tensors, nests, integers ---------------------------------------------


@pytest.mark.parametrize("n", (1, 2, 3))
def test_reduce_plain_tensor_over_axis(n: int) -> None:
    """TF runs the per-axis reduction in every replica, then reduces those across replicas:
    a tensor every replica shares is summed once per replica."""
    s = mirrored(n)
    t = torch.arange(12.0).reshape(4, 3)
    torch.testing.assert_close(s.reduce("SUM", t, axis=0), n * t.sum(0))
    torch.testing.assert_close(s.reduce("MEAN", t, axis=0), t.mean(0))
    torch.testing.assert_close(s.reduce("SUM", t, axis=(0, 1)), n * t.sum())
    one = swd.OneDeviceStrategy("cpu:0")
    torch.testing.assert_close(one.reduce("SUM", t, axis=1), t.sum(1))


@pytest.mark.parametrize("n", (2, 3))
def test_reduce_of_a_nest(n: int) -> None:
    s = mirrored(n)
    parts = [torch.tensor([1.0, 2.0]) * (i + 1) for i in range(n)]
    batches = [torch.arange(float(i + 1)) for i in range(n)]  # uneven batches
    value = {"a": swd.PerReplica(parts), "b": [swd.PerReplica(batches)]}
    got = s.reduce("SUM", {"a": value["a"]}, axis=None)
    assert set(got) == {"a"}
    torch.testing.assert_close(got["a"], torch.stack(parts).sum(0))
    mean = s.reduce("MEAN", {"b": value["b"]}, axis=0)
    torch.testing.assert_close(mean["b"][0], torch.cat(batches).mean())


@pytest.mark.parametrize("n", (2, 3))
def test_reduce_mean_of_integers_true_divides(n: int) -> None:
    """TF: an integer MEAN is the sum true-divided by the count (float64), not a floor."""
    s = mirrored(n)
    parts = [torch.tensor([i, 2 * i + 1], dtype=torch.int32) for i in range(n)]
    got = s.reduce("MEAN", swd.PerReplica(parts), axis=None)
    expected = torch.stack(parts).double().sum(0) / n
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, expected)
    uneven = [torch.arange(i + 1, dtype=torch.int32) for i in range(n)]
    got = s.reduce("MEAN", swd.PerReplica(uneven), axis=0)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, torch.cat(uneven).double().mean())
    total = s.reduce("SUM", swd.PerReplica(parts), axis=None)
    assert total.dtype == torch.int32 and total.tolist() == torch.stack(parts).sum(0).tolist()


@pytest.mark.parametrize("n", (2, 3))
def test_reduce_to_and_batch_reduce_to_mean_of_integers_true_divide(n: int) -> None:
    """TF 2.21: reduce_to, batch_reduce_to and a replica context's all_reduce give an integer
    MEAN as the sum true-divided by the replica count, float64 (reduce already did)."""
    s = mirrored(n)
    parts = [torch.tensor([i, 3 * i + 1], dtype=torch.int32) for i in range(n)]
    longs = [torch.tensor(i + 1, dtype=torch.int64) for i in range(n)]
    expected = torch.stack(parts).double().sum(0) / n
    expected_longs = torch.stack(longs).double().sum() / n
    value = swd.PerReplica(parts)
    got = s.extended.reduce_to("MEAN", value, destinations="cpu:0")
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, expected)
    mirrored_out = s.extended.reduce_to("MEAN", value, destinations=value)
    for copy in local(s, mirrored_out):
        assert copy.dtype == torch.float64
        torch.testing.assert_close(copy, expected)
    both = s.extended.batch_reduce_to(
        "MEAN", [(value, value), (swd.PerReplica(longs), value), (swd.PerReplica(parts), value)]
    )
    for got, want in zip(both, (expected, expected_longs, expected), strict=True):
        for copy in local(s, got):
            assert copy.dtype == torch.float64
            torch.testing.assert_close(copy, want)
    summed = s.extended.reduce_to("SUM", value, destinations="cpu:0")
    assert summed.dtype == torch.int32 and summed.tolist() == torch.stack(parts).sum(0).tolist()

    def replica_fn() -> torch.Tensor:
        i = int(swd.get_replica_context().replica_id_in_sync_group)
        return swd.get_replica_context().all_reduce("MEAN", parts[i])

    for copy in local(s, s.run(replica_fn)):
        assert copy.dtype == torch.float64
        torch.testing.assert_close(copy, expected)


# ----- per-replica backward: TF's GradientTape values, not doubled ----------------------------


@pytest.mark.parametrize("n", (2, 3))
def test_per_replica_backward_gives_gradient_tape_values(n: int) -> None:
    """loss.backward() in each replica thread: each copy gets its own replica's gradient
    (TF: tape.gradient(w * x_i, w) = x_i); the gradient through an all_reduce SUM is the
    all-reduce of the upstream gradients (TF: N * x_i), the only N-fold factor."""
    s = mirrored(n)
    with s.scope():
        w = swd.Variable(torch.tensor(2.0))
    xs = swd.PerReplica([torch.tensor(float(i + 1)) for i in range(n)])

    def local_loss(x: torch.Tensor) -> None:
        (w * x).backward()

    s.run(local_loss, args=(xs,))
    assert [c.grad.item() for c in w.values] == [float(i + 1) for i in range(n)]
    for c in w.values:
        c.tensor.grad = None

    def reduced_loss(x: torch.Tensor) -> None:
        swd.get_replica_context().all_reduce("SUM", w * x).backward()

    s.run(reduced_loss, args=(xs,))
    assert [c.grad.item() for c in w.values] == [n * float(i + 1) for i in range(n)]


@pytest.mark.parametrize("make", (mirrored, central))
@pytest.mark.parametrize("reduction", ("sum", "mean"))
def test_distributed_module_backward_and_optimizer_match_single_device(make, reduction) -> None:
    """Each replica's loss is the mean over its half of the batch. TF sums replica gradients
    in apply_gradients (N times the single-device step of a mean loss); MEAN gives exactly
    the single-device step. Three steps, compared with plain torch SGD."""
    torch.manual_seed(0)
    x, y = torch.randn(8, 3), torch.randn(8, 1)
    net = torch.nn.Linear(3, 1)
    reference = torch.nn.Linear(3, 1)
    reference.load_state_dict(net.state_dict())
    s = make(2)
    with s.scope():
        model = s.distribute_module(net)
        opt = swd.Optimizer(torch.optim.SGD, model.variables(), lr=0.1,
                            gradient_reduction=reduction)

    def step(xb: torch.Tensor, yb: torch.Tensor) -> None:
        ((model(xb) - yb) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()

    factor = 2 if reduction == "sum" else 1
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1 * factor)
    for _ in range(3):
        for batch in s.experimental_distribute_dataset([(x, y)]):
            s.run(step, args=batch)
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(reference(x), y).backward()
        ref_opt.step()
    weight = model.variables()[0]
    for copy in getattr(weight, "values", (weight,)):
        torch.testing.assert_close(copy.value(), reference.weight.detach())


# ----- 3. synchronization ----------------------------------------------------------------------


@pytest.mark.parametrize("n", (1, 2))
def test_mirrored_variable_reports_on_write(n: int) -> None:
    s = mirrored(n)
    with s.scope():
        auto = swd.Variable(0.0)
        on_write = swd.Variable(0.0, synchronization=VS.ON_WRITE)
        on_read = swd.Variable(0.0, synchronization=VS.ON_READ, aggregation=VA.SUM)
    for v in (auto, on_write):
        assert v.synchronization == VS.ON_WRITE
        assert all(c.synchronization == VS.ON_WRITE for c in v.values)
    assert on_read.synchronization == VS.ON_READ


# ----- 4. shardwise's deliberate difference: replica-context updates need an aggregation ------


def test_replica_context_update_without_aggregation_is_refused() -> None:
    s = mirrored(2)
    with s.scope():
        v = swd.Variable(0.0)
    with pytest.raises(DistributeValueError, match="aggregation"):
        s.run(lambda: v.assign_add(swd.get_replica_context().replica_id_in_sync_group.float()))
    assert [c.value().item() for c in v.values] == [0.0, 0.0]


# ----- TF 2.21's answers, measured in TF 2.21 on 2 logical CPU devices (issue 34) ------------


def _rid() -> int:
    return int(swd.get_replica_context().replica_id_in_sync_group)


def test_reduce_with_a_list_axis_raises_type_error() -> None:
    """TF 2.21: ``TypeError: unhashable type: 'list'`` for every strategy; a tuple works."""
    s = mirrored(2)
    pr = s.run(lambda: torch.arange(6.0).reshape(2, 3) + _rid())
    for strategy, value in ((s, pr), (swd.OneDeviceStrategy("cpu:0"), torch.ones(2, 2))):
        for axis in ([0, 1], [0]):
            with pytest.raises(TypeError, match="unhashable type: 'list'"):
                strategy.reduce("SUM", value, axis=axis)
    assert s.reduce("SUM", pr, axis=(0, 1)).item() == 36.0  # TF 2.21: 36.0


def test_reduce_of_a_python_zero_over_several_replicas_raises() -> None:
    """TF 2.21 (2 replicas): SUM or MEAN of 0 / 0.0 raise AttributeError ('int' object has no
    attribute 'shape'); MEAN of 3 gives 3, SUM of 3 raises ValueError; one device gives 0."""
    s = mirrored(2)
    for op in ("SUM", "MEAN"):
        for zero in (0, 0.0):
            with pytest.raises(AttributeError, match="no attribute 'shape'"):
                s.reduce(op, zero, axis=None)
    assert s.reduce("MEAN", 3, axis=None) == 3
    with pytest.raises(ValueError, match="non-DistributedValues value 3"):
        s.reduce("SUM", 3, axis=None)
    assert swd.OneDeviceStrategy("cpu:0").reduce("SUM", 0, axis=None) == 0


@pytest.mark.parametrize(
    ("dtype", "mean_dtype"),
    [(torch.int8, torch.float32), (torch.uint8, torch.float32), (torch.int16, torch.float32),
     (torch.int32, torch.float64), (torch.int64, torch.float64)],
)
def test_integer_reductions_keep_tf_dtypes(dtype: torch.dtype, mean_dtype: torch.dtype) -> None:
    """Replica r holds [1, 2, 4] + r. TF 2.21: SUM over axis 0 stays in the integer dtype
    (17); MEAN is TF's truediv: float32 for 8/16-bit integers, float64 for wider ones."""
    s = mirrored(2)
    pr = s.run(lambda: torch.tensor([1, 2, 4], dtype=dtype) + _rid())
    total = s.reduce("SUM", pr, axis=0)
    assert total.dtype == dtype and total.item() == 17
    mean = s.reduce("MEAN", pr, axis=0)
    assert mean.dtype == mean_dtype
    assert mean.item() == pytest.approx(2.8333333333333335, rel=1e-6)
    mean = s.reduce("MEAN", pr, axis=None)
    assert mean.dtype == mean_dtype and mean.tolist() == [1.5, 2.5, 4.5]
    got = s.extended.reduce_to("MEAN", pr, destinations="cpu:0")
    assert got.dtype == mean_dtype and got.tolist() == [1.5, 2.5, 4.5]


def test_uint8_sums_wrap_as_tf() -> None:
    s = mirrored(2)
    pr = s.run(lambda: torch.tensor([200, 100], dtype=torch.uint8))
    assert s.reduce("SUM", pr, axis=0).item() == 88  # TF 2.21: 88 (uint8)
    assert s.reduce("SUM", pr, axis=None).tolist() == [144, 200]  # TF 2.21: [144, 200]


@pytest.mark.parametrize("make", [lambda: mirrored(2), lambda: swd.OneDeviceStrategy("cpu:0")])
def test_colocate_vars_with_takes_only_variables_of_the_strategy(make) -> None:
    """TF 2.21 (MirroredStrategy, OneDeviceStrategy): ValueError "`colocate_vars_with` must
    only be passed a variable created in this tf.distribute.Strategy.scope()" for what
    non_slot_devices returned, a device string or a tensor; a variable of the scope works."""
    s = make()
    with s.scope():
        v = swd.Variable(1.0)
        for target in (s.extended.non_slot_devices([v]), "cpu:0", torch.tensor(1.0)):
            with pytest.raises(ValueError, match="must only be passed a variable created"):
                s.extended.colocate_vars_with(target).__enter__()
        with s.extended.colocate_vars_with(v):
            w = swd.Variable(3.0)
    assert w.read_value().item() == 3.0
