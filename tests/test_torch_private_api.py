"""PyTorch's private DTensor names that its own test files use (issue 30), with torch's
semantics: ``DTensor(local, spec, requires_grad=)``, ``Shard._split_tensor``, meta tensors in
``from_local``, ``from_local(run_check=True)``'s metadata check, ``CommDebugMode``'s c10d keys,
composite ops (``aten.linear``) under ``inference_mode``, ``equal`` outside a sub-mesh,
``DTensorSpec.dim_map``, ``Shard._custom_chunk`` (torch's ``shard_dim_alltoall`` on CPU)."""

from __future__ import annotations

import types
import warnings

import pytest
import torch
import torch.distributed.tensor as torch_dtensor
import torch.nn.functional as F

import shardwise as sw
from shardwise import DTensor, Replicate, Shard
from shardwise.spec import DTensorSpec, TensorMeta


def _spec(mesh: sw.DeviceMesh, shape: tuple[int, ...], local: torch.Tensor) -> DTensorSpec:
    meta = TensorMeta(torch.Size(shape), local.stride(), local.dtype)
    return DTensorSpec(mesh, (Shard(0),), tensor_meta=meta)


def test_private_constructor_takes_one_local_tensor() -> None:
    mesh = sw.DeviceMesh("cpu", [0])
    local = torch.randn(3, 3, requires_grad=True)
    d = DTensor(local, _spec(mesh, (3, 3), local), requires_grad=True)
    assert d.shape == (3, 3) and d.is_leaf and d.requires_grad
    assert torch.equal(d.to_local(), local)
    (d * 3).to_local().sum().backward()  # the oracle: d(sum(3x))/dx is 3 everywhere
    assert torch.equal(d.grad.to_local(), torch.full((3, 3), 3.0))
    with pytest.warns(UserWarning, match="To construct DTensor"):
        DTensor(local, _spec(mesh, (3, 3), local), requires_grad=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        DTensor(local.detach(), _spec(mesh, (3, 3), local), requires_grad=False)


def test_to_local_under_no_grad_is_the_local_tensor() -> None:
    d = sw.distribute_tensor(torch.randn(4, 2), sw.DeviceMesh("cpu", [0]), [Shard(0)])
    with torch.no_grad():
        assert d.to_local() is d._local_tensor


@pytest.mark.parametrize("with_padding", [True, False])
@pytest.mark.parametrize("dim", [0, 1])
def test_split_tensor_as_torchs(with_padding: bool, dim: int) -> None:
    for size in range(10):
        x = torch.randn(3, size) if dim else torch.randn(size, 3)
        for n in (1, 3, 4, 8):
            ours = Shard(dim)._split_tensor(x, n, with_padding=with_padding, contiguous=True)
            theirs = torch_dtensor.Shard(dim)._split_tensor(
                x, n, with_padding=with_padding, contiguous=True
            )
            assert ours[1] == theirs[1], (size, n)
            assert len(ours[0]) == len(theirs[0]) == n
            for a, b in zip(ours[0], theirs[0], strict=True):
                assert a.shape == b.shape and torch.equal(a, b) and a.is_contiguous()


def test_custom_chunk_as_torchs() -> None:
    for size, n, dim in ((0, 3, 0), (5, 4, 0), (7, 3, 1), (8, 4, -1), (2, 5, 1)):
        x = torch.randn(size, 3) if dim == 0 else torch.randn(3, size)
        ours = Shard._custom_chunk(x, n, dim)
        theirs = torch_dtensor.Shard._custom_chunk(x, n, dim)
        assert len(ours) == len(theirs) == n
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True)), (size, n)


def _shard_dim_alltoall_job() -> list:
    """torch's private ``_collective_utils.shard_dim_alltoall`` with a mesh of shardwise's
    under the switch (on CPU torch gathers through the functional collectives, then takes its
    ``Shard._custom_chunk``), real and meta tensors."""
    import torch.distributed as dist

    from shardwise.as_torch import as_torch

    as_torch()
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor._collective_utils import shard_dim_alltoall

    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2, 2))
    full = torch.arange(48.0).view(12, 4)
    row = rank // 2  # this rank's coordinate on mesh dim 0: its rows, all columns
    mine = full.chunk(2, 0)[row]
    out = shard_dim_alltoall(mine, 0, 1, mesh, 0)
    meta = shard_dim_alltoall(torch.empty(6, 4, device="meta"), 0, 1, mesh, 0)
    return [torch.equal(out, full.chunk(2, 1)[row]), tuple(meta.shape), meta.stride(),
            out.stride()]


@pytest.mark.slow
def test_torchs_shard_dim_alltoall_on_a_shardwise_mesh() -> None:
    from mp_harness import run_in_processes

    for out in run_in_processes(_shard_dim_alltoall_job, 4, timeout=180):
        assert out == [True, (12, 2), (2, 1), (2, 1)], out


def test_from_local_of_a_meta_tensor_stays_meta() -> None:
    mesh = sw.DeviceMesh("cpu", [0, 1])
    for placements, local_rows in (([Shard(0)], 4), ([Replicate()], 8)):
        d = DTensor.from_local([torch.empty(local_rows, 2, device="meta")] * 2, mesh, placements)
        assert d.is_meta and d.shape == (8, 2)
        e = torch.empty_like(d, device="cpu")
        torch.nn.init.constant_(e, 1.5)
        assert not e.is_meta and torch.equal(e.full_tensor(), torch.full((8, 2), 1.5))


@pytest.mark.parametrize("placements", [[Shard(0)], [Shard(1)], [Replicate()]])
def test_linear_under_inference_mode_decomposes(placements: list) -> None:
    mesh = sw.DeviceMesh("cpu", [0, 1])
    x, w, b = torch.randn(6, 4), torch.randn(8, 4), torch.randn(8)
    dx = sw.distribute_tensor(x, mesh, [Replicate()])
    dw = sw.distribute_tensor(w, mesh, placements)
    db = sw.distribute_tensor(b, mesh, [Shard(0)] if placements == [Shard(0)] else [Replicate()])
    with torch.inference_mode(), sw.config.allow_implicit_redistribute():
        out = F.linear(dx, dw, db)
    torch.testing.assert_close(out.full_tensor(), F.linear(x, w, b))


def _two_process_job() -> str:
    import torch.distributed as dist

    from shardwise.debug import CommDebugMode
    from shardwise.errors import PackError

    rank = dist.get_rank()
    mesh = sw.DeviceMesh("cpu", [0, 1])
    with CommDebugMode() as mode:
        sw.distribute_tensor(torch.randn(4, 3), mesh, [Shard(0)])
    assert mode.get_comm_counts()[torch.ops.c10d.scatter_] == 1, mode.get_comm_counts()
    x = torch.randn(3, 4, requires_grad=True)
    for local in (
        x.double() if rank == 0 else x,  # dtype
        x.detach() if rank == 0 else x,  # requires_grad
        x.t() if rank == 0 else x,  # shape and stride
    ):
        with pytest.raises(PackError, match="differ"):
            DTensor.from_local(local, mesh, [Shard(0)], run_check=True)
        DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
    # with shape and stride given, shapes and strides are the caller's (uneven pieces)
    piece = torch.randn(2 - rank, 3)
    d = DTensor.from_local(piece, mesh, [Shard(0)], shape=(3, 3), stride=(3, 1), run_check=True)
    assert d.shape == (3, 3)
    # equal on a mesh this process owns no device of: PyTorch's answer there is True
    sub = sw.DeviceMesh("cpu", [0])
    a = DTensor.from_local(torch.ones(2, 3), sub, [Shard(0)])
    b = DTensor.from_local(torch.ones(2, 3) * (2 if rank == 0 else 1), sub, [Shard(0)])
    with sw.config.allow_implicit_redistribute():
        assert a.equal(b) is (rank == 1)  # the owner compares for real (and differs)
    # a 0-d result there is PyTorch's default 0-d zero, a larger one an empty tensor
    total, piece = a.sum().to_local(), a.to_local()
    if rank == 1:
        assert total.shape == () and total.item() == 0 and piece.shape == (0,)
    else:
        assert total.item() == 6.0 and piece.shape == (2, 3)
    return "ok"


def test_run_check_distribute_counts_and_equal_outside_a_sub_mesh() -> None:
    from mp_harness import run_in_processes

    assert run_in_processes(_two_process_job, 2, timeout=180) == ["ok", "ok"]


@pytest.mark.parametrize(("op", "reduce_op"), [(torch.maximum, "max"), (torch.minimum, "min")])
def test_maximum_minimum_keep_their_own_pending_reduction(op, reduce_op: str) -> None:
    # PyTorch's test_pointwise_ops: max(max_i a_i, max_i b_i) = max_i max(a_i, b_i), no move
    from shardwise.debug import CommDebugMode

    mesh = sw.DeviceMesh("cpu", [0, 1])
    a, b = [torch.randn(3, 4) for _ in range(2)], [torch.randn(3, 4) for _ in range(2)]
    da = DTensor.from_local(a, mesh, [sw.Partial(reduce_op)])
    db = DTensor.from_local(b, mesh, [sw.Partial(reduce_op)])
    with CommDebugMode() as mode:
        out = op(da, db)
    assert out.placements == (sw.Partial(reduce_op),) and mode.get_total_counts() == 0
    reduce = torch.amax if reduce_op == "max" else torch.amin
    expected = op(reduce(torch.stack(a), 0), reduce(torch.stack(b), 0))
    assert torch.equal(out.full_tensor(), expected)


def _torch_dim_map(placements: list, ndim: int) -> list[int] | type:
    """torch's own ``DTensorSpec.dim_map`` read on torch's placements (the oracle), or the
    class of the error it raises."""
    from torch.distributed.tensor import Partial as TorchPartial
    from torch.distributed.tensor._dtensor_spec import DTensorSpec as TorchSpec
    from torch.distributed.tensor.placement_types import _StridedShard

    def theirs(p):
        if isinstance(p, sw.InterleavedShard):
            return _StridedShard(p.dim, split_factor=p.interleaved_size)
        if isinstance(p, Shard):
            return torch_dtensor.Shard(p.dim)
        return TorchPartial(p.reduce_op) if p.is_partial() else torch_dtensor.Replicate()

    spec = types.SimpleNamespace(placements=tuple(theirs(p) for p in placements), ndim=ndim)
    try:
        return TorchSpec.dim_map.fget(spec)
    except ValueError:
        return ValueError


@pytest.mark.parametrize(
    "placements",
    [
        [Shard(1), Replicate()],
        [Replicate(), Shard(0)],
        [Shard(2), Shard(0)],
        [sw.Partial(), Shard(2)],
        [sw.Partial("max"), sw.Partial()],
        [sw.InterleavedShard(0, 2), Shard(1)],  # torch's _StridedShard counts as a shard
        [Shard(0), sw.InterleavedShard(2, 2)],
        [Shard(1), Shard(1)],  # one tensor dim, two mesh dims: torch raises
        [sw.InterleavedShard(0, 2), Shard(0)],
    ],
)
def test_spec_dim_map_as_torchs(placements: list) -> None:
    """torch's test_layer_norm_bwd reads ``x._spec.dim_map`` to tell which tensor dims are
    sharded: per tensor dim the mesh dim sharding it, else -1 (Partial mesh dims nowhere)."""
    mesh = sw.init_device_mesh("cpu", (2, 2))
    spec = DTensorSpec(mesh, tuple(placements), TensorMeta(torch.Size([4, 6, 8]), (48, 8, 1),
                                                           torch.float32))
    expected = _torch_dim_map(placements, 3)
    if expected is ValueError:
        with pytest.raises(sw.errors.InvalidPlacementError, match="sharded by mesh dims 0 and 1"):
            _ = spec.dim_map
    else:
        assert spec.dim_map == expected
    if not any(p.is_partial() for p in placements) and expected is not ValueError:
        x = sw.distribute_tensor(torch.randn(4, 6, 8), mesh, placements)
        assert x._spec.dim_map == expected  # as torch's test reads it


def test_spec_dim_map_reads_negative_and_ragged_dims_and_is_read_only() -> None:
    mesh = sw.init_device_mesh("cpu", (2,))
    meta = TensorMeta(torch.Size([4, 6]), (6, 1), torch.float32)
    assert DTensorSpec(mesh, (Shard(-1),), meta).dim_map == [-1, 0]
    assert DTensorSpec(mesh, (sw.RaggedShard(0, (1, 3)),), meta).dim_map == [0, -1]
    with pytest.raises(AttributeError):
        DTensorSpec(mesh, (Shard(0),), meta).dim_map = [-1, -1]


def test_from_local_of_a_dtensor_raises_torchs_runtime_error() -> None:
    """``DTensor.from_local(dtensor, ...)``: a RuntimeError with torch's words (PyTorch's
    test_from_local asserts them), still a PackError, naming the DTensor."""
    mesh = sw.init_device_mesh("cpu", (2,))
    d = sw.distribute_tensor(torch.ones(4, 2), mesh, [Shard(0)])
    with pytest.raises(RuntimeError, match="the local_tensor argument only accepts torch.Tensor"):
        DTensor.from_local(d, mesh, [Shard(0)])
    with pytest.raises(sw.errors.PackError, match=r"shape=\[4, 2\]"):
        DTensor.from_local(d, mesh, [Shard(0)])
