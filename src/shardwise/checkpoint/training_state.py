"""Save and load a whole training state (model, optimizer, RNG, step) in one call, on
torch.distributed.checkpoint, resharding on load.

``save`` writes into ``<path>.saving`` and renames it to ``path`` only once complete (the
previous checkpoint moves to ``<path>.old`` for the instant of the swap), so a save killed
part-way leaves the previous checkpoint loadable. ``load`` first compares the checkpoint's
metadata with the state it loads into and raises ``CheckpointMismatchError`` naming every
missing and unexpected key and every shape or dtype mismatch before anything is read.
"""

from __future__ import annotations

import math
import os
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ..dcp_protocol import release_reduced
from ..errors import CheckpointMismatchError

PROGRESS_BYTES = 64 << 20  # show a progress bar by default from this many bytes on


def _rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the state a fresh optimizer creates at its first step (with zero gradients and
    a zero learning rate, so parameters do not move), for the checkpoint to load into."""
    params = [p for g in optimizer.param_groups for p in g["params"] if p not in optimizer.state]
    if not params:
        return
    lrs = [g["lr"] for g in optimizer.param_groups]
    grads = {id(p): p.grad for g in optimizer.param_groups for p in g["params"]}
    for g in optimizer.param_groups:
        g["lr"] = 0.0
        for p in g["params"]:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
    try:
        optimizer.step()
    finally:
        for g, lr in zip(optimizer.param_groups, lrs, strict=True):
            g["lr"] = lr
            for p in g["params"]:
                p.grad = grads[id(p)]


def _training_state(
    model: torch.nn.Module | None,
    optimizer: torch.optim.Optimizer | None,
    step: int | None,
    extra: dict | None,
) -> dict[str, Any]:
    state: dict[str, Any] = {"rng": torch.get_rng_state()}
    if model is not None:
        state["model"] = model.state_dict()
    if optimizer is not None:
        state["optim"] = optimizer.state_dict()
    if step is not None:
        state["step"] = step
    if extra is not None:
        state["extra"] = extra
    return state


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

    def create_local_plan(self):  # noqa: ANN201
        plan = super().create_local_plan()
        total = sum(
            math.prod(item.tensor_data.chunk.sizes)
            * torch.empty((), dtype=item.tensor_data.properties.dtype).element_size()
            for item in plan.items
            if item.tensor_data is not None
        )
        self._bar = _progress(total, "checkpoint save", self._progress)
        return plan

    def resolve_data(self, write_item):  # noqa: ANN001, ANN201
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

    def create_local_plan(self):  # noqa: ANN201
        plan = super().create_local_plan()
        total = 0
        for item in plan.items:
            md = self.metadata.state_dict_metadata[item.storage_index.fqn]
            if isinstance(md, TensorStorageMetadata):
                size = torch.empty((), dtype=md.properties.dtype).element_size()
                total += math.prod(item.lengths) * size
        self._bar = _progress(total, "checkpoint load", self._progress)
        return plan

    def commit_tensor(self, read_item, tensor) -> None:  # noqa: ANN001
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
    ``step`` and ``extra`` (picklable values) to the directory ``path``, atomically. Every
    process calls it. ``progress``: a tqdm bar (default: for states from 64 MiB on)."""
    path = Path(path)
    saving = path.with_name(path.name + ".saving")
    old = path.with_name(path.name + ".old")
    if _rank0():
        shutil.rmtree(saving, ignore_errors=True)
    _barrier()
    state = _training_state(model, optimizer, step, extra)
    _with_planner(
        _SavePlanner(progress),
        lambda planner: dcp.save(
            state, checkpoint_id=saving, planner=planner, no_dist=not dist.is_initialized()
        ),
    )
    release_reduced()
    _barrier()
    if _rank0():
        if path.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.replace(path, old)
        os.replace(saving, path)
        shutil.rmtree(old, ignore_errors=True)
    _barrier()


def _resolve(path: Path) -> Path:
    """``path``, or the previous checkpoint when a save was killed between its two renames."""
    old = path.with_name(path.name + ".old")
    if not path.exists() and old.exists():
        return old
    if not path.exists():
        raise FileNotFoundError(f"no checkpoint at {str(path)!r}")
    return path


def _check_fits(path: Path, state: dict[str, Any]) -> None:
    """Raise naming every difference between the checkpoint's keys, shapes and dtypes and the
    state's, for the sections the state holds."""
    saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
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


def load(
    path: str | os.PathLike,
    model: torch.nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    progress: bool | None = None,
) -> dict[str, Any]:
    """Load what ``save`` wrote into ``model`` and ``optimizer`` in place, whatever the mesh
    and placements they have now, and restore torch's RNG state. Returns ``{"step": ...,
    "extra": ...}`` (those that were saved). Every process calls it."""
    path = _resolve(Path(path))
    if optimizer is not None:
        _init_optimizer_state(optimizer)
    state = _training_state(model, optimizer, None, None)
    _check_fits(path, state)
    saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    for key in ("step", "extra"):
        if any(k == key or k.startswith(key + ".") for k in saved):
            state[key] = None if key == "step" else _placeholders(saved, key)
    _with_planner(
        _LoadPlanner(progress),
        lambda planner: dcp.load(
            state, checkpoint_id=path, planner=planner, no_dist=not dist.is_initialized()
        ),
    )
    torch.set_rng_state(state["rng"])
    if optimizer is not None:
        for group, loaded in zip(optimizer.param_groups, state["optim"]["param_groups"],
                                 strict=True):
            group.update({k: v for k, v in loaded.items() if k != "params"})
    return {k: state[k] for k in ("step", "extra") if k in state}


def _placeholders(saved: dict, section: str) -> Any:
    """A nested structure for the saved ``extra`` keys that DCP fills in (non-tensor leaves)."""
    out: dict[str, Any] = {}
    for key, md in saved.items():
        if not key.startswith(section + "."):
            continue
        node = out
        *parents, leaf = key[len(section) + 1 :].split(".")
        for name in parents:
            node = node.setdefault(name, {})
        node[leaf] = torch.empty(md.size, dtype=md.properties.dtype) if isinstance(
            md, TensorStorageMetadata) else None
    return out
