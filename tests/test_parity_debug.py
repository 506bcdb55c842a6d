"""shardwise.debug: CommDebugMode (PyTorch's queries and per-module counts on CommCounter) and
visualize_sharding (which device holds which block)."""

from __future__ import annotations

import io
import json

import pytest
import torch
from torch import nn

import shardwise as sw
from shardwise import InterleavedShard, Partial, Replicate, Shard
from shardwise.debug import CommDebugMode, visualize_sharding


class _Swap(nn.Module):
    """Moves its input from row to column shards: one all_to_all forward, one backward."""

    def forward(self, x: sw.DTensor) -> sw.DTensor:
        return x.redistribute(placements=[Shard(1)])


class _Net(nn.Module):
    def __init__(self, mesh: sw.DeviceMesh) -> None:
        super().__init__()
        weight = torch.arange(16.0).reshape(4, 4) / 10
        self.scale = nn.Parameter(sw.distribute_tensor(weight, mesh, [Shard(0)]))
        self.swap = _Swap()

    def forward(self, x: sw.DTensor) -> sw.DTensor:
        return self.swap(x * self.scale)


def test_comm_debug_mode_counts_per_module_and_phase():
    mesh = sw.init_device_mesh("cpu", (2,))
    net = _Net(mesh)
    x = sw.distribute_tensor(torch.ones(4, 4), mesh, [Shard(0)]).requires_grad_()
    with CommDebugMode() as mode:
        out = net(x)
        full = out.full_tensor()
        full.sum().backward()
    counts = mode.get_comm_counts()
    # forward: all_to_all in swap, all_gather in full_tensor; backward: all_to_all in swap
    assert counts == {"all_to_all": 2, "all_gather": 1} and mode.get_total_counts() == 3
    assert counts[torch.ops._c10d_functional.all_gather_into_tensor] == 1
    assert counts[torch.ops.c10d_functional.all_to_all_single] == 2
    assert counts[torch.ops._c10d_functional.all_reduce] == 0
    # PyTorch's attribute too (its test_dtensor reads it)
    assert mode.comm_counts[torch.ops.c10d_functional.all_gather_into_tensor] == 1
    assert mode.comm_counts == counts
    modules = mode.comm_module_counts
    assert modules["Global"]["forward"] == {"all_to_all": 1, "all_gather": 1}
    assert modules["Global"]["backward"] == {"all_to_all": 1}
    assert modules["_Net.swap"]["forward"] == {"all_to_all": 1}
    assert modules["_Net.swap"]["backward"] == {"all_to_all": 1}
    assert modules["_Net"]["forward"] == {"all_to_all": 1}
    # and equal to the same counts keyed by torch's ops (PyTorch's tests assertDictEqual them)
    functional = torch.ops.c10d_functional
    theirs = {functional.all_to_all_single: 1, functional.all_gather_into_tensor: 1}
    assert modules["Global"]["forward"] == theirs and not modules["Global"]["forward"] != theirs
    assert theirs == modules["Global"]["forward"]
    assert modules["Global"]["backward"] != theirs
    assert modules["Global"]["forward"] != {functional.all_to_all_single: 1}
    assert mode.get_sharding_info() == {"_Net.scale": (Shard(0),)}
    assert list(mode.get_parameter_info()["_Net"]) == ["scale"]
    assert mode.total_bytes > 0 and mode.counts == {"all_to_all": 2, "all_gather": 1}


def test_comm_debug_tracing_table_and_files(tmp_path):
    mesh = sw.init_device_mesh("cpu", (2,))
    net = _Net(mesh)
    x = sw.distribute_tensor(torch.ones(4, 4), mesh, [Shard(0)])
    with CommDebugMode() as mode:
        net(x)
    quiet = mode.generate_comm_debug_tracing_table(noise_level=0)
    assert "Global: 1 collectives" in quiet and "_Net.swap" in quiet and "*all_to_all: 1" in quiet
    assert "scale" not in quiet
    loud = mode.generate_comm_debug_tracing_table(noise_level=3)
    assert "*scale: [Shard(dim=0)]" in loud and "all_to_all on mesh dim 0" in loud
    assert "redistribute of" in loud  # what the collective was moving
    mode.log_comm_debug_tracing_table_to_file(str(tmp_path / "t.txt"), noise_level=3)
    assert (tmp_path / "t.txt").read_text() == loud
    mode.generate_json_dump(str(tmp_path / "t.json"))
    data = json.loads((tmp_path / "t.json").read_text())
    assert data["_Net.swap"]["forward"] == {"all_to_all": 1}
    assert data["_Net"]["parameters"] == {"scale": ["Shard(dim=0)"]}
    with CommDebugMode() as again:  # a fresh block starts from zero
        pass
    # as torch's: "Global" is there from the start, empty until something communicates
    assert again.get_total_counts() == 0
    assert again.comm_module_counts == {"Global": {"forward": {}, "backward": {}}}


def _grid(dt: sw.DTensor) -> list[list[str]]:
    text = visualize_sharding(dt, file=io.StringIO())
    rows = [line for line in text.splitlines() if " | " in line]
    return [[cell.strip() for cell in row.split("|")] for row in rows]


def test_visualize_sharding_2d_uneven():
    mesh = sw.init_device_mesh("cpu", (2, 3))
    dt = sw.distribute_tensor(torch.zeros(7, 10), mesh, [Shard(0), Shard(1)])
    # torch.chunk geometry: rows 4+3, cols 4+4+2
    assert _grid(dt) == [
        ["", "0:4", "4:8", "8:10"],
        ["0:4", "0", "1", "2"],
        ["4:7", "3", "4", "5"],
    ]
    replicated = sw.distribute_tensor(torch.zeros(7, 10), mesh, [Shard(1), Replicate()])
    assert _grid(replicated) == [["", "0:5", "5:10"], ["0:7", "0 1 2", "3 4 5"]]


def test_visualize_sharding_1d_partial_empty_interleaved():
    mesh = sw.init_device_mesh("cpu", (4,))
    out = io.StringIO()
    text = visualize_sharding(sw.distribute_tensor(torch.zeros(3), mesh, [Shard(0)]), "hdr", out)
    assert out.getvalue() == text and text.startswith("hdr\n")
    assert _grid(sw.distribute_tensor(torch.zeros(3), mesh, [Shard(0)]))[1] == ["", "0", "1", "2"]
    assert "devices holding no elements (uneven shards): [3]" in text
    partial = sw.distribute_tensor(torch.zeros(4), sw.init_device_mesh("cpu", (2, 2)),
                                   [Shard(0), Partial()])
    assert _grid(partial)[1:] == [["", "0* 1*", "2* 3*"]]
    assert "partial values over mesh dims [1]" in visualize_sharding(partial, file=io.StringIO())
    inter = sw.distribute_tensor(torch.zeros(8), sw.init_device_mesh("cpu", (2,)),
                                 [InterleavedShard(0, 2)])
    # two interleaved pieces: device 0 holds [0:2] and [4:6], device 1 [2:4] and [6:8]
    assert _grid(inter)[1] == ["", "0", "1", "0", "1"]


def test_visualize_sharding_scalar_and_errors():
    mesh = sw.init_device_mesh("cpu", (2,))
    assert _grid(sw.distribute_tensor(torch.tensor(1.0), mesh))[1] == ["", "0 1"]
    with pytest.raises(sw.errors.InvalidArgumentError, match=r"\[2, 2, 2\]"):
        visualize_sharding(sw.distribute_tensor(torch.zeros(2, 2, 2), mesh), file=io.StringIO())
    with pytest.raises(sw.errors.InvalidArgumentError, match="needs a DTensor"):
        visualize_sharding(torch.zeros(2))
