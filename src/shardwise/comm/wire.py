"""Point-to-point messages of shardwise's cross-process collectives (``distributed.py``),
through the transport of the execution context (``execution.Transport``, chosen once when the
context is made): the backend's ``isend``/``irecv`` between processes (``BackendTransport``),
and between the rank threads of one process (``rank_threads``) a hand-over in memory
(``MailboxTransport`` over their shared ``Mailbox``).

Rank threads share one address space, so a message needs no socket: whichever of the send and
its matching receive is posted second copies the bytes straight from the sender's tensor into
the receiver's buffer (one copy, as the backend makes one into its socket), and the other
side's handle completes. Messages between two ranks on one tag of one group match in posting
order, as the backend's do, so the protocol above is unchanged and gives the same bits:
reductions combine in coordinate order whatever carries the bytes. A rank that leaves fails
the messages still waiting on it, as a closed socket does.
"""

from __future__ import annotations

import threading
from collections import defaultdict, deque
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .. import execution
from ..runtime import group_for_ranks

Key = tuple[tuple[int, ...], int, int, int]  # group's ranks, source, destination, tag


class _Message:
    """One posted send (``tensor``) or receive (``buffer``); ``wait`` as a backend work's."""

    __slots__ = ("tensor", "done", "error")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.done = threading.Event()
        self.error: str | None = None

    def fail(self, error: str) -> None:
        self.error = error
        self.done.set()

    def wait(self, timeout: timedelta | None = None) -> bool:
        seconds = None if timeout is None else timeout.total_seconds()
        if not self.done.wait(seconds):
            raise RuntimeError(f"a message between rank threads timed out after {seconds:g} s")
        if self.error is not None:
            raise RuntimeError(self.error)
        return True

    def is_completed(self) -> bool:
        return self.done.is_set()


def _hand_over(source: torch.Tensor, receive: _Message, send: _Message) -> None:
    """Copy a send's bytes into the receive's buffer and complete both (or fail both)."""
    into = receive.tensor
    n_in, n_out = into.numel() * into.element_size(), source.numel() * source.element_size()
    if n_in != n_out or not into.is_contiguous() or not source.is_contiguous():
        error = (f"a message of {n_out} bytes met a receive of {n_in} bytes (both must be "
                 f"dense and of one size)")
        receive.fail(error)
        send.fail(error)
        return
    if n_in:
        into.reshape(-1).view(torch.uint8).copy_(source.reshape(-1).view(torch.uint8))
    receive.done.set()
    send.done.set()


class Turns:
    """Rank threads take turns: one runs while the others wait for a turn, so the interpreter
    lock, which torch releases around every op, is not handed between runnable ranks at every
    op (a context switch each). A rank gives its turn up while it waits for a message
    (``wait``); a rank that waited ``patience`` seconds for a turn while no turn changed
    hands runs without one (the holder may be blocked where shardwise cannot see it: a gloo
    collective of the program's own, a store), as threads do by default, and asks again at
    its next wait."""

    def __init__(self, patience: float = 0.002) -> None:
        self._lock = threading.Lock()
        self._patience = patience
        self._passes = 0  # turns given up so far
        self._mine = threading.local()

    def enroll(self) -> None:
        """This thread is a rank: it takes turns from now on."""
        self._mine.enrolled = True
        self.take()

    def leave(self) -> None:
        self.give()
        self._mine.enrolled = False

    def take(self) -> None:
        mine = self._mine
        if not getattr(mine, "enrolled", False) or getattr(mine, "holding", False):
            return
        while True:
            seen = self._passes
            if self._lock.acquire(timeout=self._patience):
                mine.holding = True
                return
            if self._passes == seen:  # one rank kept its turn all along: it may be blocked
                return

    def give(self) -> None:
        if getattr(self._mine, "holding", False):
            self._mine.holding = False
            self._passes += 1
            self._lock.release()


class Mailbox:
    """The messages in flight between the rank threads of one ``run_threads``, and their
    turns."""

    def __init__(self) -> None:
        self.turns = Turns()
        self._lock = threading.Lock()
        self._sends: defaultdict[Key, deque[_Message]] = defaultdict(deque)
        self._receives: defaultdict[Key, deque[_Message]] = defaultdict(deque)
        self._gone: set[int] = set()

    def send(self, tensor: torch.Tensor, key: Key) -> _Message:
        return self._post(_Message(tensor), key, sending=True)

    def receive(self, buffer: torch.Tensor, key: Key) -> _Message:
        return self._post(_Message(buffer), key, sending=False)

    def _post(self, mine: _Message, key: Key, sending: bool) -> _Message:
        """Match ``mine`` with the oldest counterpart of ``key`` waiting, else queue it."""
        ours, theirs = (self._sends, self._receives) if sending else (self._receives, self._sends)
        peer = key[2] if sending else key[1]
        with self._lock:
            waiting = theirs.get(key)
            if not waiting:
                if peer in self._gone:
                    mine.fail(f"rank {peer} has left "
                              + ("and will not receive" if sending else "without sending")
                              + " this message")
                else:
                    ours[key].append(mine)
                return mine
            other = waiting.popleft()
        send, receive = (mine, other) if sending else (other, mine)
        _hand_over(send.tensor, receive, send)
        return mine

    def leave(self, rank: int) -> None:
        """``rank`` has finished (or failed): fail what waits on it."""
        with self._lock:
            self._gone.add(rank)
            for queues, side, what in ((self._receives, 1, "without sending"),
                                       (self._sends, 2, "without receiving")):
                for key, waiting in queues.items():
                    if key[side] == rank:
                        while waiting:
                            waiting.popleft().fail(f"rank {rank} has left {what} this message")


class MailboxTransport:
    """Rank thread ``rank``'s transport (``execution.Transport``): its messages through the
    ``mailbox`` its run shares; while it waits, its turn goes to another rank."""

    name = "mailbox"

    def __init__(self, mailbox: Mailbox, rank: int) -> None:
        self.mailbox, self.rank = mailbox, rank

    def send(self, tensor: torch.Tensor, peer: int, ranks: tuple[int, ...], tag: int) -> _Message:
        return self.mailbox.send(tensor, (ranks, self.rank, peer, tag))

    def receive(self, buffer: torch.Tensor, peer: int, ranks: tuple[int, ...], tag: int
                ) -> _Message:
        return self.mailbox.receive(buffer, (ranks, peer, self.rank, tag))

    def wait(self, work: Any, timeout: timedelta) -> None:
        if work.is_completed():
            work.wait(timeout)
            return
        self.mailbox.turns.give()
        try:
            work.wait(timeout)
        finally:
            self.mailbox.turns.take()


class BackendTransport:
    """The process group's own ``isend``/``irecv`` over shardwise's groups: the transport of
    a context that declares none (a per-rank process; embedded mode has no peer)."""

    name = "backend"

    def send(self, tensor: torch.Tensor, peer: int, ranks: tuple[int, ...], tag: int) -> Any:
        return dist.isend(tensor, dst=peer, group=group_for_ranks(ranks), tag=tag)

    def receive(self, buffer: torch.Tensor, peer: int, ranks: tuple[int, ...], tag: int) -> Any:
        return dist.irecv(buffer, src=peer, group=group_for_ranks(ranks), tag=tag)

    def wait(self, work: Any, timeout: timedelta) -> None:
        work.wait(timeout)


BACKEND = BackendTransport()


def transport() -> execution.Transport:
    """The transport of this thread's execution context."""
    return execution.current().transport or BACKEND


def wait(work: Any, timeout: timedelta) -> None:
    """``work.wait(timeout)`` through this context's transport."""
    transport().wait(work, timeout)


def post_send(tensor: torch.Tensor, dst: int, ranks: tuple[int, ...], tag: int):
    """Post ``tensor`` to global rank ``dst`` of the group over ``ranks`` through this
    context's transport; returns its handle."""
    return transport().send(tensor, dst, ranks, tag)


def post_receive(buffer: torch.Tensor, src: int, ranks: tuple[int, ...], tag: int):
    """Post a receive into ``buffer`` from global rank ``src`` through this context's
    transport; returns its handle."""
    return transport().receive(buffer, src, ranks, tag)
