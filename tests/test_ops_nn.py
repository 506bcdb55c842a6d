"""nn ops on DTensors: embedding, layer_norm, rms_norm, softmax, cross_entropy / nll_loss and
scaled dot-product attention, forward and backward, against single-device torch; plus the seed's
layer_norm rule and strategy registered by a user."""

from __future__ import annotations

from collections.abc import Sequence
from typing import List  # noqa: UP035  (the seed's example uses typing.List)

import pytest
import torch
import torch.nn.functional as F

import shardwise as sw
from op_oracle import check_op, run_oracle
from shardwise import Partial, Replicate, Shard
from shardwise.debug import CommCounter
from shardwise.ops.norms import layer_norm_strategy
from shardwise.ops.registry import registration
from shardwise.rules import (
    OpSchema,
    OpStrategy,
    OutputSharding,
    PlacementStrategy,
    RuntimeSchemaInfo,
    register_op_strategy,
    register_prop_rule,
)
from shardwise.spec import DTensorSpec

aten = torch.ops.aten
MESHES = [(2,), (3,), (4,), (2, 2)]


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=gen(seed))


def on_every_mesh_dim(placement, mesh_shape: tuple[int, ...]) -> tuple:
    return (placement,) * len(mesh_shape)


def placed(mesh_shape: tuple[int, ...], *placements) -> list[tuple]:
    """One placement tuple per input, the same placement on every mesh dim."""
    return [on_every_mesh_dim(p, mesh_shape) for p in placements]


# ----- embedding -------------------------------------------------------------------------------

INDICES = torch.tensor([[0, 6, 3], [2, 2, 5], [1, 4, 6], [3, 0, 0], [5, 1, 2]])  # vocabulary 7


def test_embedding_oracle_uneven_vocab_and_batch() -> None:
    weight, indices = randn(7, 6), INDICES
    run_oracle(lambda w, i: F.embedding(i, w), [weight, indices], max_cases=20)
    run_oracle(lambda w, i: F.embedding(i, w, padding_idx=2), [weight, indices], max_cases=12)


def test_embedding_vocab_smaller_than_mesh_and_scale_grad_by_freq() -> None:
    """Vocabulary 3 on 4 devices leaves one device without rows."""
    weight, indices = randn(3, 5), torch.tensor([0, 2, 2, 1, 0])
    for mesh_shape in MESHES:
        for case in (placed(mesh_shape, Shard(0), Replicate()),
                     placed(mesh_shape, Shard(1), Replicate())):
            check_op(lambda w, i: F.embedding(i, w, padding_idx=1), [weight, indices],
                     mesh_shape, case)
            check_op(lambda w, i: F.embedding(i, w, scale_grad_by_freq=True), [weight, indices],
                     mesh_shape, case)


@pytest.mark.parametrize(
    ("weight_p", "index_p", "out_p", "grad_p"),
    [
        (Shard(0), Replicate(), Partial(), Shard(0)),  # vocabulary-parallel
        (Shard(1), Replicate(), Shard(2), Shard(1)),  # embedding-dim parallel
        (Replicate(), Shard(0), Shard(0), Partial()),  # data parallel
    ],
)
def test_embedding_shardings_need_no_communication(weight_p, index_p, out_p, grad_p) -> None:
    mesh = sw.init_device_mesh("cpu", (4,))
    weight, indices = randn(7, 6), INDICES
    w = sw.distribute_tensor(weight, mesh, [weight_p]).requires_grad_()
    i = sw.distribute_tensor(indices, mesh, [index_p])
    with CommCounter() as forward:
        out = F.embedding(i, w)
    assert forward.total_bytes == 0 and out.placements == (out_p,)
    expected_w = weight.clone().requires_grad_()
    expected = F.embedding(indices, expected_w)
    torch.testing.assert_close(out.full_tensor(), expected)
    g = randn(5, 3, 6, seed=1)
    dg = sw.distribute_tensor(g, mesh, [out_p if not out_p.is_partial() else Replicate()])
    with CommCounter() as backward:
        out.backward(dg)
    expected.backward(g)
    assert backward.total_bytes == 0 and w.grad.placements == (grad_p,)
    torch.testing.assert_close(w.grad.full_tensor(), expected_w.grad)


# ----- layer_norm, rms_norm, softmax -----------------------------------------------------------


def test_layer_norm_oracle() -> None:
    x, w, b = randn(5, 3, 6), randn(6, seed=1), randn(6, seed=2)
    run_oracle(lambda x, w, b: F.layer_norm(x, (6,), w, b), [x, w, b], max_cases=10)
    run_oracle(lambda x: F.layer_norm(x, (3, 6)), [x], mesh_shapes=[(3,), (2, 2)], max_cases=6)


def test_layer_norm_batch_sharded_stays_local_and_normalized_dim_needs_a_move() -> None:
    mesh = sw.init_device_mesh("cpu", (2, 2))
    x, w, b = randn(5, 3, 6), randn(6, seed=1), randn(6, seed=2)
    dw, db = (sw.distribute_tensor(t, mesh, [Replicate()] * 2) for t in (w, b))
    dx = sw.distribute_tensor(x, mesh, [Shard(0), Shard(1)])
    with CommCounter() as comm:
        out = F.layer_norm(dx, (6,), dw, db)
    assert comm.total_bytes == 0 and out.placements == (Shard(0), Shard(1))
    torch.testing.assert_close(out.full_tensor(), F.layer_norm(x, (6,), w, b))
    with pytest.raises(sw.errors.ImplicitRedistributeError, match="native_layer_norm"):
        F.layer_norm(sw.distribute_tensor(x, mesh, [Shard(2), Replicate()]), (6,), dw, db)


def rms_norm_cases(mesh_shape: tuple[int, ...]) -> list[list[tuple]]:
    """The input replicated or sharded on batch dims (the normalized dim stays whole)."""
    rep = on_every_mesh_dim(Replicate(), mesh_shape)
    cases = [[rep, rep]]
    for d in (0, 1):
        cases.append([on_every_mesh_dim(Shard(d), mesh_shape), rep])
    if len(mesh_shape) == 2:
        cases.append([(Shard(0), Shard(1)), rep])
    return cases


def test_rms_norm_batch_sharded() -> None:
    """``F.rms_norm`` decomposes on CPU into pow, mean, add_, rsqrt and mul."""
    x, w = randn(5, 3, 6), randn(6, seed=1)
    for mesh_shape in MESHES:
        for case in rms_norm_cases(mesh_shape):
            check_op(lambda x, w: F.rms_norm(x, (6,), w, eps=1e-5), [x, w], mesh_shape, case)


@pytest.mark.parametrize("fn", [F.softmax, F.log_softmax])
def test_softmax_oracle(fn) -> None:
    x = randn(5, 7, 3)
    run_oracle(lambda x: fn(x, 1), [x], max_cases=8)
    run_oracle(lambda x: fn(x, -1), [x], mesh_shapes=[(2,), (4,)], max_cases=5)


def test_safe_softmax_oracle() -> None:
    """``_safe_softmax`` is what SDPA's math path uses; a fully masked row gives zeros."""
    x = randn(5, 7)
    x[2] = float("-inf")
    run_oracle(lambda x: aten._safe_softmax(x, 1), [x], max_cases=8)


def test_softmax_over_a_sharded_dim_needs_a_move() -> None:
    mesh = sw.init_device_mesh("cpu", (3,))
    x = sw.distribute_tensor(randn(5, 7), mesh, [Shard(1)])
    with pytest.raises(sw.errors.ImplicitRedistributeError, match="_softmax"):
        F.softmax(x, 1)
    assert F.softmax(x, 0).placements == (Shard(1),)


# ----- losses ----------------------------------------------------------------------------------


LOGITS = randn(5, 7, seed=3)
TARGET = torch.tensor([3, 0, 6, 3, 2])  # class 3 twice: ignore_index=3 drops two rows


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_oracle(reduction: str) -> None:
    run_oracle(
        lambda x, t: F.cross_entropy(x, t, reduction=reduction, ignore_index=3),
        [LOGITS, TARGET], max_cases=10,
    )


def test_cross_entropy_with_class_weights_and_nll_loss() -> None:
    weight = torch.rand(7, generator=gen(4)) + 0.1
    run_oracle(
        lambda x, t, w: F.cross_entropy(x, t, weight=w.detach(), ignore_index=0),
        [LOGITS, TARGET, weight], max_cases=8,
    )
    for reduction in ("mean", "sum", "none"):
        run_oracle(lambda x, t, r=reduction: F.nll_loss(x, t, reduction=r), [LOGITS, TARGET],
                   mesh_shapes=[(3,), (2, 2)], max_cases=6)


def test_cross_entropy_spatial_uses_nll_loss2d() -> None:
    logits, target = randn(5, 7, 3, 2, seed=5), torch.randint(0, 7, (5, 3, 2), generator=gen(6))
    for reduction in ("mean", "none"):
        run_oracle(lambda x, t, r=reduction: F.cross_entropy(x, t, reduction=r, ignore_index=1),
                   [logits, target], max_cases=6)


@pytest.mark.parametrize("mesh_shape", MESHES)
def test_batch_sharded_mean_is_exact_and_moves_one_scalar(mesh_shape) -> None:
    """Uneven batch shards with ignored rows and class weights: the mean divides by the global
    total weight, after all-reducing it (one scalar per sharded mesh dim), in explicit mode."""
    mesh = sw.init_device_mesh("cpu", mesh_shape)
    weight = torch.rand(7, generator=gen(4)) + 0.1
    batch = [Shard(0)] * len(mesh_shape)
    x = sw.distribute_tensor(LOGITS, mesh, batch).requires_grad_()
    t = sw.distribute_tensor(TARGET, mesh, batch)
    w = sw.distribute_tensor(weight, mesh, [Replicate()] * len(mesh_shape))
    with CommCounter() as comm:
        loss = F.cross_entropy(x, t, weight=w, ignore_index=3)
    # one all-reduce per sharded mesh dim, or on several mesh dims one reducing exchange,
    # which the planner takes where it moves fewer bytes (a 0-d value cannot be sharded)
    assert set(comm.counts) in ({"all_reduce"}, {"exchange"})
    assert comm.counts["all_reduce"] in (0, len(mesh_shape))
    assert comm.total_bytes <= 8 * mesh.size()  # a 4-byte scalar, ring all-reduce on each device
    assert all(p.is_partial() for p in loss.placements)
    expected_x = LOGITS.clone().requires_grad_()
    expected = F.cross_entropy(expected_x, TARGET, weight=weight, ignore_index=3)
    torch.testing.assert_close(loss.full_tensor(), expected)
    loss.full_tensor().backward()
    expected.backward()
    assert x.grad.placements == tuple(batch)
    torch.testing.assert_close(x.grad.full_tensor(), expected_x.grad)


@pytest.mark.parametrize("loss", [F.mse_loss, F.smooth_l1_loss, F.huber_loss])
def test_elementwise_losses_oracle(loss) -> None:
    x, y = randn(5, 3, seed=13), randn(5, 3, seed=14)
    for reduction in ("mean", "sum", "none"):
        run_oracle(lambda a, b, r=reduction: loss(a, b, reduction=r), [x, y],
                   mesh_shapes=[(2,), (4,), (2, 2)], max_cases=6)


@pytest.mark.parametrize("mesh_shape", [(3,), (4,)])
def test_sharded_mse_mean_is_exact_without_communication(mesh_shape) -> None:
    mesh = sw.init_device_mesh("cpu", mesh_shape)
    x, y = randn(5, 3, seed=13), randn(5, 3, seed=14)
    dx = sw.distribute_tensor(x, mesh, [Shard(0)]).requires_grad_()
    with CommCounter() as comm:
        loss = F.mse_loss(dx, sw.distribute_tensor(y, mesh, [Shard(0)]))
        loss.backward()
    assert comm.total_bytes == 0 and loss.placements == (Partial(),)
    expected_x = x.clone().requires_grad_()
    expected = F.mse_loss(expected_x, y)
    expected.backward()
    torch.testing.assert_close(loss.full_tensor(), expected)
    torch.testing.assert_close(dx.grad.full_tensor(), expected_x.grad)


def test_cross_entropy_over_sharded_classes_needs_a_move() -> None:
    mesh = sw.init_device_mesh("cpu", (2,))
    x = sw.distribute_tensor(LOGITS, mesh, [Shard(1)])
    t = sw.distribute_tensor(TARGET, mesh, [Replicate()])
    with pytest.raises(sw.errors.ImplicitRedistributeError):
        F.cross_entropy(x, t)


# ----- scaled dot-product attention ------------------------------------------------------------


def qkv(heads: int = 3, q_len: int = 5, kv_len: int = 6) -> list[torch.Tensor]:
    return [randn(2, heads, q_len, 4, seed=7), randn(2, heads, kv_len, 4, seed=8),
            randn(2, heads, kv_len, 4, seed=9)]


def sdpa(**kwargs):
    return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, **kwargs)


@pytest.mark.parametrize("is_causal", [False, True])
def test_sdpa_oracle(is_causal: bool) -> None:
    run_oracle(sdpa(is_causal=is_causal), qkv(), max_cases=10)


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("mesh_shape", MESHES)
def test_sdpa_every_sharding_of_heads_batch_and_queries(mesh_shape, is_causal: bool) -> None:
    """3 heads and 5 queries: on 4 devices some shards are empty (the kernel's crash case)."""
    placements = [
        placed(mesh_shape, Shard(1), Shard(1), Shard(1)),
        placed(mesh_shape, Shard(0), Shard(0), Shard(0)),
        placed(mesh_shape, Shard(2), Replicate(), Replicate()),
        placed(mesh_shape, Replicate(), Replicate(), Partial()),
    ]
    if len(mesh_shape) == 2:
        placements.append([(Shard(0), Shard(1))] * 3)
    for case in placements:
        check_op(sdpa(is_causal=is_causal), qkv(), mesh_shape, case)


def test_sdpa_with_boolean_mask() -> None:
    mask = torch.rand(5, 6, generator=gen(10)) > 0.3
    mask[:, 0] = True
    fn = lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m)  # noqa: E731
    run_oracle(fn, [*qkv(), mask], max_cases=10)
    for mesh_shape in ((2,), (4,)):
        check_op(fn, [*qkv(), mask], mesh_shape,
                 placed(mesh_shape, Shard(2), Replicate(), Replicate(), Shard(0)))


@pytest.mark.parametrize("mesh_shape", [(2,), (4,)])
def test_sdpa_math_path_keeps_heads_sharded(mesh_shape) -> None:
    """A mask that needs a gradient sends SDPA down the math path (views, bmm, _safe_softmax,
    _softmax_backward_data); heads stay sharded through it."""
    mask = randn(5, 6, seed=12)
    fn = lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m)  # noqa: E731
    check_op(fn, [*qkv(), mask], mesh_shape,
             placed(mesh_shape, Shard(1), Shard(1), Shard(1), Replicate()))
    mesh = sw.init_device_mesh("cpu", mesh_shape)
    q, k, v = (sw.distribute_tensor(t, mesh, [Shard(1)]) for t in qkv())
    with CommCounter() as comm:
        out = fn(q, k, v, sw.distribute_tensor(mask, mesh, [Replicate()]).requires_grad_())
    assert comm.total_bytes == 0 and out.placements == (Shard(1),)


@pytest.mark.parametrize("mesh_shape", [(2,), (4,)])
def test_causal_sdpa_keeps_heads_sharded_without_communication(mesh_shape) -> None:
    mesh = sw.init_device_mesh("cpu", mesh_shape)
    tensors = qkv()
    dts = [sw.distribute_tensor(t, mesh, [Shard(1)]).requires_grad_() for t in tensors]
    with CommCounter() as forward:
        out = F.scaled_dot_product_attention(*dts, is_causal=True)
    assert forward.total_bytes == 0 and out.placements == (Shard(1),)
    plain = [t.clone().requires_grad_() for t in tensors]
    expected = F.scaled_dot_product_attention(*plain, is_causal=True)
    torch.testing.assert_close(out.full_tensor(), expected)
    g = randn(*expected.shape, seed=11)
    with CommCounter() as backward:
        out.backward(sw.distribute_tensor(g, mesh, [Shard(1)]))
    expected.backward(g)
    assert backward.total_bytes == 0
    for d, t in zip(dts, plain, strict=True):
        assert d.grad.placements == (Shard(1),)
        torch.testing.assert_close(d.grad.full_tensor(), t.grad)


def test_sdpa_dropout_is_refused() -> None:
    mesh = sw.init_device_mesh("cpu", (2,))
    q, k, v = (sw.distribute_tensor(t, mesh, [Shard(1)]) for t in qkv())
    with pytest.raises(sw.errors.UnsupportedOpError, match="dropout_p"):
        aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.5)


# ----- the seed's layer_norm registration examples ---------------------------------------------


@pytest.fixture
def restore_layer_norm():
    """Put the built-in native_layer_norm strategy back, whatever the test registered."""
    try:
        yield
    finally:
        register_op_strategy([aten.native_layer_norm.default], schema_info=RuntimeSchemaInfo(1))(
            layer_norm_strategy
        )


def check_batch_sharded_layer_norm() -> None:
    mesh = sw.init_device_mesh("cpu", (3,))
    x, w, b = randn(5, 3, 6), randn(6, seed=1), randn(6, seed=2)
    dx = sw.distribute_tensor(x, mesh, [Shard(0)]).requires_grad_()
    dw, db = (sw.distribute_tensor(t, mesh, [Replicate()]).requires_grad_() for t in (w, b))
    out = F.layer_norm(dx, (6,), dw, db)
    assert out.placements == (Shard(0),)
    plain = [t.clone().requires_grad_() for t in (x, w, b)]
    expected = F.layer_norm(plain[0], (6,), plain[1], plain[2])
    torch.testing.assert_close(out.full_tensor(), expected)
    g = randn(5, 3, 6, seed=3)
    out.backward(sw.distribute_tensor(g, mesh, [Shard(0)]))
    expected.backward(g)
    for d, t in zip((dx, dw, db), plain, strict=True):
        torch.testing.assert_close(d.grad.full_tensor(), t.grad)


def test_seed_rule_example(restore_layer_norm) -> None:
    @register_prop_rule(
        [torch.ops.aten.native_layer_norm.default],  # specify the op you want to register sharding propagation  # noqa: E501
        schema_info=RuntimeSchemaInfo(1),  # see docstring of class ``RuntimeSchemaInfo``
    )
    # the arguments for every operator sharding propagation is the same.
    # `op_shcema`: OpSchema object, storing the input DTensorSpec of current  operator.
    def prop_layer_norm_rule(op_schema: OpSchema) -> OutputSharding:
        # extract input DTensorSpec from op_schema
        (
            input_dtensor_spec,
            normalized_shape,
            weight_dtensor_spec,
            bias_dtensor_spec,
            _
        ) = op_schema.args_schema

        # optional: type check
        assert isinstance(input_dtensor_spec, DTensorSpec)
        assert isinstance(normalized_shape, (List, Sequence, torch.Size))  # noqa: UP006
        assert isinstance(weight_dtensor_spec, DTensorSpec)
        assert isinstance(bias_dtensor_spec, DTensorSpec)

        # input DTensorSpec validation check
        assert all(isinstance(p, Replicate) for p in weight_dtensor_spec.placements)
        assert all(isinstance(p, Replicate) for p in bias_dtensor_spec.placements)

        # calculate the output DTensorSpec
        # for native_layer_norm, output placements is just the same as the input placements.
        output_placements = input_dtensor_spec.placements

        # return OutputSharding object.
        return OutputSharding(
            output_spec=DTensorSpec(
                mesh=weight_dtensor_spec.mesh,
                placements=output_placements,
                tensor_meta=input_dtensor_spec.tensor_meta
            )
        )

    check_batch_sharded_layer_norm()


def test_seed_strategy_example(restore_layer_norm) -> None:
    @register_op_strategy(
        [torch.ops.aten.native_layer_norm.default],
        schema_info=RuntimeSchemaInfo(1),
    )
    # the arguments for every operator sharding propagation is the same.
    # `mesh`: DeviceMesh that the current operator is running.
    # `op_shcema`: OpSchema object, storing the input OpStrategy of current  operator.
    def layer_norm_strategy(mesh: sw.DeviceMesh, op_schema: OpSchema) -> OpStrategy:
        # extract placement strategy of op_schema
        (
            input_strategy,
            normalized_shape,
            weight_strategy,
            bias_strategy,
            _,
        ) = op_schema.args_schema

        output_strategy = OpStrategy([])

        # enumerate input placement strategies.
        for idx, input_placement_strategy in enumerate(input_strategy.strategies):  # noqa: B007
            op_args_specs = []
            # the output DTensorSpecs of arguments are the inputs of current op
            input_spec = input_placement_strategy.output_spec
            weight_spec = weight_strategy.output_spec
            bias_spec = bias_strategy.output_spec

            # DTensorSpec validation check
            ...

            op_args_specs.append(input_spec)
            op_args_specs.append(weight_spec)
            op_args_specs.append(bias_spec)

            output_spec = input_spec
            # generate all valid strategies, i.e., (input DTensorSpec, output DTensorSpec) pairs.
            output_strategy.strategies.append(
                PlacementStrategy(
                    output_spec=output_spec,
                    input_specs=op_args_specs,
                )
            )

        # return OpStrategy object containing a list of strategies, where one strategy will be selected during sharding propagation  # noqa: E501
        return output_strategy

    check_batch_sharded_layer_norm()


def test_builtin_layer_norm_is_back_after_the_seed_examples() -> None:
    assert registration(aten.native_layer_norm.default).strategy is layer_norm_strategy


@pytest.mark.parametrize("reduction", ["sum", "mean", "none"])
def test_chunked_linear_cross_entropy_keeps_the_batch_sharded(reduction: str) -> None:
    """torch's chunked ``F.linear_cross_entropy`` (custom ops): rows sharded with the target
    stay sharded for ``none`` and ``sum`` (no gather of the input), and give torch's loss and
    gradients; ``mean`` runs replicated."""
    options = torch.nn.LinearCrossEntropyOptions(batch_chunk_size=2)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(8, 5, dtype=torch.float64, generator=gen, requires_grad=True)
    w = torch.randn(7, 5, dtype=torch.float64, generator=gen, requires_grad=True)
    target = torch.randint(0, 7, (8,), generator=gen)
    mesh = sw.init_device_mesh("cpu", (2,))
    dx = sw.distribute_tensor(x.detach().clone(), mesh, [Shard(0)]).requires_grad_()
    dw = sw.distribute_tensor(w.detach().clone(), mesh, [Replicate()]).requires_grad_()
    dt = sw.distribute_tensor(target, mesh, [Shard(0)])
    with sw.debug.CommCounter() as counter, sw.config.allow_implicit_redistribute():
        got = F.linear_cross_entropy(dx, dw, dt, reduction=reduction, options=options)
    expected = F.linear_cross_entropy(x, w, target, reduction=reduction, options=options)
    if reduction != "mean":
        assert not counter.counts.get("all_gather"), counter.counts
    torch.testing.assert_close(got.full_tensor(), expected)
    if reduction != "none":  # the per-row loss's backward is not supported (docs/ops.md)
        got.full_tensor().backward()
        expected.backward()
        torch.testing.assert_close(dx.grad.full_tensor(), x.grad)
        torch.testing.assert_close(dw.grad.full_tensor(), w.grad)
