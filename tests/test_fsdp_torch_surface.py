"""FSDP2 names that PyTorch's own FSDP2 tests use: ``register_fsdp_forward_method``,
``FSDPModule.unshard(async_op=True)``'s handle, ``reset_iter_state``, ``share_comm_ctx`` and
the private ``_set_unshard_async_op``.
Single-device PyTorch is the oracle."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import shardwise as sw
from shardwise import Replicate, Shard
from shardwise.errors import DataParallelError
from shardwise.parallel import (
    CPUOffloadPolicy,
    OffloadPolicy,
    UnshardHandle,
    fully_shard,
    register_fsdp_forward_method,
    share_comm_ctx,
)


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(6, 8)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.proj(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.features(x).sum(dim=-1)


class Model(nn.Module):
    """The root calls ``enc.features``, not ``enc``'s forward."""

    def __init__(self) -> None:
        super().__init__()
        self.enc, self.head = Encoder(), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.enc.features(x))


def _model() -> Model:
    torch.manual_seed(0)
    return Model()

def _train_beside(model: nn.Module, opt: torch.optim.Optimizer, ref: nn.Module,
                  ref_opt: torch.optim.Optimizer, inputs: list[torch.Tensor]) -> None:
    """One step of each on every input, the losses equal step by step."""
    for x in inputs:
        with sw.config.allow_implicit_redistribute():
            loss = model(x).sum()
            loss.backward()
            opt.step()
        ref_loss = ref(x).sum()
        ref_loss.backward()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        torch.testing.assert_close(loss.full_tensor(), ref_loss, atol=1e-5, rtol=1e-5)



def test_a_registered_forward_method_gathers_the_parameters_around_it() -> None:
    mesh = sw.init_device_mesh("cpu", (2,))
    ref, model = _model(), _model()
    fully_shard(model.enc, mesh=mesh)
    fully_shard(model.head, mesh=mesh)
    fully_shard(model, mesh=mesh)
    seen = []
    method = model.enc.features

    def record(x: torch.Tensor) -> torch.Tensor:
        seen.append(model.enc.proj.weight.placements)
        return method(x)

    model.enc.features = record
    register_fsdp_forward_method(model.enc, "features")
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(1))
    out = model(x)
    assert seen == [(Replicate(),)]  # gathered while the method ran
    assert model.enc.proj.weight.placements == (Shard(0),)  # stored again after it
    torch.testing.assert_close(out.full_tensor(), ref(x), atol=1e-6, rtol=1e-5)
    with sw.config.allow_implicit_redistribute():
        out.sum().backward()
    ref(x).sum().backward()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert p.grad.placements == p.placements
        torch.testing.assert_close(p.grad.full_tensor(), q.grad, atol=1e-6, rtol=1e-5)


def test_register_fsdp_forward_method_leaves_other_modules_and_names_a_missing_method() -> None:
    plain = Encoder()
    register_fsdp_forward_method(plain, "features")  # not fully_shard's: left alone
    assert "features" not in vars(plain)
    model = _model()
    fully_shard(model.enc, mesh=sw.init_device_mesh("cpu", (2,)))
    with pytest.raises(DataParallelError, match="FSDPEncoder has no method 'feature'"):
        register_fsdp_forward_method(model.enc, "feature")


def test_unshard_async_op_returns_a_handle_and_share_comm_ctx_checks_its_modules() -> None:
    mesh = sw.init_device_mesh("cpu", (2,))
    model = _model()
    fully_shard(model.enc, mesh=mesh)
    fully_shard(model, mesh=mesh)
    assert model.enc.unshard() is None
    handle = model.enc.unshard(async_op=True)
    assert isinstance(handle, UnshardHandle)
    handle.wait()
    assert model.enc.proj.weight.placements == (Shard(0),)  # held aside, stored as before
    model.enc.reshard()
    share_comm_ctx([model, model.enc])
    with pytest.raises(DataParallelError, match="share_comm_ctx expects modules .* Linear"):
        share_comm_ctx([model.head])


def test_reset_iter_state_after_an_aborted_backward_trains_like_one_device() -> None:
    mesh = sw.init_device_mesh("cpu", (2,))
    ref, model = _model(), _model()
    fully_shard(model.enc, mesh=mesh)
    fully_shard(model, mesh=mesh)
    register_fsdp_forward_method(model.enc, "features")
    model.enc.set_reshard_after_backward(False)  # gathered parameters held after backward
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(2))

    def boom(grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("aborted backward")

    out = model(x)
    out.register_hook(boom)
    with pytest.raises(RuntimeError, match="aborted backward"), \
            sw.config.allow_implicit_redistribute():
        out.sum().backward()
    assert model.enc._shardwise_unit.held  # what that forward gathered is still held
    model.reset_iter_state()
    assert not model.enc._shardwise_unit.held
    model.zero_grad(set_to_none=True)
    with sw.config.allow_implicit_redistribute():
        model(x).sum().backward()
    ref(x).sum().backward()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad.full_tensor(), q.grad, atol=1e-6, rtol=1e-5)


def test_set_unshard_async_op_reaches_the_modules_under_it_and_trains_like_one_device() -> None:
    """PyTorch's test_train_parity_multi_group_unshard_async_op sets it on the root."""
    mesh = sw.init_device_mesh("cpu", (2,))
    ref, model = _model(), _model()
    fully_shard(model.enc, mesh=mesh, reshard_after_forward=True)
    fully_shard(model.head, mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, reshard_after_forward=True)
    units = [model.enc._shardwise_unit, model.head._shardwise_unit, model._shardwise_unit]
    model.enc._set_unshard_async_op(True)  # the modules under it only
    assert [u.unshard_async_op for u in units] == [True, False, False]
    model._set_unshard_async_op(True)
    assert [u.unshard_async_op for u in units] == [True, True, True]
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(5)
    _train_beside(model, opt, ref, ref_opt, [torch.randn(4, 6, generator=gen) for _ in range(3)])
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert p.placements == (Shard(0),)
        torch.testing.assert_close(p.full_tensor(), q, atol=1e-5, rtol=1e-5)
    model._set_unshard_async_op(False)
    assert [u.unshard_async_op for u in units] == [False, False, False]


class Tied(nn.Module):
    """An output projection sharing the embedding's weight (weight tying)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.out = nn.Embedding(10, 4), nn.Linear(4, 10, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.emb(ids)))


@pytest.mark.parametrize("grouped", [False, True], ids=["root only", "fully_shard([emb, out])"])
def test_a_tied_weight_is_gathered_into_every_module_holding_it(grouped: bool) -> None:
    mesh = sw.init_device_mesh("cpu", (2,))
    ref, model = Tied(), Tied()
    if grouped:
        fully_shard([model.emb, model.out], mesh=mesh)
    fully_shard(model, mesh=mesh)
    assert model.out.weight is model.emb.weight  # still tied, stored sharded
    ids = torch.tensor([[1, 7, 3], [9, 0, 4]])
    for _ in range(2):  # the second forward prefetches by the order the first recorded
        out = model(ids)  # every holder computes with the gathered weight: no move needed
    assert model.out.weight is model.emb.weight and model.out.weight.placements == (Shard(0),)
    torch.testing.assert_close(out.full_tensor(), ref(ids), atol=1e-6, rtol=1e-5)
    with sw.config.allow_implicit_redistribute():
        out.sum().backward()
    ref(ids).sum().backward()
    torch.testing.assert_close(model.emb.weight.grad.full_tensor(), ref.emb.weight.grad,
                               atol=1e-6, rtol=1e-5)


class Twice(nn.Module):
    """``inner`` runs twice in one forward."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inner, self.outer = nn.Linear(4, 4), nn.Linear(4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.outer(self.inner(x) + self.inner(x))


def test_a_module_run_twice_in_one_forward_trains_like_one_device() -> None:
    """From the second step on, the recorded order has ``inner`` follow itself: its first
    call must not prefetch its own parameters while it runs."""
    mesh = sw.init_device_mesh("cpu", (2,))
    ref, model = Twice(), Twice()
    fully_shard(model.inner, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(4))
    _train_beside(model, opt, ref, ref_opt, [x] * 3)
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.full_tensor(), q, atol=1e-5, rtol=1e-5)


def test_a_3d_mesh_is_refused_in_pytorchs_words() -> None:
    mesh = sw.init_device_mesh("cpu", (2, 1, 1))
    with pytest.raises(ValueError, match=r"fully\_shard expects a 1D or 2D DeviceMesh but got "
                                         r"DeviceMesh\('cpu', .*\(3-D\) for Linear: pass"):
        fully_shard(nn.Linear(4, 4), mesh=mesh)


def test_a_weight_tied_across_two_fully_shard_calls_is_refused_at_the_first_forward() -> None:
    mesh = sw.init_device_mesh("cpu", (2,))
    model = Tied()
    fully_shard(model.emb, mesh=mesh)
    fully_shard(model.out, mesh=mesh)  # holds emb's weight, which the first call manages
    fully_shard(model, mesh=mesh)
    with pytest.raises(DataParallelError, match=r"holds FSDPLinear.weight, already managed "
                                                r"by another fully_shard call"):
        model(torch.tensor([[1, 2], [3, 4]]))
    nested = Tied()  # the same parameter reached again by an outer call is fine
    fully_shard(nested, mesh=mesh)
    fully_shard(nn.Sequential(nested), mesh=mesh)(torch.tensor([[1, 2], [3, 4]]))


def _world_of_one() -> dict:
    """fully_shard on a one-device mesh: what a forward and backward count, and the gradients."""
    mesh = sw.init_device_mesh("cpu", (1,))
    model = _model()
    reference = copy.deepcopy(model)
    fully_shard(model.enc, mesh=mesh)
    fully_shard(model, mesh=mesh)
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(1))
    with sw.debug.CommCounter() as counter, sw.config.implicit_replication():
        model(x).sum().backward()
    reference(x).sum().backward()
    equal = [torch.equal(p.grad.full_tensor(), q.grad)
             for p, q in zip(model.parameters(), reference.parameters(), strict=True)]
    return {"counts": dict(counter.counts), "equal": equal}


def test_a_world_of_one_moves_and_counts_nothing() -> None:
    """FSDP2 on a world of one issues no collective (PyTorch's test_train_parity_single_worldsize1
    counts none with CommDebugMode): its gathers and reduce-scatters over one member are not
    collectives; the gradients are one device's."""
    got = _world_of_one()
    assert got["counts"] == {}, got
    assert all(got["equal"]), got


def _offload_step_counts(policy: object) -> tuple[dict, list[torch.Tensor]]:
    """One forward and backward of ``Model`` under ``fully_shard`` with ``offload_policy``
    (per unit and root) on a 2-device CPU mesh, then two Adam steps: the collectives of the
    first step by kind, and the parameters after."""
    mesh = sw.init_device_mesh("cpu", (2,))
    model = _model()
    fully_shard(model.enc, mesh=mesh, offload_policy=policy)
    fully_shard(model, mesh=mesh, offload_policy=policy)
    register_fsdp_forward_method(model.enc, "features")
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(2))
    with sw.debug.CommDebugMode() as comm:
        model(x).sum().backward()
    opt.step()
    opt.zero_grad()
    model(x).sum().backward()
    opt.step()
    counts = {str(k): v for k, v in comm.get_comm_counts().items()}
    return counts, [p.full_tensor() for p in model.parameters()]


def test_cpu_offload_on_a_cpu_mesh_packs_each_units_collectives_and_trains_like_one_device(
) -> None:
    """On a CPU mesh the offloaded parameters are where they compute: each unit gathers and
    reduces its parameters packed, as without the policy (before: one collective per
    parameter)."""
    offloaded, params = _offload_step_counts(CPUOffloadPolicy(pin_memory=False))
    plain, _ = _offload_step_counts(OffloadPolicy())
    assert offloaded == plain and sum(plain.values()) > 0, (offloaded, plain)
    ref = _model()
    opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(2))
    for _ in range(2):
        ref(x).sum().backward()
        opt.step()
        opt.zero_grad()
    for p, q in zip(params, ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5)
