"""Random ops and ``shardwise.manual_seed``: after the same seeding, DTensor random values are
the single-device ones whatever the mesh and placements."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import shardwise as sw
from op_oracle import run_oracle
from shardwise import InterleavedShard, Partial, Replicate, Shard

LAYOUTS = [
    ((2,), [Replicate()]),
    ((2,), [Shard(0)]),
    ((3,), [Shard(1)]),
    ((3,), [Partial()]),
    ((4,), [Shard(0)]),
    ((4,), [Partial("max")]),
    ((2, 2), [Shard(0), Shard(1)]),
    ((2, 2), [Shard(1), Shard(1)]),
    ((2, 2), [Partial(), Shard(0)]),
    ((2,), [InterleavedShard(0, 3)]),
]
SHAPE = (6, 5)


@pytest.mark.parametrize(("mesh_shape", "placements"), LAYOUTS)
def test_rand_randn_equal_single_device(mesh_shape: tuple[int, ...], placements: list) -> None:
    mesh = sw.init_device_mesh("cpu", mesh_shape)
    for make, ref in [(sw.randn, torch.randn), (sw.rand, torch.rand)]:
        sw.manual_seed(7)
        got = make(*SHAPE, device_mesh=mesh, placements=placements)
        after = torch.randn(3)
        torch.manual_seed(7)
        expected = ref(*SHAPE)
        assert got.placements == tuple(placements)
        assert torch.equal(got.full_tensor(), expected)
        assert torch.equal(after, torch.randn(3)), "the generator advanced differently"
    sw.manual_seed(1)
    got = sw.randn(
        SHAPE, dtype=torch.float64, requires_grad=True, device_mesh=mesh, placements=placements
    )
    torch.manual_seed(1)
    assert got.requires_grad and got.is_leaf
    assert torch.equal(got.full_tensor(), torch.randn(SHAPE, dtype=torch.float64))


def _same(fn_d, fn_t, x: torch.Tensor, mesh_shape: tuple[int, ...], placements: list) -> None:
    """``fn_d`` on the DTensor and ``fn_t`` on the tensor after the same seeding agree."""
    mesh = sw.init_device_mesh("cpu", mesh_shape)
    d = sw.distribute_tensor(x.clone(), mesh, placements)
    sw.manual_seed(11)
    got = fn_d(d)
    torch.manual_seed(11)
    expected = fn_t(x.clone())
    for g, e in zip(
        got if isinstance(got, tuple) else (got,),
        expected if isinstance(expected, tuple) else (expected,),
        strict=True,
    ):
        assert torch.equal(g.full_tensor(), e), (mesh_shape, placements)


RANDOM_OPS = {
    "uniform_": lambda t: t.uniform_(-2, 3),
    "normal_": lambda t: t.normal_(1.0, 0.5),
    "bernoulli_": lambda t: t.bernoulli_(0.3),
    "exponential_": lambda t: t.exponential_(),
    "random_": lambda t: t.random_(0, 10),
    "rand_like": torch.rand_like,
    "randn_like": lambda t: torch.randn_like(t, dtype=torch.float64),
    "bernoulli_p": lambda t: t.bernoulli(0.4),
    "dropout": lambda t: F.dropout(t, 0.4, training=True),
    "native_dropout": lambda t: torch.native_dropout(t, 0.25, True),
    "native_dropout_eval": lambda t: torch.native_dropout(t, 0.25, False),
    "two_draws": lambda t: (t.normal_() * 1, t.uniform_() * 1),
}


@pytest.mark.parametrize("name", list(RANDOM_OPS))
@pytest.mark.parametrize(("mesh_shape", "placements"), LAYOUTS[::2] + LAYOUTS[-1:])
def test_random_ops_equal_single_device(name: str, mesh_shape, placements) -> None:
    fn = RANDOM_OPS[name]
    _same(fn, fn, torch.randn(SHAPE), mesh_shape, placements)


def test_random_ops_on_transposed_dtensor() -> None:
    """Random fills follow the memory layout: a transposed DTensor fills like the transposed
    tensor."""
    _same(
        lambda d: d.t().normal_(), lambda t: t.t().normal_(), torch.zeros(SHAPE), (2,), [Shard(1)]
    )


def test_bernoulli_of_probabilities_gathers_explicitly() -> None:
    p = torch.rand(SHAPE, generator=torch.Generator().manual_seed(0))
    mesh = sw.init_device_mesh("cpu", (2,))
    dp = sw.distribute_tensor(p, mesh, [Shard(0)])
    with pytest.raises(sw.ImplicitRedistributeError, match="bernoulli"):
        torch.bernoulli(dp)
    with sw.allow_implicit_redistribute():
        _same(torch.bernoulli, torch.bernoulli, p, (2,), [Shard(0)])
        _same(torch.bernoulli, torch.bernoulli, p, (2, 2), [Replicate(), Shard(1)])


def test_explicit_generator() -> None:
    mesh = sw.init_device_mesh("cpu", (3,))
    d = sw.zeros(*SHAPE, device_mesh=mesh, placements=[Shard(0)])
    d.uniform_(generator=torch.Generator().manual_seed(5))
    expected = torch.zeros(SHAPE).uniform_(generator=torch.Generator().manual_seed(5))
    assert torch.equal(d.full_tensor(), expected)


def test_partial_inplace_random_keeps_value() -> None:
    mesh = sw.init_device_mesh("cpu", (2, 2))
    d = sw.zeros(*SHAPE, device_mesh=mesh, placements=[Partial(), Partial("avg")])
    sw.manual_seed(2)
    d.normal_()
    torch.manual_seed(2)
    assert d.placements == (Partial(), Partial("avg"))
    assert torch.allclose(d.full_tensor(), torch.randn(SHAPE))


def test_dropout_forward_backward_oracle() -> None:
    """Seeded inside the function, so both runs draw the same mask: values and gradients."""

    def fn(a: torch.Tensor) -> torch.Tensor:
        torch.manual_seed(3)
        return F.dropout(a, 0.5, training=True) + torch.native_dropout(a, 0.3, True)[0]

    run_oracle(fn, [torch.randn(5, 3)], max_cases=8)


@pytest.mark.parametrize(
    "name, fn",
    [
        ("normal", lambda m, s: torch.normal(m, s)),
        ("normal_float_std", lambda m, s: torch.normal(m, 0.5)),
        ("poisson", lambda m, s: torch.poisson(s)),
        ("standard_gamma", lambda m, s: torch._standard_gamma(s)),
        ("binomial", lambda m, s: torch.binomial(torch.full_like(s, 5.0), s / (1 + s))),
        ("multinomial", lambda m, s: torch.multinomial(s, 3)),
    ],
)
def test_random_ops_of_values_equal_single_device(name: str, fn) -> None:
    mesh = sw.init_device_mesh("cpu", (3,))
    mean, std = torch.randn(4, 5), torch.rand(4, 5) + 0.1
    dmean = sw.distribute_tensor(mean, mesh, [Shard(0)])
    dstd = sw.distribute_tensor(std, mesh, [Shard(0)])
    with sw.allow_implicit_redistribute():
        sw.manual_seed(7)
        got = fn(dmean, dstd)
    torch.manual_seed(7)
    expected = fn(mean, std)
    assert torch.equal(got.full_tensor(), expected), name
    if got.shape == mean.shape:
        assert got.placements == (Shard(0),)  # drawn whole, kept sharded like the input


def test_rrelu_in_training_draws_the_single_device_noise() -> None:
    x = torch.randn(6, 4, requires_grad=True)
    mesh = sw.init_device_mesh("cpu", (2,))
    dx = sw.distribute_tensor(x.detach(), mesh, [Shard(0)]).requires_grad_(True)
    with sw.allow_implicit_redistribute():
        sw.manual_seed(3)
        got = F.rrelu(dx, training=True)
        got.full_tensor().sum().backward()
    torch.manual_seed(3)
    expected = F.rrelu(x, training=True)
    expected.sum().backward()
    assert got.placements == (Shard(0),)
    assert torch.equal(got.full_tensor(), expected)
    torch.testing.assert_close(dx.grad.full_tensor(), x.grad)
