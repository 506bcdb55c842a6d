"""PyTorch's per-rank contract across processes: a plain tensor is this rank's data.

``fully_shard`` and ``replicate`` never touch the inputs: each rank trains on its own batch (as
FSDP2 and DDP), side inputs stay whole, and the result equals one device training on the
concatenation of the ranks' batches. With tensor parallelism on ``mesh["tp"]`` and data
parallelism on ``mesh["dp"]`` (PyTorch's FSDP2 + TP recipe) the parameters are 2-D DTensors on
the root mesh. The oracle is single-device PyTorch on the global batch.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
from mp_harness import run_in_processes
from shardwise import InterleavedShard, Replicate, Shard
from shardwise.parallel import (
    ColwiseParallel,
    FSDPModule,
    MixedPrecisionPolicy,
    RowwiseParallel,
    fully_shard,
    parallelize_module,
    replicate,
)

STEPS, ROWS = 3, 4  # rows per data-parallel rank


class Block(nn.Module):
    def __init__(self, dim: int = 6, hidden: int = 10) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(x))) * scale  # scale: a side input, not a batch


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, scale)
        return self.head(x)


def _data(dp: int) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    batches = [(torch.randn(dp * ROWS, 6, generator=g), torch.randn(dp * ROWS, 3, generator=g))
               for _ in range(STEPS)]
    return batches, torch.rand(6, generator=g) + 0.5


def _reference(dp: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = Net()
    batches, scale = _data(dp)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for x, y in batches:
        loss = F.mse_loss(model(x, scale), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _per_rank_job(kind: str, tp: int, whole: bool = False
                  ) -> tuple[list[float], dict[str, torch.Tensor], list]:
    """One rank of a per-rank program: its own rows of each global batch, plain tensors;
    ``whole``: tensor parallelism given the whole (dp, tp) mesh and tp_mesh_dim="tp"."""
    import torch.distributed as dist

    world = dist.get_world_size()
    dp = world // tp
    mesh = sw.init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = Net()
    if tp > 1 or whole:
        for block in model.blocks:
            plan = {"up": ColwiseParallel(), "down": RowwiseParallel()}
            if whole:
                parallelize_module(block, mesh, plan, tp_mesh_dim="tp")
            else:
                parallelize_module(block, mesh["tp"], plan)
    if kind == "fully_shard":
        for block in model.blocks:
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        assert isinstance(model, FSDPModule) and isinstance(model.blocks[0], FSDPModule)
    else:
        replicate(model, mesh["dp"])
    placements = {n: (tuple(p.device_mesh.mesh_dim_names), tuple(p.placements))
                  for n, p in model.named_parameters()}
    batches, scale = _data(dp)
    rank = mesh.get_local_rank("dp")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for x, y in batches:
        local_x, local_y = x[rank * ROWS:(rank + 1) * ROWS], y[rank * ROWS:(rank + 1) * ROWS]
        with sw.debug.CommCounter() as counter:
            out = model(local_x, scale)
            assert type(out) is torch.Tensor and out.shape == (ROWS, 3)  # this rank's rows
            loss = F.mse_loss(out, local_y)
            opt.zero_grad()
            loss.backward()
        opt.step()
        losses.append(loss.item())
    state = {n: p.full_tensor() for n, p in model.named_parameters()}
    return losses, state, [placements, dict(counter.counts)]


@pytest.mark.parametrize(("kind", "world", "tp", "whole"), [
    ("fully_shard", 2, 1, False), ("replicate", 2, 1, False), ("fully_shard", 4, 2, False),
    ("replicate", 4, 2, False),
    # parallelize_module on the whole mesh: per rank, its styles run on the tp sub-mesh (the
    # (2, 1) case raised "DTensors on different meshes" in forward)
    ("fully_shard", 2, 1, True), ("fully_shard", 4, 2, True),
])
def test_each_rank_trains_on_its_own_batch(kind: str, world: int, tp: int, whole: bool) -> None:
    dp = world // tp
    ref_losses, ref_state = _reference(dp)
    results = run_in_processes(_per_rank_job, world, kind, tp, whole, timeout=240)
    for step, want in enumerate(ref_losses):
        # each rank's loss is the mean over its rows: the global loss is their mean over dp
        per_dp = [results[r][0][step] for r in range(0, world, tp)]
        assert abs(sum(per_dp) / dp - want) < 1e-5, (step, per_dp, want)
    for _losses, state, _ in results:
        for name, want in ref_state.items():
            torch.testing.assert_close(state[name], want, atol=1e-5, rtol=1e-5, msg=name)
    placements = results[0][2][0]
    up = placements["blocks.0.up.weight"]
    if tp > 1 or whole:  # PyTorch's FSDP2 + TP: 2-D DTensors on the root's (dp, tp) mesh;
        # FSDP keeps each rank's dp chunk of its own tp shard (PyTorch's strided shard)
        stored = (Replicate() if kind != "fully_shard" else
                  InterleavedShard(0, interleaved_size=tp) if tp > 1 else Shard(0))
        assert up == (("dp", "tp"), (stored, Shard(0)))
    else:
        assert up[1] == ((Shard(0),) if kind == "fully_shard" else (Replicate(),))
    if kind == "fully_shard":
        # as FSDP2: one packed gather per unit (the two blocks and the root) in forward, one
        # per block resharded after forward whose saved weights backward re-gathers, one
        # packed reduce-scatter per unit (the head's uneven rows travel padded); with tp, the
        # parameters stored InterleavedShard (chunks of their tp shards) pack the same way
        counts = results[0][2][1]
        assert counts["reduce_scatter"] == 3 and "exchange" not in counts, counts
        assert counts["all_gather"] == 3 + 2, counts


def _mixed_precision_job() -> tuple[list[float], dict[str, torch.Tensor], list[str]]:
    mesh = sw.init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    torch.manual_seed(0)
    model = Net()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    batches, scale = _data(2)
    rank = mesh.get_local_rank()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, dtypes = [], []
    for x, y in batches:
        out = model(x[rank * ROWS:(rank + 1) * ROWS], scale)
        dtypes.append(str(out.dtype))
        loss = F.mse_loss(out.float(), y[rank * ROWS:(rank + 1) * ROWS])
        opt.zero_grad()
        loss.backward()
        dtypes += sorted({str(p.grad.dtype) for p in model.parameters()})
        opt.step()
        losses.append(loss.item())
    return losses, {n: p.full_tensor() for n, p in model.named_parameters()}, dtypes


def _bf16_reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    """Plain training with bf16 compute and float32 master weights and gradient averaging:
    each rank's bf16 gradient, summed in float32 over the two ranks' batches."""
    torch.manual_seed(0)
    master = Net()
    batches, scale = _data(2)
    opt = torch.optim.SGD(master.parameters(), lr=0.1)
    losses = []
    for x, y in batches:
        grads, step_losses = [], []
        for rank in range(2):
            low = copy.deepcopy(master).to(torch.bfloat16)
            out = low(x[rank * ROWS:(rank + 1) * ROWS].bfloat16(), scale.bfloat16())
            loss = F.mse_loss(out.float(), y[rank * ROWS:(rank + 1) * ROWS])
            loss.backward()
            grads.append([p.grad.float() for p in low.parameters()])
            step_losses.append(loss.item())
        for p, g0, g1 in zip(master.parameters(), *grads, strict=True):
            p.grad = (g0 + g1) / 2
        opt.step()
        losses.append(step_losses)
    return losses, {k: v.detach().clone() for k, v in master.state_dict().items()}


def test_mixed_precision_computes_in_bf16_and_reduces_in_float32() -> None:
    want_losses, want_state = _bf16_reference()
    results = run_in_processes(_mixed_precision_job, 2, timeout=240)
    for rank, (losses, state, dtypes) in enumerate(results):
        assert set(dtypes) == {"torch.bfloat16", "torch.float32"}  # outputs bf16, grads fp32
        for step, got in enumerate(losses):
            assert abs(got - want_losses[step][rank]) < 1e-6
        for name, want in want_state.items():
            torch.testing.assert_close(state[name], want, atol=1e-6, rtol=1e-5, msg=name)


def _small_plain_job() -> list[str]:
    """Per rank a plain tensor is this rank's data: mixing a small one (labels) with a DTensor
    is refused, not silently taken as replicated; a one-element constant still is."""
    mesh = sw.init_device_mesh("cpu", (2,))
    rank = mesh.get_rank()
    logits = sw.distribute_tensor(torch.arange(8.0).reshape(4, 2), mesh, [Shard(0)])
    labels = torch.tensor([0.0, 1.0, 1.0, 0.0]) + rank  # differs per rank
    outcome = []
    try:
        logits[:, 0] - labels
        outcome.append("taken")
    except sw.errors.MeshError as err:
        outcome.append("refused" if "plain torch.Tensor of shape [4]" in str(err) else str(err))
    scaled = logits * torch.tensor([2.0])
    outcome.append(str(torch.equal(scaled.full_tensor(), torch.arange(8.0).reshape(4, 2) * 2)))
    return outcome


def test_small_plain_tensors_are_not_taken_as_replicated_per_rank() -> None:
    assert run_in_processes(_small_plain_job, 2, timeout=120) == [["refused", "True"]] * 2


@pytest.mark.parametrize("rows", [4, 64])
def test_one_rule_for_plain_tensors_of_every_size_in_the_global_view(rows: int) -> None:
    """Embedded, as per rank: a plain tensor of more than one element beside a DTensor is
    refused whatever its size (the error names the fix); one element, or inside
    ``implicit_replication()``, it is taken as replicated."""
    mesh = sw.init_device_mesh("cpu", (2,))
    x = torch.arange(2.0 * rows).reshape(rows, 2)
    logits = sw.distribute_tensor(x, mesh, [Shard(0)])
    labels = torch.arange(rows) % 2
    with pytest.raises(sw.errors.MeshError, match="only a 0-d or one-element tensor") as err:
        logits[:, 0] - labels
    assert "implicit_replication" in str(err.value) and "distribute_tensor" in str(err.value)
    with pytest.raises(sw.errors.MeshError, match=f"plain torch.Tensor of shape \\[{rows}\\]"):
        F.cross_entropy(logits, labels)
    assert torch.equal((logits * torch.tensor([2.0])).full_tensor(), x * 2)
    with sw.config.implicit_replication():
        got = F.cross_entropy(logits, labels).full_tensor()
    torch.testing.assert_close(got, F.cross_entropy(x, labels))
