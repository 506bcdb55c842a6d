"""The agreement of the backend path (``native.py``): before its data moves, each process of a
group says what it is about to do, as a 56-bit fingerprint (collective, sequence number between
these processes, dtype, reduce op, every member's piece shapes as this process reckons them
from the spec, the spec being moved; with debug checks also the call site and mesh dim),
posted on the shared-memory board of processes on one host (``board.py``: microseconds), for a
group across hosts on each host's board and exchanged between the hosts' first processes in
log2(hosts) rounds (``host_tree.py``), else (rank threads, no shared memory) gathered on a CPU
gloo side group (``runtime.side_group_for_ranks``: one small gather). Equal
fingerprints cost that; different ones make every process swap the fields it hashed on the side
group and raise ``CollectiveMismatchError`` naming what differs per rank, the same error on every
rank.

Neither touches the accelerator: on CUDA the data's collective is enqueued first and
the host checks the fingerprints while the device works; on CPU the check comes first, since
gloo aborts the process on messages of another size. A rank that skips a collective meets its
peers' next fingerprint with another sequence number: the mismatch names both."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from .. import runtime, settings
from ..errors import CollectiveError, CollectiveMismatchError, CollectiveTimeoutError
from . import protocol
from .board import Board, open_boards
from .host_tree import HostTree, channel

# per process: the board or host tree of each set of ranks (None: they agree on the side
# group), with the side group it was set up on (a world made again sets it up again)
_boards: settings.ProcessLocal[dict[tuple[int, ...], tuple]] = settings.ProcessLocal(dict)


def _board(ranks: tuple[int, ...], side: dist.ProcessGroup) -> Board | HostTree | None:
    known = _boards.get().get(ranks)
    if known is None or known[0]() is not side:
        boards = None if dist.get_backend(side) == "fake" else open_boards(ranks, side)
        made = None if boards is None else channel(ranks, boards)
        known = _boards.get()[ranks] = (weakref.ref(side), made)
    return known[1]


def _gather(out: torch.Tensor, mine: torch.Tensor, group: dist.ProcessGroup) -> dist.Work:
    """Start gathering every member's ``mine`` into ``out`` on ``group``."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(out, mine, group=group, async_op=True)


def start(ranks: tuple[int, ...], fields: dict[str, object], extra: dict[str, object],
          what: Callable[[], str]) -> Callable[[], None]:
    """Gather the fingerprint of ``fields`` and ``extra`` (JSON values) over ``ranks``;
    returns the call that waits for it and raises on a difference (``what()`` names the
    collective in errors)."""
    side = runtime.side_group_for_ranks(ranks)
    word = protocol.fingerprint((fields, extra))
    board = _board(ranks, side)
    if board is not None:
        n = board.post(word)

        def posted() -> None:
            if not board.wait(n, word, ranks, what):
                _explain(side, ranks, {**fields, **extra}, what)

        return posted
    mine = torch.tensor([word], dtype=torch.int64)
    words = torch.empty(len(ranks), dtype=torch.int64)
    work = _gather(words, mine, side)

    def check() -> None:
        seconds = settings.COLLECTIVE_TIMEOUT.get()
        try:
            work.wait(timedelta(seconds=seconds))
        except RuntimeError as err:
            if "timed out" not in str(err).lower():
                raise CollectiveError(
                    f"{what()} failed: {err}; another process probably failed or timed out "
                    f"first") from err
            raise CollectiveTimeoutError(
                f"{what()}: the processes' agreement did not complete within the collective "
                f"timeout of {seconds:g} s ({err}); another process did not take part (it "
                f"diverged, failed, is late or hangs)") from err
        if bool((words != word).any()):
            _explain(side, ranks, {**fields, **extra}, what)

    return check


def gather(ranks: tuple[int, ...], fields: dict[str, object], extra: dict[str, object],
           own: object, what: Callable[[], str]) -> list:
    """Every process's ``own`` (a JSON value that may differ per process: the shapes of pieces
    no spec describes), gathered on the side group after the agreement on ``fields`` and
    ``extra`` (so a divergent peer meets a fingerprint, never an object of unknown size); for
    the generic collectives, not the hot path."""
    start(ranks, fields, extra, what)()
    seen: list = [None] * len(ranks)
    try:
        dist.all_gather_object(seen, own, group=runtime.side_group_for_ranks(ranks))
    except RuntimeError as err:
        raise CollectiveTimeoutError(
            f"{what()}: gathering the pieces' shapes did not complete ({err}); another process "
            f"failed or hangs") from err
    return seen


def _explain(side: dist.ProcessGroup, ranks: tuple[int, ...], mine: dict[str, object],
             what: Callable[[], str]) -> None:
    """Every process saw the difference: swap the fields and raise naming what differs."""
    seen: list = [None] * len(ranks)
    dist.all_gather_object(seen, mine, group=side)
    _raise(ranks, seen, what)


def _raise(ranks: tuple[int, ...], seen: list[dict[str, object]], what: Callable[[], str]
           ) -> None:
    """``CollectiveMismatchError`` naming, per rank, the fields of ``seen`` that differ."""
    keys = sorted({k for d in seen for k in d})
    diffs = [
        f"  {key}: " + "; ".join(f"rank {r}: {d.get(key)!r}" for r, d in zip(ranks, seen,
                                                                            strict=True))
        for key in keys if len({repr(d.get(key)) for d in seen}) > 1
    ]
    raise CollectiveMismatchError(
        f"processes disagree on a collective: {what()}. What differs per rank:\n"
        + ("\n".join(diffs) or "  the fields hash alike but differ") + "\nEvery process must "
        "run the same collectives in the same order on tensors of the same global shapes; "
        "set_debug_checks(True) adds the call sites")
