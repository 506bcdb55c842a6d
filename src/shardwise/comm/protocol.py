"""The protocol of every collective across processes, whichever transport moves its data (the
backend's own operations, ``native.py``, or point-to-point rounds, ``distributed.py``): the
header, sequence numbers, forecasts and fingerprints.

The unit is a *set of processes* (the global ranks of a process group). Each set keeps, in every
member, a sequence number (collectives so far between those processes) and a forecast (what
followed the last collective before). Both change only after a collective whose headers every
member agreed on, so they are equal in every member, even in a program about to diverge.

The first message of a collective, from every member of the set to every other member, is a
header (``HEADER_TAG``), then the pieces the forecast allows, and has ``message_sizes(ranks)``
bytes: a function of the set and its forecast alone, the same in every member whatever
collective (or transport) each entered. So a divergent program never hands the transport a
message of another size (gloo aborts the process on that): the header arrives and says what
the peer is doing. A header is ``FIXED`` int64 words, then a body of ``body_words(n)``:

==== ============ ===========================================================================
word field        content
==== ============ ===========================================================================
0    magic        ``MAGIC``: a shardwise header
1    kind         the collective (``KINDS``) + 16 * transport (``NATIVE``, ``POINT_TO_POINT``)
2    sequence     its number between these processes
3    fingerprint  what the receiver must expect too: the spec being moved (global shape,
                  dtype, placements, target), always; with debug checks, also the call site,
                  mesh dim and shapes (``fingerprint``)
4    dtype        index in ``DTYPES``
5    ndim         dims of the pieces
6    extra        the reduce op (index in ``OPS``) or the broadcast source
7    count        pieces announced in the body
8..  body         native: the shapes of the pieces this process sends (``MAX_NDIM`` words
                  each); point to point: bytes sent, bytes expected, then the first
                  round's message when it fits (``inline_bytes``)
==== ============ ===========================================================================

States of one set of processes, seen from one member:

============ ======================================= ==========================================
state        event                                   next state, and what is checked
============ ======================================= ==========================================
idle (s, F)  the program enters a collective         header: it is number s (the count is
                                                     s + 1 from now on, whatever follows);
                                                     send the first message (header, forecast
                                                     pieces) to every member, receive theirs;
                                                     it is sized by F alone
header       a peer's words 0-2 or 4-7 differ        error: ``CollectiveMismatchError`` on
             (another collective, transport,         every member that received it, naming
             sequence, dtype, ndim, op, count)       both headers; F unchanged, so members
                                                     that all raised stay in step
header       a peer's fingerprint differs            explain: members whose fingerprints
                                                     differ swap what they hashed and raise
                                                     ``CollectiveMismatchError`` naming what
                                                     differs per rank (the spec's shapes...)
header       point to point: a peer sends other      error: ``CollectiveMismatchError``
             than the bytes this member expects
header       every header agrees                     data: the pieces came with the header
                                                     when every member's fit the forecast;
                                                     else they follow, sized by the announced
                                                     shapes (reductions and broadcast check
                                                     that every member announced the same)
data         every message arrived                   idle (s + 1, F learns the agreed headers:
                                                     what followed the last collective)
any          a wait passes the collective timeout    ``CollectiveTimeoutError``; the group is
                                                     unusable afterwards
any          the transport fails (a peer died)       ``CollectiveError``
============ ======================================= ==========================================

What the header cannot tell (a peer in another set of processes, or one that never comes) ends
in the timeout. Two collectives that agree on every word, including the fingerprint, are
indistinguishable: debug checks add the call site to the fingerprint.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterable

import torch

from .. import settings
from ..errors import CollectiveMismatchError

TAG = 0x5357  # the point-to-point transport's rounds after the first; apart from a program's own
HEADER_TAG = TAG + 1  # every collective's first message, both transports; the native data
MAGIC = 0x5357_4844
KINDS = ("all_gather", "all_to_all", "reduce_scatter", "all_reduce", "broadcast", "scatter",
         "agree", "exchange")
NATIVE, POINT_TO_POINT = 0, 1
TRANSPORTS = ("native", "point to point")
OPS = ("sum", "avg", "max", "min")
DTYPES = sorted({str(v) for v in vars(torch).values() if isinstance(v, torch.dtype)})
_DTYPE_CODES = {name: i for i, name in enumerate(DTYPES)}
_KIND_CODES = {name: i for i, name in enumerate(KINDS)}
FIXED = 8  # header words before the body
MAX_NDIM = 8  # dims of a shape in a native header; more dims go point to point
# A piece of at most this many bytes may be forecast to follow the header at once; it bounds
# what a wrong forecast wastes (one message of this size per peer)
INLINE_MAX = 8 << 20
APART_FROM = 256 << 10  # a forecast piece this large travels in its own message, in place
FORECASTS = 1024  # collectives remembered per set of processes


def body_words(n: int) -> int:
    """Body words of a header between ``n`` processes: a shape per member."""
    return n * MAX_NDIM


def inline_bytes(n: int) -> int:
    """The point-to-point first-round message that rides in a header between ``n`` processes:
    the body less its two byte counts."""
    return (body_words(n) - 2) * 8


def header_words(kind: str, transport: int, sequence: int, fingerprint: int,
                 dtype: torch.dtype, ndim: int, extra: int, count: int) -> list[int]:
    """The ``FIXED`` words of a header."""
    return [MAGIC, _KIND_CODES[kind] + 16 * transport, sequence, fingerprint,
            _DTYPE_CODES[str(dtype)], ndim, extra, count]


def differs(mine: list[int], theirs: list[int]) -> bool:
    """Whether two headers name another collective (every fixed word but the fingerprint)."""
    return mine[:3] != theirs[:3] or mine[4:FIXED] != theirs[4:FIXED]


def describe(words: list[int]) -> str:
    """A header's fixed words in words, for error messages."""
    magic, kind, seq, _, dtype, ndim, extra, _ = words[:FIXED]
    if magic != MAGIC:
        return f"a message that is not a shardwise header ({words[:FIXED]})"
    name = KINDS[kind % 16] if 0 <= kind % 16 < len(KINDS) else f"kind {kind}"
    if name in ("all_reduce", "reduce_scatter") and 0 <= extra < len(OPS):
        name += f"({OPS[extra]})"
    elif name == "broadcast":
        name += f"(src={extra})"
    transport = TRANSPORTS[kind // 16] if 0 <= kind // 16 < len(TRANSPORTS) else "?"
    dtype_name = DTYPES[dtype] if 0 <= dtype < len(DTYPES) else f"dtype {dtype}"
    return (f"{name} #{seq} between these processes ({transport}) on {ndim}-d {dtype_name} "
            f"pieces")


def mismatch(what: str, me: int, mine: list[int], peer: int, theirs: list[int]
             ) -> CollectiveMismatchError:
    """The error for a peer's header that names another collective than this process's."""
    return CollectiveMismatchError(
        f"processes entered different collectives: {what}. Rank {me}: {describe(mine)}; rank "
        f"{peer}: {describe(theirs)}. Every process must run the same collectives in the same "
        f"order on tensors of the same shapes; set_debug_checks(True) names the call sites"
    )


def fingerprint(values: object) -> int:
    """56 bits of a digest of ``values`` (JSON values, dicts built in one order in every
    process): the same in every process that holds the same values."""
    return int.from_bytes(hashlib.sha1(repr(values).encode()).digest()[:7], "big")


# ----- sequence numbers ---------------------------------------------------------------------

# per process (per rank thread in the launcher's threads mode): collectives so far per set of
# processes; the n-th collective between the same processes must be the same one in each
_sequence: settings.ProcessLocal[dict[tuple[int, ...], int]] = settings.ProcessLocal(dict)
_sequence_lock = threading.Lock()


def next_sequence(rank_sets: Iterable[tuple[int, ...]]) -> dict[tuple[int, ...], int]:
    """The sequence number of a collective spanning ``rank_sets``, in each; counts it."""
    sequence = _sequence.get()
    with _sequence_lock:
        numbers = {}
        for key in dict.fromkeys(rank_sets):
            numbers[key] = sequence.get(key, 0)
            sequence[key] = numbers[key] + 1
    return numbers


# ----- forecasts ----------------------------------------------------------------------------


class Forecast:
    """What the next collective between one set of processes will send, learnt from what
    followed the same collective before (a training loop repeats its collectives): a
    successor seen twice in a row is forecast; one that changes is not, until it repeats.
    Every process learns from the same agreed headers, so all forecast alike, even the
    processes of a program about to diverge: the first message has one size everywhere."""

    def __init__(self) -> None:
        self.last: tuple = ()
        self.after: dict[tuple, tuple[str | None, int, bool]] = {}
        self.lock = threading.Lock()

    def predict(self) -> tuple[str | None, int]:
        """(the collective that carries the pieces, bytes of the largest piece), or a size of
        0 when nothing is forecast."""
        with self.lock:
            wire, size, confirmed = self.after.get(self.last, (None, 0, False))
        return (wire, size) if confirmed else (None, 0)

    def learn(self, digest: tuple, wire: str | None, size: int) -> None:
        """The collective ``digest`` (its agreed headers) came after the last one; it carried
        pieces of up to ``size`` bytes on ``wire`` (0 and None: none with its header)."""
        with self.lock:
            if len(self.after) >= FORECASTS:
                self.after.clear()
            seen = self.after.get(self.last)
            self.after[self.last] = (wire, size, seen is not None and seen[:2] == (wire, size))
            self.last = digest


_forecasts: settings.ProcessLocal[dict[tuple[int, ...], Forecast]] = settings.ProcessLocal(dict)


def forecast(ranks: tuple[int, ...]) -> Forecast:
    """The forecast of this process's collectives with processes ``ranks``."""
    forecasts = _forecasts.get()
    return forecasts.get(ranks) or forecasts.setdefault(ranks, Forecast())


def message_sizes(ranks: tuple[int, ...]) -> tuple[int, int, bool]:
    """(header bytes, forecast bytes, whether those travel in a second message) of the first
    message from one member of ``ranks`` to another: the same in every member."""
    _, size = forecast(ranks).predict()
    return (FIXED + body_words(len(ranks))) * 8, size, size >= APART_FROM
