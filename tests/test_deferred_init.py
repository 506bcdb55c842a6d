"""Deferred initialization: a meta-built module materialized into its shards equals the module
built normally from the same seed with its parameters sharded alike (random initializers draw
per shard), and never allocates the whole model, nor one whole parameter, at once."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import shardwise as sw
from shardwise import InterleavedShard, Shard
from shardwise.deferred_init import deferred_init, is_deferred, materialize_module
from shardwise.errors import DeferredInitError
from shardwise.memory import track_allocations
from shardwise.parallel import fully_shard, replicate

GENERATOR_STATE = torch.get_rng_state().numel()  # bytes of a CPU generator's state


class Net(nn.Module):
    """Embedding, two linears, a norm, and a tied output head."""

    def __init__(self, vocab: int = 40, dim: int = 24, hidden: int = 36) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight


PLACEMENTS = {  # on a (2, 2) mesh: every parameter split four ways where it can be
    "emb.weight": [Shard(0), Shard(1)],
    "up.weight": [Shard(0), Shard(1)],
    "up.bias": [Shard(0), Shard(0)],
    "down.weight": [Shard(1), Shard(0)],
    "down.bias": [Shard(0), Shard(0)],
    "norm.weight": [Shard(0), Shard(0)],
    "norm.bias": [Shard(0), Shard(0)],
}


def _shard(model: nn.Module, mesh: sw.DeviceMesh) -> None:
    for name, placements in PLACEMENTS.items():
        owner, attr = name.rsplit(".", 1)
        param = model.get_submodule(owner).get_parameter(attr)
        dparam = nn.Parameter(sw.distribute_tensor(param, mesh, placements))
        for m in model.modules():  # keep the tie
            for key, p in list(m._parameters.items()):
                if p is param:
                    m._parameters[key] = dparam


def _modules_in_construction_order(module: nn.Module):
    for child in module.children():
        yield from _modules_in_construction_order(child)
    yield module


def _built_like(reference: nn.Module, model: nn.Module, seed: int) -> nn.Module:
    """The eager oracle: ``reference`` (built normally) with each parameter sharded as
    ``model``'s, then its modules' own ``reset_parameters`` run after ``seed``, children before
    parents in registration order: what a normal build draws into those shards (a tied
    parameter keeps its first owner's values: a later owner drew into its own, since
    replaced, parameter)."""
    pairs = list(zip(reference.parameters(), model.parameters(), strict=True))
    for param, like in pairs:
        dparam = nn.Parameter(sw.distribute_tensor(param.detach(), like.device_mesh,
                                                   like.placements))
        for m in reference.modules():  # keep ties
            for key, p in list(m._parameters.items()):
                if p is param:
                    m._parameters[key] = dparam
    sw.manual_seed(seed)
    seen: set[int] = set()
    with torch.no_grad():
        for m in _modules_in_construction_order(reference):
            if hasattr(m, "reset_parameters"):
                own = list(m.parameters(recurse=False))
                first = {id(p): p.full_tensor().clone() for p in own if id(p) in seen}
                m.reset_parameters()
                for p in own:
                    if id(p) in first:
                        p.copy_(sw.distribute_tensor(first[id(p)], p.device_mesh, p.placements))
                seen.update(id(p) for p in own)
    return reference


def _assert_equal_params(model: nn.Module, reference: nn.Module) -> None:
    for (name, p), ref in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert p.placements == ref.placements, name
        assert torch.equal(p.full_tensor(), ref.full_tensor()), name


def test_materialized_shards_equal_the_normal_build_without_a_full_model_allocation() -> None:
    sw.manual_seed(7)
    reference = Net()
    model = deferred_init(Net)
    assert is_deferred(model) and all(p.is_meta for p in model.parameters())
    mesh = sw.init_device_mesh("cpu", (2, 2))
    _shard(model, mesh)
    sw.manual_seed(7)
    with track_allocations() as stats:
        materialize_module(model)
    assert not is_deferred(model)
    assert model.head.weight is model.emb.weight
    for name, p in model.named_parameters():
        assert p.placements == tuple(PLACEMENTS[name]), name
    full_model = sum(p.numel() * 4 for p in reference.parameters())
    largest_shard = max(c.numel() * 4 for p in model.parameters() for c in sw.tf.unpack(p))
    sharded = sum(c.numel() * 4 for p in model.parameters() for c in sw.tf.unpack(p))
    assert sharded == full_model  # every parameter split over the four devices
    # no device draws a whole parameter: past the shards, one generator state at a time
    assert stats.largest_bytes <= max(largest_shard, GENERATOR_STATE)
    # the shards, the shards of the tied weight's first value, kept aside while the head's
    # reset_parameters overwrites it, and a generator state
    tied_shards = sum(c.numel() * 4 for c in sw.tf.unpack(model.emb.weight))
    assert stats.peak_bytes <= sharded + tied_shards + GENERATOR_STATE
    _assert_equal_params(model, _built_like(reference, model, 7))


def test_fully_shard_and_replicate_leave_a_meta_model_on_meta_as_fsdp2() -> None:
    """PyTorch's flow: FSDP2 leaves a module built under ``torch.device("meta")`` on meta;
    ``to_empty`` then the modules' own ``reset_parameters`` give the seeded values."""

    def build() -> nn.Module:
        return nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.Linear(8, 4))

    mesh = sw.init_device_mesh("cpu", (3,))
    for shard in (lambda m: fully_shard(m, mesh=mesh), lambda m: replicate(m, mesh)):
        sw.manual_seed(3)
        reference = build()
        with torch.device("meta"):
            model = build()
        shard(model)
        assert is_deferred(model)
        assert all(sw.tf.is_dtensor(p) and p._components[0].is_meta for p in model.parameters())
        model.to_empty(device="cpu")
        sw.manual_seed(3)
        for m in model.modules():
            if callable(getattr(m, "reset_parameters", None)):
                m.reset_parameters()
        _assert_equal_params(model, _built_like(reference, model, 3))


def test_deferred_root_materializes_after_inner_units_in_construction_order() -> None:
    sw.manual_seed(5)
    reference = Net()
    model = deferred_init(Net)
    mesh = sw.init_device_mesh("cpu", (2,))
    sw.manual_seed(5)
    fully_shard(model.down, mesh=mesh)
    assert is_deferred(model)  # an inner unit of a deferred_init tree waits for the root
    fully_shard(model, mesh=mesh)
    assert all(p.placements == (Shard(0),) for p in model.parameters())
    _assert_equal_params(model, _built_like(reference, model, 5))


class NoReset(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(3, 5))


def test_a_module_without_reset_parameters_cannot_be_materialized() -> None:
    model = deferred_init(lambda: nn.Sequential(nn.Linear(2, 3), NoReset()))
    with pytest.raises(DeferredInitError, match=r"NoReset .*\['scale'\].*\[\[3, 5\]\]"):
        materialize_module(model)


def test_plain_meta_parameters_materialize_on_the_host() -> None:
    sw.manual_seed(1)
    reference = nn.Linear(4, 3)
    model = deferred_init(nn.Linear, 4, 3)
    sw.manual_seed(1)
    materialize_module(model)
    assert torch.equal(model.weight, reference.weight)
    assert model.weight.device.type == "cpu" and math.isclose(model.weight.std().item(),
                                                              reference.weight.std().item())


def test_tensor_parallel_children_then_fully_shard_root_materialize_into_2d_shards() -> None:
    from shardwise.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    def build() -> nn.Module:
        return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))

    sw.manual_seed(2)
    reference = build()
    sw.manual_seed(2)
    model = deferred_init(build)
    mesh = sw.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    parallelize_module(model[0], mesh, ColwiseParallel())  # inner modules: still meta
    parallelize_module(model[2], mesh, RowwiseParallel())
    assert is_deferred(model)
    with track_allocations() as stats:
        fully_shard(model, mesh=mesh["dp"])  # the root: materializes the final 2-D shards
    # the dp chunk of each device's own tp shard (FSDP2's strided shard)
    assert model[0].weight.placements == (InterleavedShard(0, interleaved_size=2), Shard(0))
    assert model[2].weight.placements == (Shard(0), Shard(1))
    shards = sum(c.numel() * 4 for p in model.parameters() for c in sw.tf.unpack(p))
    assert stats.peak_bytes <= shards + GENERATOR_STATE
    _assert_equal_params(model, _built_like(reference, model, 2))


def test_inner_replicate_units_keep_their_gradient_reduction_after_materializing() -> None:
    sw.manual_seed(4)
    reference = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2))
    model = deferred_init(lambda: nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 2)))
    mesh = sw.init_device_mesh("cpu", (2,))
    replicate(model[0], mesh)  # inner: stays meta, its reducer waits for the real parameters
    sw.manual_seed(4)
    replicate(model, mesh)
    x = torch.randn(4, 6)
    reference(x).square().sum().backward()
    with sw.debug.CommCounter() as counter:
        model(x).square().sum().backward()
    assert counter.counts["all_reduce"] == 2  # one bucket per replicate() unit
    for p, ref in zip(model.parameters(), reference.parameters(), strict=True):
        assert p.grad.placements == (sw.Replicate(),)
        torch.testing.assert_close(p.grad.full_tensor(), ref.grad)
