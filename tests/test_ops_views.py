"""View and shape ops on DTensors against single-device torch, with the placements they keep
(no communication where the local view is exact) and the ones they must redistribute."""

from __future__ import annotations

import pytest
import torch

import shardwise as sw
from op_oracle import run_oracle
from shardwise import InterleavedShard, Partial, Shard

aten = torch.ops.aten


def _rand(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape) + len(shape)))


def _no_comm(fn, *tensors):
    with sw.debug.CommCounter() as counter:
        out = fn(*tensors)
    assert counter.total_bytes == 0 and not counter.counts, counter.counts
    return out


# ----- oracle --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("shape", "fn"),
    [
        ((5, 3, 2), lambda x: x.reshape(-1, 6)),
        ((5, 6), lambda x: x.view(5, 2, 3)),
        ((6, 5), lambda x: x.view(3, 2, 5)),
        ((4, 6), lambda x: x.view(6, 4)),
        ((5, 1, 3), lambda x: x.view(15)),
        ((5, 3), lambda x: x.view(1, 5, 1, 3)),
        ((7, 3), lambda x: x.t().reshape(-1)),
        ((5, 3, 2), lambda x: x.flatten(1)),
        ((5, 3, 2), lambda x: x.flatten()),
        ((5, 6), lambda x: x.unflatten(1, (3, 2))),
        ((5, 3), lambda x: x.view_as(torch.empty(15))),
        ((0, 3), lambda x: x.view(3, 0)),
    ],
)
def test_view_oracle(shape, fn) -> None:
    run_oracle(fn, [_rand(*shape)], max_cases=10)


@pytest.mark.parametrize(
    "fn",
    [
        lambda x: x.transpose(0, 2),
        lambda x: x.permute(2, 0, 1),
        lambda x: x.movedim(0, -1),
        lambda x: x.mT,
        lambda x: x.squeeze(),
        lambda x: x.squeeze(1),
        lambda x: x.squeeze(0),
        lambda x: x.squeeze((1, 2)),
        lambda x: x.unsqueeze(1),
        lambda x: x.unsqueeze(-1),
        lambda x: x.expand(2, 5, 3, 3),
        lambda x: x.repeat(2, 1, 1, 2),
        lambda x: x.contiguous(),
        lambda x: aten.alias(x),
        lambda x: x.diagonal(0, 0, 2),
        lambda x: torch.diag(x[:, 0, :]),
        lambda x: x.flip(0, -1),
        lambda x: x.roll(2, 0),
        lambda x: x.roll((1, -1), (0, 2)),
        lambda x: x.roll(4),
    ],
)
def test_reorder_and_broadcast_oracle(fn) -> None:
    run_oracle(fn, [_rand(5, 1, 3)], max_cases=8)


def test_t_and_expand_as_oracle() -> None:
    run_oracle(lambda x: x.t(), [_rand(5, 3)], max_cases=8)
    run_oracle(lambda x: x.t(), [_rand(5)], max_cases=4)
    run_oracle(lambda x, y: x.expand_as(y), [_rand(5, 1), _rand(3, 5, 2)], max_cases=8)


@pytest.mark.parametrize(
    "fn",
    [
        lambda x: x[1:4],
        lambda x: x[:, ::2],
        lambda x: x[-3:, 1:],
        lambda x: x[:, 0:99],
        lambda x: x[2],
        lambda x: x[:, -1],
        lambda x: x.narrow(1, 1, 3),
        lambda x: x.split(2, 1),
        lambda x: x.split([1, 4], 0),
        lambda x: x.chunk(3, 0),
        lambda x: x.tensor_split(3, 1),
        lambda x: x.unbind(1),
        lambda x: x.unbind(0),
    ],
)
def test_slice_select_split_oracle(fn) -> None:
    run_oracle(fn, [_rand(5, 5)], max_cases=10)


@pytest.mark.parametrize(
    ("shapes", "fn"),
    [
        ([(5, 3), (2, 3)], lambda x, y: torch.cat([x, y], 0)),
        ([(5, 3), (5, 2)], lambda x, y: torch.cat([x, y], -1)),
        ([(5, 3), (5, 3)], lambda x, y: torch.stack([x, y], 1)),
        ([(5, 3), (5, 3)], lambda x, y: torch.stack([x, y])),
        ([(5, 3), (2, 3)], lambda x, y: torch.vstack([x, y])),
        ([(5, 3), (5, 2)], lambda x, y: torch.hstack([x, y])),
    ],
)
def test_cat_stack_oracle(shapes, fn) -> None:
    run_oracle(fn, [_rand(*s) for s in shapes], max_cases=12)


def test_cat_skips_legacy_empty_inputs() -> None:
    run_oracle(lambda x, y: torch.cat([x, y], 1), [_rand(4, 3), torch.empty(0)], max_cases=8)


@pytest.mark.parametrize(
    "fn",
    [
        lambda x: (x * 1).squeeze_(1),
        lambda x: (x * 1).squeeze_(),
        lambda x: (x * 1).unsqueeze_(0),
        lambda x: (x * 1).transpose_(0, 2),
        lambda x: (x * 1)[:, 0].t_(),
    ],
)
def test_inplace_views_oracle(fn) -> None:
    run_oracle(fn, [_rand(5, 1, 3)], max_cases=6)


def test_interleaved_inputs_oracle() -> None:
    run_oracle(lambda x: x.view(2, 3, 4), [_rand(6, 4)], interleaved=True, max_cases=10)
    run_oracle(lambda x: x.reshape(-1), [_rand(6, 4)], interleaved=True, max_cases=10)
    run_oracle(lambda x: x.t()[1:], [_rand(6, 4)], interleaved=True, max_cases=10)


# ----- placements kept, and redistribution where needed -------------------------------------


def test_merge_keeps_outer_shard_when_even() -> None:
    mesh = sw.init_device_mesh("cpu", (2,))
    x = _rand(4, 3)
    out = _no_comm(lambda d: d.view(12), sw.distribute_tensor(x, mesh, [Shard(0)]))
    assert out.placements == (Shard(0),)
    assert torch.equal(out.full_tensor(), x.view(12))


def test_uneven_merge_needs_redistribution() -> None:
    mesh = sw.init_device_mesh("cpu", (2,))
    x = _rand(5, 3)
    d = sw.distribute_tensor(x, mesh, [Shard(0)])
    with pytest.raises(sw.errors.ImplicitRedistributeError, match="aten.view"):
        d.view(15)
    with sw.config.allow_implicit_redistribute():
        out = d.view(15)
    assert torch.equal(out.full_tensor(), x.view(15))


@pytest.mark.parametrize(("size", "split", "kept"), [(12, (4, 3), True), (10, (5, 2), False)])
def test_split_of_sharded_dim_keeps_outer_shard_when_sizes_allow(size, split, kept) -> None:
    mesh = sw.init_device_mesh("cpu", (2,))
    x = _rand(size)
    d = sw.distribute_tensor(x, mesh, [Shard(0)])
    with sw.config.allow_implicit_redistribute(), sw.debug.CommCounter() as counter:
        out = d.view(*split)
    assert (counter.total_bytes == 0) == kept
    assert (out.placements == (Shard(0),)) == kept
    assert torch.equal(out.full_tensor(), x.view(*split))


def test_interleaved_split_becomes_inner_shard_and_back() -> None:
    mesh = sw.init_device_mesh("cpu", (2,))
    x = _rand(6, 4)  # a merged [q; k; v] of 3 blocks of 2 rows
    d = sw.distribute_tensor(x, mesh, [InterleavedShard(0, 3)])
    split = _no_comm(lambda t: t.view(3, 2, 4), d)
    assert split.placements == (Shard(1),)
    assert torch.equal(split.full_tensor(), x.view(3, 2, 4))
    merged = _no_comm(lambda t: t.reshape(6, 4), split)
    assert merged.placements == (InterleavedShard(0, 3),)
    assert torch.equal(merged.full_tensor(), x)


def test_transpose_and_permute_move_the_shard() -> None:
    mesh = sw.init_device_mesh("cpu", (2, 2))
    x = _rand(5, 3, 2)
    d = sw.distribute_tensor(x, mesh, [Shard(0), Partial()])
    out = _no_comm(lambda t: t.permute(2, 0, 1).transpose(0, 1), d)
    assert out.placements == (Shard(0), Partial())
    assert torch.equal(out.full_tensor(), x.permute(2, 0, 1).transpose(0, 1))


def test_slice_along_sharded_dim() -> None:
    mesh = sw.init_device_mesh("cpu", (3,))
    x = _rand(7, 4)
    d = sw.distribute_tensor(x, mesh, [Shard(0)])
    with pytest.raises(sw.errors.ImplicitRedistributeError, match="aten.slice"):
        d[1:5]
    full = _no_comm(lambda t: t[0:7, 1:3], d)
    assert full.placements == (Shard(0),)
    assert torch.equal(full.full_tensor(), x[:, 1:3])


def test_cat_along_other_dim_and_split_keep_shard() -> None:
    mesh = sw.init_device_mesh("cpu", (2,))
    x, y = _rand(5, 3), _rand(5, 2)
    dx = sw.distribute_tensor(x, mesh, [Shard(0)])
    dy = sw.distribute_tensor(y, mesh, [Shard(0)])
    out = _no_comm(lambda a, b: torch.cat([a, b], 1), dx, dy)
    assert out.placements == (Shard(0),)
    pieces = _no_comm(lambda t: t.split([3, 2], 1), out)
    assert [p.placements for p in pieces] == [(Shard(0),), (Shard(0),)]
    assert torch.equal(pieces[1].full_tensor(), y)


def test_squeeze_uses_global_sizes() -> None:
    mesh = sw.init_device_mesh("cpu", (4,))
    x = _rand(3, 1, 2)  # dim 0 has local size 1 (or 0) on every device
    d = sw.distribute_tensor(x, mesh, [Shard(0)])
    out = _no_comm(lambda t: t.squeeze(), d)
    assert out.shape == (3, 2) and out.placements == (Shard(0),)
    assert torch.equal(out.full_tensor(), x.squeeze())
    assert _no_comm(lambda t: t.squeeze(0), d).shape == (3, 1, 2)


def test_inplace_squeeze_updates_the_dtensor() -> None:
    mesh = sw.init_device_mesh("cpu", (2,))
    x = _rand(1, 5, 3)
    d = sw.distribute_tensor(x, mesh, [Shard(1)])
    d.squeeze_(0)
    assert d.shape == (5, 3) and d.placements == (Shard(0),)
    assert torch.equal(d.full_tensor(), x[0])


def test_expand_keeps_partial_and_new_dims_are_replicate() -> None:
    mesh = sw.init_device_mesh("cpu", (2, 2))
    x = _rand(5, 1)
    d = sw.distribute_tensor(x, mesh, [Shard(0), Partial()])
    out = _no_comm(lambda t: t.expand(4, 5, 3), d)
    assert out.placements == (Shard(1), Partial())
    assert torch.equal(out.full_tensor(), x.expand(4, 5, 3))


def test_view_to_a_wrong_size_names_the_shapes() -> None:
    mesh = sw.init_device_mesh("cpu", (2,))
    d = sw.distribute_tensor(_rand(3, 4), mesh, [Shard(0)])
    with pytest.raises(sw.errors.InvalidArgumentError, match=r"shape \[-1, 5\] is invalid for 12"):
        d.view(-1, 5)


@pytest.mark.parametrize(
    ("indices", "placements"),
    [(torch.tensor([1, 3, 4]), [Shard(0)]), (torch.tensor([1, 3, 4]), [sw.Replicate()]),
     (torch.tensor(3), [sw.Replicate()])],
)
def test_tensor_split_with_dtensor_indices(indices, placements) -> None:
    """tensor_split reads its indices (or number of sections) on the host before dispatch: a
    DTensor there is read as its global value."""
    mesh = sw.init_device_mesh("cpu", (2,))
    x = _rand(6, 5)
    dx = sw.distribute_tensor(x, mesh, [Shard(1)])
    di = sw.distribute_tensor(indices, mesh, placements)
    with sw.config.allow_implicit_redistribute():
        pieces = torch.tensor_split(dx, di, dim=0)
    expected = torch.tensor_split(x, indices, dim=0)
    assert len(pieces) == len(expected)
    for got, want in zip(pieces, expected, strict=True):
        assert torch.equal(got.full_tensor(), want)


def test_tensor_split_reading_sharded_indices_is_explicit() -> None:
    mesh = sw.init_device_mesh("cpu", (2,))
    dx = sw.distribute_tensor(_rand(6, 5), mesh, [Shard(1)])
    di = sw.distribute_tensor(torch.tensor([1, 3]), mesh, [Shard(0)])
    with pytest.raises(sw.errors.ImplicitRedistributeError, match="tensor_split"):
        torch.tensor_split(dx, di)


# ----- as_strided ----------------------------------------------------------------------------


@pytest.mark.parametrize("placements", [[sw.Replicate()], [Shard(0)], [Shard(1)]])
@pytest.mark.parametrize("transpose", [False, True])
def test_as_strided_addresses_the_global_storage(placements, transpose) -> None:
    mesh = sw.init_device_mesh("cpu", (2,))
    x = _rand(4, 6).requires_grad_()
    dx = sw.distribute_tensor(x.detach().clone(), mesh, placements).requires_grad_()
    src, dsrc = (x.t(), dx.t()) if transpose else (x, dx)
    args = ((3, 2), (5, 2), 3)
    with sw.config.allow_implicit_redistribute():
        out = torch.as_strided(dsrc, *args)
        copy = torch.as_strided_copy(dsrc, *args)
    expected = torch.as_strided(src, *args)
    assert out.placements == (sw.Replicate(),)
    assert torch.equal(out.full_tensor(), expected)
    assert torch.equal(copy.full_tensor(), expected)
    weight = _rand(3, 2)
    (out.full_tensor() * weight).sum().backward()
    (expected * weight).sum().backward()
    assert torch.equal(dx.grad.full_tensor(), x.grad)


def test_as_strided_output_aliases_a_replicated_input() -> None:
    mesh = sw.init_device_mesh("cpu", (2,))
    x = _rand(4, 6)
    dx = sw.distribute_tensor(x.clone(), mesh, [sw.Replicate()])
    dx.as_strided((2, 2), (6, 1), 1).add_(1.0)
    x.as_strided((2, 2), (6, 1), 1).add_(1.0)
    assert torch.equal(dx.full_tensor(), x)


@pytest.mark.parametrize("placements", [[Shard(0)], [Shard(1)], [Partial()]])
@pytest.mark.parametrize("transpose", [False, True])
def test_as_strided_to_its_own_layout_is_an_alias_that_moves_nothing(placements, transpose
                                                                     ) -> None:
    """PyTorch's test_as_strided_identity: explicit mode, nothing gathered."""
    mesh = sw.init_device_mesh("cpu", (2,))
    x = _rand(4, 6)
    dx = sw.distribute_tensor(x.clone(), mesh, [sw.Replicate()]).redistribute(
        placements=placements)  # local cuts, or a Partial's pieces: no collective
    src, dsrc = (x.t(), dx.t()) if transpose else (x, dx)
    args = (dsrc.shape, dsrc.stride(), dsrc.storage_offset())
    with sw.debug.CommCounter() as counter:
        out = torch.as_strided(dsrc, *args)
        copy = torch.as_strided_copy(dsrc, *args)
    assert dict(counter.counts) == {}
    assert out.placements == copy.placements == dsrc.placements
    assert out.shape == src.shape and out.stride() == dsrc.stride()
    assert torch.equal(out.full_tensor(), src) and torch.equal(copy.full_tensor(), src)
    out.mul_(2.0)  # an alias: the source changes with it, the copy does not
    assert torch.equal(dsrc.full_tensor(), 2 * src) and torch.equal(copy.full_tensor(), src)


def test_as_strided_of_a_slice_is_refused() -> None:
    """A slice addresses its base's storage, which no DTensor tracks."""
    mesh = sw.init_device_mesh("cpu", (2,))
    dx = sw.distribute_tensor(_rand(4, 6), mesh, [sw.Replicate()])
    with pytest.raises(sw.errors.UnsupportedOpError, match=r"a view of a tensor of shape \[4, 6\]"):
        dx[1:].as_strided((2, 2), (6, 1))
    column = sw.distribute_tensor(_rand(4, 1), mesh, [sw.Replicate()])
    with pytest.raises(sw.errors.UnsupportedOpError, match=r"a view of a tensor of shape \[4, 1\]"):
        column.expand(4, 3).as_strided((2,), (1,))


@pytest.mark.parametrize("placements", [[sw.Replicate()], [Shard(0)], [Shard(1)]])
@pytest.mark.parametrize("size", [(6, 4), (5,), (3, 7)])
def test_resize_keeps_the_storage_order(placements, size) -> None:
    """The elements of the storage in order (the transposed tensor's storage is its base's),
    then, where the tensor grows, zeros (torch leaves them uninitialized); a tensor resized to
    its own shape is left alone."""
    mesh = sw.init_device_mesh("cpu", (2,))
    x = _rand(4, 6)
    for src in (x.clone(), x.clone().t()):
        d = sw.distribute_tensor(x.clone(), mesh, placements)
        d = d.t() if src.stride() != x.stride() else d
        before, same = d.placements, list(size) == list(d.shape)
        with sw.config.allow_implicit_redistribute():
            out = d.resize_(size)
        expected = src.resize_(size)
        assert out is d and d.shape == torch.Size(size)
        if same:  # torch: its own shape changes nothing
            assert d.placements == before
        else:
            assert d.placements == (sw.Replicate(),)
        keep = min(x.numel(), expected.numel())
        assert torch.equal(d.full_tensor().reshape(-1)[:keep], expected.reshape(-1)[:keep])
        assert not d.full_tensor().reshape(-1)[keep:].any()


def test_resize_as_takes_the_template_shape() -> None:
    mesh = sw.init_device_mesh("cpu", (2,))
    x = _rand(4, 6)
    d = sw.distribute_tensor(x.clone(), mesh, [sw.Replicate()])
    template = sw.distribute_tensor(torch.zeros(8, 3), mesh, [Shard(0)])
    d.resize_as_(template)
    assert torch.equal(d.full_tensor(), x.clone().resize_as_(torch.zeros(8, 3)))
