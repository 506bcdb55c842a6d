"""fully_shard's prefetch: from the second forward on, a unit that gathers its parameters also
issues the next unit's packed gather (in the order the previous forward recorded), waited when
that unit's forward starts; in backward, a unit that re-gathers issues the re-gather of the unit
that ran before it in forward. Training gives single-device torch's numbers (bit for bit the
same with and without prefetch, in deterministic mode), the issued collectives show the overlap
without adding any, and a rank that leaves the recorded order still fails on every rank."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist
from torch import nn

import shardwise as sw
from mp_harness import run_in_processes
from shardwise.errors import DataParallelError
from shardwise.parallel import fully_shard

SIZES = ((12, 16), (16, 16), (16, 8))  # (in, out) per layer: distinct packed chunks


class Stack(nn.Sequential):
    """``nn.Sequential`` whose forward can skip one of its modules (``skip``, an index)."""

    skip: int | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, m in enumerate(self):
            if i != self.skip:
                x = m(x)
        return x


def _model() -> Stack:
    torch.manual_seed(0)
    layers = []
    for i, (a, b) in enumerate(SIZES):
        layers.append(nn.Linear(a, b))
        if i + 1 < len(SIZES):
            layers.append(nn.ReLU())
    return Stack(*layers)


def _linears(model: Stack) -> list[nn.Module]:
    return [m for m in model if isinstance(m, nn.Linear)]


def _sharded(mesh: sw.DeviceMesh, prefetch: bool) -> Stack:
    model = _model()
    for layer in _linears(model):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if not prefetch:
        model.set_implicit_prefetch(0, 0)
    return model


def _batch(step: int) -> torch.Tensor:
    return torch.randn(8, SIZES[0][0], generator=torch.Generator().manual_seed(10 + step))


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t.detach()


def train(prefetch: bool, steps: int = 4) -> dict:
    """``steps`` AdamW steps, each rank on its rows of the batch: losses and final params."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = sw.init_device_mesh("cpu", (world,))
    model = _sharded(mesh, prefetch)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, foreach=False)
    losses = []
    with sw.config.deterministic():
        for step in range(steps):
            loss = model(_batch(step).chunk(world)[rank]).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
    return {"losses": torch.stack(losses),
            "params": {k: _full(v) for k, v in model.named_parameters()}}


def torch_train(world: int, steps: int = 4) -> dict:
    """The oracle: one device, the whole batch (the mean of the ranks' equal-sized means)."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, foreach=False)
    losses = []
    for step in range(steps):
        per_rank = [model(x).pow(2).mean() for x in _batch(step).chunk(world)]
        loss = torch.stack(per_rank).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(torch.stack(per_rank).detach())
    return {"losses": torch.stack(losses),
            "params": {k: v.detach() for k, v in model.named_parameters()}}


def train_both() -> dict:
    return {"on": train(True), "off": train(False)}


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_prefetch_trains_as_torch(world: int) -> None:
    per_rank = run_in_processes(train_both, world, timeout=120)
    want = torch_train(world)
    for rank, got in enumerate(per_rank):
        on, off = got["on"], got["off"]
        assert torch.equal(on["losses"], off["losses"]), f"rank {rank}"
        for name, value in on["params"].items():
            assert torch.equal(value, off["params"][name]), f"rank {rank}: {name}"
            torch.testing.assert_close(value, want["params"][name], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(on["losses"], want["losses"][:, rank], rtol=1e-5,
                                   atol=1e-6)


@contextmanager
def _logging(model: Stack, world: int) -> Iterator[list[tuple[str, object]]]:
    """Log, in order: data all_gathers issued and waited (by the layer whose packed chunk they
    gather, told apart by its size), reduce-scatters issued, and each layer's forward start
    and end."""
    functional = torch.ops._c10d_functional
    # bytes of a layer's packed chunk (float32 weight and bias rows, padded): what it gathers
    by_size = {-(-b // world) * (a + 1) * 4: i for i, (a, b) in enumerate(SIZES)}
    log: list[tuple[str, object]] = []
    issued: dict[int, int] = {}
    real = {name: getattr(functional, name) for name in ("all_gather_into_tensor",
                                                         "wait_tensor", "reduce_scatter_tensor")}

    def gather(t: torch.Tensor, *args: object) -> torch.Tensor:
        out = real["all_gather_into_tensor"](t, *args)
        if t.dtype != torch.int64:  # not an agreement (one int64 word)
            issued[id(out)] = by_size[t.numel() * t.element_size()]
            log.append(("issue", issued[id(out)]))
        return out

    def wait(t: torch.Tensor) -> torch.Tensor:
        if id(t) in issued:
            log.append(("wait", issued.pop(id(t))))
        return real["wait_tensor"](t)

    def reduce_scatter(*args: object) -> torch.Tensor:
        log.append(("reduce_scatter", None))
        return real["reduce_scatter_tensor"](*args)

    handles = []
    for i, layer in enumerate(_linears(model)):
        handles.append(layer.register_forward_pre_hook(lambda *_, i=i: log.append(("start", i))))
        handles.append(layer.register_forward_hook(lambda *_, i=i: log.append(("end", i))))
    functional.all_gather_into_tensor = gather
    functional.wait_tensor = wait
    functional.reduce_scatter_tensor = reduce_scatter
    try:
        yield log
    finally:
        for name, fn in real.items():
            setattr(functional, name, fn)
        for h in handles:
            h.remove()


def logged_steps(prefetch: bool) -> list[list[tuple[str, object]]]:
    """Three training steps, each one's log."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _sharded(sw.init_device_mesh("cpu", (world,)), prefetch)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    logs = []
    for step in range(3):
        with _logging(model, world) as log:
            model(_batch(step).chunk(world)[rank]).sum().backward()
            opt.step()
            opt.zero_grad()
        logs.append(log)
    return logs


def logged_both() -> dict:
    return {"on": logged_steps(True), "off": logged_steps(False)}


def _at(log: list, event: tuple, after: int = 0) -> int:
    return log.index(event, after)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_prefetch_issues_the_next_gather_early(world: int) -> None:
    per_rank = run_in_processes(logged_both, world, timeout=120)
    for rank, got in enumerate(per_rank):
        on, off = got["on"], got["off"]
        for step in range(3):
            # the same collectives every step, prefetch or not
            assert sorted(map(repr, on[step])) == sorted(map(repr, off[step])), (rank, step)
        # the first forward records the order: nothing early (its backward prefetches)
        first = _at(on[0], ("end", 2)) + 1
        assert on[0][:first] == off[0][:first]
        for log in off:  # each gather waited as soon as issued
            for j, (kind, _) in enumerate(log):
                if kind == "issue":
                    assert log[j + 1][0] == "wait", (rank, log)
        for log in on[1:]:
            forward = log[: _at(log, ("end", 2)) + 1]
            for i in (1, 2):  # layer i's gather moves during layer i - 1's forward
                assert (_at(forward, ("issue", i)) < _at(forward, ("start", i - 1))
                        < _at(forward, ("end", i - 1)) < _at(forward, ("wait", i))
                        < _at(forward, ("start", i))), (rank, log)
            # backward re-gathers the layers that saved their weight (not the first: its
            # input needs no gradient); layer 1's moves while layer 2's gradient reduces
            backward = log[len(forward):]
            assert [e for e in backward if e[0] == "issue"] == [("issue", 2), ("issue", 1)]
            issued = _at(backward, ("issue", 1))
            assert _at(backward, ("wait", 2)) < issued < _at(
                backward, ("reduce_scatter", None), issued) < _at(backward, ("wait", 1)), log


def diverging() -> str:
    """Rank 1 skips the middle layer in the second step: its backward re-gathers another
    layer than rank 0's at the same point."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _sharded(sw.init_device_mesh("cpu", (world,)), True)
    for step in range(2):
        x = _batch(step).chunk(world)[rank]
        model.skip = 2 if (step, rank) == (1, 1) else None
        try:
            model(x).sum().backward()
        except sw.errors.CollectiveMismatchError as err:
            return f"CollectiveMismatchError at step {step}: {err}"
    return "no error"


@pytest.mark.slow
def test_divergence_from_the_recorded_order_raises() -> None:
    for rank, got in enumerate(run_in_processes(diverging, 2, timeout=120)):
        assert got.startswith("CollectiveMismatchError at step 1"), (rank, got)
        assert "shapes" in got, (rank, got)


def test_prefetch_api_errors() -> None:
    mesh = sw.init_device_mesh("cpu", (2,))
    model = _sharded(mesh, True)
    with pytest.raises(DataParallelError, match="set_modules_to_forward_prefetch.*ReLU"):
        model[0].set_modules_to_forward_prefetch([model[1]])
    with pytest.raises(DataParallelError, match="set_implicit_prefetch"):
        model.set_implicit_prefetch(-1)


def test_explicit_prefetch_one_process() -> None:
    """In one process the prefetched gather is computed at once: the same values, explicit
    targets (FSDP2's) or implicit."""
    mesh = sw.init_device_mesh("cpu", (2,))
    results = []
    for how in ("off", "implicit", "explicit"):
        model = _sharded(mesh, how != "off")
        first, second, third = _linears(model)
        if how == "explicit":
            first.set_modules_to_forward_prefetch([second, third])
            third.set_modules_to_backward_prefetch([second, first])
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        for step in range(3):
            loss = model(_batch(step)).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(_full(loss))
        results.append(torch.stack(losses))
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])


def _edited_run(prefetch: bool) -> list[torch.Tensor]:
    """Three steps in one process; in the second, layer 0's forward scales layer 1's stored
    weight in place (after layer 1's gather was prefetched); in the third, layer 1 is skipped
    (the recorded order changes)."""
    model = _sharded(sw.init_device_mesh("cpu", (2,)), prefetch)
    first, second, _ = _linears(model)
    edit = []

    def scale(*_: object) -> None:
        if edit:
            with torch.no_grad():
                second.weight.mul_(2.0)

    first.register_forward_hook(scale)
    losses = []
    for step in range(3):
        edit[:] = [True] if step == 1 else []
        model.skip = 2 if step == 2 else None
        out = model(_batch(step))
        out.pow(2).mean().backward()
        losses.append(_full(out))
    return losses


def test_stale_or_off_order_prefetch_is_not_used() -> None:
    """A prefetched gather of parameters changed since, or of a unit the forward no longer
    reaches next, is never used: the values are those without prefetch."""
    for got, want in zip(_edited_run(True), _edited_run(False), strict=True):
        assert torch.equal(got, want)


def test_held_parameters_follow_in_place_writes() -> None:
    """``set_reshard_after_backward(False)`` keeps gathered parameters while unchanged; an
    in-place write through the DTensor parameter (its own version counter moves, not its
    components') is a change: the next forward computes with the new values, as torch."""
    mesh = sw.init_device_mesh("cpu", (2,))
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(0))
    outs = []
    for sharded in (True, False):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        if sharded:
            fully_shard(model[0], mesh=mesh)
            fully_shard(model, mesh=mesh)
            model.set_reshard_after_backward(False)
        model(x).sum().backward()
        with torch.no_grad():
            model[0].weight.mul_(2.0)
        outs.append(_full(model(x)))
    torch.testing.assert_close(outs[0], outs[1])
