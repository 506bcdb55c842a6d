"""Dispatch machinery: user registration of custom ops, hooks, explicit and implicit modes."""

from __future__ import annotations

import logging

import pytest
import torch

import shardwise as sw
from shardwise import Replicate, Shard
from shardwise.rules import (
    OpSchema,
    OpStrategy,
    OutputSharding,
    PlacementStrategy,
    RuntimeSchemaInfo,
)
from shardwise.spec import DTensorSpec


@torch.library.custom_op("swtest::double", mutates_args=())
def double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@double.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("swtest::rowsum", mutates_args=())
def rowsum(x: torch.Tensor) -> torch.Tensor:
    """Sum over dim 1 keeping dims: needs dim 1 whole on every device."""
    return x.sum(dim=1, keepdim=True)


@rowsum.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], 1)


@torch.library.custom_op("swtest::unregistered", mutates_args=())
def unregistered(x: torch.Tensor) -> torch.Tensor:
    return x + 1


@unregistered.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


DOUBLE = torch.ops.swtest.double.default
ROWSUM = torch.ops.swtest.rowsum.default
UNREGISTERED = torch.ops.swtest.unregistered.default


@sw.rules.register_prop_rule([DOUBLE])
def double_rule(schema: OpSchema) -> OutputSharding:
    (spec,) = schema.args_schema
    return OutputSharding(DTensorSpec(spec.mesh, spec.placements, spec.tensor_meta))


@sw.rules.register_op_strategy([ROWSUM], schema_info=RuntimeSchemaInfo(1))
def rowsum_strategy(mesh: sw.DeviceMesh, schema: OpSchema) -> OpStrategy:
    (arg,) = schema.args_schema
    options = [[Replicate()], [Shard(0)]]
    return OpStrategy(
        [
            PlacementStrategy(
                output_specs=DTensorSpec(mesh, tuple(p)), input_specs=[DTensorSpec(mesh, tuple(p))]
            )
            for p in options
        ]
    )


@pytest.fixture()
def mesh() -> sw.DeviceMesh:
    return sw.init_device_mesh("cpu", (3,))


def test_user_rule_for_custom_op(mesh) -> None:
    x = torch.randn(7, 5)
    for placements in ([Shard(0)], [Shard(1)], [Replicate()]):
        out = double(sw.distribute_tensor(x, mesh, placements))
        assert isinstance(out, sw.DTensor) and out.placements == tuple(placements)
        assert torch.equal(out.full_tensor(), x * 2)


def test_user_strategy_picks_the_placement_needing_no_move(mesh) -> None:
    x = torch.randn(7, 5)
    with sw.debug.CommCounter() as counter:
        out = rowsum(sw.distribute_tensor(x, mesh, [Shard(0)]))
    assert out.placements == (Shard(0),) and counter.total_bytes == 0
    torch.testing.assert_close(out.full_tensor(), x.sum(1, keepdim=True))


def test_explicit_mode_refuses_communication_and_names_the_fix(mesh) -> None:
    dt = sw.distribute_tensor(torch.randn(7, 5), mesh, [Shard(1)])
    with pytest.raises(sw.errors.ImplicitRedistributeError) as err:
        rowsum(dt)
    text = str(err.value)
    assert "swtest.rowsum" in text and "[7, 5]" in text and "Shard(dim=1)" in text
    assert "redistribute(placements=" in text


def test_implicit_mode_moves_the_cheapest_way_and_counts_it(mesh, caplog) -> None:
    x = torch.randn(7, 5)
    dt = sw.distribute_tensor(x, mesh, [Shard(1)])
    sw.config.set_redistribute_logging(True)
    try:
        with caplog.at_level(logging.INFO, logger="shardwise.redistribute"):
            with sw.config.allow_implicit_redistribute(), sw.debug.CommCounter() as counter:
                out = rowsum(dt)
    finally:
        sw.config.set_redistribute_logging(False)
    torch.testing.assert_close(out.full_tensor(), x.sum(1, keepdim=True))
    # Shard(1) -> Shard(0) is one all_to_all, cheaper than the all_gather to Replicate.
    assert dict(counter.counts) == {"all_to_all": 1}
    assert out.placements == (Shard(0),)
    assert any("test_dispatch.py" in r.getMessage() for r in caplog.records)


def test_unsupported_op_error_names_op_and_how_to_register(mesh) -> None:
    dt = sw.distribute_tensor(torch.randn(4), mesh, [Shard(0)])
    with pytest.raises(sw.errors.UnsupportedOpError) as err:
        unregistered(dt)
    assert isinstance(err.value, NotImplementedError)
    assert "swtest.unregistered" in str(err.value) and "register_op_strategy" in str(err.value)


def test_bypass_sharding_propagation_takes_first_input_spec(mesh) -> None:
    x = torch.randn(6, 2)
    sw.rules.bypass_sharding_propagation([UNREGISTERED])
    try:
        out = unregistered(sw.distribute_tensor(x, mesh, [Shard(0)]))
    finally:
        sw.rules.remove_hooks([UNREGISTERED])
    assert out.placements == (Shard(0),)
    assert torch.equal(out.full_tensor(), x + 1)


def test_bypass_dispatch_handles_the_op(mesh) -> None:
    calls = []

    def handler(op, args, kwargs):
        calls.append(op)
        (dt,) = args
        return sw.DTensor([c - 1 for c in dt._components], dt._spec)

    x = torch.randn(5)
    sw.rules.bypass_dispatch([UNREGISTERED], handler)
    try:
        out = unregistered(sw.distribute_tensor(x, mesh, [Shard(0)]))
    finally:
        sw.rules.remove_hooks([UNREGISTERED])
    assert calls == [UNREGISTERED]
    assert torch.equal(out.full_tensor(), x - 1)


def test_pre_and_post_patches_wrap_dispatch(mesh) -> None:
    seen = []

    def pre(op, args, kwargs):
        seen.append(("pre", args[0].placements))
        return args, kwargs

    def post(op, result, args, kwargs):
        seen.append(("post", result.placements))
        return sw.DTensor([c * 10 for c in result._components], result._spec)

    x = torch.randn(5, 3)
    sw.rules.register_pre_patch([DOUBLE], pre)
    sw.rules.register_post_patch([DOUBLE], post)
    try:
        out = double(sw.distribute_tensor(x, mesh, [Shard(1)]))
    finally:
        sw.rules.remove_hooks([DOUBLE])
    assert seen == [("pre", (Shard(1),)), ("post", (Shard(1),))]
    assert torch.equal(out.full_tensor(), x * 20)
    assert torch.equal(double(sw.distribute_tensor(x, mesh, [Shard(1)])).full_tensor(), x * 2)


def test_remove_hooks_removes_every_hook_and_keeps_the_rule(mesh) -> None:
    """One entry per op: removing its hooks removes the local-args hook and the predicate too
    (they were left behind in tables of their own)."""
    x = torch.randn(6, 2)
    calls = []

    def plus_one(args, kwargs, specs, out, device):
        return (args[0] + 1, *args[1:]), kwargs

    def post(op, result, args, kwargs):
        calls.append(result.placements)
        return result

    sw.rules.register_local_args([DOUBLE], plus_one)
    try:
        hooked = double(sw.distribute_tensor(x, mesh, [Shard(0)]))
    finally:
        sw.rules.remove_hooks([DOUBLE])
    assert torch.equal(hooked.full_tensor(), (x + 1) * 2)
    out = double(sw.distribute_tensor(x, mesh, [Shard(0)]))  # the rule stays, no hook runs
    assert torch.equal(out.full_tensor(), x * 2)
    sw.rules.register_post_patch([DOUBLE], post, applies=lambda specs, out: False)
    try:
        double(sw.distribute_tensor(x, mesh, [Shard(0)]))
    finally:
        sw.rules.remove_hooks([DOUBLE])
    sw.rules.register_post_patch([DOUBLE], post)  # no predicate left over: runs for every decision
    try:
        double(sw.distribute_tensor(x, mesh, [Shard(0)]))
    finally:
        sw.rules.remove_hooks([DOUBLE])
    assert calls == [(Shard(0),)]


def test_unregister_forgets_the_whole_entry(mesh) -> None:
    from shardwise.ops import registry

    sw.rules.register_prop_rule([UNREGISTERED])(double_rule)
    sw.rules.register_local_args(
        [UNREGISTERED], lambda args, kwargs, specs, out, device: (args, kwargs)
    )
    registry.unregister([UNREGISTERED])
    assert registry.registration(UNREGISTERED) is None
    with pytest.raises(sw.errors.UnsupportedOpError, match="no sharding rule"):
        unregistered(sw.distribute_tensor(torch.randn(4), mesh, [Shard(0)]))


def test_different_meshes_are_refused() -> None:
    a = sw.distribute_tensor(torch.randn(4), sw.init_device_mesh("cpu", (2,)), [Shard(0)])
    b = sw.distribute_tensor(torch.randn(4), sw.init_device_mesh("cpu", (4,)), [Shard(0)])
    with pytest.raises(sw.errors.MeshError, match="different meshes"):
        torch.ops.aten.add.Tensor(a, b)


def test_plain_tensors_need_implicit_replication_unless_one_element(mesh) -> None:
    x, big, small, one = torch.randn(4, 5), torch.randn(4, 5), torch.randn(5), torch.randn(1)
    dt = sw.distribute_tensor(x, mesh, [Shard(0)])
    torch.testing.assert_close((dt + one).full_tensor(), x + one)  # a one-element constant
    for plain in (small, big):  # any size above one element: the same rule
        with pytest.raises(sw.errors.MeshError, match="implicit_replication"):
            dt + plain
    with sw.config.implicit_replication():
        torch.testing.assert_close((dt + big).full_tensor(), x + big)


def test_vmap_of_embedding_takes_the_index_step_its_batch_rule_makes(mesh) -> None:
    """PyTorch's test_vmap_embedding: vmap's embedding batch rule adds a plain step tensor to
    the indices under torch's own implicit-replication flag; a plain tensor of the user's
    inside vmap is still refused."""
    idx = torch.randint(0, 8, (4, 6), generator=torch.Generator().manual_seed(0))
    emb = torch.randn(4, 8, 5)
    di = sw.distribute_tensor(idx, mesh, [Shard(0)])
    de = sw.distribute_tensor(emb, mesh, [Shard(0)])
    embed = torch.vmap(torch.nn.functional.embedding)
    with sw.config.allow_implicit_redistribute():  # which rows an index reads is data
        out = embed(di, de)
    assert torch.equal(out.full_tensor(), embed(idx, emb))
    with pytest.raises(sw.errors.MeshError, match="implicit_replication"):
        torch.vmap(lambda row: row + torch.ones(6, dtype=torch.int64))(di)


def test_three_dim_causal_attention_with_its_plain_mask(mesh) -> None:
    q = torch.randn(3, 5, 4)
    dq = sw.distribute_tensor(q, mesh, [Shard(0)])
    with sw.config.implicit_replication():
        out = torch.nn.functional.scaled_dot_product_attention(dq, dq, dq, is_causal=True)
    expected = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
    torch.testing.assert_close(out.full_tensor(), expected)


def test_inplace_op_moves_self_when_allowed_and_refuses_otherwise(mesh) -> None:
    x = torch.randn(5, 6)
    part = sw.distribute_tensor(x, mesh, [Shard(1)]).sum(1, keepdim=True)  # Partial("sum")
    assert part.placements[0].is_partial()
    with pytest.raises(sw.errors.ImplicitRedistributeError):
        part.add_(1.0)
    with sw.config.allow_implicit_redistribute():
        part.add_(1.0)
    assert not part.placements[0].is_partial()
    torch.testing.assert_close(part.full_tensor(), x.sum(1, keepdim=True) + 1)


def test_rms_norm_over_a_sharded_dim(mesh) -> None:
    x, w = torch.randn(5, 3, 6), torch.randn(6)
    dx = sw.distribute_tensor(x, mesh, [Shard(2)])
    dw = sw.distribute_tensor(w, mesh, [Replicate()])
    with sw.config.allow_implicit_redistribute():
        out = torch.nn.functional.rms_norm(dx, (6,), dw)
    torch.testing.assert_close(out.full_tensor(), torch.nn.functional.rms_norm(x, (6,), w))


class _RowsumInBackward(torch.autograd.Function):
    """Identity forward; backward adds each row's sum, an op needing whole rows."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad + rowsum(grad)


def test_backward_moves_data_in_explicit_mode_and_counts_it(mesh) -> None:
    x = torch.randn(7, 5)
    dx = sw.distribute_tensor(x, mesh, [Shard(1)]).requires_grad_()
    out = _RowsumInBackward.apply(dx)
    with pytest.raises(sw.errors.ImplicitRedistributeError):
        rowsum(out)  # the same op in forward is refused
    with sw.debug.CommCounter() as counter:
        out.full_tensor().sum().backward()
    assert counter.total_bytes > 0
    torch.testing.assert_close(dx.grad.full_tensor(), torch.full((7, 5), 6.0))


def test_python_values_are_global(mesh) -> None:
    parts = [torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0]), torch.tensor([5.0, 6.0])]
    dt = sw.DTensor.from_local(parts, mesh, [sw.Partial()])
    assert dt.tolist() == [9.0, 12.0]
    assert dt.numpy().tolist() == [9.0, 12.0]
    assert dt.sum().item() == 21.0 and float(dt.sum()) == 21.0
    shards = sw.distribute_tensor(torch.arange(5.0), mesh, [Shard(0)])
    assert shards.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
