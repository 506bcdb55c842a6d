"""A data-parallel unit's gradient reduction, once per backward: ``fully_shard``'s packed
reduce-scatters (``Packed``) and ``replicate``'s gradient buckets (``Buckets``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

from ..comm.native import Pending
from ..dtensor import DTensor, local_of
from ..mesh import DeviceMesh
from ..placements import Partial, Replicate
from ..redistribute import move
from ..torch_compat import queue_autograd_callback
from ..tracing import eager_under_dynamo
from .data_parallel import reduce_packed, reducible_packed


class Unit(Protocol):
    """What a reducer reads of its ``dp_unit.DataParallelUnit``."""

    slots: Sequence[Any]
    requires_all_reduce: bool
    regathered: dict[int, Any]

    def pack_key(self, k: int) -> tuple | None: ...

    def reduce(self, param: torch.Tensor, slot: Any) -> None: ...


class Packed:
    """``fully_shard``'s gradient reduction: the gradients of slots with a packing key wait
    until every one of them has arrived (or backward ends), then those pending alike over
    the same dim go in one packed reduce-scatter (``data_parallel.reduce_packed``), issued
    and left in flight while backward goes on (FSDP2's reduce-scatter stream), its gradients
    assigned when backward ends; the others are reduced on their own as they arrive."""

    def __init__(self, unit: Unit) -> None:
        self.unit = unit
        self.waiting: dict[int, torch.Tensor] = {}
        self.expected = 0
        self.pending = False
        self.issued: list[Pending[None]] = []

    def ready(self, k: int, param: torch.Tensor) -> None:
        unit = self.unit
        if unit.pack_key(k) is None or not unit.requires_all_reduce:
            unit.reduce(param, unit.slots[k])
            return
        if not self.pending:
            self.pending = True
            self.expected = sum(
                1 for j, slot in enumerate(unit.slots)
                if slot.stored.requires_grad and unit.pack_key(j) is not None
            )
            queue_autograd_callback(self._finish)
        self.waiting[k] = param
        if len(self.waiting) == self.expected:
            self._flush()

    @eager_under_dynamo
    def _finish(self) -> None:
        if self.waiting:
            self._flush()
        issued, self.issued = self.issued, []
        for reduction in issued:
            reduction.finish()
        self.pending = False

    def discard(self) -> None:
        """Forget the gradients waiting (an aborted backward's)."""
        self.waiting, self.pending = {}, False

    def _flush(self) -> None:
        entries, self.waiting = self.waiting, {}
        unit = self.unit
        unit.regathered.clear()
        groups: dict[tuple, list[int]] = {}
        for k, param in entries.items():
            slot = unit.slots[k]
            op = reducible_packed(param, slot.storage, slot.packed)
            if op is None:
                unit.reduce(param, slot)
            else:
                key = (param.grad.device_mesh, slot.packed, op, param.grad.dtype)
                groups.setdefault(key, []).append(k)
        for (_mesh, d, op, _dtype), ks in groups.items():
            self.issued.append(reduce_packed(
                [entries[k] for k in ks], [unit.slots[k].storage for k in ks], d, op,
                async_op=True))


class Buckets:
    """``replicate``'s gradient reduction: when every parameter of a bucket has its gradient,
    one all-reduce per data-parallel dim, reduce op and dtype sums their flattened pieces.
    Buckets are filled in reverse parameter order (roughly the order backward produces
    gradients); those left at the end of backward are reduced then."""

    def __init__(self, unit: Unit, cap: int) -> None:
        self.unit = unit
        self.buckets: list[list[int]] = []
        size = cap
        for k in reversed(range(len(unit.slots))):
            param = unit.slots[k].stored
            if not param.requires_grad:
                continue
            nbytes = local_of(param).pieces[0].numel() * param.element_size()  # one device's piece
            if size + nbytes > cap and (not self.buckets or self.buckets[-1]):
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(k)
            size += nbytes
        self.bucket_of = {k: b for b, ks in enumerate(self.buckets) for k in ks}
        self.waiting: list[list[tuple[int, torch.Tensor]]] = [[] for _ in self.buckets]
        self.pending = False

    def ready(self, k: int, param: torch.Tensor) -> None:
        if not self.pending:
            self.pending = True
            queue_autograd_callback(self._finish)
        b = self.bucket_of[k]
        self.waiting[b].append((k, param))
        if len(self.waiting[b]) == len(self.buckets[b]):
            self._flush(b)

    @eager_under_dynamo
    def _finish(self) -> None:
        for b in range(len(self.buckets)):
            if self.waiting[b]:
                self._flush(b)
        self.pending = False

    def discard(self) -> None:
        """Forget the gradients waiting (an aborted backward's)."""
        self.waiting, self.pending = [[] for _ in self.buckets], False

    def _flush(self, b: int) -> None:
        entries, self.waiting[b] = self.waiting[b], []
        groups: dict[tuple, list[torch.Tensor]] = {}
        for k, p in entries:
            grad, slot = p.grad, self.unit.slots[k]
            dp = slot.dp
            if isinstance(grad, DTensor):
                ops = tuple(grad.placements[d] for d in dp.dims)
                if all(isinstance(q, Partial) for q in ops) and len(set(ops)) == 1:
                    more: tuple[tuple[int, str], ...] = ()
                    if self.unit.requires_all_reduce:  # pending over other dims, stored whole
                        more = tuple(
                            (d, q.reduce_op) for d, q in enumerate(grad.placements)
                            if d not in dp.dims and isinstance(q, Partial)
                            and isinstance(slot.storage[d], Replicate)
                        )
                    key = (dp.mesh, dp.dims, ops[0].reduce_op, grad.dtype)
                    groups.setdefault(key, []).append((p, more))
        for (mesh, dims, op, _dtype), members in groups.items():
            members.sort(key=lambda m: m[1])  # those pending alike side by side
            self._all_reduce([p for p, _ in members], mesh, dims, op, [m for _, m in members])
        for k, p in entries:
            self.unit.reduce(p, self.unit.slots[k])

    def _all_reduce(
        self, params: list[torch.Tensor], mesh: DeviceMesh, dims: tuple[int, ...], op: str,
        more: list[tuple[tuple[int, str], ...]],
    ) -> None:
        """One all-reduce per data-parallel dim of the flattened gradients of ``params``; then
        one per (mesh dim, reduce op) in ``more`` (per parameter: the other dims its gradient
        is pending over and stored whole on, such as a sequence-parallel norm's weight over
        'tp') of the run of parameters that share it (``params`` lists them side by side)."""
        grads: list[DTensor] = [p.grad for p in params]

        def what() -> str:
            return f"replicate's gradient bucket of {len(grads)} tensors"

        reduced = move.all_reduce_flat(what, mesh, dims, [local_of(g).pieces for g in grads], op)
        start = 0
        for j in range(len(grads) + 1):
            if j < len(grads) and (j == start or more[j] == more[start]):
                continue
            for d, run_op in more[start]:
                reduced[start:j] = move.all_reduce_flat(what, mesh, (d,), reduced[start:j], run_op)
            start = j
        for p, g, extra, pieces in zip(params, grads, more, reduced, strict=True):
            placements = list(g.placements)
            for d in (*dims, *(d for d, _ in extra)):
                placements[d] = Replicate()
            p.grad = DTensor(pieces, local_of(g).spec.with_placements(placements))

