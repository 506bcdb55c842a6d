"""Per-shard random streams: which numbers each device's shard of a random DTensor gets.

A random op on a DTensor runs once per local component, on that component only: no device
draws or holds more than its own shard. Which numbers a shard gets follows PyTorch's
``OffsetBasedRNGTracker`` (``torch.distributed.tensor._random``):

- Shards are numbered row-major over the tensor dims (``shard_index``); a tensor dim split by
  several mesh dims counts them in mesh-dim order; Replicate and Partial mesh dims do not count,
  so the devices holding one shard draw the same numbers.
- On a Philox generator (CUDA), shard ``k`` draws from the device's state with its offset
  advanced by ``k`` times the size of the first shard (rounded up to 4), and every device then
  sets its offset to the state before the op plus the global numel (rounded up to 4)
  (``philox_offsets``): torch's values, device for device.
- On the CPU generator (a Mersenne twister: no offset to advance) a tensor with one shard
  (every mesh dim Replicate or Partial) draws from the generator itself, as torch and a single
  device do; a sharded tensor first takes one 64-bit key from the generator, and shard ``k``
  draws from a generator seeded with a mix of the key and ``k``.

Either way the generator advances by the same amount in every process, whatever devices it
holds, so the same program gives the same numbers embedded, per rank and as rank threads.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from math import prod
from typing import TypeVar

import torch

from . import comm, settings
from .errors import UnsupportedOpError
from .geometry import segments_size, split_segments
from .mesh import DeviceMesh
from .placements import RaggedShard, Shard
from .redistribute import move
from .spec import DTensorSpec
from .torch_compat import kernel_default_generator

T = TypeVar("T")
aten = torch.ops.aten
_MASK64 = (1 << 64) - 1


def shard_index(spec: DTensorSpec, device: int) -> tuple[int, int]:
    """``(k, n)``: the shard of ``spec`` that ``device`` holds, numbered ``0 <= k < n``
    row-major over the tensor dims (equal for the devices holding the same shard)."""
    mesh = spec.mesh
    coord = mesh.coordinate_of(device)
    index, count = [0] * spec.ndim, [1] * spec.ndim
    for m, p in enumerate(spec.placements):
        if isinstance(p, Shard):
            index[p.dim] = index[p.dim] * mesh.shape[m] + coord[m]
            count[p.dim] *= mesh.shape[m]
    k = 0
    for i, n in zip(index, count, strict=True):
        k = k * n + i
    return k, prod(count)


def _round4(n: int) -> int:
    return (n + 3) // 4 * 4


def philox_offsets(spec: DTensorSpec, device: int) -> tuple[int, int]:
    """``(start, end)``: the Philox offset increments of ``device``'s shard before its draw
    and of every device after the op, as torch's tracker computes them. The stride between
    shards is the first shard's numel, where each sharded mesh dim cuts the *global* size of
    its tensor dim (torch's rule, kept for equal values; the last such mesh dim wins). A
    RaggedShard (which torch lacks) strides by its largest piece, so no two shards overlap."""
    shape = list(spec.shape)
    first = list(shape)
    for m, p in enumerate(spec.placements):
        if isinstance(p, RaggedShard):
            first[p.dim] = max(p.sizes)
        elif isinstance(p, Shard):
            whole = ((0, shape[p.dim]),)
            first[p.dim] = segments_size(split_segments(whole, p, spec.mesh.shape[m], 0))
    k, _ = shard_index(spec, device)
    return _round4(k * prod(first)), _round4(prod(shape))


def _mix(key: int, k: int) -> int:
    """A 64-bit seed for shard ``k`` of a draw keyed ``key`` (splitmix64 of their sum)."""
    z = (key + (k + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def _is_philox(state: torch.Tensor) -> bool:
    return state.dtype == torch.uint8 and state.numel() == 16


def draw_per_shard(
    spec: DTensorSpec,
    devices: Sequence[torch.device],
    draw: Callable[[int], T],
    generator: torch.Generator | None = None,
) -> list[T]:
    """``draw(i)`` for each local component ``i`` of ``spec`` (on ``devices[i]``), each run
    with its shard's stream in torch's default generator of that device; ``generator`` (the
    op's own, if given) is the one read and advanced instead of the default. ``draw`` must
    use the default generator (call the op without its ``generator`` argument)."""
    ids = spec.mesh.local_device_ids
    if not ids or devices[0].type == "meta":
        return [draw(i) for i in range(len(ids))]
    if devices[0].type == "cpu":
        return _draw_cpu(spec, ids, draw, generator)
    return _draw_philox(spec, ids, devices, draw, generator)


def _draw_cpu(
    spec: DTensorSpec, ids: Sequence[int], draw: Callable[[int], T],
    generator: torch.Generator | None,
) -> list[T]:
    kernel = kernel_default_generator()  # the one kernels draw from (rank threads swap theirs in)
    shards = [shard_index(spec, d) for d in ids]
    out = []
    with settings.drawing_from_default_generator():
        saved = kernel.get_state() if generator is not None else None
        source = kernel if generator is None else generator
        if shards[0][1] == 1:  # one shard: the generator's own numbers, as on one device
            start, key = source.get_state(), None
        else:  # one key from the generator: it advances alike whatever devices draw
            key = int(aten.random_.default(torch.empty((), dtype=torch.int64), generator=source))
            start = kernel.get_state() if generator is None else None
        try:
            for i, (k, _) in enumerate(shards):
                if key is None:
                    kernel.set_state(start)
                else:
                    kernel.manual_seed(_mix(key, k))
                out.append(draw(i))
            if key is None and generator is not None:
                generator.set_state(kernel.get_state())
        finally:
            if saved is not None:
                kernel.set_state(saved)
            elif key is not None:
                kernel.set_state(start)
    return out


def _draw_philox(
    spec: DTensorSpec, ids: Sequence[int], devices: Sequence[torch.device],
    draw: Callable[[int], T], generator: torch.Generator | None,
) -> list[T]:
    module = torch.get_device_module(devices[0].type)
    before = {
        dev: (generator.get_state() if generator is not None else module.get_rng_state(dev)).cpu()
        for dev in dict.fromkeys(devices)
    }
    if not all(_is_philox(s) for s in before.values()):
        raise UnsupportedOpError(
            f"a random op on a DTensor of shape {list(spec.shape)} with placements "
            f"{list(spec.placements)} on {spec.mesh}: the {devices[0].type} generator is not a "
            f"Philox (seed, offset) one; shardwise draws shards on cpu and cuda devices"
        )
    saved = {dev: module.get_rng_state(dev) for dev in before} if generator is not None else {}
    out = []
    try:
        for i, (d, dev) in enumerate(zip(ids, devices, strict=True)):
            module.set_rng_state(_with_offset(before[dev], philox_offsets(spec, d)[0]), dev)
            out.append(draw(i))
    finally:
        end = philox_offsets(spec, ids[0])[1]
        for dev, state in before.items():
            if generator is not None:
                generator.set_state(_with_offset(state, end))
                module.set_rng_state(saved[dev], dev)
            else:
                module.set_rng_state(_with_offset(state, end), dev)
    return out


def _with_offset(state: torch.Tensor, increment: int) -> torch.Tensor:
    """The Philox ``state`` (8 bytes seed, 8 bytes offset) with its offset advanced."""
    out = state.clone()
    offset = int(state[8:].view(torch.int64)) + increment
    out[8:] = torch.tensor([offset], dtype=torch.int64).view(torch.uint8)
    return out


# the (mesh, device) pairs this process compared (a rank thread is a process of its own)
_checked_generators: settings.ProcessLocal[set[tuple]] = settings.ProcessLocal(set)


def check_generator(mesh: DeviceMesh, device: torch.device) -> None:
    """Every process draws its shards from its own generator (no data moves), so the
    processes of ``mesh`` must hold the same generator state: compare it on the first random
    op of each mesh, and on every one under debug checks; a difference raises
    ``CollectiveMismatchError`` on every process."""
    key = (mesh, device)
    if len(mesh.local_device_ids) == mesh.size():
        return  # one process holds the whole mesh: there is no other generator to compare
    if key in _checked_generators.get() and not comm.debug_checks_enabled():
        return
    state = torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()
    fields = {"generator state": hashlib.sha1(state.numpy().tobytes()).hexdigest()[:16]}
    move.agree(
        "the random generator state: call shardwise.manual_seed(seed) with the same seed in "
        "every process before random DTensor ops", mesh, "random op", fields, state,
    )
    _checked_generators.get().add(key)
