"""One rank of a PyTorch program, observed: ``python record.py PROGRAM.py`` (or the program
named by ``PROGRAM_PATH``).

Runs the program as ``python PROGRAM.py`` would (its folder first on ``sys.path``, run as
``__main__``) and changes nothing in it. Before, it seeds torch's generator with ``SEED + RANK``
(``SEED`` on every rank with ``PROGRAM_SEED=same``): torch seeds it from the OS at start-up
here, and the programs draw their initial weights (the sequence-parallel ones their inputs
too) from it, so each rank draws differently, as it would, but the same in every run.

It prints ``RANK <rank> LOSS <step> <value>`` for every scalar the program calls
``backward()`` on (its global value, repr-exact), and when the program destroys its process
group, rank 0 saves the full value of every parameter its optimizers stepped, and of their
gradients, to the file ``PROGRAM_RECORD`` names. ``PROGRAM_SDPA=math`` runs the program
under SDPA's math backend and ``PROGRAM_IMPLICIT_REPLICATION=1`` under torch's
implicit_replication (a ``harness.Programs``' ``oracle_env``).
"""

from __future__ import annotations

import contextlib
import os
import runpy
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.optim.optimizer import register_optimizer_step_post_hook

SEED = 1234


class _Rank:
    """What is recorded of one rank: its optimizers and loss steps."""

    def __init__(self) -> None:
        self.optimizers: list[torch.optim.Optimizer] = []
        self.steps = 0
        self.recorded = False


# one process may run several ranks (shardwise.launch --threads runs this file once per rank
# thread): torch's hooks are installed once, on the first run, and find the rank's record by
# its RANK (each rank thread sees its own environment)
_RANKS: dict[str, _Rank] = torch.Tensor.__dict__.get("_record_ranks", {})


def _mine() -> _Rank:
    return _RANKS.setdefault(os.environ["RANK"], _Rank())


def _full(t: torch.Tensor) -> torch.Tensor:
    """The global value of a (torch or shardwise) DTensor; a plain tensor as it is."""
    full = t.full_tensor() if hasattr(t, "full_tensor") else t
    return full.detach().clone()


_inside = threading.local()


def _backward(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    if getattr(_inside, "backward", False):  # a torch function mode calls Tensor.backward again
        return _ORIGINAL_BACKWARD(self, *args, **kwargs)
    if self.numel() == 1:
        with torch.no_grad():
            value = _full(self).item()
        rank = _mine()
        print(f"RANK {os.environ['RANK']} LOSS {rank.steps} {value!r}", flush=True)
        rank.steps += 1
    _inside.backward = True
    try:
        return _ORIGINAL_BACKWARD(self, *args, **kwargs)
    finally:
        _inside.backward = False


def _remember(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    mine = _mine().optimizers
    if not any(o is optimizer for o in mine):
        mine.append(optimizer)


def _record() -> None:
    """Every rank takes part (the full values are gathered); rank 0 writes the file."""
    rank = _mine()
    if rank.recorded or not rank.optimizers:  # recorded already, or the program never trained
        return
    rank.recorded = True
    params = [p for o in rank.optimizers for g in o.param_groups for p in g["params"]]
    with torch.no_grad():
        values = [_full(p) for p in params]
        grads = [None if p.grad is None else _full(p.grad) for p in params]
    if dist.get_rank() == 0 and "PROGRAM_RECORD" in os.environ:
        torch.save({"params": values, "grads": grads}, os.environ["PROGRAM_RECORD"])
    # gloo's worker thread drops a finished gather's tensors a moment after the wait returns;
    # when that falls into interpreter finalization (the program ends right after this) the
    # drop takes the GIL and std::terminate aborts the process (about 1 run in 15 seen here)
    time.sleep(0.05)


def _destroy(group: Any = None) -> None:
    if group is None and dist.is_initialized():
        _record()
    _ORIGINAL_DESTROY(group)


def _install() -> None:
    """Torch's hooks, once per process."""
    if "_record_ranks" in torch.Tensor.__dict__:
        return
    torch.Tensor._record_ranks = _RANKS  # type: ignore[attr-defined]
    torch.Tensor.backward = _backward  # type: ignore[method-assign]
    dist.destroy_process_group = _destroy
    register_optimizer_step_post_hook(_remember)


_ORIGINAL_BACKWARD = torch.Tensor.__dict__.get("_record_backward", torch.Tensor.backward)
_ORIGINAL_DESTROY = getattr(dist, "_record_destroy", dist.destroy_process_group)
torch.Tensor._record_backward = _ORIGINAL_BACKWARD  # type: ignore[attr-defined]
dist._record_destroy = _ORIGINAL_DESTROY  # type: ignore[attr-defined]


def main() -> None:
    # rank threads share sys.argv (and runpy rewrites its first entry): PROGRAM_PATH says it
    program = Path(os.environ.get("PROGRAM_PATH") or sys.argv[1]).resolve()
    sys.argv = [str(program)]
    sys.path[0] = str(program.parent)  # as `python PROGRAM.py`: its helpers import from there
    _install()
    same = os.environ.get("PROGRAM_SEED") == "same"
    torch.manual_seed(SEED if same else SEED + int(os.environ["RANK"]))
    with contextlib.ExitStack() as stack:
        if os.environ.get("PROGRAM_SDPA") == "math":
            stack.enter_context(sdpa_kernel([SDPBackend.MATH]))
        if os.environ.get("PROGRAM_IMPLICIT_REPLICATION") == "1":
            from torch.distributed.tensor.experimental import implicit_replication

            stack.enter_context(implicit_replication())
        runpy.run_path(str(program), run_name="__main__")
    if dist.is_initialized():  # a program that leaves its process group alone
        _record()


if __name__ == "__main__":
    main()
