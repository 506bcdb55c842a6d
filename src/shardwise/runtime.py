"""The process runtime: who this process is, how it joins its peers, the process groups it
keeps, and how it leaves. Everything shardwise does to ``torch.distributed`` outside the
collectives themselves happens here:

- ``rank_and_world``: this process's rank and the world size ((0, 1) when torch.distributed is
  not initialized). In the launcher's threads mode each rank thread is a process of its own
  (``rank_threads`` switches c10d's state per thread), so the answer is the thread's.
- ``start``: start-up from the ``torchrun`` environment, under one deadline: meeting at rank
  0's store (``rendezvous``) and initializing the default process group together take at most
  the collective timeout, and a rank that never comes is named.
- ``group_for_ranks``: the process group over a set of ranks, made once per process (per rank
  thread) by its members only.
- ``shutdown``: destroy every process group this process made or used, so the backend's
  worker threads are joined before the interpreter finalizes. It runs at exit (registered when
  shardwise is imported, so after the program's own exit handlers), at the end of each rank
  thread, and whenever a program calls it.
"""

from __future__ import annotations

import atexit
import socket
import threading
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from . import settings
from .errors import CollectiveError, CollectiveTimeoutError, MeshError
from .torch_compat import c10d_world, get_default_group, new_process_group_helper


def initialized() -> bool:
    """Whether this process (rank thread) is part of a ``torch.distributed`` world."""
    return dist.is_available() and dist.is_initialized()


def rank_and_world() -> tuple[int, int]:
    """(rank, world size) of this process; (0, 1) when torch.distributed is not initialized."""
    if initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


# ----- start-up ---------------------------------------------------------------------------------


def start(device_type: str, wanted: bool | None) -> None:
    """Initialize torch.distributed from the torchrun environment: when ``wanted`` is True, or
    when it is None and the environment names a world of several processes (``WORLD_SIZE``
    above 1; see ``init_device_mesh``). Nothing when it is already initialized or ``wanted``
    is False. ``MeshError`` when the environment is half set (``RANK``, ``MASTER_ADDR`` or
    ``MASTER_PORT`` missing) or malformed: never one process owning every device instead."""
    if wanted is False or not dist.is_available() or dist.is_initialized():
        return
    env = settings.torchrun_environ()
    if wanted is None and _env_int("WORLD_SIZE", 1) <= 1:
        return
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in env]
    if missing:
        why = ("init_process_group=True reads the torchrun environment" if wanted else
               f"WORLD_SIZE={env['WORLD_SIZE']} names a world of several processes (alone, each "
               f"would run as one process owning every device)")
        raise MeshError(
            f"{why}, but {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set; "
            f"start the script with torchrun or python -m shardwise.launch (or unset "
            f"WORLD_SIZE to run as one process)"
        )
    rank, world = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
    if not 0 <= rank < world:
        raise MeshError(f"RANK={rank} is not a rank of WORLD_SIZE={world} processes")
    backend = "nccl" if device_type == "cuda" else "gloo"
    seconds = settings.COLLECTIVE_TIMEOUT.get()
    timeout = timedelta(seconds=seconds)
    if "TORCHELASTIC_RUN_ID" in env:  # torchrun's agent owns the store and watches the peers
        dist.init_process_group(backend, timeout=timeout)
        return
    store = rendezvous(rank, world, seconds)
    # every rank has joined the store: the backend connects them at once (the timeout given
    # here is the process group's collective timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)


def _env_int(name: str, default: int) -> int:
    """The torchrun variable ``name`` as an integer (``default`` when unset); ``MeshError``
    naming it for anything else."""
    text = settings.environ(name)
    if text is None:
        return default
    try:
        return int(text)
    except ValueError:
        raise MeshError(f"{name}={text!r} is not an integer (the torchrun environment)") from None


def rendezvous(rank: int, world: int, seconds: float) -> Any:
    """The store every process meets at (rank 0 hosts it at MASTER_ADDR:MASTER_PORT), once all
    ``world`` processes have joined it. Reaching the store and waiting for the others share
    one deadline of ``seconds``; past it raise ``CollectiveTimeoutError`` naming the ranks that
    did not come (or rank 0's store that could not be reached)."""
    addr, port = settings.torchrun_environ()["MASTER_ADDR"], _env_int("MASTER_PORT", 0)
    deadline = time.monotonic() + seconds
    if rank != 0:
        _wait_for_store(rank, world, addr, port, seconds, deadline)
    try:
        store = dist.TCPStore(
            addr, port, world, is_master=rank == 0, wait_for_workers=False,
            timeout=timedelta(seconds=max(deadline - time.monotonic(), 0.1)),
        )
    except RuntimeError as err:
        raise CollectiveTimeoutError(
            f"process-group setup: rank {rank} of {world} could not reach the store of rank 0 "
            f"at {addr}:{port} within {seconds:g} s (rank 0 did not start, died, or the "
            f"address is wrong): {err}"
        ) from None
    missing = [r for r in range(world) if r != rank]
    while True:
        try:
            store.set(f"shardwise/joined/{rank}", "1")
            missing = [r for r in range(world) if not store.check([f"shardwise/joined/{r}"])]
        except RuntimeError as err:
            raise CollectiveError(
                f"process-group setup: rank {rank} of {world} lost the store of rank 0 at "
                f"{addr}:{port} while ranks {missing} had not joined (rank 0 gave up waiting "
                f"for them, or died): {err}"
            ) from None
        if not missing:
            store.set_timeout(timedelta(seconds=seconds))  # for the groups made through it
            return store
        if time.monotonic() >= deadline:
            raise CollectiveTimeoutError(
                f"process-group setup: ranks {missing} of {world} did not join within the "
                f"collective timeout of {seconds:g} s (rank {rank} waited at {addr}:{port}); "
                f"they died or were not started"
            )
        time.sleep(0.02)


def _wait_for_store(
    rank: int, world: int, addr: str, port: int, seconds: float, deadline: float
) -> None:
    """Wait until rank 0's store accepts connections, until ``deadline`` (the store's own
    client retries with back-off past its timeout)."""
    while True:
        left = deadline - time.monotonic()
        try:
            with socket.create_connection((addr, port), timeout=max(min(left, 1.0), 0.01)):
                return
        except OSError:
            if time.monotonic() + 0.05 >= deadline:
                raise CollectiveTimeoutError(
                    f"process-group setup: rank {rank} of {world} could not reach the store of "
                    f"rank 0 at {addr}:{port} within {seconds:g} s (rank 0 did not start, died, "
                    f"or the address is wrong)"
                ) from None
            time.sleep(0.05)


# ----- process groups ---------------------------------------------------------------------------

# per process (per rank thread in the launcher's threads mode, settings.ProcessLocal)
_process_groups: settings.ProcessLocal[dict[tuple, dist.ProcessGroup]] = (
    settings.ProcessLocal(dict)
)
# one lock per process (per rank thread): a rank holds it while its group's members meet, so
# a lock shared by rank threads would keep the other members from coming
_group_lock: settings.ProcessLocal[threading.Lock] = settings.ProcessLocal(threading.Lock)


def group_for_ranks(ranks: tuple[int, ...]) -> dist.ProcessGroup:
    """The process group over ``ranks`` (global ranks, ascending), created on first use: never
    the program's own default group, even over the whole world, so shardwise's collectives
    (some issued from its background worker) never interleave with the program's.

    Only its members create it, and its name (where they meet in the store) is made of its
    ranks alone (``_new_group``), so processes that made different groups before (a mesh over
    ranks 0 and 2 on those two, one over ranks 1 and 3 on the others) still meet. A mesh dim's
    groups are created together, in mesh order, and collectives run in one order in every
    process, so members reach a creation in the same order.
    """
    pg = _live_groups().get(ranks)
    if pg is not None:
        return pg
    return _made(ranks, None)


def _live_groups() -> dict[tuple, dist.ProcessGroup]:
    """This process's groups, forgotten once the world they were made in is gone (a program
    that destroyed its process groups itself and initialized torch.distributed again, as
    PyTorch's test harness does per test, or a forked child of such a process)."""
    groups = _process_groups.get()
    if groups and next(iter(groups.values())) not in c10d_world().pg_map:
        groups.clear()
    return groups


def side_group_for_ranks(ranks: tuple[int, ...]) -> dist.ProcessGroup:
    """A gloo group over ``ranks`` for what the host checks beside the data (the agreement of
    ``comm/agreement.py``): the data's own group where that is gloo, else one of its own, so
    a check never waits on an accelerator. On torch's ``fake`` backend (no peers, nothing
    to wait on; no store a gloo group could meet on) the data's own group."""
    group = group_for_ranks(ranks)
    if dist.get_backend(group) in ("gloo", "fake"):
        return group
    return _live_groups().get(("gloo", *ranks)) or _made(ranks, "gloo")


def _made(ranks: tuple[int, ...], backend: str | None) -> dist.ProcessGroup:
    """Create (once, under the lock) the group over ``ranks`` on ``backend`` (None: the
    default group's)."""
    key = ranks if backend is None else (backend, *ranks)
    process_groups = _process_groups.get()
    with _group_lock.get():
        pg = process_groups.get(key)
        if pg is None:
            try:
                pg = _new_group(ranks, backend)
            except RuntimeError as err:
                raise CollectiveError(
                    f"creating the process group of ranks {list(ranks)} failed on rank "
                    f"{dist.get_rank()}: {err}"
                ) from err
            process_groups[key] = pg
    return pg


def _new_group(ranks: tuple[int, ...], backend: str | None) -> dist.ProcessGroup:
    """A process group over ``ranks`` made by its members only, named by its ranks (and
    backend) alone.

    ``dist.new_group(use_local_synchronization=True)`` would name it by its ranks and the
    number of process groups this process has made so far: processes whose programs made
    different groups before name it differently and each waits for the others under its own
    name forever. So the group is made as ``new_group`` makes it, with the name given (each set
    of ranks is made once per process, so the name is unique)."""
    default = get_default_group()
    default_backend, store = c10d_world().pg_map[default]
    prefix = "shardwise_ranks_" if backend is None else f"shardwise_{backend}_ranks_"
    name = prefix + "_".join(map(str, ranks))
    pg, _ = new_process_group_helper(
        len(ranks),
        ranks.index(dist.get_rank()),
        list(ranks),
        dist.Backend(backend or default_backend),
        store,
        name,
        timeout=timedelta(seconds=settings.COLLECTIVE_TIMEOUT.get()),
        device_id=None if backend else default.bound_device_id,
        group_desc=f"shardwise ranks {list(ranks)}",
    )
    c10d_world().pg_group_ranks[pg] = {rank: i for i, rank in enumerate(ranks)}
    return pg


# ----- barriers ---------------------------------------------------------------------------------


def barrier(ranks: tuple[int, ...] | None = None, seconds: float | None = None,
            what: str = "barrier") -> None:
    """Wait until every process of ``ranks`` (all of the world when None) arrives; nothing to
    wait for without a world or with one process. Past ``seconds`` (default: the collective
    timeout) on gloo it raises ``CollectiveTimeoutError`` naming ``what``; other backends wait
    as their own timeout says."""
    rank, world = rank_and_world()
    ranks = tuple(range(world)) if ranks is None else ranks
    if world < 2 or len(ranks) < 2:
        return
    seconds = settings.COLLECTIVE_TIMEOUT.get() if seconds is None else seconds
    group = group_for_ranks(ranks)
    if dist.get_backend(group) != "gloo":
        dist.barrier(group)
        return
    try:
        dist.monitored_barrier(group, timeout=timedelta(seconds=seconds))
    except RuntimeError as err:
        raise CollectiveTimeoutError(
            f"{what}: processes {list(ranks)} did not all arrive within {seconds:g} s ({err})"
        ) from None


# ----- shutdown ---------------------------------------------------------------------------------


def shutdown() -> None:
    """Leave the world: forget shardwise's process groups and destroy every process group of
    this process (rank thread), whoever started it, so the backend's worker threads are
    joined now (one that drops its last tensors during interpreter finalization aborts the
    process). Afterwards torch.distributed is not initialized; calling it again, or without a
    world, does nothing. Every process of the world should call it at its end (it runs at exit
    by itself); collectives after it raise."""
    _process_groups.get().clear()
    if initialized():
        dist.destroy_process_group()


atexit.register(shutdown)  # at import: after the exit handlers the program registers later
