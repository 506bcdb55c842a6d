"""How rules are written and checked: ``product_strategy``, the strategy validator (run over
every registered op by tests/test_opinfo.py), plain tensors made by torch's decompositions, and
edge cases the OpInfo sweep found."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import shardwise as sw
from shardwise import Partial, Replicate, Shard
from shardwise.op_inputs import PLAIN_MAKING_DECOMPOSITIONS
from shardwise.ops import registry
from shardwise.ops.common import product_strategy
from shardwise.ops.validate import adversarial_components
from shardwise.placements import RaggedShard
from shardwise.rules import OpSchema, OpStrategy

aten = torch.ops.aten


# ----- product_strategy ----------------------------------------------------------------------


def test_product_strategy_expands_per_mesh_dim_options_and_drops_duplicates() -> None:
    mesh = sw.init_device_mesh("cpu", (2, 2))
    options = [((Replicate(),), (Replicate(),)), ((Shard(0),), (Shard(0),))] * 2  # twice each
    found = product_strategy(mesh, options)
    pairs = {(s.input_specs[0].placements, s.output_spec.placements) for s in found.strategies}
    assert len(found.strategies) == len(pairs) == 4
    assert ((Shard(0), Replicate()), (Shard(0), Replicate())) in pairs


def test_product_strategy_prunes_combinations_that_do_not_fit_the_shapes() -> None:
    mesh = sw.init_device_mesh("cpu", (2,))
    ragged = RaggedShard(0, (3, 3))
    options = [((Replicate(),), (Replicate(),)), ((ragged,), (ragged,))]
    assert len(product_strategy(mesh, options, shapes=[(6,)]).strategies) == 2
    assert len(product_strategy(mesh, options, shapes=[(4,)]).strategies) == 1  # 3 + 3 != 4


# ----- the validator -------------------------------------------------------------------------


def test_adversarial_partial_pieces_reduce_to_the_value() -> None:
    mesh = sw.init_device_mesh("cpu", (2, 3))
    x = torch.randn(4, 5, dtype=torch.float64)
    for op in ("sum", "avg", "max", "min"):
        dt = adversarial_components(x, mesh, [Shard(1), Partial(op)], seed=1)
        torch.testing.assert_close(dt.full_tensor(), x)
        pieces = dt._components
        assert not torch.equal(pieces[0], pieces[1]), op  # really split, not copies


@torch.library.custom_op("test_rules::square", mutates_args=())
def _square(x: torch.Tensor) -> torch.Tensor:
    return x * x


@_square.register_fake
def _(x):
    return torch.empty_like(x)


def _square_strategy(linear: bool):
    def strategy(mesh: sw.DeviceMesh, schema: OpSchema) -> OpStrategy:
        options = [((Replicate(),), (Replicate(),)), ((Shard(0),), (Shard(0),))]
        if linear:  # wrong: a square of a sum is not the sum of squares
            options.append(((Partial(),), (Partial(),)))
        return product_strategy(mesh, options)

    return strategy


def test_validate_strategy_finds_a_wrong_strategy_that_dispatch_never_picks() -> None:
    op = torch.ops.test_rules.square.default
    x = torch.randn(5, 3, dtype=torch.float64)
    sw.rules.register_op_strategy([op])(_square_strategy(linear=True))
    try:
        # dispatch picks a right strategy for a sharded input: the wrong one never runs here
        dt = sw.distribute_tensor(x, sw.init_device_mesh("cpu", (2,)), [Shard(0)])
        torch.testing.assert_close(_square(dt).full_tensor(), x * x)
        with pytest.raises(sw.errors.StrategyValidationError, match=r"Partial\(\)"):
            sw.rules.validate_strategy(op, (x,))
        sw.rules.register_op_strategy([op])(_square_strategy(linear=False))
        report = sw.rules.validate_strategy(op, (x,))
        assert report.ok and report.checked >= 6  # two strategies on (2,), (3,); four on (2, 2)
    finally:
        registry.unregister([op])


def test_validate_strategy_needs_a_registered_strategy() -> None:
    with pytest.raises(sw.errors.InvalidArgumentError, match="no registered sharding strategy"):
        sw.rules.validate_strategy(aten.nonzero.default, (torch.ones(3),))


# ----- plain tensors made by torch's decompositions -------------------------------------------


def test_tensors_made_by_decompositions_are_replicated_but_the_users_are_refused() -> None:
    mesh = sw.init_device_mesh("cpu", (2,))
    q = torch.randn(3, 5, 4, requires_grad=True)  # 3-d: torch's math variant, not the fused one
    dq = sw.distribute_tensor(q.detach(), mesh, [Shard(0)]).requires_grad_()
    math = aten._scaled_dot_product_attention_math.default
    assert math in PLAIN_MAKING_DECOMPOSITIONS
    out = F.scaled_dot_product_attention(dq, dq, dq, is_causal=True)  # C++-made causal mask
    want = F.scaled_dot_product_attention(q, q, q, is_causal=True)
    torch.testing.assert_close(out.full_tensor(), want)
    out.sum().backward()
    want.sum().backward()
    torch.testing.assert_close(dq.grad.full_tensor(), q.grad)
    attn_mask = torch.randn(5, 5)
    with pytest.raises(sw.errors.MeshError, match=r"_scaled_dot_product_attention_math.*\[5, 5\]"):
        F.scaled_dot_product_attention(dq, dq, dq, attn_mask=attn_mask)  # the user's own mask
    with sw.config.implicit_replication():
        torch.testing.assert_close(
            F.scaled_dot_product_attention(dq, dq, dq, attn_mask=attn_mask).full_tensor(),
            F.scaled_dot_product_attention(q, q, q, attn_mask=attn_mask),
        )
    x = torch.randn(6, 7)
    mask = torch.rand(6, 7, generator=torch.Generator().manual_seed(0)) > 0.3
    dx = sw.distribute_tensor(x, mesh, [Shard(0)])
    dmask = sw.distribute_tensor(mask, mesh, [Shard(0)])
    got = torch.masked.sum(dx, 1, mask=dmask)  # masked ops make plain fill values in Python
    torch.testing.assert_close(got.full_tensor(), torch.masked.sum(x, 1, mask=mask))
    with pytest.raises(sw.errors.MeshError, match="implicit_replication"):
        torch.masked.sum(dx, 1, mask=mask)  # the user's own plain mask, through torch.masked
    big = torch.randn(6, 7)
    with pytest.raises(sw.errors.MeshError, match=r"\[6, 7\]"):
        dx + big  # the user's own plain tensor, directly
    with sw.config.implicit_replication():
        torch.testing.assert_close((dx + big).full_tensor(), x + big)

    class Masked(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("mask", torch.ones(6, 7))

        def forward(self, t: torch.Tensor) -> torch.Tensor:
            return t * self.mask

    with pytest.raises(sw.errors.MeshError, match="implicit_replication"):
        Masked()(dx)  # a module's own buffer is the user's too


# ----- edge cases found by the OpInfo sweep ---------------------------------------------------


@pytest.mark.parametrize("mesh_shape", [(2,), (3,)])
def test_zero_dim_inputs_with_dim_zero(mesh_shape: tuple[int, ...]) -> None:
    mesh = sw.init_device_mesh("cpu", mesh_shape)
    s, i = torch.tensor(2.0), torch.tensor(0)
    ds = sw.distribute_tensor(s, mesh, [Replicate()])
    di = sw.distribute_tensor(i, mesh, [Replicate()])
    part = sw.distribute_tensor(s, mesh, [Partial()])
    cases = [
        (lambda a, b: torch.index_add(a, 0, b, a), ds, di, s, i),
        (lambda a, b: torch.scatter_add(a, 0, b, a), ds, di, s, i),
        (lambda a, b: torch.index_select(a, 0, b.reshape(1)), ds, di, s, i),
        (lambda a, b: torch.squeeze(a, 0), ds, di, s, i),
        (lambda a, b: torch.squeeze(a, (0,)), part, di, s, i),
    ]
    with sw.config.allow_implicit_redistribute():
        for fn, a, b, ta, tb in cases:
            got, expected = fn(a, b).full_tensor(), fn(ta, tb)
            assert got.shape == expected.shape and torch.equal(got, expected)


def test_index_select_with_fewer_indices_than_devices() -> None:
    mesh = sw.init_device_mesh("cpu", (3,))
    x, index = torch.randn(5, 4), torch.tensor([4, 1])
    dx = sw.distribute_tensor(x, mesh, [Replicate()])
    di = sw.distribute_tensor(index, mesh, [Shard(0)])  # one device holds no index
    out = torch.index_select(dx, 0, di)
    assert out.placements == (Shard(0),)
    assert torch.equal(out.full_tensor(), x[index])


def test_masked_scatter_with_a_mask_larger_than_the_input() -> None:
    mesh = sw.init_device_mesh("cpu", (2,))
    x, source = torch.randn(5), torch.randn(5, 5)
    mask = torch.rand(5, 5, generator=torch.Generator().manual_seed(3)) > 0.5
    d = [sw.distribute_tensor(t, mesh, [Shard(0)]) for t in (x, mask, source)]
    with sw.config.allow_implicit_redistribute():
        got = torch.masked_scatter(*d)
    assert torch.equal(got.full_tensor(), torch.masked_scatter(x, mask, source))


def test_sparse_inputs_are_refused_clearly() -> None:
    mesh = sw.init_device_mesh("cpu", (2,))
    sparse = torch.eye(4).to_sparse()
    with pytest.raises(sw.errors.InvalidArgumentError, match=r"sparse_coo.*\[4, 4\].*to_dense"):
        sw.distribute_tensor(sparse, mesh, [Shard(0)])


def test_validation_failures_name_the_mesh_and_placements() -> None:
    op = torch.ops.test_rules.square.default
    sw.rules.register_op_strategy([op])(_square_strategy(linear=True))
    try:
        report = sw.rules.validate_strategy(
            op, (torch.randn(4, 2, dtype=torch.float64),), raise_on_failure=False,
            mesh_shapes=[(2,)],
        )
    finally:
        registry.unregister([op])
    assert report.failures and all("mesh (2,)" in f for f in report.failures)
