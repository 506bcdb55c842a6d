"""parallelize_module styles: forward and backward equal single-device PyTorch on meshes
(2,), (3,) and (2, 2), with sizes that do not divide evenly."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise import Replicate, Shard
from shardwise.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

MESHES = [(2,), (3,), (2, 2)]


class MLP(nn.Module):
    def __init__(self, dim: int = 7, hidden: int = 11) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


def _full(x: torch.Tensor) -> torch.Tensor:
    return x.full_tensor() if isinstance(x, sw.DTensor) else x


def _check_grads(sharded: nn.Module, reference: nn.Module, same_placements: bool = True) -> None:
    """Gradients equal the reference; a style's parameters get them in their own placements."""
    pairs = zip(sharded.named_parameters(), reference.parameters(), strict=True)
    for (name, p), ref in pairs:
        assert isinstance(p, sw.DTensor), name
        assert p.grad is not None, name
        assert p.grad.placements == p.placements or not same_placements, name
        torch.testing.assert_close(_full(p.grad), ref.grad, atol=1e-5, rtol=1e-4, msg=name)


def _run(
    model: nn.Module, plan, x: torch.Tensor, mesh_shape, *, replicate_first: bool = False
) -> tuple[sw.DTensor, torch.Tensor]:
    reference = copy.deepcopy(model)
    mesh = sw.init_device_mesh("cpu", mesh_shape)
    if replicate_first:  # Prepare styles only move activations: parameters replicated first
        sw.distribute_module(model, mesh)
    parallelize_module(model, mesh, plan)
    out, ref = model(x), reference(x)
    torch.testing.assert_close(_full(out), ref, atol=1e-5, rtol=1e-4)
    grad = torch.randn_like(ref)
    ref.backward(grad)
    (_full(out) * grad).sum().backward()
    _check_grads(model, reference, same_placements=not replicate_first)
    return out, ref


@pytest.mark.parametrize("mesh_shape", MESHES)
def test_colwise_then_rowwise_mlp(mesh_shape) -> None:
    torch.manual_seed(0)
    plan = {"up": ColwiseParallel(), "down": RowwiseParallel()}
    out, _ = _run(MLP(), plan, torch.randn(3, 5, 7), mesh_shape)
    assert type(out) is torch.Tensor  # a Replicate output, use_local_output=True: plain
    plan = {"up": ColwiseParallel(), "down": RowwiseParallel(use_local_output=False)}
    out, _ = _run(MLP(), plan, torch.randn(3, 5, 7), mesh_shape)
    assert out.placements == (Replicate(),) * len(mesh_shape)


@pytest.mark.parametrize("mesh_shape", MESHES)
def test_colwise_output_layouts_and_rowwise_reduce_scatter(mesh_shape) -> None:
    torch.manual_seed(1)
    plan = {
        "up": ColwiseParallel(output_layouts=Replicate()),
        "down": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
    }
    out, _ = _run(MLP(), plan, torch.randn(2, 5, 7), mesh_shape)
    assert out.placements[-1] == Shard(1)


@pytest.mark.parametrize("mesh_shape", MESHES)
def test_embedding_styles(mesh_shape) -> None:
    torch.manual_seed(2)
    tokens = torch.randint(0, 13, (3, 5))
    for style, placement in [(RowwiseParallel(), Shard(0)), (ColwiseParallel(), Shard(1))]:
        emb = nn.Embedding(13, 7)
        out, _ = _run(emb, style, tokens, mesh_shape)
        assert emb.weight.placements[-1] == placement
    emb = nn.Embedding(13, 7)
    parallelize_module(emb, sw.init_device_mesh("cpu", mesh_shape), RowwiseParallel())
    with sw.debug.CommCounter() as counter:
        emb(tokens)  # tokens go in replicated: the only collective reduces the output
    assert [r.kind for r in counter.records] == ["all_reduce"]


class Norms(nn.Module):
    """LayerNorm in sequence parallel between a row- and a column-parallel linear."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = MLP()
        self.norm = nn.LayerNorm(7)
        self.head = nn.Linear(7, 9)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(x + self.mlp(x)))


@pytest.mark.parametrize("mesh_shape", MESHES)
def test_sequence_parallel_between_tp_layers(mesh_shape) -> None:
    torch.manual_seed(3)
    plan = {
        "mlp": PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate()),
        "mlp.up": ColwiseParallel(),
        "mlp.down": RowwiseParallel(output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }
    model = Norms()
    reference = copy.deepcopy(model)
    mesh = sw.init_device_mesh("cpu", mesh_shape)
    parallelize_module(model, mesh, plan)
    x = torch.randn(2, 5, 7)
    # the residual input arrives sequence-sharded, like the output of a previous SP block
    dx = sw.distribute_tensor(x, mesh, [Shard(1)] * len(mesh_shape))
    dx = dx.redistribute(placements=[Replicate()] * (len(mesh_shape) - 1) + [Shard(1)])
    out, ref = model(dx), reference(x)
    torch.testing.assert_close(_full(out), ref, atol=1e-5, rtol=1e-4)
    assert type(out) is torch.Tensor  # the head's Replicate output (use_local_output=True)
    ref.sum().backward()
    out.sum().backward()
    _check_grads(model, reference)
    assert model.norm.weight.placements[-1] == Replicate()


@pytest.mark.parametrize("mesh_shape", MESHES)
def test_prepare_module_output_and_input_output(mesh_shape) -> None:
    torch.manual_seed(4)
    model = MLP()
    plan = {
        "up": PrepareModuleInputOutput(
            input_layouts=Replicate(),
            desired_input_layouts=Shard(0),
            output_layouts=Shard(0),
            desired_output_layouts=Replicate(),
            use_local_output=False,
        ),
        "down": PrepareModuleOutput(
            output_layouts=Replicate(), desired_output_layouts=Shard(1), use_local_output=False
        ),
    }
    out, _ = _run(model, plan, torch.randn(5, 7), mesh_shape, replicate_first=True)
    assert out.placements[-1] == Shard(1)


class Head(nn.Module):
    """An MLP whose output's gradient is watched: where the plan keeps it a Replicate DTensor,
    that is what the plain output of the style around this module sends back."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = MLP()
        self.seen: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.mlp(x)
        y.register_hook(self.seen.append)
        return y


@pytest.mark.parametrize("mesh_shape", MESHES)
def test_replicate_outputs_are_plain_global_values_in_one_process(mesh_shape) -> None:
    """use_local_output=True in one process: a Replicate output (every device holds it) is the
    global value as a plain tensor, and its gradient flows back replicated; values and
    gradients (parameters and input) equal single-device PyTorch."""
    torch.manual_seed(5)
    x, grad = torch.randn(3, 5, 7), torch.randn(3, 5, 7)
    plans = {
        "RowwiseParallel()": {"mlp.up": ColwiseParallel(), "mlp.down": RowwiseParallel()},
        "ColwiseParallel(output_layouts=Replicate())": {
            "mlp.up": ColwiseParallel(output_layouts=Replicate()),
            "mlp.down": RowwiseParallel(input_layouts=Replicate()),
        },
        "PrepareModuleOutput Shard(1) to Replicate": {
            "mlp.up": ColwiseParallel(),
            "mlp.down": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
            "": PrepareModuleOutput(output_layouts=Shard(1), desired_output_layouts=Replicate()),
        },
        "PrepareModuleOutput Replicate to Replicate": {
            "mlp.up": ColwiseParallel(),
            "mlp.down": RowwiseParallel(use_local_output=False),
            "": PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Replicate()),
        },
    }
    mesh = sw.init_device_mesh("cpu", mesh_shape)
    rest = (Replicate(),) * (mesh.ndim - 1)
    kept = {  # placements of Head's own output where the plan keeps it a DTensor
        "PrepareModuleOutput Shard(1) to Replicate": (*rest, Shard(1)),
        # nothing between Head's output and the plain tensor but full_tensor's backward
        "PrepareModuleOutput Replicate to Replicate": (Replicate(), *rest),
    }
    for name, plan in plans.items():
        model = Head()
        reference = copy.deepcopy(model)
        parallelize_module(model, mesh, plan)
        kinds: list[type] = []
        model.mlp.up.register_forward_hook(lambda m, i, out, kinds=kinds: kinds.append(type(out)))
        xin, xref = x.clone().requires_grad_(), x.clone().requires_grad_()
        out, ref = model(xin), reference(xref)
        assert type(out) is torch.Tensor, name
        if "Colwise" in name:
            assert kinds == [torch.Tensor], name  # the Replicate output of `up` too
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4, msg=name)
        out.backward(grad)
        ref.backward(grad)
        _check_grads(model.mlp, reference.mlp)
        torch.testing.assert_close(xin.grad, xref.grad, atol=1e-5, rtol=1e-4, msg=name)
        (seen,) = model.seen
        if name in kept:
            assert isinstance(seen, sw.DTensor) and seen.placements == kept[name], name
            seen = seen.full_tensor()
        torch.testing.assert_close(seen, grad, msg=name)


def test_outputs_not_held_whole_by_every_device_stay_dtensors() -> None:
    """One process, several devices: only a Replicate output has one value for all of them;
    an output sharded on the data-parallel dim keeps its DTensor."""
    torch.manual_seed(6)
    mesh = sw.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = MLP()
    reference = copy.deepcopy(model)
    parallelize_module(model, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    x = torch.randn(4, 5, 7)
    out = model(sw.distribute_tensor(x, mesh, [Shard(0), Replicate()]))  # a dp-sharded batch
    assert isinstance(out, sw.DTensor) and out.placements == (Shard(0), Replicate())
    torch.testing.assert_close(out.full_tensor(), reference(x), atol=1e-5, rtol=1e-4)
