"""The agreement of a group that spans hosts: each host's members post on their host's board
(``board.py``), each host's first member (its leader) reads them, and the leaders combine the
smallest and largest fingerprint of their hosts by a dissemination exchange on the side group
(round r: send to the leader 2**r places on, receive from the one 2**r places back; after
ceil(log2 H) rounds every leader holds the whole group's), then post the verdict on their board
for the others. H hosts cost every leader ceil(log2 H) rounds of one 16-byte message each way,
where a gather of the group's words on the side group takes N - 1 dependent steps (gloo's ring)
for N processes: 3 rounds against 63 steps for 64 processes on 8 hosts, 7 against 1,023 for
1,024 on 128. Agreements are decided in the order they were posted, whichever is waited first,
so every leader exchanges them in the same order.

The others of a host wait for their leader to reach the check of the same agreement (or a later
one), where a gather waited only for every process to start it. Processes that run the same
program reach their checks at the same points of it (right after enqueueing a collective that
is waited at once, at the first use of one left in flight; never from a garbage collection), so
the leader is never held up by what a waiting process has not done yet; a process whose leader
never gets there (a divergent program) fails at the collective timeout naming the leader."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from .. import runtime, settings
from ..errors import CollectiveError, CollectiveTimeoutError
from .board import LOW, Board, Boards


@dataclass
class HostTree:
    """This process's part in the agreement of ``ranks`` across ``hosts`` (positions in
    ``ranks`` per host, leader first); ``board`` is its host's (None: alone there)."""

    ranks: tuple[int, ...]
    hosts: tuple[tuple[int, ...], ...]
    board: Board | None
    posted: int = 0
    decided: int = 0
    words: dict[int, int] = field(default_factory=dict)
    verdicts: dict[int, bool] = field(default_factory=dict)

    def __post_init__(self) -> None:
        me = self.ranks.index(dist.get_rank())
        self.host = next(h for h, members in enumerate(self.hosts) if me in members)
        self.local = tuple(self.ranks[j] for j in self.hosts[self.host])
        self.leader = self.hosts[self.host][0] == me
        self.leaders = tuple(self.ranks[members[0]] for members in self.hosts)
        # the leaders' own side group, made by them alone when first needed
        self._group: dist.ProcessGroup | None = None

    def post(self, fingerprint: int) -> int:
        """Post this process's next fingerprint; returns its number, for ``wait``."""
        self.posted += 1
        if self.board is not None:
            self.board.post(fingerprint)
        if self.leader:
            self.words[self.posted] = fingerprint & LOW
        return self.posted

    def wait(self, n: int, fingerprint: int, ranks: tuple[int, ...], what: Callable[[], str]
             ) -> bool:
        """Whether every process of the group posted ``fingerprint`` as its n-th word."""
        if not self.leader and self.board is not None:  # (a process alone leads its host)
            return self.board.verdict(n, self.local, what)
        while self.decided < n:
            self._decide(self.decided + 1, what)
        return self.verdicts.pop(n)

    def _decide(self, n: int, what: Callable[[], str]) -> None:
        low = high = self.words.pop(n)
        if self.board is not None:  # the host's words, this process's among them
            fingerprints = [w & LOW for w in self.board.words_of(n, self.local, what)]
            low, high = min(fingerprints), max(fingerprints)
        low, high = self._exchange(low, high, what)
        same = low == high
        if self.board is not None:
            self.board.post_verdict(n, same)
        self.verdicts[n] = same
        self.decided = n

    def _exchange(self, low: int, high: int, what: Callable[[], str]) -> tuple[int, int]:
        """The smallest and largest fingerprint of every host, by dissemination."""
        if self._group is None:
            self._group = runtime.side_group_for_ranks(tuple(sorted(self.leaders)))
        count, me = len(self.leaders), self.host
        seconds = settings.COLLECTIVE_TIMEOUT.get()
        step, tag = 1, 0
        while step < count:
            mine = torch.tensor([low, high], dtype=torch.int64)
            theirs = torch.empty(2, dtype=torch.int64)
            source = self.leaders[(me - step) % count]
            works = [dist.isend(mine, self.leaders[(me + step) % count], group=self._group,
                                tag=tag),
                     dist.irecv(theirs, source, group=self._group, tag=tag)]
            for work in works:
                try:
                    work.wait(timedelta(seconds=seconds))
                except RuntimeError as err:
                    kind = (CollectiveTimeoutError if "timed out" in str(err).lower()
                            else CollectiveError)
                    raise kind(
                        f"{what()}: the agreement between the hosts' first processes did not "
                        f"complete (rank {dist.get_rank()} waiting for rank {source}, within "
                        f"the collective timeout of {seconds:g} s): {err}") from err
            low, high = min(low, int(theirs[0])), max(high, int(theirs[1]))
            step, tag = 2 * step, tag + 1
        return low, high


def channel(ranks: tuple[int, ...], boards: Boards) -> Board | HostTree | None:
    """What carries the agreement of ``ranks``: the one board of a group on one host, the host
    tree of a group across hosts."""
    if len(boards.hosts) == 1:
        return boards.board
    return HostTree(ranks, boards.hosts, boards.board)
