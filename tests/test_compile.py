"""torch.compile over DTensors (embedded mode): the subclass flattens into its components, so
dynamo and AOT autograd trace dispatch's local ops and in-process collectives into one graph
(fullgraph), forward and backward, with eager's values and placements."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from mp_harness import run_in_processes
from shardwise import Replicate, Shard
from shardwise import parallel as tp
from shardwise.parallel import replicate


def _mlp_loss(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    hidden = torch.relu(x @ w1.t())
    out = (hidden @ w2.t()).redistribute(placements=[Replicate()])
    return (out * out).mean()


def _inputs(mesh: sw.DeviceMesh, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x, w1, w2 = torch.randn(6, 4, generator=g), torch.randn(10, 4, generator=g), torch.randn(
        4, 10, generator=g
    )
    rep = [Replicate()] * mesh.ndim
    col = [Shard(0)] + [Replicate()] * (mesh.ndim - 1)
    row = [Shard(1)] + [Replicate()] * (mesh.ndim - 1)
    return (
        sw.distribute_tensor(x, mesh, rep),
        sw.distribute_tensor(w1, mesh, col).requires_grad_(),
        sw.distribute_tensor(w2, mesh, row).requires_grad_(),
    ), (x, w1.requires_grad_(), w2.requires_grad_())


def test_compiled_tensor_parallel_step_equals_eager_and_single_device() -> None:
    torch._dynamo.reset()
    for mesh_shape in [(2,), (3,)]:  # (3,): uneven shards of the 10 hidden units
        mesh = sw.init_device_mesh("cpu", mesh_shape)
        (dx, d1, d2), (x, w1, w2) = _inputs(mesh, 0)
        compiled = torch.compile(_mlp_loss, backend="aot_eager", fullgraph=True)
        loss = compiled(dx, d1, d2)
        loss.backward()
        ref = ((torch.relu(x @ w1.t()) @ w2.t()) ** 2).mean()
        ref.backward()
        torch.testing.assert_close(loss.full_tensor(), ref)
        assert d1.grad.placements == d1.placements and d2.grad.placements == d2.placements
        torch.testing.assert_close(d1.grad.full_tensor(), w1.grad)
        torch.testing.assert_close(d2.grad.full_tensor(), w2.grad)


def test_compiled_function_returns_dtensor_with_eager_spec() -> None:
    torch._dynamo.reset()
    mesh = sw.init_device_mesh("cpu", (2, 2))
    x = torch.randn(8, 6)
    dx = sw.distribute_tensor(x, mesh, [Shard(0), Shard(1)])

    def f(t: torch.Tensor) -> torch.Tensor:
        return torch.softmax(t * 2.0, dim=0).sum(1)

    with sw.config.allow_implicit_redistribute():
        eager = f(dx)
        out = torch.compile(f, backend="aot_eager", fullgraph=True)(dx)
    assert isinstance(out, sw.DTensor) and out.placements == eager.placements
    torch.testing.assert_close(out.full_tensor(), torch.softmax(x * 2.0, dim=0).sum(1))


# ----- tensor-parallel training steps (parallelize_module) -------------------------------------


class _MLP(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class _Block(nn.Module):
    """LayerNorm, causal attention with q/k/v/o projections, MLP, residuals."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.ln_1, self.ln_2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))
        self.mlp = _MLP(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        h = self.ln_1(x)

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, s, -1, self.head_dim).transpose(1, 2)

        att = F.scaled_dot_product_attention(
            heads(self.q(h)), heads(self.k(h)), heads(self.v(h)), is_causal=True
        )
        x = x + self.o(att.transpose(1, 2).reshape(b, s, -1))
        return x + self.mlp(self.ln_2(x))


_PLANS = {
    "mlp": lambda local: {"up": tp.ColwiseParallel(),
                          "down": tp.RowwiseParallel(use_local_output=local)},
    "block": lambda local: {"q": tp.ColwiseParallel(), "k": tp.ColwiseParallel(),
                            "v": tp.ColwiseParallel(),
                            "o": tp.RowwiseParallel(use_local_output=local),
                            "mlp.up": tp.ColwiseParallel(),
                            "mlp.down": tp.RowwiseParallel(use_local_output=local)},
}


def _loss(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = module(x)
    if isinstance(x, sw.DTensor):
        return out.full_tensor().pow(2).mean()
    assert not isinstance(out, sw.DTensor)  # a Replicate output with use_local_output=True
    return out.pow(2).mean()


def _plain(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, sw.DTensor) else t


def _train(module: nn.Module, step, inputs: list) -> tuple[list[float], list]:
    """Losses and final gradients of SGD steps (the optimizer runs eagerly)."""
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    losses = []
    for x in inputs:
        opt.zero_grad(set_to_none=True)
        loss = step(x)
        loss.backward()
        losses.append(loss.item())
        grads = [_plain(p.grad).clone() for p in module.parameters()]
        with sw.config.allow_implicit_redistribute():  # replicated norms get pending-sum gradients
            opt.step()
    return losses, grads


def _compiled_vs_eager(model: str, mesh: sw.DeviceMesh, inputs: list, dim: int) -> dict:
    """Train a parallelized model compiled (fullgraph) and eagerly, and the unsharded model."""
    torch.manual_seed(0)
    base = _MLP(dim) if model == "mlp" else _Block(dim, 4)
    runs = {}
    for kind in ("compiled", "eager", "single"):
        module = copy.deepcopy(base)
        # several devices in this process: the block keeps its outputs DTensors
        # (use_local_output=False), so the residual is one, and the norms' parameters are
        # replicated DTensors too; the MLP's Replicate output is a plain tensor
        dtensors = model == "block" and mesh.num_local_devices() > 1
        if kind != "single":
            tp.parallelize_module(module, mesh, _PLANS[model](not dtensors))
        step = lambda x, m=module: _loss(m, x)  # noqa: E731
        if kind == "compiled":
            torch._dynamo.reset()
            step = torch.compile(step, backend="aot_eager", fullgraph=True, dynamic=False)
        xs = inputs
        if kind != "single" and dtensors:
            sw.distribute_module(module, mesh)
            xs = [sw.distribute_tensor(x, mesh) for x in inputs]
        runs[kind] = _train(module, step, xs)
    return runs


def _check(runs: dict) -> None:
    (c_loss, c_grads), (e_loss, e_grads) = runs["compiled"], runs["eager"]
    assert c_loss == e_loss  # aot_eager runs the same kernels: bit-equal
    for c, e in zip(c_grads, e_grads, strict=True):
        assert torch.equal(c, e)
    s_loss, s_grads = runs["single"]
    torch.testing.assert_close(torch.tensor(c_loss), torch.tensor(s_loss))
    for c, s in zip(c_grads, s_grads, strict=True):
        torch.testing.assert_close(c, s)


def test_compiled_parallelized_mlp_and_block_train_like_eager_on_simulated_devices() -> None:
    mesh = sw.init_device_mesh("cpu", (2,))
    g = torch.Generator().manual_seed(1)
    for model, shape in (("mlp", (6, 8)), ("block", (2, 4, 8))):
        inputs = [torch.randn(shape, generator=g) for _ in range(2)]
        _check(_compiled_vs_eager(model, mesh, inputs, 8))


def _tp_mlp_job() -> list[float]:
    """Rank-local: a TP MLP compiled over 2 gloo processes."""
    mesh = sw.init_device_mesh("cpu", (2,))
    g = torch.Generator().manual_seed(2)
    inputs = [torch.randn(6, 8, generator=g) for _ in range(2)]
    runs = _compiled_vs_eager("mlp", mesh, inputs, 8)
    _check(runs)
    return runs["compiled"][0]


def test_compiled_tensor_parallel_mlp_across_two_processes() -> None:
    """Redistributions across processes trace into the graph (fullgraph, no break), compiled
    steps equal eager bit for bit on every rank and the unsharded model's values."""
    losses = run_in_processes(_tp_mlp_job, 2, timeout=300)
    assert losses[0] == losses[1]


def _graph_job() -> dict:
    """The TP MLP's forward and backward graphs as AOT autograd hands them to the compiler:
    the ops of every node, per graph."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    mesh = sw.init_device_mesh("cpu", (2,))
    graphs: list[list[str]] = []

    def record(gm: torch.fx.GraphModule, _: object) -> torch.fx.GraphModule:
        graphs.append([str(n.target) for n in gm.graph.nodes if n.op == "call_function"])
        return make_boxed_func(gm.forward)

    torch._dynamo.reset()
    step = torch.compile(_mlp_loss, backend=aot_autograd(fw_compiler=record, bw_compiler=record),
                         fullgraph=True)
    dts, plain = _inputs(mesh, 3)
    loss = step(*dts)
    loss.backward()
    x, w1, w2 = plain
    want = ((torch.relu(x @ w1.t()) @ w2.t()) ** 2).mean()
    return {"graphs": graphs, "loss": loss.full_tensor(), "want": want.detach()}


def test_compiled_redistribution_lowers_to_functional_collectives() -> None:
    """Across processes the TP step's redistribution is the backend's functional collective
    in the graph (an all_reduce and its wait_tensor) that inductor can schedule, not an opaque
    op; the compiled loss equals one device's."""
    for result in run_in_processes(_graph_job, 2, timeout=300):
        forward = result["graphs"][0]
        assert "_c10d_functional.all_reduce.default" in forward, forward
        assert "_c10d_functional.wait_tensor.default" in forward, forward
        assert not any("execute_plan" in op for graph in result["graphs"] for op in graph)
        torch.testing.assert_close(result["loss"], result["want"])


def test_plan_op_replans_from_its_key_alone() -> None:
    """A graph from torch's compile caches carries only the op's key: a process that never
    traced it plans again from the key and gets eager's bits (and the fake shapes)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from shardwise.redistribute import plan_redistribute, traced

    mesh = sw.init_device_mesh("cpu", (3,), mesh_dim_names=("tp",))
    x = torch.randn(7, 5)
    d = sw.distribute_tensor(x, mesh, [Shard(0)])
    plan = plan_redistribute(d._spec, (Shard(1),))
    key = traced._key(plan, mesh, x.dtype)
    traced._entries.pop(key, None)
    out = torch.ops.shardwise.execute_plan(sw.local_components(d), key)
    expected = d.redistribute(placements=[Shard(1)])
    for got, want in zip(out, sw.local_components(expected), strict=True):
        assert torch.equal(got, want)
    traced._entries.pop(key, None)
    mode = FakeTensorMode()
    fakes = [mode.from_tensor(c.detach()) for c in sw.local_components(d)]
    with mode:
        fake = torch.ops.shardwise.execute_plan(fakes, key)
    assert [list(f.shape) for f in fake] == [[7, 2], [7, 2], [7, 1]]


# ----- the whole training step compiled, optimizer included ------------------------------------

_OPTIMIZERS = {
    "Adam": lambda params: torch.optim.Adam(params, lr=0.01),
    "AdamW": lambda params: torch.optim.AdamW(params, lr=0.01, weight_decay=0.1, foreach=True),
    "SGD": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    "AdamW-fused": lambda params: torch.optim.AdamW(params, lr=0.01, amsgrad=True, fused=True),
}


def _parallelize(module: nn.Module, layout: str) -> nn.Module:
    """Tensor parallel on a (2,) mesh, or FSDP x TP (DDP x TP) on a ("dp", "tp") (2, 2) mesh;
    ``fsdp_tp_per_rank``: on a (2, 1) mesh, one device per process across two processes (each
    rank runs its own forward and backward on local tensors)."""
    plan = {"up": tp.ColwiseParallel(), "down": tp.RowwiseParallel()}
    if layout == "tp":
        return tp.parallelize_module(module, sw.init_device_mesh("cpu", (2,)), plan)
    if layout == "fsdp_tp_per_rank":  # as torchtitan: TP on the "tp" sub-mesh
        mesh = sw.init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp", "tp"))
        tp.parallelize_module(module, mesh["tp"], plan)
        return tp.fully_shard(module, mesh=mesh["dp"])
    mesh = sw.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tp.parallelize_module(module, mesh, plan, tp_mesh_dim=1)
    if layout == "ddp_tp":
        return replicate(module, mesh["dp"])
    tp.fully_shard(module.up, mesh=mesh["dp"])
    return tp.fully_shard(module, mesh=mesh["dp"])


def _break_kinds() -> set[str]:
    """What dynamo graph-broke on so far (the first line of each reason)."""
    return {reason.split("\n")[0] for reason in torch._dynamo.utils.counters["graph_break"]}


def _full_step_run(layout: str | None, optimizer: str, compiled: bool, inputs: list) -> dict:
    """Train with ``step`` = zero_grad, forward, loss, backward, optimizer step, compiled as one
    function (aot_eager) or eager; ``layout`` None: the unsharded model on one device."""
    torch.manual_seed(0)
    module = _MLP(8)
    if layout is not None:
        module = _parallelize(module, layout)
    opt = _OPTIMIZERS[optimizer](module.parameters())

    def step(x: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = _plain(module(x)).pow(2).mean()
        loss.backward()
        opt.step()
        return loss.detach()

    counters = torch._dynamo.utils.counters
    if compiled:
        torch._dynamo.reset()
        counters.clear()
        step = torch.compile(step, backend="aot_eager")
    losses, graphs = [], []
    for x in inputs:
        losses.append(step(x))
        graphs.append((counters["stats"]["unique_graphs"], counters["frames"]["total"]))
    params = [_plain(p).detach().clone() for p in module.parameters()]
    return {"losses": torch.stack(losses), "params": params, "graphs": graphs,
            "breaks": _break_kinds() if compiled else set()}


def _inputs_of_steps() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randn(6, 8, generator=g) for _ in range(3)]


@functools.cache
def _unsharded_runs(optimizer: str) -> tuple[dict, dict]:
    """The unsharded model's eager and compiled runs (shared by the layouts)."""
    inputs = _inputs_of_steps()
    return (_full_step_run(None, optimizer, False, inputs),
            _full_step_run(None, optimizer, True, inputs))


def _check_full_step(layout: str, optimizer: str) -> list[float]:
    single, single_compiled = _unsharded_runs(optimizer)
    inputs = _inputs_of_steps()
    compiled = _full_step_run(layout, optimizer, True, inputs)
    eager = _full_step_run(layout, optimizer, False, inputs)
    for other in (eager, single, single_compiled):
        torch.testing.assert_close(compiled["losses"], other["losses"])
        for c, o in zip(compiled["params"], other["params"], strict=True):
            torch.testing.assert_close(c, o)
    # the optimizer state exists from the second step on: nothing compiles after it
    assert compiled["graphs"][1] == compiled["graphs"][-1], compiled["graphs"]
    # dynamo breaks where it breaks on the unsharded step (zero_grad, backward, the optimizer's
    # own graph_break()), and for data parallel where its forward hooks run eagerly, as FSDP2's
    allowed = set(single_compiled["breaks"])
    if layout != "tp":
        allowed.add("Skip calling `torch.compiler.disable()`d function")
    assert compiled["breaks"] <= allowed, compiled["breaks"] - allowed
    return compiled["losses"].tolist()


@pytest.mark.slow  # end to end: a compiled training step per optimizer and layout (25 s of CPU)
@pytest.mark.parametrize("optimizer", sorted(_OPTIMIZERS))
@pytest.mark.parametrize("layout", ["tp", "fsdp_tp"])
def test_compiled_full_step_with_optimizer_equals_eager_and_one_device(
    layout: str, optimizer: str
) -> None:
    """forward, backward and ``optimizer.step()`` in one compiled function over DTensor
    parameters: the optimizer's math is traced (dynamo's fused multiply-adds included), the
    values are eager's and the unsharded model's, and no step after the second compiles."""
    _check_full_step(layout, optimizer)


def test_compiled_full_step_with_replicate_and_tensor_parallel() -> None:
    """The same with ``replicate`` (DDP) on the data-parallel dim."""
    _check_full_step("ddp_tp", "AdamW")


def _full_step_job() -> list[list[float]]:
    return [_check_full_step(layout, "AdamW") for layout in ("tp", "fsdp_tp")]


def test_compiled_full_step_across_two_processes() -> None:
    """The same over two gloo processes (TP: one device each; FSDP x TP: two each)."""
    losses = run_in_processes(_full_step_job, 2, timeout=300)
    assert losses[0] == losses[1]


def test_compiled_full_step_fsdp_one_device_per_process() -> None:
    """FSDP x TP with one device per process: the gathered parameters' backward, which the
    eager backward after dynamo's break at ``loss.backward()`` calls, runs as it is (dynamo
    tracing it frame by frame broke on its placements and its DTensor, every step's
    parameters)."""
    losses = run_in_processes(_check_full_step, 2, "fsdp_tp_per_rank", "AdamW", timeout=300)
    assert losses[0] == losses[1]
