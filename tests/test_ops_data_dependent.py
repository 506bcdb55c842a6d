"""Data-dependent and scatter ops, padding/unfold and LSTM on DTensors: single-device torch is the
oracle (forward and backward), on meshes (2,), (3,), (4,), (2, 2) with uneven shapes; plus the
placements they keep and the communication they need."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import shardwise as sw
from op_oracle import run_oracle
from shardwise import Partial, Replicate, Shard
from shardwise.debug import CommCounter
from shardwise.errors import ImplicitRedistributeError

G = torch.Generator().manual_seed(0)


def randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=G)


X = randn(5, 3)
MASK = torch.rand(5, 3, generator=G) > 0.4
INTS = torch.tensor([1, 1, 2, 2, 2, 0, 1, 5])
ROWS = torch.tensor([[1, 2], [3, 4], [1, 2], [0, 0], [3, 4]])
SCATTER_INDEX = torch.tensor([[0, 1, 0], [4, 4, 2], [1, 3, 3]])
BAG_INDICES = torch.tensor([1, 2, 4, 5, 4, 3, 2, 9])
BAG_OFFSETS = torch.tensor([0, 3, 3, 6])

# name -> (fn, inputs, oracle options); grad=False where torch has no derivative.
CASES = {
    "unique_consecutive": (
        lambda a: torch.unique_consecutive(a, return_inverse=True, return_counts=True),
        [INTS],
        {},
    ),
    "unique_consecutive_dim": (lambda a: torch.unique_consecutive(a, dim=0), [ROWS], {}),
    "unique_dim": (lambda a: torch.unique(a, dim=0, return_inverse=True), [ROWS], {}),
    "nonzero": (torch.nonzero, [MASK], {}),
    "where_cond": (torch.where, [MASK], {}),
    "argwhere_float": (torch.argwhere, [X], {}),
    "masked_select": (torch.masked_select, [X, MASK], {}),
    "masked_select_broadcast": (torch.masked_select, [X, MASK[:1]], {"max_cases": 4}),
    "bool_index": (lambda a, m: a[m], [X, MASK], {}),
    "bool_index_rows": (lambda a, m: a[m], [X, MASK[:, 0]], {}),
    "bool_index_put": (lambda a, m, v: a.index_put((m,), v), [X, MASK[:, 1], randn(3)], {}),
    "masked_scatter": (lambda a, m, s: a.masked_scatter(m, s), [X, MASK, randn(17)], {}),
    "scatter_reduce_sum": (
        lambda a, i, s: a.scatter_reduce(0, i, s, "sum"),
        [X, SCATTER_INDEX, randn(3, 3)],
        {},
    ),
    "scatter_reduce_amax": (
        lambda a, i, s: a.scatter_reduce(0, i, s, "amax"),
        [X, SCATTER_INDEX, randn(3, 3)],
        {},
    ),
    "scatter_reduce_amin_dim1": (
        lambda a, i, s: a.scatter_reduce(1, i, s, "amin", include_self=False),
        [randn(3, 5), SCATTER_INDEX.T.clone() % 3, randn(3, 3)],
        {"grad": False},
    ),
    "put": (lambda a, i, s: a.put(i, s), [X, torch.tensor([0, 7, 3, -1]), randn(4)], {}),
    "put_accumulate": (
        lambda a, i, s: a.put(i, s, accumulate=True),
        [X, torch.tensor([0, 7, 7, -1]), randn(4)],
        {},
    ),
    "take": (torch.take, [X, torch.tensor([[0, 7], [3, -1], [14, 2]])], {}),
    "repeat_interleave": (
        lambda a, r: a.repeat_interleave(r, dim=0),
        [X, torch.tensor([1, 0, 2, 1, 3])],
        {},
    ),
    "repeat_interleave_counts": (torch.repeat_interleave, [torch.tensor([1, 0, 2, 3])], {}),
    "embedding_bag_mean": (
        lambda w, i, o: F.embedding_bag(i, w, o, mode="mean"),
        [randn(10, 3), BAG_INDICES, BAG_OFFSETS],
        {},
    ),
    "embedding_bag_max": (
        lambda w, i, o: F.embedding_bag(i, w, o, mode="max"),
        [randn(10, 3), BAG_INDICES, torch.tensor([0, 3, 4, 6])],
        {},
    ),
    "embedding_bag_weighted": (
        lambda w, i, o, p: F.embedding_bag(i, w, o, mode="sum", per_sample_weights=p),
        [randn(10, 5), BAG_INDICES, BAG_OFFSETS, randn(8)],
        {"max_cases": 4},
    ),
    "embedding_max_norm": (
        lambda w, i: F.embedding(i, w, max_norm=1.0),
        [randn(7, 3), torch.tensor([1, 2, 4, 2])],
        {},
    ),
    "embedding_max_norm_inf": (
        lambda w, i: F.embedding(i, w, max_norm=0.5, norm_type=float("inf")),
        [randn(7, 5), torch.tensor([6, 0, 3])],
        {"max_cases": 4},
    ),
    "bincount": (lambda a: torch.bincount(a, minlength=3), [INTS], {"grad": False}),
    "bincount_weights": (torch.bincount, [INTS, randn(8)], {"grad": False}),
    "searchsorted": (
        torch.searchsorted,
        [torch.sort(randn(7)).values, randn(5, 3)],
        {},
    ),
    "searchsorted_nd_right": (
        lambda s, v: torch.searchsorted(s, v, right=True),
        [torch.sort(randn(3, 6)).values, randn(3, 5)],
        {},
    ),
    "cdist": (torch.cdist, [X, randn(6, 3)], {}),
    "cdist_batched_p1": (
        lambda a, b: torch.cdist(a, b, p=1.0),
        [randn(2, 5, 3), randn(2, 3, 3)],
        {},
    ),
    "histc_data_range": (lambda a: torch.histc(a, bins=4), [X], {"grad": False}),
    "histc_fixed_range": (
        lambda a: torch.histc(a, bins=5, min=-1, max=1),
        [X],
        {"grad": False},
    ),
    "histogram": (lambda a: torch.histogram(a, bins=4), [X], {"grad": False}),
    "histogram_weighted": (
        lambda a, w: torch.histogram(a, bins=3, range=(-1.0, 1.0), weight=w),
        [X, randn(5, 3).abs()],
        {"grad": False},
    ),
    "histogram_density": (
        lambda a: torch.histogram(a, bins=3, density=True),
        [X],
        {"grad": False},
    ),
    "quantile_tensor_q": (
        lambda a, q: torch.quantile(a, q, dim=1, keepdim=True),
        [X, torch.tensor([0.25, 0.5])],
        {"partial": False},
    ),
    "reflect_pad_1d": (lambda a: F.pad(a, (2, 1), mode="reflect"), [randn(3, 5, 4)], {}),
    "reflect_pad_2d": (lambda a: F.pad(a, (2, 1, 1, 2), mode="reflect"), [randn(3, 2, 5, 4)], {}),
    "replicate_pad_1d": (lambda a: F.pad(a, (0, 3), mode="replicate"), [randn(5, 3)], {}),
    "replicate_pad_2d": (
        lambda a: F.pad(a, (2, 1, 1, 2), mode="replicate"),
        [randn(3, 2, 5, 4)],
        {},
    ),
    "replicate_pad_3d": (
        lambda a: F.pad(a, (1, 1, 0, 2, 1, 0), mode="replicate"),
        [randn(2, 3, 2, 3, 2)],
        {"max_cases": 4},
    ),
    "unfold": (lambda a: F.unfold(a, 2, padding=1, stride=2), [randn(3, 4, 5, 3)], {}),
    "unfold_unbatched_dilated": (
        lambda a: F.unfold(a, (2, 3), dilation=(2, 1)),
        [randn(2, 5, 4)],
        {},
    ),
    "fold": (lambda a: F.fold(a, (5, 4), 2, padding=1, stride=2), [randn(3, 8, 9)], {}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_oracle(name: str) -> None:
    fn, tensors, options = CASES[name]
    options = {"max_cases": 6, **options}
    assert run_oracle(fn, tensors, **options) > 0


@pytest.mark.slow  # end to end: an LSTM's forward and backward on several meshes (about 5 s)
def test_lstm_forward_backward() -> None:
    lstm = torch.nn.LSTM(3, 4, batch_first=True)
    names = [n for n, _ in lstm.named_parameters()]
    params = [p.detach().clone() for _, p in lstm.named_parameters()]

    def fn(x: torch.Tensor, *ps: torch.Tensor):
        out, (h, c) = torch.func.functional_call(lstm, dict(zip(names, ps, strict=True)), (x,))
        return out, h, c

    cases = run_oracle(fn, [randn(5, 3, 3), *params], max_cases=3, partial=False)
    assert cases > 0


def test_lstm_on_a_replicated_input_cut_to_the_batch_split_equals_torch() -> None:
    """The batch-split states make the replicated input be cut to its batch piece, a strided
    view, which the oneDNN kernel would read as dense."""
    lstm = torch.nn.LSTM(3, 4)
    x, h, c = randn(5, 4, 3), randn(1, 4, 4), randn(1, 4, 4)
    mesh = _mesh(2)
    params = {n: sw.distribute_tensor(p.detach(), mesh, [sw.Replicate()])
              for n, p in lstm.named_parameters()}
    states = tuple(sw.distribute_tensor(s, mesh, [sw.Shard(1)]) for s in (h, c))
    out = torch.func.functional_call(
        lstm, params, (sw.distribute_tensor(x, mesh, [sw.Replicate()]), states)
    )[0]
    assert out.placements == (sw.Shard(1),)
    torch.testing.assert_close(out.full_tensor(), lstm(x, (h, c))[0].detach())


def _mesh(*shape: int) -> sw.DeviceMesh:
    return sw.init_device_mesh("cpu", shape)


def test_data_dependent_shape_needs_explicit_gather() -> None:
    mask = sw.distribute_tensor(MASK, _mesh(2), [Shard(0)])
    with pytest.raises(ImplicitRedistributeError, match="nonzero"):
        torch.nonzero(mask)
    out = torch.nonzero(mask.redistribute(placements=[Replicate()]))
    assert out.placements == (Replicate(),)
    assert torch.equal(out.full_tensor(), torch.nonzero(MASK))


def test_counts_of_a_sharded_input_are_partial() -> None:
    mesh = _mesh(3)
    x = sw.distribute_tensor(X, mesh, [Shard(0)])
    with CommCounter() as counter:
        fixed = torch.histc(x, bins=4, min=-1, max=1)
    assert fixed.placements == (Partial("sum"),) and counter.total_bytes == 0
    with CommCounter() as counter:
        found = torch.histc(x, bins=4)
    assert found.placements == (Partial("sum"),)
    assert set(counter.counts) == {"all_reduce"}  # only the range's scalars
    assert torch.equal(found.full_tensor(), torch.histc(X, bins=4))
    ints = sw.distribute_tensor(INTS, mesh, [Shard(0)])
    counts = torch.bincount(ints)
    assert counts.placements == (Partial("sum"),)
    assert torch.equal(counts.full_tensor(), torch.bincount(INTS))


def test_sharded_ops_keep_their_shards_without_communication() -> None:
    mesh = _mesh(2, 2)
    x = sw.distribute_tensor(randn(4, 3, 6), mesh, [Shard(0), Shard(1)])
    rows = sw.distribute_tensor(X, mesh, [Shard(0), Replicate()])
    other = sw.distribute_tensor(randn(4, 3), mesh, [Replicate(), Replicate()])
    boundaries = sw.distribute_tensor(torch.sort(randn(7)).values, mesh, [Replicate()] * 2)
    weight = sw.distribute_tensor(randn(10, 4), mesh, [Shard(1), Replicate()])
    indices = sw.distribute_tensor(BAG_INDICES, mesh, [Replicate()] * 2)
    offsets = sw.distribute_tensor(BAG_OFFSETS, mesh, [Replicate()] * 2)
    with CommCounter() as counter:
        padded = F.pad(x, (2, 1), mode="reflect")
        dist = torch.cdist(rows, other)
        found = torch.searchsorted(boundaries, rows)
        bags = F.embedding_bag(indices, weight, offsets)
    assert counter.total_bytes == 0
    assert padded.placements == (Shard(0), Shard(1))
    assert dist.placements == (Shard(0), Replicate())
    assert found.placements == (Shard(0), Replicate())
    assert bags.placements == (Shard(1), Replicate())


def test_put_in_place_keeps_placements() -> None:
    mesh = _mesh(3)
    x = sw.distribute_tensor(X.clone(), mesh, [Shard(1)])
    index = sw.distribute_tensor(torch.tensor([0, 5, 14]), mesh, [Replicate()])
    source = sw.distribute_tensor(torch.tensor([1.0, 2.0, 3.0]), mesh, [Replicate()])
    x.put_(index, source, accumulate=True)
    assert x.placements == (Shard(1),)
    expected = X.clone().put_(torch.tensor([0, 5, 14]), torch.tensor([1.0, 2.0, 3.0]), True)
    assert torch.equal(x.full_tensor(), expected)
