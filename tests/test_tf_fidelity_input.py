"""shardwise.distribute gives TensorFlow 2.21's answers: dataset splitting, ``gather`` of a plain
tensor, ``MirroredStrategy([])``, a kept ReplicaContext's id, ``torch.as_tensor`` of a
sync-on-read variable and ``compute_average_loss(..., sample_weight=...)``.

Expected values are TF's behaviour as stated in the issue and spec 1B.4 (measured in TF 2.21),
or computed with plain torch on the full values."""

from __future__ import annotations

import math

import pytest
import torch

import shardwise.distribute as swd
from shardwise.distribute import VariableAggregation as VA
from shardwise.distribute import VariableSynchronization as VS


def mirrored(n: int) -> swd.MirroredStrategy:
    return swd.MirroredStrategy([f"cpu:{i}" for i in range(n)])


def steps_of(strategy: swd.Strategy, batches: list) -> list[list[list]]:
    dist = strategy.experimental_distribute_dataset(batches)
    return [[t.tolist() for t in strategy.experimental_local_results(b)] for b in dist]


# ----- dataset splitting ----------------------------------------------------------------------


def test_measured_tf_splits() -> None:
    """The splits measured in TF 2.21 (MirroredStrategy, experimental_distribute_dataset)."""
    # range(4).batch(4) over 3 replicas, with and without drop_remainder
    assert steps_of(mirrored(3), [torch.arange(4)]) == [[[0, 1], [2, 3], []]]
    # range(10).batch(8) over 2 replicas: the last batch [8, 9] is [8] | [9]
    assert steps_of(mirrored(2), [torch.arange(8), torch.arange(8, 10)]) == [
        [[0, 1, 2, 3], [4, 5, 6, 7]],
        [[8], [9]],
    ]


def test_drop_remainder_loader() -> None:
    """A DataLoader with drop_last (TF's drop_remainder=True): full batches of 4 over 3."""
    loader = torch.utils.data.DataLoader(torch.arange(10), batch_size=4, drop_last=True)
    assert steps_of(mirrored(3), list(loader)) == [[[0, 1], [2, 3], []], [[4, 5], [6, 7], []]]


def tf_split(batch: list, n: int) -> list[list]:
    """TF 2.21's rule: contiguous pieces of ceil(b / n) in replica order, then empty ones."""
    piece = math.ceil(len(batch) / n)
    return [batch[r * piece : (r + 1) * piece] for r in range(n)]


@pytest.mark.parametrize(
    ("n", "size", "batch"),
    [(3, 5, 5), (2, 1, 1), (2, 6, 4), (3, 10, 4), (4, 5, 5), (4, 7, 7), (3, 7, 3), (2, 9, 9)],
)
def test_general_rule(n: int, size: int, batch: int) -> None:
    data = list(range(size))
    batches = [data[i : i + batch] for i in range(0, size, batch)]
    expected = [tf_split(b, n) for b in batches]
    assert steps_of(mirrored(n), [torch.tensor(b) for b in batches]) == expected


def test_spelled_out_cases() -> None:
    assert steps_of(mirrored(3), [torch.arange(5)]) == [[[0, 1], [2, 3], [4]]]
    assert steps_of(mirrored(2), [torch.arange(1)]) == [[[0], []]]
    # range(6).batch(4) over 2 (spec 1B.4): the last batch [4, 5] is [4] | [5]
    assert steps_of(mirrored(2), [torch.arange(4), torch.arange(4, 6)])[1] == [[4], [5]]


def test_empty_pieces_keep_shape_and_dtype_and_structure() -> None:
    s = mirrored(3)
    xs = torch.arange(8.0).reshape(4, 2)
    ys = torch.arange(4)
    ((x, y),) = list(s.experimental_distribute_dataset([(xs, ys)]))
    xl, yl = s.experimental_local_results(x), s.experimental_local_results(y)
    assert [t.tolist() for t in yl] == [[0, 1], [2, 3], []]
    assert torch.equal(torch.cat(xl), xs)
    assert xl[2].shape == (0, 2) and xl[2].dtype == xs.dtype and yl[2].dtype == ys.dtype
    # the global mean over the pieces is the mean of the whole batch
    assert s.reduce("mean", x, axis=0).tolist() == xs.mean(0).tolist()


# ----- gather ------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 3])
def test_gather_plain_tensor_comes_back_once(n: int) -> None:
    s = mirrored(n)
    t = torch.tensor([[5]])
    assert s.gather(t, 0).tolist() == [[5]]
    assert s.gather(t, 1).tolist() == [[5]]


def test_gather_distributed_values_still_concatenates() -> None:
    s = mirrored(2)
    pr = swd.PerReplica([torch.tensor([1]), torch.tensor([2, 3])])
    assert s.gather(pr, 0).tolist() == [1, 2, 3]
    with s.scope():
        v = swd.Variable(torch.tensor([7.0]))
    assert s.gather(v, 0).tolist() == [7.0, 7.0]  # one copy per replica, as TF's
    got = s.run(lambda: swd.get_replica_context().all_gather(torch.tensor([1, 2]), axis=0))
    assert [t.tolist() for t in s.experimental_local_results(got)] == [[1, 2, 1, 2]] * 2


# ----- strategy, replica context, variables, losses --------------------------------------------


def test_mirrored_strategy_empty_device_list_is_the_default() -> None:
    default = swd.MirroredStrategy()
    empty = swd.MirroredStrategy([])
    assert empty.extended.worker_devices == default.extended.worker_devices
    assert empty.num_replicas_in_sync == default.num_replicas_in_sync


def test_replica_id_of_a_kept_replica_context() -> None:
    s = mirrored(3)
    contexts = s.experimental_local_results(s.run(swd.get_replica_context))
    ids = [rc.replica_id_in_sync_group for rc in contexts]
    assert [int(i) for i in ids] == [0, 1, 2]
    assert all(i.dtype == torch.int32 for i in ids)


@pytest.mark.parametrize(
    ("aggregation", "combine"),
    [
        (VA.SUM, lambda a: sum(a)),
        (VA.MEAN, lambda a: sum(a) / len(a)),
        (VA.ONLY_FIRST_REPLICA, lambda a: a[0]),
    ],
)
def test_as_tensor_of_sync_on_read_is_the_aggregate(aggregation: VA, combine) -> None:
    s = mirrored(3)
    with s.scope():
        v = swd.Variable(torch.zeros(2), synchronization=VS.ON_READ, aggregation=aggregation)
    per_replica = [torch.tensor([1.0, 2.0]) * (r + 1) for r in range(3)]
    s.run(lambda: v.assign(per_replica[int(swd.get_replica_context().replica_id_in_sync_group)]))
    expected = combine(per_replica)
    with s.scope():
        got = torch.as_tensor(v)
        assert type(got) is torch.Tensor and torch.allclose(got, expected)
        assert torch.allclose(torch.tensor(v), expected)


def test_compute_average_loss_with_sample_weight() -> None:
    loss = torch.tensor([1.0, 2.0, 3.0, 4.0])
    w = torch.tensor([0.5, 1.0, 0.0, 2.0])
    expected = (loss * w).sum() / 8
    assert torch.allclose(
        swd.compute_average_loss(loss, sample_weight=w, global_batch_size=8), expected
    )
    assert torch.allclose(swd.compute_average_loss(loss, w, 8), expected)  # TF's argument order
    assert torch.allclose(swd.compute_average_loss(loss, sample_weight=2.0), loss.sum() * 2 / 4)
    # in a replica context the default global batch is local batch x replicas
    s = mirrored(2)
    pr = swd.PerReplica([loss[:2], loss[2:]])
    wr = swd.PerReplica([w[:2], w[2:]])
    out = s.run(lambda lv, wv: swd.compute_average_loss(lv, sample_weight=wv), args=(pr, wr))
    assert torch.allclose(s.reduce("sum", out, axis=None), (loss * w).sum() / 4)
