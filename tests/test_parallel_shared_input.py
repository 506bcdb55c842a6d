"""Modules that receive the same plain tensor share one DTensor of it: the q, k and v
projections of one normed input reduce their input gradient once in the backward (PyTorch's
styles reduce it once per projection), with values equal to single-device PyTorch, embedded and
on 2 gloo processes. A tensor changed in place, or used under another grad mode, is wrapped
anew, and sharing keeps nothing alive."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from mp_harness import run_in_processes
from shardwise.debug import CommDebugMode
from shardwise.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    parallelize_module,
)


class QKV(nn.Module):
    """Attention's projections: three column-parallel linears on one normed input."""

    def __init__(self, dim: int = 8, heads: int = 2) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.ln = nn.LayerNorm(dim)
        self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.o = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        h = self.ln(x)

        def split(t: torch.Tensor) -> torch.Tensor:  # -1: the heads this process holds
            return t.view(b, s, -1, self.head_dim).transpose(1, 2)

        att = F.scaled_dot_product_attention(split(self.q(h)), split(self.k(h)), split(self.v(h)))
        return self.o(att.transpose(1, 2).reshape(b, s, -1))


def _plan() -> dict:
    return {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(),
            "o": RowwiseParallel()}


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, sw.DTensor) else t


def _train_once(mesh: sw.DeviceMesh, heads: int) -> dict:
    """Forward and backward of the sharded and the reference module; the backward's
    all_reduce count and the largest gradient difference."""
    torch.manual_seed(0)
    model = QKV(heads=heads)
    reference = copy.deepcopy(model)
    parallelize_module(model, mesh, _plan())
    x = torch.randn(2, 5, 8)
    xs, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
    out, ref = model(xs), reference(xr)
    grad = torch.randn_like(ref)
    with CommDebugMode() as comm:
        (_full(out) * grad).sum().backward()
    ref.backward(grad)
    diffs = [(xs.grad - xr.grad).abs().max().item()]
    for p, r in zip(model.parameters(), reference.parameters(), strict=True):
        diffs.append((_full(p.grad) - r.grad).abs().max().item())
    return {"backward": dict(comm.get_comm_counts()), "out": (_full(out) - ref).abs().max().item(),
            "grad": max(diffs)}


@pytest.mark.parametrize("mesh_shape", [(2,), (2, 2)])
def test_qkv_input_gradient_is_reduced_once(mesh_shape) -> None:
    result = _train_once(sw.init_device_mesh("cpu", mesh_shape), heads=2)
    assert result["out"] < 1e-5 and result["grad"] < 1e-5
    assert result["backward"] == {"all_reduce": 1}


def _on_process() -> dict:
    import torch.distributed as dist

    return _train_once(sw.init_device_mesh("cpu", (dist.get_world_size(),)), heads=2)


def test_qkv_input_gradient_is_reduced_once_across_processes() -> None:
    for result in run_in_processes(_on_process, 2, timeout=120):
        assert result["out"] < 1e-5 and result["grad"] < 1e-5
        assert result["backward"] == {"all_reduce": 1}


class Twice(nn.Module):
    """Two modules receive one tensor; between them it changes in place, or the first runs
    under no_grad. ``peek`` returns the DTensor its boundary made, keeping it alive."""

    def __init__(self, between: str) -> None:
        super().__init__()
        self.between = between
        self.peek = nn.Identity()
        self.b = nn.Linear(4, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.between == "no_grad":
            with torch.no_grad():
                kept = self.peek(x)
        else:
            kept = self.peek(x)
            x.mul_(3)  # b must see the new values, and its gradient must go through the mul_
        out = self.b(x)
        del kept
        return out


@pytest.mark.parametrize("between", ["in_place", "no_grad"])
def test_changed_or_differently_tracked_inputs_are_wrapped_anew(between: str) -> None:
    torch.manual_seed(0)
    model = Twice(between)
    reference = copy.deepcopy(model)
    plan = {"peek": PrepareModuleInput(input_layouts=sw.Replicate(),
                                       desired_input_layouts=sw.Replicate()),
            "b": ColwiseParallel(output_layouts=sw.Replicate())}
    parallelize_module(model, sw.init_device_mesh("cpu", (2,)), plan)
    x = torch.randn(3, 4)
    base = x.clone().requires_grad_()
    ref_base = x.clone().requires_grad_()
    out, ref = model(base * 1), reference(ref_base * 1)  # non-leaf: in place is allowed
    torch.testing.assert_close(_full(out), ref)
    _full(out).sum().backward()
    ref.sum().backward()
    torch.testing.assert_close(base.grad, ref_base.grad)
    for p, r in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(_full(p.grad), r.grad)


def test_sharing_keeps_no_tensor_alive() -> None:
    model = QKV()
    parallelize_module(model, sw.init_device_mesh("cpu", (2,)), _plan())
    x = torch.randn(2, 5, 8, requires_grad=True)
    out = model(x)
    _full(out).sum().backward()
    seen = weakref.ref(x)
    del x, out
    gc.collect()
    assert seen() is None
