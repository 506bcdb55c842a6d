"""Issue 7, point 16: ``Module.load_state_dict`` with DTensor entries that do not fit raises
shardwise's ``StateDictMismatchError`` (a RuntimeError) naming the key, both global shapes,
meshes and placements, and loads nothing; entries with other placements are redistributed."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import shardwise as sw
from shardwise import Partial, Replicate, Shard
from shardwise.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

MESH = sw.init_device_mesh("cpu", (2,))
OTHER = sw.DeviceMesh("cpu", [2, 3])


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2))
    return parallelize_module(model, MESH, {"0": ColwiseParallel(), "2": RowwiseParallel()})


def _values(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.full_tensor() if isinstance(v, sw.DTensor) else v.clone()
            for k, v in model.state_dict().items()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_other_placements_load_by_redistributing() -> None:
    source = _values(_model(1))
    model = _model(2)
    placed = {  # same global values, other placements (one needs an all_to_all)
        "0.weight": sw.distribute_tensor(source["0.weight"], MESH, [Shard(1)]),
        "0.bias": sw.distribute_tensor(source["0.bias"], MESH, [Replicate()]),
        "2.weight": sw.distribute_tensor(source["2.weight"], MESH, [Shard(0)]),
        "2.bias": sw.DTensor.from_local([source["2.bias"] / 2] * 2, MESH, [Partial()]),
    }
    before = {k: v.placements for k, v in model.state_dict().items()}
    model.load_state_dict(placed)  # explicit mode: the hook redistributes, not copy_
    assert _same(_values(model), source)
    assert {k: v.placements for k, v in model.state_dict().items()} == before
    x = torch.randn(3, 4)
    reference = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2))
    reference.load_state_dict(source)
    out = model(sw.distribute_tensor(x, MESH, [Replicate()]))
    assert type(out) is torch.Tensor  # the Replicate output, use_local_output=True
    torch.testing.assert_close(out, reference(x))


def _bad_entries() -> list[tuple[str, torch.Tensor, list[str]]]:
    """(key, entry, words the message must hold) for each kind of mismatch."""
    return [
        ("2.weight", sw.distribute_tensor(torch.ones(2, 7), MESH, [Shard(1)]),
         ["'2.weight'", "[2, 7]", "[2, 6]", "Shard(dim=1)", "global shapes differ"]),
        ("0.weight", sw.distribute_tensor(torch.ones(6, 4), OTHER, [Shard(0)]),
         ["'0.weight'", "[6, 4]", "[2, 3]", "[0, 1]", "meshes differ"]),
        ("2.weight", torch.ones(2, 6),
         ["'2.weight'", "plain tensor of shape [2, 6]", "Shard(dim=1)", "distribute"]),
    ]


@pytest.mark.parametrize("strict", [True, False])
def test_mismatches_raise_shardwise_error_and_load_nothing(strict: bool) -> None:
    source = _values(_model(1))
    for key, entry, words in _bad_entries():
        model = _model(2)
        before = _values(model)
        state = {k: sw.distribute_tensor(v, MESH, [Replicate()]) for k, v in source.items()}
        state[key] = entry
        with pytest.raises(sw.errors.StateDictMismatchError) as caught:
            model.load_state_dict(state, strict=strict)
        assert isinstance(caught.value, RuntimeError)  # `except RuntimeError` still catches it
        for word in words:
            assert word in str(caught.value), (word, str(caught.value))
        assert _same(_values(model), before)  # not even the entries that fit were copied


def test_a_dtensor_into_a_plain_parameter_and_hand_built_modules() -> None:
    layer = nn.Linear(3, 2)
    layer.weight = nn.Parameter(sw.distribute_tensor(layer.weight.detach(), MESH, [Shard(0)]))
    # bias stays plain; the DTensor weight registered on the module guards its loading
    weight, bias = layer.weight.full_tensor().clone(), layer.bias.detach().clone()
    state = {"weight": torch.zeros(2, 3),
             "bias": sw.distribute_tensor(torch.zeros(2), MESH, [Replicate()])}
    with pytest.raises(sw.errors.StateDictMismatchError) as caught:
        layer.load_state_dict(state, strict=False)
    message = str(caught.value)
    assert "'weight'" in message and "'bias'" in message and ".full_tensor()" in message
    assert torch.equal(layer.weight.full_tensor(), weight) and torch.equal(layer.bias, bias)
    layer.load_state_dict({"weight": sw.distribute_tensor(torch.ones(2, 3), MESH, [Replicate()]),
                           "bias": torch.ones(2)})
    assert torch.equal(layer.weight.full_tensor(), torch.ones(2, 3))
    assert layer.weight.placements == (Shard(0),)


def test_plain_modules_keep_torchs_behaviour() -> None:
    plain = nn.Linear(3, 2)
    for strict in (True, False):  # torch raises for a size mismatch either way
        with pytest.raises(RuntimeError, match="size mismatch") as caught:
            plain.load_state_dict({"weight": torch.zeros(2, 4), "bias": torch.zeros(2)},
                                  strict=strict)
        assert not isinstance(caught.value, sw.errors.ShardwiseError)
