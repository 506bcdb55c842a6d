"""``distribute_module``'s hooks in both of PyTorch's forms: (module, value, mesh) and the older
(value, mesh); anything else is a clear error. Single-device PyTorch is the oracle."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import shardwise as sw
from shardwise import Replicate, Shard
from shardwise.errors import ParallelPlanError


@pytest.mark.parametrize("form", ["three", "two"])
def test_input_and_output_fns_of_either_form(form: str) -> None:
    mesh = sw.init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    ref = nn.Linear(4, 3)
    model = nn.Linear(4, 3)
    model.load_state_dict(ref.state_dict())
    seen = []

    def place(inputs, device_mesh):
        seen.append(device_mesh)
        return tuple(sw.distribute_tensor(x, device_mesh, [Shard(0)]) for x in inputs)

    def gather(outputs, device_mesh):
        return outputs.redistribute(device_mesh, [Replicate()]).full_tensor()

    if form == "three":
        sw.distribute_module(model, mesh, input_fn=lambda m, i, d: place(i, d),
                             output_fn=lambda m, o, d: gather(o, d))
    else:  # PyTorch's deprecated form: it warns of it (FutureWarning) for each hook
        with pytest.warns(FutureWarning, match="Deprecating") as caught:
            sw.distribute_module(model, mesh, input_fn=place, output_fn=gather)
        assert len(caught) == 2
    x = torch.randn(6, 4)
    got = model(x)
    assert seen == [mesh]
    assert isinstance(got, torch.Tensor) and not isinstance(got, sw.DTensor)
    torch.testing.assert_close(got, ref(x))


def test_a_hook_of_another_arity_is_refused() -> None:
    mesh = sw.init_device_mesh("cpu", (2,))
    with pytest.raises(ParallelPlanError, match="1 parameters"):
        sw.distribute_module(nn.Linear(2, 2), mesh, input_fn=lambda inputs: inputs)
