"""Random ops and ``shardwise.manual_seed``: every device draws only its own shard, from the
stream PyTorch's offset-based tracker gives that shard (``tests/rng_oracle.py`` computes it
from torch's own code), and a random op never allocates the global tensor."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import shardwise as sw
from rng_oracle import expected_shards, torch_offsets, torch_shard_index
from shardwise import InterleavedShard, Partial, Replicate, Shard
from shardwise.memory import track_allocations
from shardwise.rng import philox_offsets, shard_index

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


def sw_components(dt) -> list[torch.Tensor]:
    return dt._components


def _assert_shards(dt, expected: list[torch.Tensor], what: object) -> None:
    for got, want in zip(dt._components, expected, strict=True):
        assert torch.equal(got, want), what


@pytest.mark.parametrize(
    ("mesh_shape", "placements", "shape"),
    [(m, p, s) for m, p in LAYOUTS for s in [SHAPE, (7, 3), (1, 9), (13, 4)]]
    + [((2, 3), [Shard(0), Replicate()], (5, 7)), ((2, 2, 2), [Shard(1), Shard(0), Shard(1)],
                                                   (9, 10)),
       ((2, 2), [InterleavedShard(0, 2), Shard(0)], (8, 3)), ((2,), [Shard(0)], (0, 4))],
)
def test_shard_numbering_and_philox_offsets_are_torchs(mesh_shape, placements, shape) -> None:
    """Per device, the shard index and the (start, end) offsets equal what torch's
    OffsetBasedRNGTracker computes: on CUDA the Philox streams, hence the values, are torch's."""
    mesh = sw.init_device_mesh("cpu", mesh_shape)
    try:
        d = sw.zeros(*shape, device_mesh=mesh, placements=placements)
    except sw.errors.InvalidPlacementError:
        pytest.skip("not a valid layout of this shape")
    for device in mesh.local_device_ids:
        coord = mesh.coordinate_of(device)
        want = torch_offsets(mesh_shape, placements, shape, coord)
        assert philox_offsets(d._spec, device) == want, (coord, placements, shape)
        assert shard_index(d._spec, device) == torch_shard_index(
            mesh_shape, placements, shape, coord
        ), (coord, placements, shape)


@pytest.mark.parametrize(("mesh_shape", "placements"), LAYOUTS)
def test_rand_randn_draw_each_shard_from_its_stream(mesh_shape, placements) -> None:
    mesh = sw.init_device_mesh("cpu", mesh_shape)
    for make, fill in [(sw.randn, torch.randn), (sw.rand, torch.rand)]:
        sw.manual_seed(7)
        got = make(*SHAPE, device_mesh=mesh, placements=placements)
        after = torch.randn(3)
        source = torch.Generator().manual_seed(7)
        shapes = [c.shape for c in got._components]
        want = expected_shards(got, source, lambda i, f=fill, s=shapes: f(s[i]))
        for i, device in enumerate(mesh.local_device_ids):
            if not sw.factories.keeps_value(got._spec, device):
                want[i] = torch.zeros_like(want[i])  # a Partial("sum") holds its value once
        assert got.placements == tuple(placements)
        _assert_shards(got, want, placements)
        assert torch.equal(after, torch.randn(3, generator=source)), "advanced differently"
    got = sw.randn(SHAPE, dtype=torch.float64, requires_grad=True, device_mesh=mesh,
                   placements=placements)
    assert got.requires_grad and got.is_leaf and got.dtype == torch.float64


def test_one_shard_draws_what_one_device_draws() -> None:
    """Replicated (and Partial) random DTensors hold the single-device values, as torch's
    DTensor does on CPU, and the generator advances as on one device."""
    mesh = sw.init_device_mesh("cpu", (2, 2))
    sw.manual_seed(3)
    got = sw.randn(*SHAPE, device_mesh=mesh, placements=[Replicate(), Partial("max")])
    w = sw.zeros(*SHAPE, device_mesh=mesh, placements=[Replicate(), Replicate()])
    torch.nn.init.kaiming_uniform_(w)
    after = torch.rand(2)
    torch.manual_seed(3)
    assert torch.equal(got.full_tensor(), torch.randn(SHAPE))
    assert torch.equal(w.full_tensor(), torch.nn.init.kaiming_uniform_(torch.zeros(SHAPE)))
    assert torch.equal(after, torch.rand(2))


def test_shards_differ_and_replicas_agree() -> None:
    mesh = sw.init_device_mesh("cpu", (2, 2))
    sw.manual_seed(0)
    d = sw.randn(8, 4, device_mesh=mesh, placements=[Shard(0), Replicate()])
    a, b, c, e = sw_components(d)  # coordinates (0,0) (0,1) (1,0) (1,1)
    assert torch.equal(a, b) and torch.equal(c, e) and not torch.equal(a, c)


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
}


def _same_per_shard(fn, x: torch.Tensor, mesh_shape, placements) -> None:
    """``fn`` on the DTensor gives, on each device, ``fn`` of that device's piece drawn from
    its shard's stream (Partial pieces replicated: each device's piece is the value)."""
    mesh = sw.init_device_mesh("cpu", mesh_shape)
    d = sw.distribute_tensor(x.clone(), mesh, placements)
    pieces = sw_components(sw.distribute_tensor(
        x.clone(), mesh, [Replicate() if p.is_partial() else p for p in placements]
    ))
    sw.manual_seed(11)
    got = fn(d)
    after = torch.rand(2)
    got = got if isinstance(got, tuple) else (got,)
    source = torch.Generator().manual_seed(11)
    want = expected_shards(d, source, lambda i: fn(pieces[i].clone()))
    for j, g in enumerate(got):
        _assert_shards(g, [w[j] if isinstance(w, tuple) else w for w in want], placements)
    assert torch.equal(after, torch.rand(2, generator=source)), "advanced differently"


@pytest.mark.parametrize("name", list(RANDOM_OPS))
@pytest.mark.parametrize(("mesh_shape", "placements"), LAYOUTS[:3] + LAYOUTS[6:8] + LAYOUTS[9:])
def test_random_ops_draw_per_shard(name: str, mesh_shape, placements) -> None:
    _same_per_shard(RANDOM_OPS[name], torch.randn(SHAPE), mesh_shape, placements)


@pytest.mark.parametrize("placements", [[Replicate()], [Shard(1)]])
def test_consecutive_random_ops_continue_from_each_other(placements) -> None:
    mesh = sw.init_device_mesh("cpu", (2,))
    d = sw.zeros(*SHAPE, device_mesh=mesh, placements=placements)
    sw.manual_seed(5)
    a = d.normal_().clone()
    b = torch.rand_like(d)
    source = torch.Generator().manual_seed(5)
    for got, fill in ((a, torch.randn), (b, torch.rand)):
        shapes = [c.shape for c in got._components]
        want = expected_shards(d, source, lambda i, f=fill, s=shapes: f(s[i]))
        _assert_shards(got, want, placements)


def test_random_ops_on_transposed_dtensor() -> None:
    """Random fills follow each component's memory layout, as the local op on torch's."""
    mesh = sw.init_device_mesh("cpu", (2,))
    d = sw.zeros(*SHAPE, device_mesh=mesh, placements=[Shard(1)]).t()
    sw.manual_seed(4)
    d.normal_()
    want = expected_shards(d, torch.Generator().manual_seed(4),
                           lambda i: torch.zeros(sw_components(d)[i].t().shape).t().normal_())
    _assert_shards(d, want, "transposed")


def test_bernoulli_of_sharded_probabilities_moves_nothing() -> None:
    p = torch.rand(SHAPE, generator=torch.Generator().manual_seed(0))
    mesh = sw.init_device_mesh("cpu", (2,))
    with sw.debug.CommCounter() as counter:
        _same_per_shard(torch.bernoulli, p, (2,), [Shard(0)])
    assert not counter.counts
    dp = sw.distribute_tensor(p, mesh, [Partial()])
    with pytest.raises(sw.errors.ImplicitRedistributeError, match="bernoulli"):
        torch.bernoulli(dp)  # the probabilities of a pending sum need an all_reduce


def test_explicit_generator_is_read_and_advanced() -> None:
    mesh = sw.init_device_mesh("cpu", (3,))
    d = sw.zeros(*SHAPE, device_mesh=mesh, placements=[Shard(0)])
    torch.manual_seed(1)
    default_before = torch.get_rng_state()
    g = torch.Generator().manual_seed(5)
    d.uniform_(generator=g)
    source = torch.Generator().manual_seed(5)
    _assert_shards(d, expected_shards(d, source, lambda i: torch.rand(2, 5)), "generator")
    assert torch.equal(g.get_state(), source.get_state())
    assert torch.equal(torch.get_rng_state(), default_before)


def test_partial_inplace_random_keeps_value() -> None:
    mesh = sw.init_device_mesh("cpu", (2, 2))
    d = sw.zeros(*SHAPE, device_mesh=mesh, placements=[Partial(), Partial("avg")])
    sw.manual_seed(2)
    d.normal_()
    torch.manual_seed(2)
    assert d.placements == (Partial(), Partial("avg"))
    assert torch.allclose(d.full_tensor(), torch.randn(SHAPE))


@pytest.mark.parametrize("placements", [[Shard(0)], [Shard(1)], [Partial()]])
def test_dropout_forward_backward(placements) -> None:
    """The gradient of dropout is its mask times the scale, shard by shard."""
    mesh = sw.init_device_mesh("cpu", (2,))
    x = sw.distribute_tensor(torch.randn(6, 4), mesh, placements).requires_grad_(True)
    sw.manual_seed(3)
    y = F.dropout(x, 0.5, training=True)
    y.sum().backward() if not placements[0].is_partial() else y.full_tensor().sum().backward()
    full_x = x.full_tensor().detach()
    keep = y.full_tensor().detach() != 0
    assert torch.allclose(y.full_tensor(), torch.where(keep, full_x * 2, 0))
    assert torch.equal(x.grad.full_tensor(), keep.float() * 2)


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
def test_random_ops_of_values_draw_per_shard(name: str, fn) -> None:
    mesh = sw.init_device_mesh("cpu", (3,))
    mean, std = torch.randn(6, 5), torch.rand(6, 5) + 0.1
    dmean = sw.distribute_tensor(mean, mesh, [Shard(0)])
    dstd = sw.distribute_tensor(std, mesh, [Shard(0)])
    sw.manual_seed(7)
    with sw.debug.CommCounter() as counter:
        got = fn(dmean, dstd)
    assert not counter.counts, "sharded alike: nothing moves"
    assert got.placements == (Shard(0),)
    ms, ss = sw_components(dmean), sw_components(dstd)
    want = expected_shards(got, torch.Generator().manual_seed(7), lambda i: fn(ms[i], ss[i]))
    _assert_shards(got, want, name)


def test_multinomial_over_sharded_categories_moves_them() -> None:
    mesh = sw.init_device_mesh("cpu", (2,))
    probs = sw.distribute_tensor(torch.rand(4, 6) + 0.1, mesh, [Shard(1)])
    with pytest.raises(sw.errors.ImplicitRedistributeError, match="multinomial"):
        torch.multinomial(probs, 2)
    with sw.config.allow_implicit_redistribute():
        got = torch.multinomial(probs, 2)
    assert got.shape == (4, 2) and got.placements == (Replicate(),)


def test_rrelu_in_training_draws_noise_per_shard() -> None:
    x = torch.randn(6, 4)
    mesh = sw.init_device_mesh("cpu", (2,))
    dx = sw.distribute_tensor(x, mesh, [Shard(0)]).requires_grad_(True)
    sw.manual_seed(3)
    got = F.rrelu(dx, training=True)
    got.sum().backward()
    pieces = sw_components(dx)
    want = expected_shards(got, torch.Generator().manual_seed(3),
                           lambda i: F.rrelu(pieces[i].detach(), training=True))
    assert got.placements == (Shard(0),)
    _assert_shards(got, want, "rrelu")
    slope = torch.where(x >= 0, 1.0, got.full_tensor().detach() / x)
    torch.testing.assert_close(dx.grad.full_tensor(), slope)


MB = 1 << 20


@pytest.mark.parametrize("op", ["randn", "normal_", "kaiming_uniform_", "dropout", "rand_like",
                                "bernoulli"])
def test_random_ops_allocate_only_each_shard(op: str) -> None:
    """On a 16 MiB tensor sharded over 8 devices, no allocation of a random op is larger than
    one shard (2 MiB), and all of them together hold at most the result's shards (dropout: plus
    what torch's local kernel allocates beside its output, a float and a bool mask)."""
    mesh = sw.init_device_mesh("cpu", (8,))
    shape, placements = (2048, 2048), [Shard(0)]
    x = sw.zeros(*shape, device_mesh=mesh, placements=placements)
    shard = x.numel() * 4 // 8
    sw.manual_seed(0)
    with track_allocations() as stats:
        if op == "randn":
            out = sw.randn(*shape, device_mesh=mesh, placements=placements)
        elif op == "normal_":
            out = x.normal_()
        elif op == "kaiming_uniform_":
            out = torch.nn.init.kaiming_uniform_(x)
        elif op == "dropout":
            out = F.dropout(x, 0.5)
        elif op == "rand_like":
            out = torch.rand_like(x)
        else:
            out = torch.bernoulli(x, 0.5)
    assert out.placements == tuple(placements)
    assert stats.largest_bytes <= shard, stats
    assert stats.allocated_bytes <= 8 * shard * (2.25 if op == "dropout" else 1) + MB, stats


def _philox_state(seed: int, offset: int) -> torch.Tensor:
    return torch.tensor([seed, offset], dtype=torch.int64).view(torch.uint8)


def _read(state: torch.Tensor) -> tuple[int, int]:
    seed, offset = state.view(torch.int64).tolist()
    return seed, offset


@pytest.mark.parametrize("gpus", [4, 1])
@pytest.mark.parametrize("user_generator", [False, True])
def test_philox_draws_use_torchs_offsets(monkeypatch, gpus: int, user_generator: bool) -> None:
    """The CUDA path without a GPU: a stand-in device module keeps 16-byte (seed, offset)
    states; each component's draw sees the state torch's tracker would set on its rank
    (offset + start), and afterwards every device (or the op's generator) holds offset + end,
    the device's own state untouched when a generator was passed."""
    states: dict[torch.device, torch.Tensor] = {}

    class Device:
        @staticmethod
        def get_rng_state(device: torch.device) -> torch.Tensor:
            return states[device].clone()

        @staticmethod
        def set_rng_state(state: torch.Tensor, device: torch.device) -> None:
            states[device] = state.clone()

    class Generator:
        state = _philox_state(99, 8)

        def get_state(self) -> torch.Tensor:
            return self.state.clone()

        def set_state(self, state: torch.Tensor) -> None:
            self.state = state.clone()

    monkeypatch.setattr(torch, "get_device_module", lambda kind: Device)
    mesh_shape, placements, shape = (2, 2), [Shard(1), Shard(0)], (7, 6)
    mesh = sw.init_device_mesh("cpu", mesh_shape)
    spec = sw.zeros(*shape, device_mesh=mesh, placements=placements)._spec
    devices = [torch.device("cuda", i % gpus) for i in range(4)]
    for device in devices:
        states[device] = _philox_state(1234, 40)
    generator = Generator() if user_generator else None
    seed, offset = (99, 8) if user_generator else (1234, 40)
    seen = sw.rng.draw_per_shard(spec, devices, lambda i: _read(states[devices[i]]), generator)
    for i, device in enumerate(mesh.local_device_ids):
        start, end = torch_offsets(mesh_shape, placements, shape, mesh.coordinate_of(device))
        assert seen[i] == (seed, offset + start)
        after = _read(generator.state) if user_generator else _read(states[devices[i]])
        assert after == (seed, offset + end)
        if user_generator:
            assert _read(states[devices[i]]) == (1234, 40)


def test_a_generator_without_offsets_on_an_accelerator_is_refused(monkeypatch) -> None:
    class Device:  # a Mersenne-twister-like state: no offset to advance per shard
        @staticmethod
        def get_rng_state(device: torch.device) -> torch.Tensor:
            return torch.get_rng_state()

    monkeypatch.setattr(torch, "get_device_module", lambda kind: Device)
    mesh = sw.init_device_mesh("cpu", (2,))
    spec = sw.zeros(4, 3, device_mesh=mesh, placements=[Shard(0)])._spec
    devices = [torch.device("xpu", 0)] * 2
    with pytest.raises(sw.errors.UnsupportedOpError, match=r"\[4, 3\].*Shard.*xpu generator"):
        sw.rng.draw_per_shard(spec, devices, lambda i: None)


def test_broadcast_arguments_are_expanded_and_sharded_like_the_result() -> None:
    mesh = sw.init_device_mesh("cpu", (2,))
    mean = sw.distribute_tensor(torch.randn(6, 5), mesh, [Shard(0)])
    std = sw.distribute_tensor(torch.rand(5) + 0.1, mesh, [Replicate()])
    sw.manual_seed(1)
    got = torch.normal(mean, std)
    means, stds = sw_components(mean), [std.full_tensor()] * 2
    want = expected_shards(got, torch.Generator().manual_seed(1),
                           lambda i: torch.normal(means[i], stds[i].expand(3, 5)))
    assert got.shape == (6, 5) and got.placements == (Shard(0),)
    _assert_shards(got, want, "normal")
    d = sw.zeros(6, 5, device_mesh=mesh, placements=[Shard(1)])
    p = sw.distribute_tensor(torch.rand(6, 1), mesh, [Replicate()])
    d.bernoulli_(p)  # p expanded over the sharded dim: each device its columns
    assert ((d.full_tensor() == 0) | (d.full_tensor() == 1)).all()
    with pytest.raises(sw.errors.MeshError, match="plain torch.Tensor"):
        d.bernoulli_(torch.rand(6, 5))
