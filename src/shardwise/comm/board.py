"""The agreement board: where the processes of a group that share one host post their
agreement fingerprints (``agreement.py``), in shared memory, instead of gathering them on the
CPU side group. A gloo round trip costs 0.4 ms between two processes and several between four
on a loaded host; posting a word and reading the peers' costs microseconds once they are there,
which matters most where it runs before the data (gloo, whose messages of another size abort the
process) and on the common cluster node, 8 GPUs of one host.

One file per set of processes, in ``/dev/shm`` (else the temporary directory), made by the
lowest rank, mapped by every member, and unlinked as soon as all have mapped it, so nothing is
left behind even if a process is killed. Member j's word for its n-th agreement lies in its ring
of ``SLOTS`` words at n mod ``SLOTS``: ``(n mod 2**16) << 48 | fingerprint mod 2**48``, written
in one aligned 8-byte store, so a reader sees it whole or not at all. A reader waits for every
member's word of n; one that shows a later n means the ring was lapped (more than ``SLOTS`` / 2
agreements started and not checked), which raises. A reader spins a few microseconds, then
sleeps in the kernel on the board's wake word (a Linux futex: every post changes it and wakes
the sleepers), so a waiting process takes no CPU from its peers and wakes as soon as the last
word arrives, as a process blocked in gloo does; where futexes are not at hand it polls. While
it waits it checks, every ``_LIVENESS`` seconds, that the members it waits for are alive (their
pids, posted at setup), so a peer that died fails the wait at once instead of at the collective
timeout.

One more ring, after the members', carries the verdicts of the host's first member when the
group spans hosts (``host_tree.py``): whether the words of every host agreed.

``open_boards`` sets up one board per host of a group's members (a host where one member runs
needs none): its members tell each other their host (host name and boot id) and pid, each
host's first member makes the file, and every member maps its host's, reads the creator's nonce
and sees its host's pids. Where any of that fails, and in rank threads or with
``settings.AGREE_IN_SHARED_MEMORY`` off (``SHARDWISE_AGREE_ON_SIDE_GROUP=1``), the side group
carries the agreement."""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import platform
import secrets
import socket
import tempfile
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch.distributed as dist

from .. import execution, settings
from ..errors import CollectiveError, CollectiveTimeoutError

SLOTS = 4096
HEADER = 2  # words before the rings: the creator's nonce, the wake word
_TAG = 1 << 16
LOW = (1 << 48) - 1  # the fingerprint's bits in a word
_LIVENESS = 0.1
_SPINS = 32
# the futex system call's number where it is known (Linux)
_SYS_FUTEX = {"x86_64": 202, "aarch64": 98, "arm64": 98}.get(platform.machine())
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class Futex:
    """A 32-bit word of memory shared between processes that a process can sleep on until
    another changes it (Linux's futex, on a shared mapping)."""

    def __init__(self, buffer: mmap.mmap, offset: int) -> None:
        self._cell = ctypes.c_uint32.from_buffer(buffer, offset)
        self._address = ctypes.c_void_p(ctypes.addressof(self._cell))
        self._syscall = ctypes.CDLL(None, use_errno=True).syscall

    @property
    def value(self) -> int:
        return self._cell.value

    def change(self, value: int) -> None:
        """Set the word (to a value no sleeper saw) and wake every process sleeping on it."""
        self._cell.value = value & 0xFFFFFFFF
        self._syscall(ctypes.c_long(_SYS_FUTEX), self._address, ctypes.c_int(_FUTEX_WAKE),
                      ctypes.c_int(2**31 - 1), None, None, ctypes.c_int(0))

    def sleep(self, seen: int, seconds: float) -> None:
        """Sleep until the word changes from ``seen`` (at once if it already has), a wake or
        ``seconds``."""
        timeout = _Timespec(int(seconds), int(seconds % 1 * 1e9))
        self._syscall(ctypes.c_long(_SYS_FUTEX), self._address, ctypes.c_int(_FUTEX_WAIT),
                      ctypes.c_int(seen), ctypes.byref(timeout), None, ctypes.c_int(0))


@dataclass
class Board:
    """One mapped board: ``me`` is this process's position among ``pids`` (the members of one
    host; the first posts the verdicts); ``path`` where its file was (unlinked once every
    member mapped it)."""

    words: memoryview
    me: int
    pids: tuple[int, ...]
    path: str = ""
    posted: int = 0
    _map: mmap.mmap | None = None
    wake: Futex | None = None

    def _at(self, ring: int, n: int) -> int:
        return HEADER + ring * SLOTS + n % SLOTS

    def _write(self, ring: int, n: int, low: int) -> None:
        """Write word n of ``ring`` and wake the sleepers: the wake word takes a value of its
        own for each (ring, n), so a sleeper never sees it change back to what it saw."""
        self.words[self._at(ring, n)] = (n % _TAG) << 48 | low
        if self.wake is not None:
            self.wake.change(n * (len(self.pids) + 1) + ring + 1)

    def _owner(self, ring: int) -> int:
        """The member who writes ``ring`` (the verdicts' ring is the first member's)."""
        return ring if ring < len(self.pids) else 0

    def post(self, fingerprint: int) -> int:
        """Post this process's next fingerprint; returns its number, for ``wait``."""
        self.posted += 1
        n = self.posted
        self._write(self.me, n, fingerprint & LOW)
        return n

    def wait(self, n: int, fingerprint: int, ranks: tuple[int, ...], what: Callable[[], str]
             ) -> bool:
        """Wait until every member posted its n-th word; whether all equal ``fingerprint``.
        Raises ``CollectiveTimeoutError`` past the collective timeout and ``CollectiveError``
        when a member it waits for has exited."""
        expected = (n % _TAG) << 48 | (fingerprint & LOW)
        return all(word == expected for word in self.words_of(n, ranks, what))

    def words_of(self, n: int, ranks: tuple[int, ...], what: Callable[[], str]) -> list[int]:
        """Every member's n-th word (tag and fingerprint), once all are posted."""
        return self._await(n, range(len(self.pids)), ranks, what)

    def post_verdict(self, n: int, same: bool) -> None:
        """The first member's verdict on agreement n (the group spans hosts)."""
        self._write(len(self.pids), n, int(same))

    def verdict(self, n: int, ranks: tuple[int, ...], what: Callable[[], str]) -> bool:
        """Wait for the first member's verdict on agreement n."""
        return bool(self._await(n, [len(self.pids)], ranks, what)[0] & 1)

    def _await(self, n: int, rings: Iterable[int], ranks: tuple[int, ...],
               what: Callable[[], str]) -> list[int]:
        """The n-th word of each of ``rings``, once all are there (``ranks``: the members',
        for errors)."""
        tag = n % _TAG
        waiting = list(rings)
        got: list[int] = []
        spins, start, checked = 0, 0.0, 0.0
        while True:
            seen = self.wake.value if self.wake is not None else 0
            still = []
            for j in waiting:
                word = self.words[self._at(j, n)]
                if word >> 48 == tag:
                    got.append(word)
                elif (word >> 48) == (n + SLOTS) % _TAG:
                    raise CollectiveError(
                        f"{what()}: more than {SLOTS // 2} agreements were started and not "
                        f"checked on rank {ranks[self.me]}; the agreement board of ranks "
                        f"{list(ranks)} was lapped")
                else:
                    still.append(j)
            if not still:
                return got
            waiting = still
            spins += 1
            if spins < _SPINS:
                continue
            now = time.monotonic()
            if not start:
                start = checked = now
            elif now - checked > _LIVENESS:
                checked = now
                self._alive(waiting, ranks, what)
                if now - start > settings.COLLECTIVE_TIMEOUT.get():
                    seconds = settings.COLLECTIVE_TIMEOUT.get()
                    raise CollectiveTimeoutError(
                        f"{what()}: the processes' agreement did not complete within the "
                        f"collective timeout of {seconds:g} s: rank(s) "
                        f"{[ranks[self._owner(j)] for j in waiting]} did not take part "
                        f"(diverged, failed, late or hung)")
            if self.wake is not None:
                self.wake.sleep(seen, _LIVENESS)
            else:
                time.sleep(0 if now - start < 5e-5 else min(1e-4, (now - start) / 10))

    def _alive(self, rings: list[int], ranks: tuple[int, ...], what: Callable[[], str]
               ) -> None:
        for ring in rings:
            j = self._owner(ring)
            if not _running(self.pids[j]):
                raise CollectiveError(
                    f"{what()} failed: the process of rank {ranks[j]} (pid {self.pids[j]}) "
                    f"exited while rank {ranks[self.me]} waited for it at the agreement")


def _running(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return True


def _host() -> str:
    """This host's name and boot id: equal for processes that can share memory."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as boot:
            return f"{socket.gethostname()}/{boot.read().strip()}"
    except OSError:
        return socket.gethostname()


def _directory() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def _map(path: str, size: int) -> mmap.mmap | None:
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return None
    try:
        return mmap.mmap(fd, size)
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)


@dataclass(frozen=True)
class Boards:
    """What ``open_boards`` set up for this process: ``hosts`` lists the positions (in the
    group's ranks) of the members of each host, each host's in order and the hosts by their
    first member; ``board`` is this process's host's (None where it runs alone there)."""

    hosts: tuple[tuple[int, ...], ...]
    board: Board | None


def _size(members: int) -> int:
    return 8 * (HEADER + (members + 1) * SLOTS)


def _make_file(members: int) -> tuple[str | None, int]:
    """A zeroed board file for ``members`` with a fresh nonce first: its path and the nonce
    (None where it cannot be made)."""
    path = os.path.join(_directory(), f"shardwise-agreement-{uuid.uuid4().hex}")
    nonce = secrets.randbits(63)
    try:
        with open(path, "wb") as file:
            file.write(nonce.to_bytes(8, "little") + bytes(_size(members) - 8))
    except OSError:
        return None, 0
    return path, nonce


def open_boards(ranks: tuple[int, ...], side: dist.ProcessGroup) -> Boards | None:
    """Set up the boards of the hosts of ``ranks`` (every member calls it at the same point, on
    ``side``), or None where the side group must carry the agreement."""
    me = ranks.index(dist.get_rank())
    willing = (settings.AGREE_IN_SHARED_MEMORY.get()
               and execution.current().kind is not execution.Kind.RANK_THREAD)
    offers: list = [None] * len(ranks)
    dist.all_gather_object(offers, (willing, _host(), os.getpid()), group=side)
    if not all(offer[0] for offer in offers):
        return None
    by_host: dict[str, list[int]] = {}
    for j, offer in enumerate(offers):
        by_host.setdefault(offer[1], []).append(j)
    hosts = tuple(tuple(members) for members in by_host.values())
    local = by_host[offers[me][1]]
    pids = tuple(offers[j][2] for j in local)
    made = _make_file(len(local)) if local[0] == me and len(local) > 1 else (None, 0)
    files: list = [None] * len(ranks)
    dist.all_gather_object(files, made, group=side)
    path, nonce = files[local[0]]
    mapped = _map(path, _size(len(local))) if path is not None else None
    words = mapped and memoryview(mapped).cast("Q")
    ok = len(local) == 1 or (bool(words) and words[0] == nonce and all(map(_running, pids)))
    results: list = [None] * len(ranks)
    dist.all_gather_object(results, ok, group=side)
    if made[0] is not None:
        with contextlib.suppress(OSError):
            os.unlink(made[0])
    if not all(results):
        if words:
            words.release()
            mapped.close()
        return None
    if len(local) == 1:
        return Boards(hosts, None)
    wake = Futex(mapped, 8) if _SYS_FUTEX is not None else None
    return Boards(hosts, Board(words, local.index(me), pids, path, _map=mapped, wake=wake))
