"""loss_parallel in PyTorch's per-rank programs: plain labels are this rank's (the plain-tensor
rule), DTensor labels carry their placements, a plain class weight is every class's, and other
shapes raise a shardwise error.

The program is PyTorch's FSDP + TP recipe on a (dp, tp) mesh: vocabulary-sharded logits
(``Shard(-1)`` on ``mesh["tp"]``), this rank's labels, ``F.cross_entropy(logits.flatten(0, 1),
labels.flatten(0, 1))``. The oracle is single-device PyTorch on this rank's rows, and on the
global batch for the mean over dp ranks.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shardwise as sw
import shardwise.distribute as swd
from mp_harness import run_in_processes
from shardwise import DTensor, Replicate, Shard
from shardwise.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    fully_shard,
    loss_parallel,
    parallelize_module,
)

ROWS, SEQ, VOCAB = 2, 3, 11  # rows per dp rank; 11 classes: uneven over tp=2
TOL = {"atol": 1e-5, "rtol": 1e-5}


def _global_batch(dp: int, ignore: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits and labels of every dp rank's rows (each rank takes its own)."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(dp * ROWS, SEQ, VOCAB, generator=g)
    labels = torch.randint(0, VOCAB, (dp * ROWS, SEQ), generator=g)
    if ignore:
        labels[0, 1] = labels[-1, 2] = -100
    return logits, labels


def _reference(logits: torch.Tensor, labels: torch.Tensor, reduction: str, grad=None,
               weight=None):
    x = logits.clone().requires_grad_()
    loss = F.cross_entropy(x.flatten(0, 1), labels.flatten(0, 1), weight, reduction=reduction)
    loss.backward(grad)
    return loss.detach(), x.grad


def _tp_submesh_checks(mesh: sw.DeviceMesh) -> int:
    """Logits on ``mesh["tp"]`` hold this rank's rows: the loss is over them."""
    import torch.distributed as dist

    dp, tp_mesh = mesh.shape[0], mesh["tp"]
    rank = mesh.get_local_rank("dp")
    checks = 0
    for ignore in (True, False):
        full, labels = _global_batch(dp, ignore)
        mine, my_labels = full[rank * ROWS:(rank + 1) * ROWS], labels[rank * ROWS:(rank + 1) * ROWS]
        for reduction in ("mean", "sum", "none"):
            g = torch.Generator().manual_seed(rank)  # the same on the ranks of a tp group
            grad = torch.randn(ROWS * SEQ, generator=g) if reduction == "none" else None
            want, want_grad = _reference(mine, my_labels, reduction, grad)
            given = {
                "plain": my_labels,  # this rank's labels, replicated over tp
                "dtensor": DTensor.from_local(my_labels, tp_mesh, [Replicate()]),
            }
            for kind, target in given.items():
                what = f"{kind} labels, reduction {reduction}"
                logits = sw.distribute_tensor(mine, tp_mesh, [Shard(-1)], src_data_rank=None)
                logits.requires_grad_()
                with loss_parallel():
                    loss = F.cross_entropy(
                        logits.flatten(0, 1), target.flatten(0, 1), reduction=reduction
                    )
                loss.backward(None if grad is None else sw.distribute_tensor(
                    grad, tp_mesh, [Replicate()], src_data_rank=None))
                assert loss.placements == (Replicate(),), kind
                torch.testing.assert_close(loss.full_tensor(), want, **TOL, msg=what)
                assert logits.grad.placements == (Shard(2),)
                torch.testing.assert_close(logits.grad.full_tensor(), want_grad, **TOL, msg=what)
                checks += 1
            if reduction == "mean" and not ignore:
                # the global loss is the mean over dp ranks of each rank's mean
                total = loss.to_local().detach().clone()
                dist.all_reduce(total)
                want_global, _ = _reference(full, labels, "mean")
                torch.testing.assert_close(total / dist.get_world_size(), want_global, **TOL)
                checks += 1
    return checks


def _root_mesh_checks(mesh: sw.DeviceMesh, weighted: bool) -> int:
    """Logits on the (dp, tp) mesh, rows on dp: this rank's labels are its rows' labels and the
    loss is over the global batch. A plain class weight is every class's (the same on every
    rank, as in PyTorch), not this rank's share."""
    dp, tp = mesh.shape
    rank, tp_rank = mesh.get_local_rank("dp"), mesh.get_local_rank("tp")
    full, labels = _global_batch(dp, ignore=True)
    weight = torch.rand(VOCAB, generator=torch.Generator().manual_seed(4)) if weighted else None
    rows = slice(rank * ROWS, (rank + 1) * ROWS)
    checks = 0
    for reduction in ("mean", "sum", "none"):
        g = torch.Generator().manual_seed(3)
        grad = torch.randn(dp * ROWS * SEQ, generator=g) if reduction == "none" else None
        want, want_grad = _reference(full, labels, reduction, grad, weight)
        for kind in ("plain", "dtensor"):
            piece = full[rows].chunk(tp, -1)[tp_rank].clone().requires_grad_()
            logits = DTensor.from_local(piece, mesh, [Shard(0), Shard(2)], shape=full.shape)
            target, given = labels[rows], weight
            if kind == "dtensor":
                target = DTensor.from_local(target, mesh, [Shard(0), Replicate()])
                if weighted:
                    given = DTensor.from_local(weight, mesh, [Replicate(), Replicate()])
            with loss_parallel():
                loss = F.cross_entropy(
                    logits.flatten(0, 1), target.flatten(0, 1), given, reduction=reduction
                )
            if reduction == "none":
                assert loss.placements == (Shard(0), Replicate())
                loss.backward(DTensor.from_local(grad.view(dp * ROWS, SEQ)[rows].flatten(),
                                                 mesh, [Shard(0), Replicate()]))
                torch.testing.assert_close(
                    loss.to_local(), want.view(dp * ROWS, SEQ)[rows].flatten(), **TOL
                )
            else:
                loss.backward()
                torch.testing.assert_close(loss.full_tensor(), want, **TOL, msg=kind)
            # PyTorch's per-rank view: this rank's piece of the logits gets its gradient
            want_piece = want_grad[rows].chunk(tp, -1)[tp_rank]
            torch.testing.assert_close(piece.grad, want_piece, **TOL, msg=kind)
            checks += 1
    return checks


class _LM(nn.Module):
    def __init__(self, vocab: int = VOCAB, dim: int = 6) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.norm = nn.LayerNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.output(self.norm(self.embed(tokens)))


def _fsdp_tp_checks(mesh: sw.DeviceMesh) -> int:
    """PyTorch's FSDP + TP program: each rank's loss over its rows, and parameter gradients
    (averaged over dp by FSDP) of the mean of the dp ranks' losses."""
    dp = mesh.shape[0]
    rank = mesh.get_local_rank("dp")
    torch.manual_seed(0)
    model = _LM()
    reference = copy.deepcopy(model)
    parallelize_module(model, mesh["tp"], {
        "embed": RowwiseParallel(input_layouts=Replicate()),
        "output": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
    })
    fully_shard(model, mesh=mesh["dp"])
    g = torch.Generator().manual_seed(9)
    tokens = torch.randint(0, VOCAB, (dp * ROWS, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (dp * ROWS, SEQ), generator=g)
    rows = slice(rank * ROWS, (rank + 1) * ROWS)

    logits = model(tokens[rows])
    assert logits.placements == (Shard(2),) and logits.device_mesh == mesh["tp"]
    with loss_parallel():
        loss = F.cross_entropy(logits.flatten(0, 1), labels[rows].flatten(0, 1))
    loss.backward()

    def ce(r: int) -> torch.Tensor:
        part = slice(r * ROWS, (r + 1) * ROWS)
        return F.cross_entropy(reference(tokens[part]).flatten(0, 1), labels[part].flatten(0, 1))

    mine = ce(rank)
    torch.testing.assert_close(loss.full_tensor(), mine.detach(), **TOL)
    (sum(ce(r) for r in range(dp)) / dp).backward()
    pairs = zip(model.named_parameters(), reference.parameters(), strict=True)
    for (name, p), ref in pairs:
        torch.testing.assert_close(p.grad.full_tensor(), ref.grad, **TOL, msg=name)
    return 1


def _error_checks(mesh: sw.DeviceMesh) -> int:
    dp, tp = mesh.shape
    full, labels = _global_batch(dp, ignore=False)
    rank, tp_rank = mesh.get_local_rank("dp"), mesh.get_local_rank("tp")
    piece = full[rank * ROWS:(rank + 1) * ROWS].chunk(tp, -1)[tp_rank]
    logits = DTensor.from_local(piece, mesh, [Shard(0), Shard(2)], shape=full.shape)
    flat = logits.flatten(0, 1)
    with loss_parallel():
        if dp > 1:  # every row's labels, given as this rank's
            with pytest.raises(sw.errors.InvalidArgumentError, match=r"shape \[12\].*\[6\]"):
                F.cross_entropy(flat, labels.flatten())
        with pytest.raises(sw.errors.InvalidArgumentError, match=r"shape \[5\]"):
            F.cross_entropy(flat, labels.flatten()[:5])
        other = DTensor.from_local(labels[:ROWS].flatten(), mesh["tp"], [Replicate()])
        with pytest.raises(sw.errors.MeshError, match="logits' mesh"):
            F.cross_entropy(flat, other)
        wrong = DTensor.from_local(labels[:ROWS], mesh, [Shard(0), Replicate()])
        with pytest.raises(
            sw.errors.InvalidArgumentError, match=rf"global shape \[{dp * ROWS}, 3\]"
        ):
            F.cross_entropy(flat, wrong)
    return 1


def _job(shapes: list[tuple[int, int]]) -> int:
    checks = 0
    for dp, tp in shapes:
        mesh = sw.init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
        checks += _tp_submesh_checks(mesh)
        checks += _root_mesh_checks(mesh, weighted=False)
        checks += _root_mesh_checks(mesh, weighted=True)
        checks += _fsdp_tp_checks(mesh)
        checks += _error_checks(mesh)
    return checks


@pytest.mark.parametrize(("world", "shapes"), [(2, [(2, 1), (1, 2)]), (4, [(2, 2)])])
def test_per_rank_labels_across_processes(world: int, shapes: list) -> None:
    counts = run_in_processes(_job, world, shapes, timeout=300)
    assert len(set(counts)) == 1 and counts[0] > 0


# ----- one process: the other two cases of the plain-tensor rule --------------------------------


def test_plain_labels_are_global_with_several_devices_in_one_process() -> None:
    mesh = sw.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    full, labels = _global_batch(2, ignore=True)
    want, want_grad = _reference(full, labels, "mean")
    logits = sw.distribute_tensor(full, mesh, [Shard(0), Shard(2)]).requires_grad_()
    with loss_parallel():
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(0, 1))
        one_rank = labels[:ROWS].flatten(0, 1)  # one rank's labels: not every row's
        with pytest.raises(
            sw.errors.InvalidArgumentError, match=r"\[6\] are the global labels.*\[12\]"
        ):
            F.cross_entropy(logits.flatten(0, 1), one_rank)
    loss.backward()
    torch.testing.assert_close(loss.full_tensor(), want, **TOL)
    torch.testing.assert_close(logits.grad.full_tensor(), want_grad, **TOL)


def test_plain_labels_are_the_replicas_in_strategy_run() -> None:
    """A per-replica thread acts for one device: its plain labels are that replica's."""
    strategy = swd.MirroredStrategy(["cpu:0", "cpu:1"])
    mesh = strategy.extended.mesh
    full, labels = _global_batch(1, ignore=True)
    want, _ = _reference(full, labels, "sum")

    def per_replica(piece: torch.Tensor) -> tuple[torch.Tensor, str]:
        logits = DTensor.from_local(piece, mesh, [Shard(2)])
        with loss_parallel():
            loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
            try:
                F.cross_entropy(logits.flatten(0, 1), labels[:1].flatten(), reduction="sum")
            except sw.errors.InvalidArgumentError as err:
                return loss.to_local(), str(err)
        return loss.to_local(), ""

    losses, errors = strategy.run(per_replica, args=(swd.PerReplica(list(full.chunk(2, -1))),))
    for got, message in zip(losses.values, errors.values, strict=True):
        torch.testing.assert_close(got, want, **TOL)
        assert "this rank's labels" in message and "[3]" in message and "[6]" in message
