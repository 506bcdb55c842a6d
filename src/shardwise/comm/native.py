"""Collectives on ``torch.distributed``'s own operations, for device groups with one device per
process (classic SPMD, the common case), received into fresh buffers whose views are the
results (``join`` even turns pieces received side by side into one tensor without a copy).

First the processes of a group swap the protocol's header (``protocol.py``: collective,
sequence number, fingerprint of the spec being moved, dtype, reduce op, and the shapes of the
pieces each will send), so a divergent program raises ``CollectiveMismatchError`` on every rank
before gloo sees messages of the wrong size (it aborts the process on those); the shapes in the
header also size the receive buffers. A training loop repeats its collectives, so each set of
processes learns which collective follows which (``protocol.Forecast``): once a successor has
repeated, its pieces (up to ``INLINE_MAX`` bytes) follow the header at once, small ones in the
header's message, large ones as a message of their own received in place, and a repeated
collective takes one round trip instead of two. The forecast comes from headers every process
agreed on, so every message has the same size in every process even when their programs
diverge; a wrong forecast only costs the padding, and the data follows as without one.

The data, when it did not come with the header: all_gather point to point into the result
(gloo's all_gather copies through a flat buffer of the whole result, and measured slower at
every size); all_to_all point to point too, each piece received into its slot of the result
and made dense once on its way out (``all_to_all_single`` packs them all into one buffer, and
copies the own piece once more); broadcast by the backend's broadcast. Reductions stay
bit-identical to the embedded transport, which combines terms in coordinate order
(``reduction.combine``): an all_to_all brings member k chunk k of every term, which it
combines in that order, and all_reduce all-gathers the reduced chunks (the bytes of a ring
all_reduce), the terms landing in the result's own memory; reduce_scatter is the first half.
Two processes exchange whole components (a ring's bytes) when forecast, in one round trip,
and combine them. Otherwise the backend's own all_reduce, after the headers, serves wherever
its bits cannot depend on the order it adds in: integers (associative, no NaN, on which its
max and min differ from torch's; over more than two processes even when forecast, the waits
of the chunks' exchange and gather), and a sum of two terms (a + b == b + a) in a dtype it
adds exactly as torch does. Against the forecast exchange it measured no faster at 4 MiB and
slower below (the header's extra round trip)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import lru_cache
from math import prod

import torch
import torch.distributed as dist

from ..errors import CollectiveError, CollectiveMismatchError
from ..mesh import DeviceMesh
from . import protocol
from .accounting import all_reduce_received
from .distributed import Call, Group, Traffic, as_bytes, first_local, group_for_ranks, wait_all
from .protocol import HEADER_TAG, INLINE_MAX, MAX_NDIM, OPS
from .reduction import combine, finish
from .wire import post_receive, post_send

# dtypes whose sum of two terms the backend computes exactly as ``reduction.combine`` does (half
# types accumulate in float32 there; max/min differ on NaN)
_PAIR_EXACT = (torch.float32, torch.float64, torch.int32, torch.int64)
# dtypes whose sum, max and min the backend computes as ``reduction.combine`` does in any order
# and over any number of terms: integers (addition wraps alike and is associative; no NaN, on
# which the backend's max and min differ from torch's) that gloo and NCCL both reduce
_ORDER_FREE = (torch.int8, torch.uint8, torch.int32, torch.int64)
_BACKEND_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
                "min": dist.ReduceOp.MIN}


def _backend_reduces(op: str, dtype: torch.dtype, n: int) -> bool:
    """Whether the backend's own all_reduce of ``n`` terms gives the bits of the coordinate
    order: integers at any count; two terms summed (a + b == b + a) in a dtype it adds as
    torch does (avg is that sum, divided after)."""
    if dtype in _ORDER_FREE:
        return op in ("sum", "max", "min")
    return n == 2 and op in ("sum", "avg") and dtype in _PAIR_EXACT


@lru_cache(maxsize=1024)
def _one_device_per_process(mesh: DeviceMesh, mesh_dim: int) -> bool:
    """Every group along ``mesh_dim`` has its members in distinct processes (the same answer
    in every process, so all take the same path)."""
    return all(
        len({mesh.owner_of(d) for d in members}) == len(members)
        for members in mesh.groups(mesh_dim)
    )


def applies(mesh: DeviceMesh, mesh_dim: int, sample: torch.Tensor) -> bool:
    """Whether the native collectives serve the cross-process groups of ``mesh_dim``: every
    such group has one device per process, and the tensors fit the header."""
    return sample.ndim <= MAX_NDIM and _one_device_per_process(mesh, mesh_dim)


class _Native:
    """One cross-process group of a call, seen from its single local member."""

    def __init__(self, call: Call, group: Group) -> None:
        members, indices = group
        self.call, self.n = call, len(members)
        self.ranks = call.ranks[members]
        self.pg = group_for_ranks(self.ranks)
        self.owners = [call.owner(d) for d in members]
        self.k = next(k for k, i in enumerate(indices) if i is not None)
        self.local = first_local(group)
        self.forecast = protocol.forecast(self.ranks)

    def first_round(
        self,
        wire: str | None,
        shapes: Sequence[Sequence[int]],
        outgoing: Sequence[torch.Tensor] = (),
        sent: Callable[[list[list[int]]], list[int]] = lambda shapes: [],
        extra: int = 0,
        own: bool = False,
        into: torch.Tensor | None = None,
    ) -> tuple[list[list[list[int]]], list[torch.Tensor] | None]:
        """Exchange headers, the pieces inline when the forecast allows: returns, per member,
        the shapes it announced and (if every piece came inline) the bytes it sent here.

        ``wire`` says which pieces could ride along ("all_gather": ``outgoing[0]`` to everyone;
        "all_to_all": ``outgoing[k]`` to member k; None: headers only; any dtype and strides, made
        dense only to ride along), ``sent`` the bytes a
        member sends, from its announced shapes (the same rule in every process decides who
        sent inline). Each peer gets one message of the header and the forecast bytes, or, for
        a large forecast, the header and then the piece on its own, received in place: in
        member order into ``into`` (bytes) when it is large enough, else one fresh buffer,
        with this process's own piece copied into its slot too when ``own``; the one-message
        form lands in ``into`` too when it fits."""
        call = self.call
        header = self._header(shapes, extra)
        hb = header.numel()
        f_wire, f_size = self.forecast.predict()
        inline = f_size > 0 and wire == f_wire and all(
            t.numel() * t.element_size() <= f_size for t in outgoing)
        apart = f_size >= protocol.APART_FROM
        peers = [j for j in range(self.n) if j != self.k]
        device = header.device
        width = hb if apart else hb + f_size  # what each peer's first message holds
        inbox = dict(zip(peers, self._buffer((self.n - 1) * width, None if apart else into)
                         .split(width), strict=True))
        landing: dict[int, torch.Tensor] = {}
        if apart:
            slots = list(range(self.n)) if own else peers
            landing = dict(zip(slots, self._buffer(len(slots) * f_size, into).split(f_size),
                               strict=True))
        junk = torch.empty(f_size if f_size and not inline else 0, dtype=torch.uint8,
                           device=device)

        def piece_for(j: int) -> torch.Tensor:
            """The forecast bytes for member j (exactly ``f_size``)."""
            if not inline:
                return junk
            piece = as_bytes(outgoing[j if wire == "all_to_all" else 0])
            if piece.numel() == f_size:
                return piece
            padded = torch.empty(f_size, dtype=torch.uint8, device=device)
            padded[: piece.numel()] = piece
            return padded

        def start() -> list:
            works = []
            for j in peers:
                src = self.owners[j]
                works.append(post_receive(inbox[j], src, self.ranks, HEADER_TAG))
                if apart:
                    works.append(post_receive(landing[j], src, self.ranks, HEADER_TAG))
            shared = None  # one message for every peer unless the pieces differ per member
            for j in peers:
                dst = self.owners[j]
                if apart:
                    works.append(post_send(header, dst, self.ranks, HEADER_TAG))
                    works.append(post_send(piece_for(j), dst, self.ranks, HEADER_TAG))
                    continue
                message = shared
                if message is None:
                    message = torch.empty(hb + f_size, dtype=torch.uint8, device=device)
                    message[:hb] = header
                    if f_size:
                        message[hb:] = piece_for(j)
                    if not (inline and wire == "all_to_all"):
                        shared = message
                works.append(post_send(message, dst, self.ranks, HEADER_TAG))
            return works

        self.run(start)
        call.rounds = max(call.rounds, 1)  # the debug comparison needs no point-to-point header
        rows = [(header if j == self.k else inbox[j][:hb]).view(torch.int64).tolist()
                for j in range(self.n)]  # per member: the same order in every process
        announced = self._check(rows, header.view(torch.int64).tolist(), len(shapes))
        needs = [sent(shapes) for shapes in announced]  # per member
        largest = max((b for row in needs for b in row), default=0)
        everyone_inline = f_size > 0 and wire == f_wire and largest <= f_size
        self.forecast.learn(
            tuple(tuple(row[1:2] + row[4:]) for row in rows),
            wire, -(-largest // 16) * 16 if wire and 0 < largest <= INLINE_MAX else 0,
        )
        message_bytes = (self.n - 1) * (hb + f_size)
        if not everyone_inline:
            call.traffic.meta += message_bytes
            return announced, None
        arrived = []
        for j in range(self.n):
            size = needs[j][self.k if wire == "all_to_all" else 0]
            if j != self.k:
                arrived.append(landing[j][:size] if apart else inbox[j][hb : hb + size])
                continue
            mine = outgoing[self.k if wire == "all_to_all" else 0]
            if own:  # a result of its own, not a view of the input: one copy, strided or not
                slot = landing[j][:size] if apart else self._buffer(size, None)
                _typed(slot, mine.dtype, mine.shape).copy_(mine)
                arrived.append(slot)
            else:
                arrived.append(as_bytes(mine))
        call.traffic.meta += message_bytes - sum(
            a.numel() for j, a in enumerate(arrived) if j != self.k
        )
        return announced, arrived

    def _buffer(self, nbytes: int, into: torch.Tensor | None) -> torch.Tensor:
        """``nbytes`` bytes to receive into: the front of ``into`` when it is large enough."""
        if into is not None and into.numel() >= nbytes:
            return into[:nbytes]
        return torch.empty(nbytes, dtype=torch.uint8, device=self.call.sample.device)

    def _header(self, shapes: Sequence[Sequence[int]], extra: int) -> torch.Tensor:
        """This process's header as bytes (``protocol``): the collective, its sequence number,
        fingerprint, dtype, reduce op or source, and the shapes of the pieces it sends."""
        call = self.call
        fixed = protocol.header_words(
            call.kind, protocol.NATIVE, call.seq[self.ranks], call.fingerprints.get(self.ranks, 0),
            call.sample.dtype, call.sample.ndim, extra, len(shapes),
        )
        padded = [-1] * protocol.body_words(self.n)
        flat = [int(x) for s in shapes for x in s]
        padded[: len(flat)] = flat
        return torch.tensor(fixed + padded, dtype=torch.int64,
                            device=call.sample.device).view(torch.uint8)

    def _check(self, rows: list[list[int]], fixed: list[int], count: int) -> list[list[list[int]]]:
        """Raise on a header (``rows``: per member) that differs from this process's
        (``fixed``): first explain differing fingerprints with the peers that found them too;
        return, per member, the shapes it announced."""
        call = self.call
        differ, wrong = set(), []
        for j, row in enumerate(rows):
            if protocol.differs(row, fixed):
                wrong.append(protocol.mismatch(call.what(), call.me, fixed, self.owners[j], row))
            elif row[3] != fixed[3]:
                differ.add((self.ranks, self.owners[j]))
        if differ:
            call.compare(differ)
        if wrong:
            raise wrong[0]
        ndim, at = call.sample.ndim, protocol.FIXED
        return [[row[at + m * ndim : at + (m + 1) * ndim] for m in range(count)] for row in rows]

    def count_arrived(self, arrived: Sequence[torch.Tensor]) -> None:
        """Count the pieces that came inline as the payload from the other members."""
        self.call.traffic.payload += sum(a.numel() for j, a in enumerate(arrived) if j != self.k)

    def same_shapes(self, announced: list[list[list[int]]]) -> None:
        """Reductions and broadcast need every member to announce the same shapes."""
        for j, shapes in enumerate(announced):
            if shapes != announced[self.k]:
                raise CollectiveMismatchError(
                    f"processes disagree on the shapes of a collective: {self.call.what()}. "
                    f"Rank {self.call.me}: {announced[self.k]}; rank {self.owners[j]}: "
                    f"{shapes}. Every process must pass tensors of the same shapes"
                )

    def run(self, start: Callable[[], object]) -> None:
        """Start the native operation(s) and wait for them within the collective timeout."""
        try:
            works = start()
        except RuntimeError as err:
            raise CollectiveError(
                f"{self.call.what()} failed: {err}; another process probably failed or timed "
                f"out first"
            ) from err
        wait_all(self.call, works if isinstance(works, list) else [works])

    def all_to_all(
        self, send: Sequence[torch.Tensor], receive: Sequence[int],
        into: torch.Tensor | None = None, own: bool = True,
    ) -> list[torch.Tensor]:
        """Member k gets ``send[k]`` (any dtype and strides); returns the bytes each member
        sent here, ``receive[j]`` from member j, received point to point straight into their
        slots of one buffer in member order (``into`` when large enough). Each piece is made
        dense once, on its way out (not at all where it already is: rows of a component), and
        this member's own piece is copied into its slot while the others travel (``own``; else
        its bytes as they are). gloo's all_to_all_single would take every piece packed into one
        buffer and copy the own piece once more."""
        out = self._buffer(sum(receive), into)
        slots = list(out.split(list(receive)))
        self.call.traffic.payload += out.numel() - receive[self.k]
        outgoing = []  # kept alive until the sends complete

        def start() -> list:
            works = []
            for j in range(self.n):
                if j != self.k and slots[j].numel():
                    works.append(post_receive(slots[j], self.owners[j], self.ranks, HEADER_TAG))
            for j in range(self.n):
                if j != self.k and send[j].numel():
                    outgoing.append(as_bytes(send[j]))
                    works.append(post_send(outgoing[-1], self.owners[j], self.ranks, HEADER_TAG))
            mine = send[self.k]
            if own:
                _typed(slots[self.k], mine.dtype, mine.shape).copy_(mine)
            else:
                slots[self.k] = as_bytes(mine)
            return works

        self.run(start)
        return slots

    def gather_into(self, parts: Sequence[torch.Tensor], mine: torch.Tensor) -> None:
        """Fill ``parts[j]`` (views of one result buffer) with member j's ``mine``, point to
        point, received in place: gloo's all_gather goes through a flat copy of the whole
        result and is slower at every size measured (2 and 4 processes, 16 KiB to 4 MiB)."""
        self.call.traffic.payload += sum(p.numel() for p in parts) - parts[self.k].numel()
        parts[self.k].copy_(mine)

        def start() -> list:
            works = []
            for j in range(self.n):
                if j != self.k and mine.numel():
                    works.append(post_send(mine, self.owners[j], self.ranks, HEADER_TAG))
                if j != self.k and parts[j].numel():
                    works.append(post_receive(parts[j], self.owners[j], self.ranks, HEADER_TAG))
            return works

        self.run(start)


def _adjacent(pieces: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The bytes of ``pieces`` one after the other as one view, when they already lie side by
    side, dense, in one storage (a component cut along its first dim); else None."""
    first = pieces[0]
    offset = start = first.storage_offset() * first.element_size()
    for p in pieces:
        if not p.is_contiguous() or p.untyped_storage().data_ptr() != first.untyped_storage(
        ).data_ptr() or p.storage_offset() * p.element_size() != offset:
            return None
        offset += p.numel() * p.element_size()
    joined = torch.empty(0, dtype=torch.uint8, device=first.device)
    return joined.set_(first.untyped_storage(), start, (offset - start,))


class Received(list):
    """Pieces that a collective received side by side into one fresh buffer, which nothing
    else holds: ``join`` may return a view of it instead of copying them."""


def join(pieces: Sequence[torch.Tensor], dim: int) -> torch.Tensor:
    """``torch.cat(pieces, dim)``, without the copy when ``pieces`` is ``Received`` and they
    lie in order along ``dim`` (an all_gather or all_to_all along the first non-trivial dim):
    then a view of their buffer."""
    first = pieces[0]
    if (
        isinstance(pieces, Received)
        and len(pieces) > 1
        and all(
            prod(p.shape[:dim]) == 1
            and p.shape[:dim] + p.shape[dim + 1 :] == first.shape[:dim] + first.shape[dim + 1 :]
            for p in pieces
        )
        and _adjacent(pieces) is not None
    ):
        shape = list(first.shape)
        shape[dim] = sum(p.shape[dim] for p in pieces)
        return first.new_empty(0).set_(first.untyped_storage(), first.storage_offset(), shape)
    return torch.cat(list(pieces), dim)


def _typed(raw: torch.Tensor, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    return raw.view(dtype).view(tuple(shape))


def _nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    return prod(shape) * dtype.itemsize


# ----- collectives (same signatures and results as distributed.py's) ---------------------------


def all_gather(
    mesh: DeviceMesh, mesh_dim: int, groups: Sequence[Group], components: Sequence[torch.Tensor]
) -> tuple[dict[int, list[torch.Tensor]], Traffic]:
    """Every member's piece: with the headers when forecast, else as views of one buffer
    filled point to point after them."""
    sample = components[0]
    call = Call("all_gather", mesh, mesh_dim, groups, sample, transport=protocol.NATIVE)
    call.check(lambda group: {"ndim": sample.ndim})
    out = {}
    for group in sorted(groups):
        g = _Native(call, group)
        piece = components[g.local]
        announced, arrived = g.first_round(
            "all_gather", [piece.shape], [piece],
            lambda shapes: [_nbytes(shapes[0], sample.dtype)], own=True,
        )
        shapes = [s[0] for s in announced]
        if arrived is not None:
            g.count_arrived(arrived)
            out[g.local] = Received(
                _typed(a, sample.dtype, s) for a, s in zip(arrived, shapes, strict=True)
            )
            continue
        sizes = [_nbytes(s, sample.dtype) for s in shapes]
        parts = torch.empty(sum(sizes), dtype=torch.uint8, device=sample.device).split(sizes)
        g.gather_into(parts, as_bytes(piece))
        out[g.local] = Received(
            _typed(p, sample.dtype, s) for p, s in zip(parts, shapes, strict=True)
        )
    return out, call.traffic


def all_gather_tensor(
    mesh: DeviceMesh, mesh_dim: int, groups: Sequence[Group], components: Sequence[torch.Tensor],
    gather_dim: int,
) -> tuple[dict[int, torch.Tensor], Traffic]:
    """``all_gather`` joined along ``gather_dim``: a view of the gathered buffer where the pieces
    lie in order along it, else one concatenation."""
    gathered, traffic = all_gather(mesh, mesh_dim, groups, components)
    return {i: join(pieces, gather_dim) for i, pieces in gathered.items()}, traffic


def all_to_all(
    mesh: DeviceMesh,
    mesh_dim: int,
    groups: Sequence[Group],
    pieces: Sequence[Sequence[torch.Tensor]],
) -> tuple[dict[int, list[torch.Tensor]], Traffic]:
    """``pieces[i][k]`` goes to member k: inline with the headers when forecast, else by one
    all_to_all with the pieces' split sizes after them."""
    sample = pieces[0][0]
    call = Call("all_to_all", mesh, mesh_dim, groups, sample, transport=protocol.NATIVE)
    call.check(lambda group: {"ndim": sample.ndim})
    out = {}
    for group in sorted(groups):
        g = _Native(call, group)
        mine = pieces[g.local]
        announced, received = g.first_round(
            "all_to_all", [p.shape for p in mine], mine,
            lambda shapes: [_nbytes(s, sample.dtype) for s in shapes], own=True,
        )
        shapes = [announced[j][g.k] for j in range(g.n)]
        if received is None:
            received = g.all_to_all(mine, [_nbytes(s, sample.dtype) for s in shapes])
        else:
            g.count_arrived(received)
        # fresh buffers either way (the own piece copied too): ``join`` may view them
        out[g.local] = Received(
            _typed(r, sample.dtype, s) for r, s in zip(received, shapes, strict=True)
        )
    return out, call.traffic


def reduce_scatter(
    mesh: DeviceMesh,
    mesh_dim: int,
    groups: Sequence[Group],
    pieces: Sequence[Sequence[torch.Tensor]],
    op: str,
) -> tuple[dict[int, torch.Tensor], Traffic]:
    """An all_to_all of the pieces (inline with the headers when forecast), then each member
    combines its terms in coordinate order."""
    sample = pieces[0][0]
    call = Call("reduce_scatter", mesh, mesh_dim, groups, sample, f"({op})",
                transport=protocol.NATIVE)
    call.check(lambda g: {"piece shapes": [list(p.shape) for p in pieces[first_local(g)]]})
    out = {}
    for group in sorted(groups):
        g = _Native(call, group)
        mine = pieces[g.local]
        announced, terms = g.first_round(
            "all_to_all", [p.shape for p in mine], mine,
            lambda shapes: [_nbytes(s, sample.dtype) for s in shapes], OPS.index(op),
        )
        g.same_shapes(announced)
        shape = mine[g.k].shape
        size = _nbytes(shape, sample.dtype)
        if terms is None:
            terms = g.all_to_all(mine, [size] * g.n, own=False)
        else:
            g.count_arrived(terms)
        reduced = combine([_typed(t, sample.dtype, shape) for t in terms], op)
        out[g.local] = finish(reduced, op, g.n, sample.dtype)
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
    """Member k reduces chunk k of every component in coordinate order (after an all_to_all of
    the chunks, inline with the headers when forecast), then the reduced chunks are
    all-gathered into the result buffer. Two processes exchange their whole components (the
    same bytes as a ring) with the headers when forecast; else the backend's all_reduce
    where its bits are those (``_backend_reduces``)."""
    sample = components[0]
    call = Call("all_reduce", mesh, mesh_dim, groups, sample, f"({op})",
                transport=protocol.NATIVE)
    call.check(lambda group: {"shape": list(components[first_local(group)].shape)})
    out = {}
    item = sample.dtype.itemsize
    for group in sorted(groups):
        g = _Native(call, group)
        component = components[g.local]
        bounds = _chunks(component.numel(), g.n)
        backend = _backend_reduces(op, sample.dtype, g.n)
        if g.n == 2:  # the ring's bytes: each process gets the other's whole component
            announced, terms = g.first_round(
                "all_gather", [component.shape], [component],
                lambda shapes: [_nbytes(shapes[0], sample.dtype)], OPS.index(op),
            )
            g.same_shapes(announced)
            if terms is not None:  # both came inline: combine them in coordinate order
                g.count_arrived(terms)
                typed = [_typed(t, sample.dtype, component.shape) for t in terms]
                if op in ("sum", "avg") and sample.dtype in _PAIR_EXACT:
                    # a + b == b + a: add into the received buffer, no third one
                    reduced = typed[1 - g.k].add_(typed[g.k])
                else:
                    reduced = combine(typed, op)
                out[g.local] = finish(reduced, op, g.n, sample.dtype)
                continue
        elif backend:  # headers alone: the pieces would not ride along
            g.same_shapes(g.first_round(None, [component.shape], extra=OPS.index(op))[0])
        if backend:
            result = component.clone(memory_format=torch.contiguous_format)
            if result.numel():
                g.run(lambda r=result, g=g: dist.all_reduce(
                    r, op=_BACKEND_OPS[op], group=g.pg, async_op=True))
            call.traffic.payload += all_reduce_received(result.numel(), item, g.n, g.k)
            out[g.local] = finish(result, op, g.n, sample.dtype)
            continue
        flat = as_bytes(component)
        chunks = [flat[a * item : b * item] for a, b in bounds]
        # the terms land in the result's memory (no second fresh buffer): they are combined
        # before the all_gather overwrites them
        result = torch.empty(component.shape, dtype=sample.dtype, device=sample.device)
        raw = as_bytes(result)
        terms = None
        if g.n > 2:
            announced, terms = g.first_round(
                "all_to_all", [component.shape], chunks,
                lambda shapes, n=g.n: [(b - a) * item for a, b in _chunks(prod(shapes[0]), n)],
                OPS.index(op), into=raw,
            )
            g.same_shapes(announced)
        start, stop = bounds[g.k]
        if terms is None:
            terms = g.all_to_all(chunks, [(stop - start) * item] * g.n, raw, own=False)
        else:
            g.count_arrived(terms)
        reduced = finish(
            combine([_typed(t, sample.dtype, (stop - start,)) for t in terms], op), op, g.n,
            sample.dtype,
        )
        g.gather_into([raw[a * item : b * item] for a, b in bounds], as_bytes(reduced))
        out[g.local] = result
    return out, call.traffic


def broadcast(
    mesh: DeviceMesh,
    mesh_dim: int,
    groups: Sequence[Group],
    components: Sequence[torch.Tensor],
    src: int,
) -> tuple[dict[int, torch.Tensor], Traffic]:
    """Member ``src``'s component, by one native broadcast into a fresh buffer."""
    sample = components[0]
    call = Call("broadcast", mesh, mesh_dim, groups, sample, f"(src={src})",
                transport=protocol.NATIVE)
    call.check(lambda group: {"shape": list(components[first_local(group)].shape)})
    out = {}
    for group in sorted(groups):
        g = _Native(call, group)
        component = components[g.local]
        g.same_shapes(g.first_round(None, [component.shape], extra=src)[0])
        if g.k == src:
            buffer, value = as_bytes(component), component
        else:
            value = torch.empty(component.shape, dtype=sample.dtype, device=sample.device)
            buffer = as_bytes(value)
            call.traffic.payload += buffer.numel()
        if buffer.numel():
            g.run(lambda b=buffer, g=g: dist.broadcast(b, src=g.owners[src], group=g.pg,
                                                       async_op=True))
        out[g.local] = value
    return out, call.traffic
