"""Collectives on the process group's own collective operations, for device groups with one
device per process (classic SPMD, the common case): each collective of a group is one call of
``torch.distributed``'s functional collectives (``_c10d_functional``: ``all_gather_into_tensor``,
``reduce_scatter_tensor``, ``all_reduce``, ``all_to_all_single``, ``broadcast``, then
``wait_tensor``), the ops PyTorch DTensor issues and the compiler schedules: on NCCL they use its
ring and tree algorithms and nothing waits on the host.

No shape travels: the shapes of every member's piece come from the spec every process holds
(``shapes``: device id -> its component's shape; without it, every member's piece has this
process's shape). Uneven pieces are padded to the largest and cut after, as PyTorch pads.
Nothing is read back to the host on this path. Under ``settings.WAIT_AT_FIRST_USE`` (eager
``redistribute(async_op=True)``) results are not waited here: each is torch's
``AsyncCollectiveTensor``, as PyTorch's functional collectives return, whose view ops (the cuts
and joins after a collective) stay unwaited and whose first other op waits, so the data moves
while the caller computes. ``all_gather`` may also return before the wait (``wait=False``): a
``Pending`` whose ``finish()`` waits (fully_shard's prefetch).

Before (on CPU) or beside (on an accelerator) each collective, the processes of a group agree
(``agreement.py``): a fingerprint of what each is about to do, exchanged on a CPU side group, so
a divergent program raises ``CollectiveMismatchError`` on every rank instead of a wrong value
(or gloo's abort on messages of another size).

Reductions reduce with the backend by default, as PyTorch does: within float rounding of the
embedded run, in the order the backend adds. ``deterministic`` mode (``set_deterministic``)
combines in coordinate order on the same backend collectives (an ``all_to_all_single`` of the
ring chunks, the terms combined locally, an ``all_gather_into_tensor`` of the reduced chunks):
the bits of the embedded run, at the bytes of a ring all_reduce. Float max and min, and dtypes
the backends do not reduce, always take that path (the backends' max and min drop NaN)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from math import prod
from typing import Any, Generic, TypeVar
from weakref import ref

import torch
import torch.distributed as dist

from .. import settings
from ..caches import PER_GROUP, cached
from ..errors import CollectiveError, CollectiveMismatchError, CollectiveTimeoutError
from ..mesh import DeviceMesh
from ..torch_compat import (
    AsyncCollectiveTensor,
    c10d_functional,
    len_torch_dispatch_stack,
    unwaited_collectives,
)
from . import agreement, protocol
from .accounting import all_reduce_received
from .call import Call, Group, Traffic, as_bytes, first_local, group_for_ranks
from .reduction import combine, finish

# device id -> the shape of its component, from the spec; None: unknown, learnt from the peers
# (a metadata gather on the side group: the generic collectives, never the hot path)
Shapes = Callable[[int], Sequence[int]] | None

_functional = c10d_functional
T = TypeVar("T")
U = TypeVar("U")
# dtypes both gloo and NCCL reduce (complex ones as pairs of reals, for sums)
_BACKEND_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8,
                   torch.uint8, torch.int32, torch.int64)
_INTEGERS = (torch.int8, torch.uint8, torch.int32, torch.int64)


def _backend_reduces(op: str, dtype: torch.dtype) -> bool:
    """Whether the backend's own reduction serves ``op`` on ``dtype`` outside deterministic
    mode: sums and averages of the dtypes it reduces (complex as real pairs), max and min of
    integers (no NaN, which the backends' max and min drop)."""
    if settings.DETERMINISTIC.get():
        return False
    if op in ("sum", "avg"):
        return dtype in _BACKEND_DTYPES or dtype in (torch.complex64, torch.complex128)
    return op in ("max", "min") and dtype in _INTEGERS


@cached(PER_GROUP)
def _one_device_per_process(mesh: DeviceMesh, mesh_dim: int) -> bool:
    """Every group along ``mesh_dim`` has its members in distinct processes (the same answer
    in every process, so all take the same path)."""
    return all(
        len({mesh.owner_of(d) for d in members}) == len(members)
        for members in mesh.groups(mesh_dim)
    )


def applies(mesh: DeviceMesh, mesh_dim: int) -> bool:
    """Whether the backend's collectives serve the cross-process groups of ``mesh_dim``: every
    such group has one device per process."""
    return _one_device_per_process(mesh, mesh_dim)


class _Backend:
    """One cross-process group of a call, seen from its single local member ``k``."""

    def __init__(self, call: Call, group: Group) -> None:
        members, indices = group
        self.call, self.group, self.members, self.n = call, group, members, len(members)
        self.ranks = call.ranks[members]
        self.pg = group_for_ranks(self.ranks)
        self.name = self.pg.group_name
        self.k = next(k for k, i in enumerate(indices) if i is not None)
        self.local = first_local(group)
        # the backend orders a group by rank: member j is at position rank_of[j] there
        self.owners = [call.owner(d) for d in members]
        self.rank_of = [self.ranks.index(r) for r in self.owners]
        self.member_at = sorted(range(self.n), key=self.rank_of.__getitem__)

    def _fields(self, fields: dict[str, object]) -> tuple[dict[str, object], dict]:
        call = self.call
        return ({"collective": call.kind + call.detail, "sequence": call.seq[self.ranks],
                 "dtype": str(call.sample.dtype), **fields}, call.fields(self.group))

    def agree(self, device: torch.device, **fields: object) -> Callable[[], None]:
        """Start this group's agreement on ``fields`` (and the call's); returns the check to
        finish it (before the data on CPU, where gloo aborts on messages of another size;
        after enqueueing it on an accelerator, so the host never waits on the device)."""
        if _tracing():  # a compiled graph holds the collectives alone
            return _checked
        check = agreement.start(self.ranks, *self._fields(fields), self.call.what)
        self.call.traffic.meta += 8 * (self.n - 1)
        if device.type == "cpu":
            check()
            return _checked
        return check

    def learn(self, own: object, **fields: object) -> list:
        """Every member's ``own`` (shapes no spec gave), in member order, gathered with the
        agreement on ``fields`` (the generic collectives only)."""
        by_rank = agreement.gather(self.ranks, *self._fields(fields), own, self.call.what)
        self.call.traffic.meta += 8 * (self.n - 1) + sum(
            len(repr(theirs)) for j, theirs in enumerate(by_rank) if j != self.rank_of[self.k])
        return [by_rank[self.rank_of[j]] for j in range(self.n)]

    def run(self, op: Callable[..., torch.Tensor], *args: object) -> torch.Tensor:
        """Issue one functional collective ``op(*args, group name)`` and wait for its result (a
        stream wait on an accelerator, not a host one), or leave it to wait at first use
        (``wait``); failures and the timeout become shardwise's errors."""
        return self.wait(self.issue(op, *args))

    def issue(self, op: Callable[..., torch.Tensor], *args: object) -> torch.Tensor:
        """``run`` without the wait: the collective's output, valid once ``wait`` returns."""
        gloo_gather = (op is _functional.all_gather_into_tensor and not _tracing()
                       and _is_gloo(self.pg))
        with self._errors():
            if gloo_gather:
                _wait_gloo_gather(self.name)
            issued = op(*args, self.name)
        if gloo_gather:
            _gloo_gathers.get()[self.name] = ref(issued)
        return issued

    def wait(self, issued: torch.Tensor, now: bool = False) -> torch.Tensor:
        """Wait for a collective that ``issue`` started; under ``WAIT_AT_FIRST_USE`` (eager)
        and not ``now``, its result unwaited instead, an ``AsyncCollectiveTensor`` that waits
        at first use."""
        if not now and settings.WAIT_AT_FIRST_USE.get() and not _tracing():
            return AsyncCollectiveTensor(issued)
        with self._errors():
            return _functional.wait_tensor(issued)

    @contextmanager
    def _errors(self) -> Iterator[None]:
        try:
            yield
        except RuntimeError as err:
            text = str(err)
            kind = CollectiveTimeoutError if "timed out" in text.lower() else CollectiveError
            raise kind(f"{self.call.what()} failed: {text}; another process probably failed, "
                       f"diverged or timed out first") from err

    def all_gather_bytes(self, mine: torch.Tensor, sizes: Sequence[int]) -> list[torch.Tensor]:
        """Member j's bytes (``sizes[j]`` of them) from every member, by one
        ``all_gather_into_tensor``, each padded to the largest; views of one fresh buffer."""
        return self.start_all_gather_bytes(mine, sizes)()

    def start_all_gather_bytes(self, mine: torch.Tensor, sizes: Sequence[int]
                               ) -> Callable[[], list[torch.Tensor]]:
        """``all_gather_bytes`` issued now; returns the call that waits for it and cuts the
        pieces out."""
        width = max(sizes)
        if width == 0:
            return lambda: [mine[:0]] * self.n
        if mine.numel() < width:
            padded = mine.new_zeros(width)
            padded[: mine.numel()] = mine
            mine = padded
        issued = self.issue(_functional.all_gather_into_tensor, mine, self.n)
        self.call.traffic.payload += sum(sizes) - sizes[self.k]
        self.call.traffic.meta += width * (self.n - 1) - sum(sizes) + sizes[self.k]  # padding
        at = [self.rank_of[j] * width for j in range(self.n)]

        def pieces() -> list[torch.Tensor]:
            out = self.wait(issued)
            return [out[a : a + s] for a, s in zip(at, sizes, strict=True)]

        return pieces

    def all_to_all_bytes(self, send: Sequence[torch.Tensor], receive: Sequence[int]
                         ) -> list[torch.Tensor]:
        """Member j gets ``send[j]`` (any dtype and strides, sent as its bytes); returns what
        each member sent here (``receive[j]`` bytes from member j), by one
        ``all_to_all_single``: views of one fresh buffer in member order."""
        flat = [as_bytes(send[j]) for j in self.member_at]
        packed = _flat(flat)
        arriving = [receive[j] for j in self.member_at]
        out = self.run(_functional.all_to_all_single, packed, arriving,
                       [t.numel() for t in flat])
        self.call.traffic.payload += sum(receive) - receive[self.k]
        by_rank = out.split(arriving)
        return [by_rank[self.rank_of[j]] for j in range(self.n)]

    def ordered_reduce_scatter(self, terms: Sequence[torch.Tensor], op: str) -> torch.Tensor:
        """Member j's reduction of ``terms[j]`` of every member in coordinate order (the
        embedded run's bits): an all_to_all of the terms, combined here."""
        shape, dtype = terms[self.k].shape, terms[self.k].dtype
        got = self.all_to_all_bytes(terms, [_nbytes(shape, dtype)] * self.n)
        reduced = combine([_typed(t, dtype, shape) for t in got], op)
        return finish(reduced, op, self.n, dtype)


def _tracing() -> bool:
    """Whether a tracer (torch.compile's) records this collective instead of running it: then
    it is the functional collective and its wait alone, with no agreement and no view of a
    buffer's storage."""
    return len_torch_dispatch_stack() > 0 or torch.compiler.is_compiling()


# gloo group name -> its last all_gather_into_tensor, perhaps in flight: two in flight on one
# gloo group corrupt the process's heap (torch 2.13, measured: malloc aborts within 3,000 steps
# of three overlapping gathers; one gather beside any other collectives ran clean)
_gloo_gathers: settings.ProcessLocal[dict[str, ref]] = settings.ProcessLocal(dict)


def _is_gloo(pg: dist.ProcessGroup) -> bool:
    return dist.get_backend(pg) == "gloo"


def _wait_gloo_gather(name: str) -> None:
    """Wait for the gather in flight on gloo group ``name``, if any (a waited one: no-op)."""
    held = _gloo_gathers.get().pop(name, None)
    issued = held() if held is not None and unwaited_collectives() else None
    if issued is not None:  # alive while any view of it is
        _functional.wait_tensor(issued)


def _checked() -> None:
    """The check of a collective whose agreement is done (or, traced, not made)."""


def _typed(raw: torch.Tensor, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    return raw.view(dtype).view(tuple(shape))


def _nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    return prod(shape) * dtype.itemsize


def _adjacent(pieces: Sequence[torch.Tensor]) -> bool:
    """Whether ``pieces`` lie one after the other, dense, in one storage."""
    first = pieces[0]
    offset = first.storage_offset()
    for p in pieces:
        if not p.is_contiguous() or p.untyped_storage().data_ptr() != first.untyped_storage(
        ).data_ptr() or p.storage_offset() != offset:
            return False
        offset += p.numel()
    return True


def _flat(pieces: Sequence[torch.Tensor]) -> torch.Tensor:
    """``pieces`` one after the other as one flat tensor: a view where they already lie so
    (the even chunks of a dense tensor along its first dim), else one copy."""
    first = pieces[0]
    if len(pieces) == 1:
        return first.reshape(-1)
    if not _tracing() and not isinstance(first, AsyncCollectiveTensor) and _adjacent(pieces):
        return first.as_strided((sum(p.numel() for p in pieces),), (1,),
                                first.storage_offset())
    return torch.cat([p.reshape(-1) for p in pieces])


class Received(list):
    """Pieces that a collective received side by side into one fresh buffer, which nothing
    else holds: ``join`` may return a view of it instead of copying them."""


def join(pieces: Sequence[torch.Tensor], dim: int) -> torch.Tensor:
    """``torch.cat(pieces, dim)``, without the copy when ``pieces`` is ``Received`` and they
    lie in order along ``dim`` (an all_gather or all_to_all along the first non-trivial dim):
    then a view of their buffer."""
    lazy = isinstance(pieces[0], AsyncCollectiveTensor)  # not waited: the view stays so
    raw = [p.elem for p in pieces] if lazy else pieces
    first = raw[0]
    if (
        isinstance(pieces, Received)
        and not _tracing()
        and len(pieces) > 1
        and all(
            prod(p.shape[:dim]) == 1
            and p.shape[:dim] + p.shape[dim + 1 :] == first.shape[:dim] + first.shape[dim + 1 :]
            for p in raw
        )
        and _adjacent(raw)
    ):
        shape = list(first.shape)
        shape[dim] = sum(p.shape[dim] for p in raw)
        out = first.new_empty(0).set_(first.untyped_storage(), first.storage_offset(), shape)
        return AsyncCollectiveTensor(out) if lazy else out
    return torch.cat(list(pieces), dim)


class Pending(Generic[T]):
    """A result whose collectives are issued and not yet waited for (PyTorch's functional
    collectives before their ``wait_tensor``): ``finish()`` waits, once, and returns it."""

    def __init__(self, finish: Callable[[], T]) -> None:
        self._finish: Callable[[], T] | None = finish
        self._value: T | None = None

    def finish(self) -> T:
        if self._finish is not None:
            self._value, self._finish = self._finish(), None
        return self._value  # type: ignore[return-value]

    def then(self, fn: Callable[[T], U]) -> Pending[U]:
        """The pending result of ``fn`` applied to this one once it is finished."""
        return Pending(lambda: fn(self.finish()))


def _call(kind: str, mesh: DeviceMesh, mesh_dim: int, groups: Sequence[Group],
          sample: torch.Tensor, detail: str = "") -> Call:
    return Call(kind, mesh, mesh_dim, groups, sample, detail, transport=protocol.NATIVE)


# ----- collectives (same signatures and results as distributed.py's, plus ``shapes``) ---------


def all_gather(
    mesh: DeviceMesh, mesh_dim: int, groups: Sequence[Group], components: Sequence[torch.Tensor],
    shapes: Shapes = None, wait: bool = True,
) -> tuple[dict[int, Any], Traffic]:
    """Every member's piece, as views of one buffer that one ``all_gather_into_tensor`` filled
    (``wait=False``: each result a ``Pending``, the collective issued after the agreement)."""
    sample = components[0]
    call = _call("all_gather", mesh, mesh_dim, groups, sample)
    call.check(lambda group: {"ndim": sample.ndim})
    out: dict[int, Any] = {}
    for group in sorted(groups):
        g = _Backend(call, group)
        piece = components[g.local]
        if shapes is None:
            every = [tuple(s) for s in g.learn(list(piece.shape))]
            finish_check = _checked
        else:
            every = [tuple(shapes(d)) for d in g.members]
            finish_check = g.agree(sample.device, shapes=every)
        if tuple(piece.shape) != every[g.k]:
            raise CollectiveMismatchError(
                f"{call.what()}: this process's piece has shape {list(piece.shape)} where the "
                f"spec says {list(every[g.k])}")
        got = g.start_all_gather_bytes(as_bytes(piece),
                                       [_nbytes(s, sample.dtype) for s in every])

        def received(got: Callable[[], list[torch.Tensor]] = got,
                     finish_check: Callable[[], None] = finish_check,
                     every: list[tuple[int, ...]] = every) -> Received:
            pieces = got()
            finish_check()
            return Received(_typed(p, sample.dtype, s) for p, s in zip(pieces, every,
                                                                       strict=True))

        result = Pending(received)
        out[g.local] = result.finish() if wait else result
    return out, call.traffic


def all_gather_tensor(
    mesh: DeviceMesh, mesh_dim: int, groups: Sequence[Group], components: Sequence[torch.Tensor],
    gather_dim: int, shapes: Shapes = None, wait: bool = True,
) -> tuple[dict[int, Any], Traffic]:
    """``all_gather`` joined along ``gather_dim``: a view of the gathered buffer where the pieces
    lie in order along it (even pieces along the first non-trivial dim), else one copy
    (``wait=False``: each a ``Pending``)."""
    gathered, traffic = all_gather(mesh, mesh_dim, groups, components, shapes, wait)
    if wait:
        return {i: join(pieces, gather_dim) for i, pieces in gathered.items()}, traffic
    return {i: pending.then(lambda pieces: join(pieces, gather_dim))
            for i, pending in gathered.items()}, traffic


def all_to_all(
    mesh: DeviceMesh, mesh_dim: int, groups: Sequence[Group],
    pieces: Sequence[Sequence[torch.Tensor]], receive_shapes: Callable[[int], Sequence[
        Sequence[int]]] | None = None,
) -> tuple[dict[int, list[torch.Tensor]], Traffic]:
    """``pieces[i][k]`` goes to member k by one ``all_to_all_single``; what member j sends
    here is shaped ``receive_shapes(local index)[j]`` (from the spec), else learnt from the
    peers."""
    sample = pieces[0][0]
    call = _call("all_to_all", mesh, mesh_dim, groups, sample)
    call.check(lambda group: {"ndim": sample.ndim})
    out = {}
    for group in sorted(groups):
        g = _Backend(call, group)
        mine = pieces[g.local]
        if receive_shapes is None:
            rows = g.learn([list(p.shape) for p in mine])
            expected = [tuple(row[g.k]) for row in rows]
            finish_check = _checked
        else:
            expected = [tuple(s) for s in receive_shapes(g.local)]
            # the spec being moved (the call's fields) stands for the pieces' shapes
            finish_check = g.agree(sample.device, ndim=sample.ndim)
        got = g.all_to_all_bytes(mine, [_nbytes(s, sample.dtype) for s in expected])
        finish_check()
        out[g.local] = Received(_typed(r, sample.dtype, s) for r, s in zip(got, expected,
                                                                           strict=True))
    return out, call.traffic


def reduce_scatter(
    mesh: DeviceMesh,
    mesh_dim: int,
    groups: Sequence[Group],
    pieces: Sequence[Sequence[torch.Tensor]],
    op: str,
    wait: bool = True,
) -> tuple[dict[int, Any], Traffic]:
    """Member k gets the reduction of every member's ``pieces[.][k]``: one
    ``reduce_scatter_tensor`` of the pieces padded to the largest, or, in coordinate order, an
    all_to_all of the pieces combined here (``wait=False``: each result a ``Pending``, the
    backend's collective issued and not waited; an average is divided when it is finished)."""
    sample = pieces[0][0]
    call = _call("reduce_scatter", mesh, mesh_dim, groups, sample, f"({op})")
    call.check(lambda g: {"piece shapes": [list(p.shape) for p in pieces[first_local(g)]]})
    out: dict[int, Any] = {}
    for group in sorted(groups):
        g = _Backend(call, group)
        mine = pieces[g.local]
        finish_check = g.agree(sample.device, op=op, shapes=[list(p.shape) for p in mine])
        width = max(p.numel() for p in mine)
        if not _backend_reduces(op, sample.dtype) or width == 0:
            value = (g.ordered_reduce_scatter(mine, op) if width else
                     finish(mine[g.k].clone(), op, g.n, sample.dtype))
            finish_check()
            out[g.local] = value if wait else Pending(lambda value=value: value)
            continue
        ordered = [mine[j] for j in g.member_at]  # the backend scatters in rank order
        if all(p.numel() == width for p in ordered):
            flat = _flat(ordered)
        else:
            flat = mine[0].new_zeros(g.n * width)
            for at, p in enumerate(ordered):
                flat[at * width : at * width + p.numel()] = p.reshape(-1)
        real = torch.view_as_real(flat).reshape(-1) if flat.is_complex() else flat
        issued = g.issue(_functional.reduce_scatter_tensor, real,
                         "sum" if op == "avg" else op, g.n)
        item = sample.element_size()
        call.traffic.payload += sum(p.numel() for p in mine) * item - mine[g.k].numel() * item
        call.traffic.meta += (g.n - 1) * width * item - call.traffic.payload  # padding

        def reduced(g: _Backend = g, issued: torch.Tensor = issued, complex_: bool =
                    flat.is_complex(), shape: torch.Size = mine[g.k].shape,
                    finish_check: Callable[[], None] = finish_check, waited: bool = wait
                    ) -> torch.Tensor:
            value = g.wait(issued, now=not waited)
            if complex_:
                value = torch.view_as_complex(value.view(-1, 2))
            finish_check()
            return finish(value[: prod(shape)].view(shape), op, g.n, sample.dtype)

        out[g.local] = reduced() if wait else Pending(reduced)
    return out, call.traffic


def _chunks(numel: int, n: int) -> list[tuple[int, int]]:
    """(start, stop) of the ring chunks of a flat tensor (the accounting's all_reduce model)."""
    size = -(-numel // n) if numel else 0
    return [(min(k * size, numel), min((k + 1) * size, numel)) for k in range(n)]


def all_reduce(
    mesh: DeviceMesh,
    mesh_dim: int,
    groups: Sequence[Group],
    components: Sequence[torch.Tensor],
    op: str,
) -> tuple[dict[int, torch.Tensor], Traffic]:
    """One backend ``all_reduce``; in coordinate order (deterministic mode, float max/min,
    dtypes the backend does not reduce): member k reduces ring chunk k of every component
    (all_to_all_single), then the reduced chunks are gathered (all_gather_into_tensor)."""
    sample = components[0]
    call = _call("all_reduce", mesh, mesh_dim, groups, sample, f"({op})")
    call.check(lambda group: {"shape": list(components[first_local(group)].shape)})
    out = {}
    item = sample.element_size()
    for group in sorted(groups):
        g = _Backend(call, group)
        component = components[g.local]
        finish_check = g.agree(sample.device, op=op, shape=list(component.shape))
        if component.numel() == 0:
            out[g.local] = finish(component.clone(), op, g.n, sample.dtype)
        elif _backend_reduces(op, sample.dtype):
            dense = component.contiguous()
            real = torch.view_as_real(dense) if dense.is_complex() else dense
            result = g.run(_functional.all_reduce, real, "sum" if op == "avg" else op)
            if dense.is_complex():
                result = torch.view_as_complex(result)
            call.traffic.payload += all_reduce_received(dense.numel(), item, g.n, g.k)
            out[g.local] = finish(result, op, g.n, sample.dtype)
        else:
            bounds = _chunks(component.numel(), g.n)
            flat = component.contiguous().reshape(-1)
            # member k gets ring chunk k of every member: of one size, even where chunks differ
            reduced = g.ordered_reduce_scatter([flat[a:b] for a, b in bounds], op)
            got = g.all_gather_bytes(as_bytes(reduced), [(b - a) * item for a, b in bounds])
            out[g.local] = torch.cat(got).view(sample.dtype).view(component.shape)
        finish_check()
    return out, call.traffic


def broadcast(
    mesh: DeviceMesh,
    mesh_dim: int,
    groups: Sequence[Group],
    components: Sequence[torch.Tensor],
    src: int,
) -> tuple[dict[int, torch.Tensor], Traffic]:
    """Member ``src``'s component, by one backend broadcast (of its bytes, any dtype)."""
    sample = components[0]
    call = _call("broadcast", mesh, mesh_dim, groups, sample, f"(src={src})")
    call.check(lambda group: {"shape": list(components[first_local(group)].shape)})
    out = {}
    for group in sorted(groups):
        g = _Backend(call, group)
        component = components[g.local]
        finish_check = g.agree(sample.device, src=src, shape=list(component.shape))
        if g.k == src or component.numel() == 0:
            value = component
            if component.numel():  # waited here: nothing else holds the result
                with settings.WAIT_AT_FIRST_USE.override(False):
                    g.run(_functional.broadcast, as_bytes(component), g.owners[src])
        else:
            received = g.run(_functional.broadcast, as_bytes(component), g.owners[src])
            value = received.view(sample.dtype).view(component.shape)
            call.traffic.payload += received.numel()
        finish_check()
        out[g.local] = value
    return out, call.traffic

