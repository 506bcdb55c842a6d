"""The protocol of the point-to-point transport's collectives across processes
(``distributed.py``; the backend path, ``native.py``, sends no header): the header, sequence
numbers (which the agreement of both uses too) and fingerprints.

The unit is a *set of processes* (the global ranks of a process group). Each set keeps, in every
member, a sequence number (collectives so far between those processes), which changes at every
collective, agreed or not, so it is equal in every member of a program that runs in step.

Every collective first passes the agreement (``agreement.py``: one fixed-size gather of
fingerprints, the same message whatever collective each process entered). Then the first message
of a point-to-point collective, from every member of the set to every other member, is a header
(``HEADER_TAG``) of ``header_bytes(n)`` bytes: ``FIXED`` int64 words, then a body of
``body_words(n)``:

==== ============ ===========================================================================
word field        content
==== ============ ===========================================================================
0    magic        ``MAGIC``: a shardwise header
1    kind         the collective (``KINDS``) + 16 * transport (``POINT_TO_POINT``)
2    sequence     its number between these processes
3    fingerprint  what the receiver must expect too: the spec being moved (global shape,
                  dtype, placements, target), always; with debug checks, also the call site,
                  mesh dim and shapes (``fingerprint``)
4    dtype        index in ``DTYPES``
5    ndim         dims of the pieces
6    extra        the reduce op (index in ``OPS``) or the broadcast source
7    count        pieces announced in the body
8..  body         bytes sent, bytes expected, then the first round's message when it fits
                  (``inline_bytes``)
==== ============ ===========================================================================

A header whose words 0-2 or 4-7 differ from this member's raises ``CollectiveMismatchError`` on
every member that received it; a differing fingerprint makes the members swap what they hashed
and name what differs per rank; a peer that sends other than the bytes this member expects is
a mismatch too. What neither the agreement nor the header can tell (a peer in another set of
processes, or one that never comes) ends in the timeout (``CollectiveTimeoutError``); a
transport a peer broke raises ``CollectiveError``. Two collectives that agree on every word,
including the fingerprint, are indistinguishable: debug checks add the call site.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterable

import torch

from .. import settings
from ..errors import CollectiveMismatchError

TAG = 0x5357  # the point-to-point transport's rounds after the first; apart from a program's own
HEADER_TAG = TAG + 1  # the first message of a point-to-point collective
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


def body_words(n: int) -> int:
    """Body words of a header between ``n`` processes: eight per member (the room for a first
    round's message, ``inline_bytes``, grows with the set)."""
    return n * 8


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


def header_bytes(n: int) -> int:
    """Bytes of the first message from one member of a set of ``n`` processes to another."""
    return (FIXED + body_words(n)) * 8
