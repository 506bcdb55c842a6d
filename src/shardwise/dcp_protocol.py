"""torch.distributed.checkpoint's protocol for shardwise DTensors.

DCP asks a distributed tensor three things: what to write (``__create_write_items__``), which
chunks of the global tensor this process holds (``__create_chunk_list__``, for loading) and the
local tensor behind one chunk (``__get_tensor_shard__``). A chunk is a box of the global tensor
(offsets and sizes per dim). A shardwise component is the product, over tensor dims, of runs of
global indices (one run per dim for Shard, several for InterleavedShard), so each component
contributes one box per combination of runs, a view of the component. Each box is written once:
by the device at coordinate 0 of every mesh dim that does not shard the tensor. On load every
local device (replicas included) asks for its boxes, and DCP reads what overlaps them from the
saved boxes, whatever mesh and placements saved them: that is the resharding.

Partial values are saved reduced (one all_reduce per Partial mesh dim while DCP plans, in the
same order in every process; the reduced copy is kept for the writes). Loading into a Partial
DTensor gives every component the value, except under Partial("sum") where the devices past
coordinate 0 get zeros, so the reduction is the loaded value.
"""

from __future__ import annotations

import itertools
import math
import weakref
from collections.abc import Iterator, Sequence
from typing import Protocol

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from .placements import Partial, Placement, Replicate, Shard
from .spec import DTensorSpec


class DTensor(Protocol):
    """What these hooks read of the DTensor calling them (named by its shape here: dtensor.py
    imports this module, and nothing imports back)."""

    _spec: DTensorSpec
    _components: list[torch.Tensor]
    shape: torch.Size
    placements: tuple[Placement, ...]

    def numel(self) -> int: ...

    def redistribute(self, *, placements: Sequence[Placement]) -> DTensor: ...


Box = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]  # global offsets, sizes, local


def boxes(spec: DTensorSpec, device: int) -> Iterator[Box]:
    """The boxes of the global tensor that ``device``'s component holds, in component order."""
    per_dim = []
    for runs in spec.local_segments(device):
        items, local = [], 0
        for start, stop in runs:
            items.append((start, stop - start, local))
            local += stop - start
        per_dim.append(items)
    for combo in itertools.product(*per_dim):
        yield (
            tuple(c[0] for c in combo),
            tuple(c[1] for c in combo),
            tuple(c[2] for c in combo),
        )


def _is_writer(spec: DTensorSpec, device: int) -> bool:
    coord = spec.mesh.coordinate_of(device)
    return all(isinstance(p, Shard) or coord[m] == 0 for m, p in enumerate(spec.placements))


def _local_boxes(dtensor: DTensor) -> list[tuple[int, Box]]:
    """(local index, box) for every box of every local component that loads the value, in
    chunk-list order; empty boxes only for an empty tensor (an empty ragged piece may share
    its offset with a full one)."""
    spec = dtensor._spec
    empty = dtensor.numel() == 0
    return [
        (i, box)
        for i, device in enumerate(spec.mesh.local_device_ids)
        if _is_reader(spec, device)
        for box in boxes(spec, device)
        if empty or math.prod(box[1])
    ]


# DTensors with Partial placements, while DCP writes them: their reduced copy (until the
# DTensor dies, a load into it, or release_reduced())
# (keyed by id: tensors compare elementwise, so they cannot be dictionary keys themselves)
_reduced: dict[int, tuple[weakref.ref, DTensor]] = {}


def _reduced_copy(dtensor: DTensor) -> DTensor:
    entry = _reduced.get(id(dtensor))
    return entry[1] if entry is not None and entry[0]() is dtensor else dtensor


def _without_partial(dtensor: DTensor) -> DTensor:
    placements = dtensor._spec.placements
    if not any(p.is_partial() for p in placements):
        return dtensor
    with torch.no_grad():
        reduced = dtensor.redistribute(
            placements=[Replicate() if p.is_partial() else p for p in placements]
        )
    key = id(dtensor)
    _reduced[key] = (weakref.ref(dtensor, lambda _: _reduced.pop(key, None)), reduced)
    return reduced


def release_reduced() -> None:
    """Drop the reduced copies of Partial DTensors kept for a save that has finished."""
    _reduced.clear()


def create_write_items(fqn: str, dtensor: DTensor) -> list[WriteItem]:
    """One write item per box this process must write (each global element exactly once)."""
    source = _without_partial(dtensor)
    spec = source._spec
    components = source._components
    empty = source.numel() == 0
    items = []
    for i, device in enumerate(spec.mesh.local_device_ids):
        if not _is_writer(spec, device):
            continue
        properties = TensorProperties.create_from_tensor(components[i])
        for offsets, sizes, _ in boxes(spec, device):
            volume = math.prod(sizes)
            if volume == 0 and not (empty and not any(spec.mesh.coordinate_of(device))):
                continue
            items.append(
                WriteItem(
                    index=MetadataIndex(fqn, torch.Size(offsets)),
                    type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        chunk=ChunkStorageMetadata(
                            offsets=torch.Size(offsets), sizes=torch.Size(sizes)
                        ),
                        properties=properties,
                        size=source.size(),
                    ),
                )
            )
            if volume == 0:
                break
    return items


def _is_reader(spec: DTensorSpec, device: int) -> bool:
    coord = spec.mesh.coordinate_of(device)
    return all(
        coord[m] == 0 for m, p in enumerate(spec.placements) if p == Partial("sum")
    )


def create_chunk_list(dtensor: DTensor) -> list[ChunkStorageMetadata]:
    """Every box of every local component that loads the value (replicas too); components
    past coordinate 0 of a Partial("sum") mesh dim are zeroed instead."""
    _reduced.pop(id(dtensor), None)  # a load reads into the tensor itself
    spec = dtensor._spec
    for i, device in enumerate(spec.mesh.local_device_ids):
        if not _is_reader(spec, device):
            with torch.no_grad():
                dtensor._components[i].zero_()
    return [
        ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
        for _, (offsets, sizes, _) in _local_boxes(dtensor)
    ]


def get_tensor_shard(dtensor: DTensor, index: MetadataIndex) -> torch.Tensor:
    """The view of a local component behind the box at ``index.offset`` (``index.index``, when
    it points into the chunk list at a box with that offset, picks among replicas)."""
    dtensor = _reduced_copy(dtensor)  # while saving a Partial DTensor
    found = _local_boxes(dtensor)
    choice = None
    if index.index is not None and 0 <= index.index < len(found):
        if torch.Size(found[index.index][1][0]) == index.offset:
            choice = found[index.index]
    if choice is None:
        choice = next((f for f in found if torch.Size(f[1][0]) == index.offset), None)
    if choice is None:
        raise ValueError(
            f"{index.fqn!r}: no local component of this DTensor of shape "
            f"{list(dtensor.shape)} with placements {list(dtensor.placements)} holds a chunk at "
            f"offset {list(index.offset or [])}"
        )
    i, (_, sizes, local) = choice
    view = dtensor._components[i]
    for dim, (start, size) in enumerate(zip(local, sizes, strict=True)):
        if (start, size) != (0, view.shape[dim]):
            view = view.narrow(dim, start, size)
    return view
