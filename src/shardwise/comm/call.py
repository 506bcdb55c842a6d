"""One collective call across processes, on either transport: its description for errors, its
sequence number and fingerprint in each set of processes it spans (``protocol``), the agreement
it starts with (``agreement``), its rounds of point-to-point messages (the first one's header
exchange, a small first message inline) and waiting for them within the collective timeout."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch

from ..caches import PER_GROUP, cached
from ..call_site import call_site
from ..errors import CollectiveError, CollectiveMismatchError, CollectiveTimeoutError
from ..mesh import DeviceMesh
from ..runtime import group_for_ranks, rank_and_world
from . import agreement, protocol, safety
from .wire import post_receive, post_send, wait

Group = tuple[tuple[int, ...], tuple[int | None, ...]]  # member ids, local index of each or None


@cached(PER_GROUP)
def group_ranks(mesh: DeviceMesh, mesh_dim: int) -> dict[tuple[int, ...], tuple[int, ...]]:
    """For each cross-process device group along ``mesh_dim`` holding a device of this process,
    the ranks of the processes that own its members. Creates their process groups, in mesh order."""
    me = rank_and_world()[0]
    result: dict[tuple[int, ...], tuple[int, ...]] = {}
    for members in mesh.groups(mesh_dim):
        ranks = tuple(sorted({mesh.owner_of(d) for d in members}))
        if me in ranks and len(ranks) > 1:
            group_for_ranks(ranks)
            result[members] = ranks
    return result


@dataclass
class Traffic:
    """Bytes this process received from other processes in one collective."""

    payload: int = 0
    meta: int = 0  # shape headers, agreements, debug-check descriptors, padding of uneven pieces


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of ``t`` (strides of size-1 and empty dims do not matter once dense)."""
    dense = t.detach().contiguous()
    return dense.as_strided((dense.numel(),), (1,)).view(torch.uint8)


class Call:
    """One collective across processes (either transport): its description for errors, its
    sequence number and fingerprint in each set of processes it spans (``protocol``), its
    point-to-point rounds of messages."""

    def __init__(
        self, kind: str, mesh: DeviceMesh, mesh_dim: int | None, groups: Sequence[Group],
        sample: torch.Tensor, detail: str = "",
        ranks: dict[tuple[int, ...], tuple[int, ...]] | None = None,
        transport: int = protocol.POINT_TO_POINT, extra: int = 0,
    ) -> None:
        self.kind, self.mesh, self.mesh_dim, self.groups = kind, mesh, mesh_dim, groups
        self.sample, self.detail, self.transport, self.extra = sample, detail, transport, extra
        self.me = rank_and_world()[0]
        self.ranks = group_ranks(mesh, mesh_dim) if ranks is None else ranks
        self.traffic = Traffic()
        self.rounds = 0
        self.seq = protocol.next_sequence(self.ranks.values())
        # always: the spec being moved; the debug checks add more (``check``)
        spec = safety.current_spec()
        self.fields: Callable[[Group], dict[str, object]] = lambda group: {}
        self.fingerprints: dict[tuple[int, ...], int] = {}
        if spec is not None:
            values, fingerprint = spec
            self.fields = lambda group: {"spec": values}
            self.fingerprints = dict.fromkeys(self.seq, fingerprint)

    def what(self) -> str:
        moving = safety.current_description() or "local components"
        where = "the whole" if self.mesh_dim is None else f"mesh dim {self.mesh_dim} of"
        return (
            f"{self.kind}{self.detail} over {where} {self.mesh} (rank {self.me}, moving "
            f"{moving}; local piece {list(self.sample.shape)} {self.sample.dtype})"
        )

    def owner(self, device: int) -> int:
        return self.mesh.owner_of(device)

    def agree(self) -> None:
        """The agreement every cross-process collective starts with (``agreement.py``), per
        set of processes, on what ``check`` and the spec put in ``fields``: a process here and
        a peer in a backend collective meet in one message of one size."""
        for rank_set, number in self.seq.items():
            group = next((g for g in self.groups if self.ranks.get(g[0]) == rank_set), None)
            agreement.start(rank_set, {"collective": self.kind + self.detail,
                                       "sequence": number, "dtype": str(self.sample.dtype)},
                            {} if group is None else self.fields(group), self.what)()

    def peers(self, members: tuple[int, ...]) -> list[int]:
        return [r for r in self.ranks[members] if r != self.me]

    def round(self, meta: bool = False) -> _Round:
        return _Round(self, meta)

    def check(self, fields: Callable[[Group], dict[str, object]]) -> None:
        """Debug checks: the first round's header carries a fingerprint of what this process
        is about to do in each group (``fields(group)`` adds the group's shapes) besides the
        spec; processes whose fingerprints differ exchange the details and raise
        ``CollectiveMismatchError`` naming what differs per rank. The same programs pay no
        extra message."""
        if not safety.debug_checks_enabled():
            return
        always = self.fields
        common = {
            "collective": self.kind + self.detail,
            "mesh": self.mesh.torch_repr(),
            "mesh_dim": self.mesh_dim,
            "dtype": str(self.sample.dtype),
            "moving": safety.current_description(),
            "call site": call_site(),
        }
        self.expect_same(lambda group: {
            **common, **always(group), "sequence": self.seq[self.ranks[group[0]]],
            **fields(group),
        })

    def expect_same(self, fields: Callable[[Group], dict[str, object]]) -> None:
        """The next round's headers carry a fingerprint of ``fields(group)`` per process group;
        a difference is explained by ``compare`` (see ``check``)."""
        self.fields = fields
        by_ranks: dict[tuple[int, ...], list] = {}
        for group in self.groups:
            by_ranks.setdefault(self.ranks[group[0]], []).append(fields(group))
        self.fingerprints = {
            ranks: protocol.fingerprint(values) for ranks, values in by_ranks.items()
        }

    def compare(self, keys: set[tuple[tuple[int, ...], int]]) -> None:
        """Exchange ``self.fields`` with the peers of ``keys`` ((ranks, peer) pairs whose
        fingerprints differed, who do the same towards this process) and raise
        ``CollectiveMismatchError`` naming what differs per rank."""
        mine = [self.fields(group) for group in self.groups]
        encoded = [
            torch.frombuffer(bytearray(json.dumps(d).encode()), dtype=torch.uint8) for d in mine
        ]

        def peers(members: tuple[int, ...]) -> list[int]:
            return [p for p in self.peers(members) if (self.ranks[members], p) in keys]

        lengths = self.round(meta=True)
        for (members, _), payload in zip(self.groups, encoded, strict=True):
            for peer in peers(members):
                lengths.send(self.ranks[members], peer, torch.tensor([payload.numel()]))
                lengths.expect(self.ranks[members], peer, (1,), torch.int64)
        sizes = iter(lengths.run())
        bodies = self.round(meta=True)
        for (members, _), payload in zip(self.groups, encoded, strict=True):
            for peer in peers(members):
                bodies.send(self.ranks[members], peer, payload)
                bodies.expect(self.ranks[members], peer, (int(next(sizes).item()),), torch.uint8)
        received = iter(bodies.run())
        report = []
        for (members, _), own in zip(self.groups, mine, strict=True):
            seen = {self.me: own}
            for peer in peers(members):
                seen[peer] = json.loads(next(received).numpy().tobytes().decode())
            diffs = [
                f"  {key}: " + "; ".join(f"rank {r}: {seen[r].get(key)!r}" for r in sorted(seen))
                for key in sorted({k for d in seen.values() for k in d})
                if len({json.dumps(d.get(key)) for d in seen.values()}) > 1
            ]
            if diffs:
                report.append(f"device group {list(members)}:\n" + "\n".join(diffs))
        raise CollectiveMismatchError(
            f"processes disagree on a collective; {self.what()}. What differs per rank, "
            f"{'; '.join(report) or 'the order of their groups'}"
        )


class _Round:
    """One round of messages: everything for one (process group, peer) travels as one buffer
    of raw bytes, so any dtype goes through and the byte count is exact."""

    def __init__(self, call: Call, meta: bool) -> None:
        self.call, self.meta = call, meta
        self.outgoing: dict[tuple[tuple[int, ...], int], list[torch.Tensor]] = {}
        self.incoming: dict[tuple[tuple[int, ...], int], list[int]] = {}
        self.expected: list[
            tuple[tuple[tuple[int, ...], int], torch.Size, torch.dtype, torch.Tensor | None]
        ] = []

    def send(self, ranks: tuple[int, ...], peer: int, tensor: torch.Tensor) -> None:
        self.outgoing.setdefault((ranks, peer), []).append(as_bytes(tensor))

    def expect(
        self, ranks: tuple[int, ...], peer: int, shape: Sequence[int], dtype: torch.dtype,
        into: torch.Tensor | None = None,
    ) -> None:
        """Expect the next tensor from ``peer``; ``run`` returns them in ``expect`` order.
        With ``into`` (of that shape and dtype) the tensor lands there: when the ``into``s of
        one peer are contiguous and adjacent in memory, the transport receives straight into
        them, without a buffer and a copy."""
        shape = torch.Size(shape)
        nbytes = shape.numel() * torch.empty((), dtype=dtype).element_size()
        self.incoming.setdefault((ranks, peer), []).append(nbytes)
        self.expected.append(((ranks, peer), shape, dtype, into))

    def run(self) -> list[torch.Tensor]:
        try:
            return self._run()
        except CollectiveError:
            raise
        except RuntimeError as err:  # the transport broke (a peer died or closed)
            raise CollectiveError(
                f"{self.call.what()} failed: {err}; another process probably failed or timed "
                f"out first"
            ) from err

    def _run(self) -> list[torch.Tensor]:
        device = self.call.sample.device
        self.call.rounds += 1
        payloads = {
            key: (parts[0] if len(parts) == 1 else torch.cat(parts)).to(device)
            for key, parts in self.outgoing.items()
        }
        inline: dict[tuple[tuple[int, ...], int], torch.Tensor] = {}
        if self.call.rounds == 1:  # later rounds' sizes follow from the first one's
            self.call.agree()
            inline = self._exchange_headers(device, payloads)
        works = []
        buffers, direct = dict(inline), set()
        for key, sizes in self.incoming.items():  # receives first: the data has a place to go
            if key in inline:
                continue
            buffer = _span([into for k, _, _, into in self.expected if k == key], sum(sizes))
            if buffer is None:
                buffer = torch.empty(sum(sizes), dtype=torch.uint8, device=device)
            else:
                direct.add(key)
            buffers[key] = buffer
            if buffer.numel():
                works.append(post_receive(buffer, key[1], key[0], protocol.TAG))
        for (ranks, peer), buffer in payloads.items():
            if buffer.numel() and not (self.call.rounds == 1 and _fits(buffer.numel(), ranks)):
                works.append(post_send(buffer, peer, ranks, protocol.TAG))
        self._wait(works)
        received = sum(b.numel() for b in buffers.values())
        if self.meta:
            self.call.traffic.meta += received
        else:
            self.call.traffic.payload += received
        offsets = dict.fromkeys(buffers, 0)
        out = []
        for key, shape, dtype, into in self.expected:
            if key in direct:
                out.append(into)
                continue
            start = offsets[key]
            nbytes = shape.numel() * torch.empty((), dtype=dtype).element_size()
            offsets[key] = start + nbytes
            piece = buffers[key][start : start + nbytes]  # a fresh buffer: views are safe
            itemsize = torch.empty((), dtype=dtype).element_size()
            piece = piece.view(dtype) if start % itemsize == 0 else piece.clone().view(dtype)
            out.append(piece.reshape(shape) if into is None else into.copy_(piece.reshape(shape)))
        return out

    def _exchange_headers(
        self, device: torch.device, payloads: dict[tuple[tuple[int, ...], int], torch.Tensor]
    ) -> dict[tuple[tuple[int, ...], int], torch.Tensor]:
        """The protocol's first message (``protocol``), swapped with every other process of
        each set of processes the collective spans: its fixed words, then the bytes this
        process sends that peer in the first round and the bytes it expects from it, so
        processes that entered different collectives (on either transport), or the same one
        with other sizes or another spec, raise ``CollectiveMismatchError`` on both sides
        instead of handing the transport a message of the wrong size (gloo aborts the process
        on that). The sizes of later rounds follow from what the first one carried (shapes,
        lengths) or from the same local shapes, so they agree once the first round's do. A
        first-round message that fits (``protocol.inline_bytes``) rides in the header; returns
        the ones received that way, per (ranks, peer)."""
        call = self.call
        keys = list(dict.fromkeys([
            *self.outgoing, *self.incoming,
            *((ranks, peer) for ranks in call.seq for peer in ranks if peer != call.me),
        ]))
        fixed = {
            ranks: protocol.header_words(
                call.kind, call.transport, call.seq[ranks], call.fingerprints.get(ranks, 0),
                call.sample.dtype, call.sample.ndim, call.extra, 0,
            )
            for ranks in call.seq
        }
        sizes = {ranks: protocol.header_bytes(len(ranks)) for ranks in call.seq}
        mine, theirs, works = {}, {}, []
        for key in keys:
            theirs[key] = torch.empty(sizes[key[0]], dtype=torch.uint8, device=device)
            works.append(post_receive(theirs[key], key[1], key[0], protocol.HEADER_TAG))
        for key in keys:
            sent = sum(p.numel() for p in self.outgoing.get(key, []))
            mine[key] = [*fixed[key[0]], sent, sum(self.incoming.get(key, []))]
            message = torch.zeros(sizes[key[0]], dtype=torch.uint8)
            message[: len(mine[key]) * 8] = torch.tensor(mine[key]).view(torch.uint8)
            payload = payloads.get(key)
            if payload is not None and payload.numel() and _fits(payload.numel(), key[0]):
                message[_INLINE_AT : _INLINE_AT + payload.numel()] = payload
            works.append(post_send(message.to(device), key[1], key[0], protocol.HEADER_TAG))
        self._wait(works)
        inline = {  # copied out of the header (small), so what arrives owns its storage
            key: theirs[key][_INLINE_AT : _INLINE_AT + sum(parts)].clone()
            for key, parts in self.incoming.items()
            if _fits(sum(parts), key[0])
        }  # counted with the round they belong to
        call.traffic.meta += sum(b.numel() for b in theirs.values()) - sum(
            b.numel() for b in inline.values())
        words = protocol.FIXED + 2
        differ, wrong = set(), []
        for key in keys:
            own = mine[key]
            other = theirs[key][: words * 8].cpu().view(torch.int64).tolist()
            if protocol.differs(own, other):
                wrong.append(protocol.mismatch(call.what(), call.me, own, key[1], other))
            elif other[-2:] != own[-2:][::-1]:
                wrong.append(CollectiveMismatchError(
                    f"processes disagree on the bytes of a collective: {call.what()}. Rank "
                    f"{call.me} sends {own[-2]} bytes to rank {key[1]} and expects {own[-1]}; "
                    f"rank {key[1]} sends {other[-2]} and expects {other[-1]}. Every process "
                    f"must pass tensors of the same shapes"
                ))
            elif other[3] != own[3]:
                differ.add(key)
        if differ:  # first: the peers that found the same difference explain it together
            call.compare(differ)
        if wrong:
            raise wrong[0]
        return inline

    def _wait(self, works: list) -> None:
        wait_all(self.call, works)


def wait_all(call: Call, works: list) -> None:
    """Wait for ``works`` (async handles of ``call``) within the collective timeout: past it
    ``CollectiveTimeoutError``, a transport failure ``CollectiveError``."""
    timeout = safety.get_collective_timeout()
    deadline = time.monotonic() + timeout
    for work in works:
        left = max(deadline - time.monotonic(), 0.001)
        try:
            wait(work, timedelta(seconds=left))
        except RuntimeError as err:
            if "timed out" in str(err).lower() or time.monotonic() >= deadline:
                raise CollectiveTimeoutError(
                    f"{call.what()} did not complete within the collective timeout of "
                    f"{timeout:g} s: another process did not take part (it diverged, is "
                    f"slower than the timeout, or hangs); set_debug_checks(True) finds "
                    f"divergent programs"
                ) from err
            raise CollectiveError(f"{call.what()} failed: {err}") from err


def _fits(nbytes: int, ranks: tuple[int, ...]) -> bool:
    """Whether a first-round message of ``nbytes`` between ``ranks`` travels in the header."""
    return nbytes <= protocol.inline_bytes(len(ranks))


# where a first-round message that fits starts in the header: after its fixed words and the
# two byte counts
_INLINE_AT = (protocol.FIXED + 2) * 8


def _span(targets: list[torch.Tensor | None], nbytes: int) -> torch.Tensor | None:
    """The ``nbytes`` bytes of memory that ``targets`` cover, as one uint8 tensor to receive
    into, if they are all given, contiguous and back to back in one storage; else None."""
    if any(t is None for t in targets):
        return None
    filled = [t for t in targets if t.numel()]
    if not filled:
        return None
    first = filled[0]
    storage = first.untyped_storage()
    end = first.data_ptr()
    for t in filled:
        if (not t.is_contiguous() or t.data_ptr() != end
                or t.untyped_storage().data_ptr() != storage.data_ptr()):
            return None
        end += t.numel() * t.element_size()
    if end - first.data_ptr() != nbytes:
        return None
    offset = first.data_ptr() - storage.data_ptr()
    span = torch.empty(0, dtype=torch.uint8, device=first.device)
    return span.set_(storage, offset, (nbytes,))


def first_local(group: Group) -> int:
    """The local index of the group's first member in this process."""
    return next(i for i in group[1] if i is not None)
