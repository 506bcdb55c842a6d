"""Plan matching (exact names, globs, regexes, veScale dict plans), plan errors, and
distribute_module."""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from shardwise import Replicate, Shard
from shardwise.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from shardwise.placements import is_any_shard


class Layer(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.relu(self.up(x)))


class Stack(nn.Module):
    def __init__(self, dim: int = 6, n: int = 3) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Layer(dim) for _ in range(n))
        self.head = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _sharded_names(model: nn.Module) -> set[str]:
    return {
        n
        for n, p in model.named_parameters()
        if isinstance(p, sw.DTensor) and any(is_any_shard(pl) for pl in p.placements)
    }


def _same_as_reference(
    model: nn.Module, reference: nn.Module, x: torch.Tensor, mesh: sw.DeviceMesh | None = None
) -> None:
    """Forward and backward equal; with ``mesh`` the input goes in replicated on it."""
    out = model(x if mesh is None else sw.distribute_tensor(x, mesh, [Replicate()] * mesh.ndim))
    out = out.full_tensor() if isinstance(out, sw.DTensor) else out
    ref = reference(x)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)
    out.sum().backward()
    ref.sum().backward()
    for (name, p), r in zip(model.named_parameters(), reference.parameters(), strict=True):
        g = p.grad.full_tensor() if isinstance(p.grad, sw.DTensor) else p.grad
        torch.testing.assert_close(g, r.grad, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize(
    "up_key,down_key,expected_layers",
    [
        ("layers.1.up", "layers.1.down", {1}),  # exact names
        ("layers.*.up", "layers.*.down", {0, 1, 2}),  # globs: * is one name component
        ("layers.[02].up", "layers.[02].down", {0, 2}),
        (re.compile(r"layers\.[12]\.up"), re.compile(r"layers\.[12]\.down"), {1, 2}),
        ("re:layers\\.(0|2)\\.up", "re:layers\\.(0|2)\\.down", {0, 2}),
    ],
)
def test_plan_keys_select_modules(up_key, down_key, expected_layers) -> None:
    torch.manual_seed(0)
    model = Stack()
    reference = copy.deepcopy(model)
    mesh = sw.init_device_mesh("cpu", (2,))
    sw.distribute_module(model.head, mesh)
    for i in set(range(3)) - expected_layers:
        sw.distribute_module(model.layers[i], mesh)
    # the other modules are replicated DTensor modules: the output stays a DTensor
    plan = {up_key: ColwiseParallel(), down_key: RowwiseParallel(use_local_output=False)}
    parallelize_module(model, mesh, plan)
    expected = {f"layers.{i}.{n}" for i in expected_layers for n in ("up.weight", "up.bias")}
    expected |= {f"layers.{i}.down.weight" for i in expected_layers}
    assert _sharded_names(model) == expected
    _same_as_reference(model, reference, torch.randn(4, 6), mesh)


def test_glob_star_does_not_cross_dots() -> None:
    model = Stack()
    mesh = sw.init_device_mesh("cpu", (2,))
    with pytest.raises(sw.errors.ParallelPlanError, match=r"'\*\.up' matches no module of Stack"):
        parallelize_module(model, mesh, {"*.up": ColwiseParallel()})


def test_unmatched_plan_key_names_the_entry_and_modules() -> None:
    mesh = sw.init_device_mesh("cpu", (2,))
    with pytest.raises(sw.errors.ParallelPlanError) as err:
        parallelize_module(Stack(), mesh, {"layers.7.up": ColwiseParallel()})
    message = str(err.value)
    assert "'layers.7.up'" in message and "'layers.0.up'" in message and "Stack" in message


def test_style_that_does_not_fit_the_module() -> None:
    mesh = sw.init_device_mesh("cpu", (2,))
    model = nn.Sequential(nn.LayerNorm(4))
    with pytest.raises(sw.errors.ParallelStyleError) as err:
        parallelize_module(model, mesh, {"0": ColwiseParallel()})
    assert "'0'" in str(err.value) and "LayerNorm" in str(err.value)
    assert isinstance(err.value, TypeError)
    with pytest.raises(sw.errors.ParallelStyleError, match="RowwiseParallel.*Conv1d"):
        parallelize_module(nn.Conv1d(2, 2, 1), mesh, RowwiseParallel())


def test_heads_must_divide_over_the_tp_dim() -> None:
    mesh = sw.init_device_mesh("cpu", (2, 2))
    qkv = nn.Linear(12, 36)
    with pytest.raises(sw.errors.ParallelPlanError) as err:
        parallelize_module(
            nn.ModuleDict({"qkv": qkv}), mesh, {"qkv": ColwiseParallel(interleave=3, num_heads=3)}
        )
    message = str(err.value)
    assert "'qkv'" in message and "num_heads = 3" in message and "size 2" in message
    with pytest.raises(sw.errors.ParallelPlanError, match="interleave=5 does not divide the 36"):
        parallelize_module(qkv, mesh, ColwiseParallel(interleave=5))
    with pytest.raises(sw.errors.ParallelPlanError, match="do not split into num_heads=8 heads"):
        parallelize_module(qkv, mesh, ColwiseParallel(interleave=3, num_heads=8))


def test_plan_value_must_be_a_style() -> None:
    mesh = sw.init_device_mesh("cpu", (2,))
    with pytest.raises(sw.errors.ParallelPlanError, match="not a ParallelStyle"):
        parallelize_module(Stack(), mesh, {"head": "colwise"})


def test_tp_mesh_dim_by_name() -> None:
    torch.manual_seed(1)
    model = Stack(n=1)
    reference = copy.deepcopy(model)
    mesh = sw.init_device_mesh("cpu", (3, 2), mesh_dim_names=("tp", "dp"))
    sw.distribute_module(model.head, mesh)
    plan = {"layers.0.up": ColwiseParallel(),
            "layers.0.down": RowwiseParallel(use_local_output=False)}  # for the replicated head
    parallelize_module(model, mesh, plan)
    assert model.layers[0].up.weight.placements == (Shard(0), Replicate())
    _same_as_reference(model, reference, torch.randn(5, 6), mesh)


# ----- veScale dict plans ------------------------------------------------------------------------


class GPTBlock(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(dim)
        self.attn = nn.Module()
        for name in ("q_proj", "k_proj", "v_proj", "c_proj"):
            setattr(self.attn, name, nn.Linear(dim, dim))
        self.ln_2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential()
        self.mlp.c_fc = nn.Linear(dim, 3 * dim)
        self.mlp.gelu = nn.GELU()
        self.mlp.c_proj = nn.Linear(3 * dim, dim)
        self.attn.forward = self._attend  # a plain module whose forward is the attention

    def _attend(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.size()
        a = self.attn

        def heads(y: torch.Tensor) -> torch.Tensor:
            return y.view(b, t, self.heads, c // self.heads).transpose(1, 2)

        y = F.scaled_dot_product_attention(
            heads(a.q_proj(x)), heads(a.k_proj(x)), heads(a.v_proj(x)), is_causal=True
        )
        return a.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    """nanoGPT's module names (``transformer.h.<i>...``), tied input and output embeddings."""

    def __init__(self, vocab: int = 23, block: int = 8, dim: int = 8, heads: int = 2) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict(
            {
                "wte": nn.Embedding(vocab, dim),
                "wpe": nn.Embedding(block, dim),
                "h": nn.ModuleList(GPTBlock(dim, heads) for _ in range(2)),
                "ln_f": nn.LayerNorm(dim),
            }
        )
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.transformer.wte.weight = self.lm_head.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1])
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


def vescale_nanogpt_plan() -> dict:
    """A veScale-format plan (regex keys, placement lists) for ``NanoGPT``."""
    params = {
        r"transformer.wte.weight": [Shard(1)],
        r"transformer.wpe.weight": [Shard(1)],
        r"transformer.h.\d+.attn.[qkv]_proj.(weight|bias)": [Shard(0)],
        r"transformer.h.\d+.attn.c_proj.weight": [Shard(1)],
        r"transformer.h.\d+.mlp.c_fc.(weight|bias)": [Shard(0)],
        r"transformer.h.\d+.mlp.c_proj.weight": [Shard(1)],
        r"lm_head.weight": [Shard(1)],
    }
    forward = {
        r"transformer.wte.input": [[Replicate()]],
        r"transformer.wte.output": [[Replicate()]],
        r"transformer.wpe.input": [[Replicate()]],
        r"transformer.wpe.output": [[Replicate()]],
        r"transformer.h.\d+.input": [[Shard(1)]],
        r"transformer.h.\d+.attn.input": [[Replicate()]],
        r"transformer.h.\d+.attn.c_proj.output": [[Replicate()]],
        r"transformer.h.\d+.attn.output": [[Shard(1)]],
        r"transformer.h.\d+.mlp.c_fc.input": [[Replicate()]],
        r"transformer.h.\d+.mlp.c_proj.output": [[Replicate()]],
        r"transformer.h.\d+.mlp.output": [[Shard(1)]],
        r"transformer.ln_f.input": [[Shard(1)]],
        r"lm_head.input": [[Shard(2)]],
        r"lm_head.output": [[Replicate()]],
    }
    return {"parameter": params, "forward": forward}


@pytest.mark.parametrize("mesh_shape", [(2,), (2, 2)])
def test_vescale_plan_runs_nanogpt(mesh_shape) -> None:
    torch.manual_seed(0)
    model = NanoGPT()
    reference = copy.deepcopy(model)
    mesh = sw.init_device_mesh("cpu", mesh_shape)
    parallelize_module(model, mesh, vescale_nanogpt_plan())
    assert model.lm_head.weight is model.transformer.wte.weight  # still tied
    assert model.transformer.h[1].attn.k_proj.bias.placements[-1] == Shard(0)
    assert model.transformer.h[0].ln_1.weight.placements[-1] == Replicate()
    idx = torch.randint(0, 23, (2, 7))
    out = model(idx)
    assert out.placements[-1] == Replicate()
    _same_as_reference(model, reference, idx)


def test_vescale_plan_by_argument_name_and_root_keys() -> None:
    torch.manual_seed(2)
    model = Layer(6)
    reference = copy.deepcopy(model)
    mesh = sw.init_device_mesh("cpu", (3,))
    plan = {
        "parameter": {r"up.(weight|bias)": [Shard(0)], r"down.weight": [Shard(1)]},
        "forward": {
            "input": {"x": [Replicate()]},
            "down.output": [[Replicate()]],
            "output": [[Shard(0)]],
        },
    }
    parallelize_module(model, mesh, plan)
    out = model(torch.randn(5, 6))
    assert out.placements == (Shard(0),)
    _same_as_reference(model, reference, torch.randn(5, 6))


def test_vescale_plan_errors() -> None:
    mesh = sw.init_device_mesh("cpu", (2,))
    with pytest.raises(
        sw.errors.ParallelPlanError, match=r"'h\.\\d\+\.up.weight' matches no parameter"
    ):
        parallelize_module(Stack(), mesh, {"parameter": {r"h.\d+.up.weight": [Shard(0)]}})
    with pytest.raises(sw.errors.ParallelPlanError, match="matches no module"):
        parallelize_module(Stack(), mesh, {"forward": {r"h.\d+.input": [[Replicate()]]}})
    with pytest.raises(sw.errors.ParallelPlanError, match=r"must end in '.input' or '.output'"):
        parallelize_module(Stack(), mesh, {"forward": {r"head.inputs": [[Replicate()]]}})
    with pytest.raises(sw.errors.ParallelPlanError, match=r"parameter 'head.bias' of shape \[6\]"):
        parallelize_module(Stack(), mesh, {"parameter": {r"head.bias": [Shard(1)]}})


# ----- distribute_module -----------------------------------------------------------------------


def test_distribute_module_partition_input_and_output_fns() -> None:
    torch.manual_seed(3)
    model = Layer(6)
    reference = copy.deepcopy(model)
    mesh = sw.init_device_mesh("cpu", (2,))
    seen = []

    def partition(name: str, module: nn.Module, device_mesh: sw.DeviceMesh) -> None:
        seen.append(name)
        if name == "up":
            for pname, p in list(module.named_parameters()):
                dp = sw.distribute_tensor(p.detach(), device_mesh, [Shard(0)])
                module.register_parameter(pname, nn.Parameter(dp))

    def input_fn(module: nn.Module, inputs: tuple, device_mesh: sw.DeviceMesh) -> tuple:
        return tuple(sw.distribute_tensor(x, device_mesh, [Replicate()]) for x in inputs)

    def output_fn(module: nn.Module, output: sw.DTensor, device_mesh: sw.DeviceMesh):
        return output.redistribute(placements=[Replicate()])

    out_model = sw.distribute_module(model, mesh, partition, input_fn, output_fn)
    assert out_model is model and seen == ["", "up", "down"]
    assert model.up.weight.placements == (Shard(0),)
    assert model.down.weight.placements == (Replicate(),)  # left alone: replicated
    x = torch.randn(4, 6)
    with sw.config.allow_implicit_redistribute():
        _same_as_reference(model, reference, x)


def test_sequence_parallel_plain_input_is_the_global_value_with_several_local_devices() -> None:
    torch.manual_seed(4)
    norm = nn.LayerNorm(6)
    reference = copy.deepcopy(norm)
    mesh = sw.init_device_mesh("cpu", (3,))
    parallelize_module(norm, mesh, SequenceParallel())
    x = torch.randn(2, 5, 6)
    out = norm(x)
    assert out.placements == (Shard(1),)
    torch.testing.assert_close(out.full_tensor(), reference(x))


def test_vescale_plan_keeps_ties_whichever_name_the_plan_uses() -> None:
    torch.manual_seed(5)
    mesh = sw.init_device_mesh("cpu", (2,))
    for params in ({r"lm_head.weight": [Shard(1)]}, {}):  # the second holder named; none named
        model = NanoGPT()
        parallelize_module(model, mesh, {"parameter": params})
        assert model.lm_head.weight is model.transformer.wte.weight
        assert model.lm_head.weight.placements == ((Shard(1),) if params else (Replicate(),))
    with pytest.raises(sw.errors.ParallelPlanError, match="tied parameter"):
        parallelize_module(
            NanoGPT(),
            mesh,
            {"parameter": {r"lm_head.weight": [Shard(1)], r"transformer.wte.weight": [Shard(0)]}},
        )


def test_distribute_module_keeps_ties() -> None:
    model = NanoGPT()
    sw.distribute_module(model, sw.init_device_mesh("cpu", (2,)))
    assert model.lm_head.weight is model.transformer.wte.weight
    assert isinstance(model.lm_head.weight, sw.DTensor)


class Decoder(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, hidden_states, attention_mask=None, position_ids=None):
        self.mask_seen = attention_mask
        return hidden_states + self.mlp(hidden_states) * attention_mask, None


class Llamaish(nn.Module):
    """Hugging Face conventions: keyword inputs, tuple layer outputs, a dict model output."""

    def __init__(self, dim: int = 6) -> None:
        super().__init__()
        self.model = nn.Module()
        self.model.layers = nn.ModuleList(Decoder(dim) for _ in range(2))
        self.model.forward = self._run

    def _run(self, x: torch.Tensor) -> dict:
        mask = torch.ones(())
        for layer in self.model.layers:
            x, _ = layer(x, attention_mask=mask)
        return {"last_hidden_state": x}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)["last_hidden_state"]


def test_vescale_plan_with_named_inputs_tuple_and_dict_outputs() -> None:
    """The structure of veScale's published Llama plan."""
    torch.manual_seed(6)
    model = Llamaish()
    reference = copy.deepcopy(model)
    decoder = {
        "input": {"hidden_states": [Shard(1)], "attention_mask": [Replicate()]},
        "mlp.input": [[Replicate()]],
        "mlp.output": [[Shard(1)]],
        "output": [[Shard(1)], None],
    }
    plan = {
        "parameter": {
            r"model.layers.\d+.mlp.0.(weight|bias)": [Shard(0)],
            r"model.layers.\d+.mlp.2.weight": [Shard(1)],
        },
        "forward": {
            "model.input": [[Replicate()]],
            "model.output": {"last_hidden_state": [Replicate()]},
            **{rf"model.layers.\d+.{k}": v for k, v in decoder.items()},
        },
    }
    mesh = sw.init_device_mesh("cpu", (2, 3))
    parallelize_module(model, mesh, plan)
    x = torch.randn(2, 7, 6)
    out = model(x)
    assert out.placements == (Replicate(), Replicate())
    assert model.model.layers[1].mask_seen.placements == (Replicate(), Replicate())
    _same_as_reference(model, reference, x)


def test_replicated_then_parallelized_parameters_are_replaced_and_train() -> None:
    """distribute_module first (all replicated), then a plan re-places the parameters it names:
    they keep requires_grad and frozen ones stay frozen."""
    torch.manual_seed(7)
    model = Layer(6)
    model.down.bias.requires_grad_(False)
    reference = copy.deepcopy(model)
    mesh = sw.init_device_mesh("cpu", (2,))
    sw.distribute_module(model, mesh)
    plan = {"up": ColwiseParallel(), "down": RowwiseParallel(use_local_output=False)}
    parallelize_module(model, mesh, plan)  # a DTensor output for the replicated residual
    assert model.up.weight.placements == (Shard(0),) and model.up.weight.requires_grad
    assert not model.down.bias.requires_grad
    _same_as_reference(model, reference, torch.randn(3, 6), mesh)


def test_prepare_styles_check_their_layouts() -> None:
    from shardwise.parallel import PrepareModuleInput, PrepareModuleOutput

    with pytest.raises(sw.errors.ParallelPlanError, match="same length"):
        PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(),))
    with pytest.raises(sw.errors.ParallelPlanError, match="has no desired layout"):
        PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(None,))
    with pytest.raises(sw.errors.ParallelPlanError, match="same keyword arguments"):
        PrepareModuleInput(input_kwarg_layouts={"mask": Shard(0)})
    with pytest.raises(sw.errors.ParallelPlanError, match="same length"):
        PrepareModuleOutput(output_layouts=(Shard(0), Shard(1)), desired_output_layouts=Shard(0))
    mesh = sw.init_device_mesh("cpu", (2,))
    model = nn.Linear(4, 4)
    sw.distribute_module(model, mesh)
    parallelize_module(
        model,
        mesh,
        PrepareModuleInput(
            input_layouts=(Shard(0), Shard(0)), desired_input_layouts=(Replicate(),) * 2
        ),
    )
    with pytest.raises(
        sw.errors.ParallelPlanError, match="2 input layouts for Linear, but it got 1"
    ):
        model(torch.randn(2, 4))
