"""Save and load a whole training state (model, optimizer, RNG, step, extra values) in one
call, on torch.distributed.checkpoint, resharding on load.

``save`` writes into a new directory beside ``path`` and exchanges it with ``path`` only once
complete, so a save killed part-way leaves the previous checkpoint loadable; it refuses a
``path`` holding anything it did not write and removes only what it wrote (``directory``). It
records a digest of every item and of the
metadata (``storage.py``). ``load`` runs nothing from the checkpoint (allow-listed metadata
unpickling, weights-only values, ``extra`` as JSON), compares the metadata with the state it
loads into (``CheckpointMismatchError`` naming every difference), reads and verifies
everything into a staging copy, and only then copies into the model and optimizer: any error
leaves them as they were.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import operator
import os
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from .. import runtime
from ..dcp_protocol import release_reduced
from ..dtensor import DTensor
from ..errors import (
    CheckpointCorruptError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CheckpointPathError,
    ShardwiseError,
    ShardwiseTypeError,
)
from ..torch_compat import flatten_state_dict, set_element
from . import directory
from .extra import decode, encode
from .storage import (
    METADATA,
    RECORD,
    Checkpoint,
    DigestWriter,
    VerifiedReader,
    load_plain,
    open_checkpoint,
)

PROGRESS_BYTES = 64 << 20  # show a progress bar by default from this many bytes on
HEADER = "shardwise"  # the state key of the JSON header: step and the extra tree


def _rank0() -> bool:
    return runtime.rank_and_world()[0] == 0


def _barrier() -> None:
    runtime.barrier(what="checkpoint")


def _init_optimizer_state(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Create the state a fresh optimizer creates at its first step (with zero gradients and
    a zero learning rate, so parameters do not move), for the checkpoint to load into; returns
    the parameters that had no state."""
    params = [p for g in optimizer.param_groups for p in g["params"] if p not in optimizer.state]
    if not params:
        return params
    lrs = [g["lr"] for g in optimizer.param_groups]
    grads = {id(p): p.grad for g in optimizer.param_groups for p in g["params"]}
    for g in optimizer.param_groups:
        g["lr"] = 0.0
        for p in g["params"]:
            p.grad = torch.zeros_like(p)  # placed as the parameter, unlike some gradients
    try:
        optimizer.step()
    finally:
        for g, lr in zip(optimizer.param_groups, lrs, strict=True):
            g["lr"] = lr
            for p in g["params"]:
                p.grad = grads[id(p)]
    return params


def _progress(total: int, desc: str, progress: bool | None) -> Any:
    """A tqdm bar over ``total`` bytes, or None (tqdm missing, small state, not rank 0)."""
    if progress is False or (progress is None and total < PROGRESS_BYTES) or not _rank0():
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024)


class _SavePlanner(dcp.DefaultSavePlanner):
    def __init__(self, progress: bool | None) -> None:
        super().__init__()
        self._progress, self._bar = progress, None

    def create_local_plan(self):
        plan = super().create_local_plan()
        total = sum(
            math.prod(item.tensor_data.chunk.sizes)
            * torch.empty((), dtype=item.tensor_data.properties.dtype).element_size()
            for item in plan.items
            if item.tensor_data is not None
        )
        self._bar = _progress(total, "checkpoint save", self._progress)
        return plan

    def resolve_data(self, write_item):
        data = super().resolve_data(write_item)
        if self._bar is not None and isinstance(data, torch.Tensor):
            self._bar.update(data.numel() * data.element_size())
        return data

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


class _LoadPlanner(dcp.DefaultLoadPlanner):
    def __init__(self, progress: bool | None) -> None:
        super().__init__()
        self._progress, self._bar = progress, None

    def create_local_plan(self):
        plan = super().create_local_plan()
        total = 0
        for item in plan.items:
            md = self.metadata.state_dict_metadata[item.storage_index.fqn]
            if isinstance(md, TensorStorageMetadata):
                size = torch.empty((), dtype=md.properties.dtype).element_size()
                total += math.prod(item.lengths) * size
        self._bar = _progress(total, "checkpoint load", self._progress)
        return plan

    def load_bytes(self, read_item, value) -> None:
        # DCP's own unpickles with weights_only=False, which runs whatever the bytes name
        set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn],
                    load_plain(value))

    def commit_tensor(self, read_item, tensor) -> None:
        super().commit_tensor(read_item, tensor)
        if self._bar is not None:
            self._bar.update(tensor.numel() * tensor.element_size())

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def _with_planner(planner: Any, run: Callable[[Any], None]) -> None:
    try:
        with warnings.catch_warnings():  # one process without torch.distributed is intended
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            run(planner)
    finally:
        planner.close()


def _check_fits(path: Path, metadata: Metadata, state: dict[str, Any]) -> None:
    """Raise naming every difference between the checkpoint's keys, shapes and dtypes and the
    state's, for the sections the state holds."""
    saved = metadata.state_dict_metadata
    flat, _ = flatten_state_dict(state)
    sections = {key.split(".", 1)[0] for key in flat}
    saved_keys = {k for k in saved if k.split(".", 1)[0] in sections}
    missing = sorted(set(flat) - saved_keys)
    unexpected = sorted(saved_keys - set(flat))
    mismatched = []
    for key in sorted(set(flat) & saved_keys):
        value, md = flat[key], saved[key]
        saved_tensor = isinstance(md, TensorStorageMetadata)
        if isinstance(value, torch.Tensor) != saved_tensor:
            what = "a tensor" if saved_tensor else "a non-tensor value"
            mismatched.append(f"{key}: saved {what}, this state has a {type(value).__name__}")
        elif isinstance(value, torch.Tensor):
            if tuple(md.size) != tuple(value.shape) or md.properties.dtype != value.dtype:
                mismatched.append(
                    f"{key}: saved shape {list(md.size)} {md.properties.dtype}, model has "
                    f"{list(value.shape)} {value.dtype}"
                )
    if missing or unexpected or mismatched:

        def listed(title: str, items: list[str]) -> str:
            shown = items[:20] + ([f"... {len(items) - 20} more"] if len(items) > 20 else [])
            return f"\n  {title} ({len(items)}): " + (", ".join(shown) if items else "none")

        raise CheckpointMismatchError(
            f"the checkpoint at {str(path)!r} does not fit this state; nothing was loaded."
            + listed("missing from the checkpoint", missing)
            + listed("unexpected in the checkpoint", unexpected)
            + listed("shape/dtype mismatches", mismatched)
        )




def _training_state(
    model: torch.nn.Module | None, optimizer: torch.optim.Optimizer | None
) -> dict[str, Any]:
    state: dict[str, Any] = {"rng": torch.get_rng_state()}
    if model is not None:
        state["model"] = model.state_dict()
    if optimizer is not None:
        state["optim"] = optimizer.state_dict()
    return state


def _header(step: Any, extra: dict | None) -> tuple[str, list[torch.Tensor]]:
    """The JSON header (step and the tree of ``extra``) and the tensors of ``extra``;
    ``ShardwiseTypeError`` for a step that is no integer or an unsupported extra value."""
    header: dict[str, Any] = {}
    tensors: list[torch.Tensor] = []
    if step is not None:
        if isinstance(step, bool) or not hasattr(type(step), "__index__"):
            raise ShardwiseTypeError(
                f"step={step!r} ({type(step).__name__}): a checkpoint's step is an integer; "
                f"nothing was saved"
            )
        header["step"] = operator.index(step)
    if extra is not None:
        header["extra"], tensors = encode(extra)
    return json.dumps(header), tensors


def save(
    path: str | os.PathLike,
    model: torch.nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    step: int | None = None,
    extra: dict | None = None,
    progress: bool | None = None,
) -> None:
    """Save ``model`` and ``optimizer`` state (DTensors as their shards), torch's RNG state,
    ``step`` (an integer) and ``extra`` (None, bool, int, float, str, bytes, lists, tuples,
    dicts and tensors, nested; anything else raises ``ShardwiseTypeError`` before anything is
    written) to the directory ``path``, atomically. ``path`` is new, an empty directory, or a
    checkpoint ``save`` wrote (replaced whole); anything else raises ``CheckpointPathError``
    before anything is written. Every process calls it. ``progress``: a tqdm bar (default: for
    states from 64 MiB on)."""
    header, tensors = _header(step, extra)
    path = Path(path)
    with _exclusive(path) if _rank0() else contextlib.nullcontext():
        _save(path, model, optimizer, header, tensors, progress)


@contextlib.contextmanager
def _exclusive(path: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on the directory that holds ``path`` while saving to
    ``path``: a concurrent save there (a thread, or a process of another job) waits for this
    one to finish, so saves to one path run one after the other. No lock file is made; the
    kernel releases the lock of a killed process."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _on_rank0(run: Callable[[], Any]) -> Any:
    """``run()`` on rank 0, its result given to every rank; when it raises, rank 0 raises
    that and the other ranks a ``CheckpointPathError`` carrying its message."""
    rank, world = runtime.rank_and_world()
    result = failure = None
    try:
        if rank == 0:
            result = run()
    except Exception as exc:
        failure = exc
    if world > 1:
        box = [(result, None if failure is None else f"{type(failure).__name__}: {failure}")]
        dist.broadcast_object_list(box, src=0)
        result, message = box[0]
        if failure is None and message is not None:
            raise CheckpointPathError(f"rank 0 could not save the checkpoint: {message}")
    if failure is not None:
        raise failure
    return result


def _save(
    path: Path, model: torch.nn.Module | None, optimizer: torch.optim.Optimizer | None,
    header: str, tensors: list[torch.Tensor], progress: bool | None,
) -> None:
    saving = Path(_on_rank0(lambda: str(directory.new_saving_dir(path))))
    state = _training_state(model, optimizer)
    state[HEADER] = header
    if tensors:
        state["extra"] = {str(i): t for i, t in enumerate(tensors)}
    _with_planner(
        _SavePlanner(progress),
        lambda planner: dcp.save(
            state, storage_writer=DigestWriter(saving), planner=planner,
            no_dist=not dist.is_initialized(),
        ),
    )
    release_reduced()
    _barrier()
    _on_rank0(lambda: directory.replace(path, saving))


def _resolve(path: Path) -> Path:
    """``path``, or the previous checkpoint when a save was killed between its two renames."""
    if not os.path.lexists(path):
        previous = directory.interrupted(path)
        if previous is not None:
            return previous
        raise CheckpointNotFoundError(f"no checkpoint at {str(path)!r}: the path does not exist")
    if not path.is_dir():
        raise CheckpointNotFoundError(f"no checkpoint at {str(path)!r}: it is not a directory")
    if not (path / RECORD).exists() and not (path / METADATA).exists():
        raise CheckpointNotFoundError(
            f"no checkpoint at {str(path)!r}: the directory holds neither {RECORD} nor "
            f"{METADATA} (no save finished there)"
        )
    return path


def _staging(value: Any) -> Any:
    """``value`` with every tensor replaced by a new uninitialized one of the same kind (a
    DTensor of the same spec), for the load to fill before anything is copied in place."""
    if isinstance(value, DTensor):
        return DTensor([torch.empty_like(c) for c in value._components], value._spec)
    if isinstance(value, torch.Tensor):
        return torch.empty_like(value, requires_grad=False)
    if isinstance(value, dict):  # model.state_dict() is an OrderedDict
        return {k: _staging(v) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(_staging(v) for v in value)
    return value


def _commit(into: dict | list, staged: dict | list) -> None:
    """Copy the loaded ``staged`` into ``into`` in place: tensors by value, other values by
    replacing them in their container."""
    for key in into if isinstance(into, dict) else range(len(into)):
        target, loaded = into[key], staged[key]
        if isinstance(target, DTensor):
            for a, b in zip(target._components, loaded._components, strict=True):
                a.copy_(b)
        elif isinstance(target, torch.Tensor):
            target.copy_(loaded)
        elif isinstance(target, dict | list) and isinstance(loaded, dict | list):
            _commit(target, loaded)
        else:
            into[key] = loaded


def _raise_from(exc: CheckpointException, path: Path) -> NoReturn:
    """The ``ShardwiseError`` a process raised inside DCP (else one carrying DCP's report):
    ``CheckpointException`` is a ``BaseException``, which ``except Exception`` misses."""
    for error, _ in exc.failures.values():
        if isinstance(error, ShardwiseError):
            raise error from None
    raise CheckpointCorruptError(f"loading the checkpoint at {str(path)!r} failed; nothing was "
                                 f"loaded:\n{exc}") from None


def _read(
    checkpoint: Checkpoint, state: dict[str, Any], progress: bool | None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Load the checkpoint into a staging copy of ``state`` (plus its header and extra
    tensors); returns the staging copy and the decoded ``{"step", "extra"}``."""
    saved = checkpoint.metadata.state_dict_metadata
    staged = _staging(state)
    staged[HEADER] = None
    tensors = {int(k[len("extra."):]): torch.empty(md.size, dtype=md.properties.dtype)
               for k, md in saved.items() if k.startswith("extra.") and k[6:].isdigit()
               and isinstance(md, TensorStorageMetadata)}
    if tensors:
        staged["extra"] = {str(i): t for i, t in tensors.items()}
    if HEADER not in saved:
        raise CheckpointCorruptError(
            f"the checkpoint at {str(checkpoint.directory)!r} has no {HEADER!r} header")
    try:
        _with_planner(
            _LoadPlanner(progress),
            lambda planner: dcp.load(
                staged, storage_reader=VerifiedReader(checkpoint), planner=planner,
                no_dist=not dist.is_initialized(),
            ),
        )
    except CheckpointException as exc:
        _raise_from(exc, checkpoint.directory)
    try:
        header = json.loads(staged[HEADER])
        info = {k: header[k] for k in ("step", "extra") if k in header}
        if "extra" in info:
            info["extra"] = decode(info["extra"], tensors)
    except ShardwiseError:
        raise
    except Exception as exc:  # a header that save does not write
        raise CheckpointCorruptError(
            f"the checkpoint at {str(checkpoint.directory)!r}: its {HEADER!r} header is not "
            f"what shardwise.checkpoint.save writes ({type(exc).__name__}: {exc})"
        ) from None
    if type(info.get("step", 0)) is not int:
        raise CheckpointCorruptError(
            f"the checkpoint at {str(checkpoint.directory)!r}: step {info['step']!r} is no "
            f"integer")
    return staged, info


def load(
    path: str | os.PathLike,
    model: torch.nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    progress: bool | None = None,
) -> dict[str, Any]:
    """Load what ``save`` wrote into ``model`` and ``optimizer`` in place, whatever the mesh
    and placements they have now, and restore torch's RNG state. Returns ``{"step": ...,
    "extra": ...}`` (those that were saved). Every process calls it. All or nothing: any
    error (``CheckpointMismatchError``, ``CheckpointCorruptError``, ``UnsafeCheckpointError``)
    leaves the model, optimizer and RNG as they were."""
    checkpoint = open_checkpoint(_resolve(Path(path)))
    created = _init_optimizer_state(optimizer) if optimizer is not None else []
    try:
        state = _training_state(model, optimizer)
        _check_fits(checkpoint.directory, checkpoint.metadata, state)
        staged, info = _read(checkpoint, state, progress)
    except BaseException:
        for p in created:  # a fresh optimizer stays without state
            optimizer.state.pop(p, None)
        raise
    with torch.no_grad():
        _commit(state, {k: staged[k] for k in state})
    torch.set_rng_state(state["rng"])
    if optimizer is not None:
        for group, loaded in zip(optimizer.param_groups, state["optim"]["param_groups"],
                                 strict=True):
            group.update({k: v for k, v in loaded.items() if k != "params"})
    return info
