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
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from ..errors import InvalidPlacementError
from ..placements import Shard
from ..spec import DTensorSpec

if TYPE_CHECKING:
    from ..dtensor import DTensor

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
    """(local index, box) for every box of every local component, in chunk-list order."""
    spec = dtensor._spec
    return [
        (i, box)
        for i, device in enumerate(spec.mesh.local_device_ids)
        for box in boxes(spec, device)
    ]


def create_write_items(fqn: str, dtensor: DTensor) -> list[WriteItem]:
    """One write item per box this process must write (each global element exactly once)."""
    spec = dtensor._spec
    partial = [p for p in spec.placements if p.is_partial()]
    if partial:
        raise InvalidPlacementError(
            f"cannot checkpoint {fqn!r}, a DTensor of shape {list(dtensor.shape)} with "
            f"placements {list(spec.placements)} on {spec.mesh}: its Partial values are not "
            f"reduced; redistribute it to Replicate first (shardwise.checkpoint.save does)"
        )
    components = dtensor._components
    empty = dtensor.numel() == 0
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
                        size=dtensor.size(),
                    ),
                )
            )
            if volume == 0:
                break
    return items


def create_chunk_list(dtensor: DTensor) -> list[ChunkStorageMetadata]:
    """Every box of every local component (replicas too: each device loads its copy)."""
    return [
        ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
        for _, (offsets, sizes, _) in _local_boxes(dtensor)
    ]


def get_tensor_shard(dtensor: DTensor, index: MetadataIndex) -> torch.Tensor:
    """The view of a local component behind the box at ``index.offset`` (``index.index``, when
    it points into the chunk list at a box with that offset, picks among replicas)."""
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
