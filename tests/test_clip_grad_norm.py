"""``torch.nn.utils.clip_grad_norm_`` over DTensor gradients, foreach and not, across 2 processes:
the total norm and the clipped gradients equal single-device PyTorch's, and the norm costs one
scalar collective per mesh dim the gradients are sharded over (never one per parameter), as
counted by ``CommDebugMode``. Also: torch's foreach paths take DTensors (``foreach=None``
chooses them as for plain tensors)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._foreach_utils import _has_foreach_support

import shardwise as sw
from mp_harness import run_in_processes
from shardwise import Replicate, Shard, demo
from shardwise.debug import CommDebugMode
from shardwise.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    fully_shard,
    loss_parallel,
    parallelize_module,
)

FOREACH = (None, True, False)
NORMS = (2.0, math.inf)


def _check(model, single, norm_type: float, foreach: bool | None) -> tuple[list, bool]:
    """Clip both models' gradients; the collectives the sharded clip ran (kind, mesh dim,
    bytes) and whether its norm and gradients equal the single-device ones."""
    expected = torch.nn.utils.clip_grad_norm_(single.parameters(), 0.05, norm_type,
                                              foreach=foreach)
    with sw.config.allow_implicit_redistribute(), CommDebugMode() as mode:
        total = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05, norm_type,
                                               foreach=foreach)
    ok = torch.allclose(total.full_tensor(), expected, rtol=1e-5) and all(
        torch.allclose(p.grad.full_tensor(), r.grad, rtol=1e-5, atol=1e-7)
        for p, r in zip(model.parameters(), single.parameters(), strict=True)
    )
    return [(r.kind, r.mesh_dim, max(r.bytes, r.cross_process_bytes)) for r in mode.records], ok


def _tp_models() -> tuple[torch.nn.Module, torch.nn.Module, sw.DeviceMesh, torch.Tensor]:
    """An MLP, a tensor-parallel copy on a 2-device mesh, the mesh, and an input."""
    torch.manual_seed(0)
    single = demo.MLP(demo.GPTConfig(dim=16))
    model = copy.deepcopy(single)
    mesh = sw.init_device_mesh("cpu", (2,))
    parallelize_module(model, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    return single, model, mesh, torch.randn(4, 16)


def _tp_mlp(norm_type: float, foreach: bool | None) -> tuple[list, bool]:
    """1-D tensor parallelism: one device per process."""
    single, model, _, x = _tp_models()
    single(x).pow(2).sum().backward()
    model(x).pow(2).sum().backward()  # use_local_output: the plain output is this rank's
    return _check(model, single, norm_type, foreach)


def _fsdp_tp_gpt(norm_type: float, foreach: bool | None) -> tuple[list, bool]:
    """The demo's GPT, fully_shard on 'dp' x tensor + sequence parallel on 'tp', on a 2x2 mesh
    (two devices per process): gradients sharded over both mesh dims, some over one."""
    cfg = demo.GPTConfig()
    torch.manual_seed(0)
    single = demo.GPT(cfg)
    model = copy.deepcopy(single)
    mesh = sw.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    parallelize_module(model, mesh, demo.tensor_parallel_plan(cfg))
    for block in model.blocks:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    ids, targets = demo.make_batch(0, 8, cfg, 0)
    F.cross_entropy(single(ids).transpose(1, 2), targets).backward()
    placements = [Shard(0), Replicate()]
    with sw.config.allow_implicit_redistribute(), loss_parallel():
        logits = model(sw.distribute_tensor(ids, mesh, placements))
        loss = F.cross_entropy(logits.transpose(1, 2),
                               sw.distribute_tensor(targets, mesh, placements))
        loss.backward()
    return _check(model, single, norm_type, foreach)


def _program() -> dict:
    return {(name, p, f): fn(p, f) for name, fn in (("tp", _tp_mlp), ("fsdp_tp", _fsdp_tp_gpt))
            for p in NORMS for f in FOREACH}


@pytest.mark.timeout(300)
def test_clip_grad_norm_one_scalar_collective_per_mesh_dim_across_processes() -> None:
    for rank in run_in_processes(_program, 2, timeout=280):
        for (name, p, foreach), (records, ok) in rank.items():
            what = (name, p, foreach, records)
            assert ok, what
            if name == "tp":  # one float32 scalar all-reduced
                assert [r[:2] for r in records] == [("all_reduce", 0)], what
                assert records[0][2] <= 4 * 2, what  # at most one scalar per device
            else:  # pending over both mesh dims: at most one scalar collective per dim
                assert 1 <= len(records) <= 2, what
                assert all(nbytes <= 4 * 4 for _, _, nbytes in records), what  # one per device


def test_foreach_paths_take_dtensors() -> None:
    mesh = sw.init_device_mesh("cpu", (2,))
    grads = [sw.distribute_tensor(torch.randn(4, 3), mesh, [Shard(0)])]
    assert _has_foreach_support(grads, grads[0].device)
    from torch.optim.optimizer import _foreach_supported_types

    assert sw.DTensor in _foreach_supported_types


def test_foreach_scaling_keeps_pending_sums_and_reduces_the_rest() -> None:
    """``_foreach_mul_`` by a scalar (tensor or number) is linear: a Partial("sum") element stays
    pending; a Partial("max") one (a negative factor flips it) and a pending scalar tensor are
    reduced first. Values against single-device PyTorch."""
    mesh = sw.init_device_mesh("cpu", (2,))
    pieces = [torch.randn(3, 4, generator=torch.Generator().manual_seed(s)) for s in range(2)]
    with sw.config.allow_implicit_redistribute():
        _scale(mesh, pieces)


def _scale(mesh: sw.DeviceMesh, pieces: list[torch.Tensor]) -> None:
    for factor in (torch.tensor(-0.5), -0.5):
        summed = [sw.DTensor.from_local([p.clone() for p in pieces], mesh, [sw.Partial("sum")])
                  for _ in range(2)]
        maxed = sw.DTensor.from_local([p.clone() for p in pieces], mesh, [sw.Partial("max")])
        coef = factor if isinstance(factor, float) else sw.distribute_tensor(factor, mesh, [
            Replicate()])
        torch._foreach_mul_(summed, coef)
        torch._foreach_mul_([maxed], coef)
        for d in summed:
            assert d.placements == (sw.Partial("sum"),)
            torch.testing.assert_close(d.full_tensor(), (pieces[0] + pieces[1]) * -0.5)
        assert maxed.placements == (Replicate(),)
        torch.testing.assert_close(maxed.full_tensor(), torch.maximum(*pieces) * -0.5)
    pending = sw.DTensor.from_local([torch.tensor(1.0), torch.tensor(2.0)], mesh,
                                    [sw.Partial("sum")])
    shard = sw.distribute_tensor(pieces[0].clone(), mesh, [Shard(0)])
    torch._foreach_mul_([shard], pending)
    torch.testing.assert_close(shard.full_tensor(), pieces[0] * 3.0)


@pytest.mark.parametrize("order", [2.0, 1.0, 3.0, math.inf, 0.0, -math.inf])
def test_foreach_norm_at_once_equals_per_tensor_norms(order: float) -> None:
    """``_foreach_norm`` over DTensors of several placements (uneven and interleaved shards, a
    2-D mesh, replicated, pending) gives each tensor's ``linalg_vector_norm``: the same
    placements and, reduced, single-device PyTorch's norm."""
    mesh = sw.init_device_mesh("cpu", (2, 2))
    g = torch.Generator().manual_seed(3)
    cases = [((5, 3), [Shard(0), Replicate()]), ((4, 6), [Replicate(), Shard(1)]),
             ((6, 2), [sw.InterleavedShard(0, interleaved_size=3), Shard(1)]),
             ((3,), [Replicate(), Replicate()]), ((1, 4), [Shard(0), Shard(1)])]
    full = [torch.randn(shape, generator=g) for shape, _ in cases]
    tensors = [sw.distribute_tensor(f, mesh, p) for f, (_, p) in zip(full, cases, strict=True)]
    with_pending = [*tensors, sw.DTensor.from_local(
        [torch.randn(2, generator=g) for _ in range(4)], mesh, [sw.Partial(), Replicate()])]
    from shardwise.ops.foreach import _norms_at_once

    # one _foreach_norm per device where the order is positive; the second and third groups
    # fall back to one norm per tensor (a pending input; an empty shard under the inf-norm)
    assert (_norms_at_once(tensors[:-1], order) is not None) == (order > 0)
    assert _norms_at_once(with_pending, order) is None
    for group in (tensors[:-1], with_pending, tensors):
        with sw.config.allow_implicit_redistribute():
            norms = torch._foreach_norm(group, order)
            for d, n in zip(group, norms, strict=True):
                alone = torch.linalg.vector_norm(d, order)
                assert n.placements == alone.placements
                torch.testing.assert_close(n.full_tensor(), alone.full_tensor())
                torch.testing.assert_close(
                    n.full_tensor(), torch.linalg.vector_norm(d.full_tensor(), order))


@pytest.mark.parametrize("foreach", FOREACH)
@pytest.mark.parametrize("norm_type", NORMS)
def test_clip_grad_norm_runs_in_explicit_mode(norm_type: float, foreach: bool | None) -> None:
    """The default explicit mode reduces a scalar pending p-norm where clipping uses it (one
    scalar all_reduce, PyTorch's cost) and nothing else: no allow_implicit_redistribute."""
    single, model, mesh, x = _tp_models()
    single(x).pow(2).sum().backward()
    out = model(sw.distribute_tensor(x, mesh, [Replicate()]))
    (out.full_tensor() if isinstance(out, sw.DTensor) else out).pow(2).sum().backward()
    expected = torch.nn.utils.clip_grad_norm_(single.parameters(), 0.05, norm_type,
                                              foreach=foreach)
    with CommDebugMode() as mode:
        total = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05, norm_type,
                                               foreach=foreach)
    torch.testing.assert_close(total.full_tensor(), expected, rtol=1e-5, atol=0)
    for p, r in zip(model.parameters(), single.parameters(), strict=True):
        torch.testing.assert_close(p.grad.full_tensor(), r.grad, rtol=1e-5, atol=1e-7)
    assert [(r.kind, r.mesh_dim) for r in mode.records] == [("all_reduce", 0)]


def test_explicit_mode_still_refuses_other_pending_values() -> None:
    """Only a scalar pending norm is reduced without asking: a pending sum, or a pending norm
    that is not a scalar, still raises."""
    mesh = sw.init_device_mesh("cpu", (2,))
    for shape, reduce_op in (((), "sum"), ((3,), "norm2")):
        pending = sw.DTensor.from_local([torch.ones(shape), torch.ones(shape)], mesh,
                                        [sw.Partial(reduce_op)])
        with pytest.raises(sw.errors.ImplicitRedistributeError, match=r"Partial"):
            pending + 1.0
