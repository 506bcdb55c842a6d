"""The oracle of random DTensor values: which numbers each device's shard holds.

Shard numbering and Philox offsets come from torch's own ``OffsetBasedRNGTracker`` code
(``torch.distributed.tensor._random``), run on a stand-in mesh; the CPU stream of a shard is the
documented one (docs/index.md, "Random numbers"): with one shard the generator's own numbers,
else a 64-bit key drawn from the generator and shard ``k`` seeded with splitmix64 of the key and
``k``. Nothing here calls shardwise's random code.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch.distributed.tensor import Replicate as TorchReplicate
from torch.distributed.tensor import Shard as TorchShard
from torch.distributed.tensor import _random as torch_random
from torch.distributed.tensor.placement_types import _StridedShard

from shardwise import InterleavedShard, Shard

MASK = (1 << 64) - 1


def torch_placement(p: Any) -> Any:
    if isinstance(p, InterleavedShard):
        return _StridedShard(p.dim, split_factor=p.interleaved_size)
    if isinstance(p, Shard):
        return TorchShard(p.dim)
    return TorchReplicate()  # Replicate and Partial: no shard of their own


class _Mesh:
    """What torch's offset code reads of a mesh: its shape and this rank's coordinate."""

    def __init__(self, shape: Sequence[int], coord: Sequence[int]) -> None:
        self.shape, self.ndim, self._coord = tuple(shape), len(shape), tuple(coord)

    def size(self, dim: int) -> int:
        return self.shape[dim]

    def _sym_get_coordinate(self, dim: int) -> int:
        return self._coord[dim]


class _Spec:
    def __init__(self, mesh: _Mesh, placements: Sequence[Any], shape: Sequence[int]) -> None:
        self.mesh, self.shape, self.ndim = mesh, torch.Size(shape), len(shape)
        self.placements = tuple(torch_placement(p) for p in placements)


def torch_offsets(mesh_shape, placements, shape, coord) -> tuple[int, int]:
    """torch's (start, end) Philox offset increments for the device at ``coord``."""
    tracker = object.__new__(torch_random.OffsetBasedRNGTracker)  # no CUDA needed for this
    return tracker._compute_rng_offsets(_Spec(_Mesh(mesh_shape, coord), placements, shape))


def torch_shard_index(mesh_shape, placements, shape, coord) -> tuple[int, int]:
    """torch's (linear shard index, number of shards) for the device at ``coord``."""
    spec = _Spec(_Mesh(mesh_shape, coord), placements, shape)
    index, counts = torch_random._calc_shard_info(list(coord), spec)
    total = 1
    for n in counts:
        total *= n
    return torch_random._calc_shard_linear_idx(index, counts), total


def splitmix64(key: int, k: int) -> int:
    z = (key + (k + 1) * 0x9E3779B97F4A7C15) & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


@contextmanager
def drawing_from(generator: torch.Generator):
    """torch's default CPU generator runs on ``generator``'s state inside (and hands the
    advanced state back to it)."""
    saved = torch.get_rng_state()
    torch.set_rng_state(generator.get_state())
    try:
        yield
    finally:
        generator.set_state(torch.get_rng_state())
        torch.set_rng_state(saved)


def expected_shards(
    dt: Any, source: torch.Generator, draw: Callable[[int], torch.Tensor]
) -> list[torch.Tensor]:
    """What each local component of ``dt`` (a random op's result, or its template) holds on
    CPU: ``draw(i)`` run on the stream of component ``i``'s shard, ``source`` being the
    generator the op read (advanced as the op advances it)."""
    mesh = dt.device_mesh
    coords = [mesh.coordinate_of(d) for d in mesh.local_device_ids]
    shards = [torch_shard_index(mesh.shape, dt.placements, dt.shape, c) for c in coords]
    out = []
    if shards[0][1] == 1:
        start = source.get_state()
        for i in range(len(coords)):
            source.set_state(start)
            with drawing_from(source):
                out.append(draw(i))
        return out
    key = int(torch.empty((), dtype=torch.int64).random_(generator=source))
    for i, (k, _) in enumerate(shards):
        with drawing_from(torch.Generator().manual_seed(splitmix64(key, k))):
            out.append(draw(i))
    return out
