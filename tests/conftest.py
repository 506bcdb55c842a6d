"""Shared hypothesis strategies and an independent reference of shard geometry.

The reference below is written with plain python index lists, on purpose without
``shardwise.spec``: tests compare shardwise against it and against single-device torch.
"""

from __future__ import annotations

import ast
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from shardwise import (
    DeviceMesh,
    InterleavedShard,
    Partial,
    Placement,
    RaggedShard,
    Replicate,
    Shard,
)

settings.register_profile(
    "shardwise",
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("thorough", parent=settings.get_profile("shardwise"), max_examples=2000)
settings.load_profile("shardwise")

REDUCE_OPS = ("sum", "avg", "max", "min")
DTYPES = (torch.float32, torch.float64, torch.int64)
MAX_DEVICES = 8


# ----- reference geometry ------------------------------------------------------------------


class NotDivisible(Exception):
    """An interleaved size that does not divide the size it shards (reference side)."""


def ref_chunk(indices: list[int], n: int, k: int) -> list[int]:
    """Piece ``k`` of ``n``: [k*c, min((k+1)*c, len)) with c = ceil(len / n)."""
    c = -(-len(indices) // n)
    return indices[k * c : (k + 1) * c]


def ref_indices(
    shape: Sequence[int],
    mesh_shape: Sequence[int],
    placements: Sequence[Placement],
    coord: Sequence[int],
) -> list[list[int]]:
    """Per tensor dim, the global indices (in order) held by the device at ``coord``."""
    held = [list(range(s)) for s in shape]
    for m, p in enumerate(placements):
        if not isinstance(p, Shard):
            continue
        d = p.dim % len(shape)
        n, k = mesh_shape[m], coord[m]
        if isinstance(p, RaggedShard):
            if len(p.sizes) != n or sum(p.sizes) != len(held[d]):
                raise NotDivisible
            start = sum(p.sizes[:k])
            held[d] = held[d][start : start + p.sizes[k]]
        elif isinstance(p, InterleavedShard):
            blocks = p.interleaved_size
            if len(held[d]) % blocks:
                raise NotDivisible
            b = len(held[d]) // blocks
            held[d] = [
                i for j in range(blocks) for i in ref_chunk(held[d][j * b : (j + 1) * b], n, k)
            ]
        else:
            held[d] = ref_chunk(held[d], n, k)
    return held


def ref_slice(x: torch.Tensor, indices: list[list[int]]) -> torch.Tensor:
    for d, idx in enumerate(indices):
        x = x.index_select(d, torch.tensor(idx, dtype=torch.int64))
    return x


def ref_coords(mesh_ids: torch.Tensor) -> dict[int, tuple[int, ...]]:
    """Device id -> coordinate, read off the id array."""
    return {int(mesh_ids[c]): c for c in _all_coords(tuple(mesh_ids.shape))}


def _all_coords(shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    coords: list[tuple[int, ...]] = [()]
    for size in shape:
        coords = [c + (i,) for c in coords for i in range(size)]
    return coords


def fits(shape: Sequence[int], mesh_shape: Sequence[int], placements: Sequence[Placement]) -> bool:
    """True if every interleave divides at every device (reference side)."""
    try:
        for coord in _all_coords(tuple(mesh_shape)):
            ref_indices(shape, mesh_shape, placements, coord)
    except NotDivisible:
        return False
    return True


def ref_reduce(tensors: Sequence[torch.Tensor], op: str) -> torch.Tensor:
    stacked = torch.stack(list(tensors))
    if op == "sum":
        return stacked.sum(0)
    if op == "avg":
        total = stacked.sum(0)
        return total / len(tensors) if total.is_floating_point() else total // len(tensors)
    return stacked.amax(0) if op == "max" else stacked.amin(0)


def ref_value(
    components: dict[tuple[int, ...], torch.Tensor],
    mesh_shape: Sequence[int],
    placements: Sequence[Placement],
) -> dict[tuple[int, ...], torch.Tensor]:
    """Reduce components over every Partial mesh dim, the lowest mesh dim first (PyTorch's
    order, which matters when reduce ops differ): what each component means once reduced."""
    out = dict(components)
    for m in range(len(mesh_shape)):
        p = placements[m]
        if not isinstance(p, Partial):
            continue
        reduced = {}
        for coord in out:
            group = [coord[:m] + (i,) + coord[m + 1 :] for i in range(mesh_shape[m])]
            reduced[coord] = ref_reduce([out[g] for g in group], p.reduce_op)
        out = reduced
    return out


# ----- strategies --------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """A mesh, a tensor shape and dtype, and placements valid for them."""

    mesh: DeviceMesh
    shape: tuple[int, ...]
    dtype: torch.dtype
    placements: tuple[Placement, ...]

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        return tuple(self.mesh.mesh.shape)


@st.composite
def mesh_shapes(draw: st.DrawFn, max_dims: int = 3) -> tuple[int, ...]:
    shape = draw(st.lists(st.integers(1, 4), min_size=1, max_size=max_dims))
    while math.prod(shape) > MAX_DEVICES:
        shape[shape.index(max(shape))] -= 1
    return tuple(shape)


@st.composite
def meshes(draw: st.DrawFn, max_dims: int = 3) -> DeviceMesh:
    """Meshes of 1-3 dims with up to 8 devices; ids sometimes permuted, dims sometimes named."""
    shape = draw(mesh_shapes(max_dims))
    n = math.prod(shape)
    ids = draw(st.one_of(st.just(list(range(n))), st.permutations(range(n))))
    names = draw(st.sampled_from([None, ("a", "b", "c")[: len(shape)]]))
    return DeviceMesh("cpu", torch.tensor(ids).reshape(shape), mesh_dim_names=names)


def tensor_shapes(min_rank: int = 1, max_rank: int = 3) -> st.SearchStrategy[tuple[int, ...]]:
    """Small shapes: sizes 0..9, so not divisible by the mesh and smaller than it."""
    return st.lists(st.integers(0, 9), min_size=min_rank, max_size=max_rank).map(tuple)


def placement_for(rank: int, *, partial: bool = True) -> st.SearchStrategy[Placement]:
    options: list[st.SearchStrategy[Placement]] = [st.just(Replicate())]
    if rank:
        dims = st.integers(-rank, rank - 1)
        options.append(dims.map(Shard))
        options.append(st.builds(InterleavedShard, dims, st.integers(1, 3)))
    if partial:
        options.append(st.sampled_from(REDUCE_OPS).map(Partial))
    return st.one_of(options)


@st.composite
def placements_for(
    draw: st.DrawFn,
    shape: tuple[int, ...],
    mesh_shape: tuple[int, ...],
    *,
    partial: bool = True,
) -> tuple[Placement, ...]:
    """Placements valid for ``shape`` on a mesh of ``mesh_shape`` (interleaves that divide)."""
    strategy = st.lists(
        placement_for(len(shape), partial=partial),
        min_size=len(mesh_shape),
        max_size=len(mesh_shape),
    ).map(tuple)
    return draw(strategy.filter(lambda ps: fits(shape, mesh_shape, ps)))


@st.composite
def cases(draw: st.DrawFn, max_dims: int = 3, *, partial: bool = True) -> Case:
    mesh = draw(meshes(max_dims))
    shape = draw(tensor_shapes())
    placements = draw(placements_for(shape, tuple(mesh.mesh.shape), partial=partial))
    dtypes = DTYPES
    if Partial("avg") in placements:  # the mean of integers is not an integer (issue 7)
        dtypes = tuple(d for d in DTYPES if d.is_floating_point)
    dtype = draw(st.sampled_from(dtypes))
    return Case(mesh, shape, dtype, placements)


def make_tensor(shape: Sequence[int], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Integer-valued data, so sums of a few components are exact in every dtype used."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-64, 64, tuple(shape), generator=g).to(dtype)


def _split_for(t: torch.Tensor, n: int, op: str, g: torch.Generator) -> list[torch.Tensor]:
    """``n`` integer-valued tensors whose ``op`` reduction is exactly ``t``."""
    noise = [torch.randint(0, 64, tuple(t.shape), generator=g).to(t.dtype) for _ in range(n)]
    rest = sum(noise[1:], torch.zeros_like(t))
    if op == "sum":
        return [t - rest, *noise[1:]]
    if op == "avg":
        return [t - rest, *(t + r for r in noise[1:])]
    holder = torch.randint(0, n, tuple(t.shape), generator=g)
    sign = -1 if op == "max" else 1
    return [t + sign * noise[q] * (holder != q) for q in range(n)]


def _decompose(
    v: torch.Tensor, dims: list[tuple[int, str]], g: torch.Generator
) -> dict[tuple[int, ...], torch.Tensor]:
    """Split ``v`` over Partial mesh dims (lowest first in ``dims``): the last one is reduced
    last, so it is split first. Keys are the coordinates on those dims."""
    if not dims:
        return {(): v}
    *inner, (n, op) = dims
    out = {}
    for q, piece in enumerate(_split_for(v, n, op, g)):
        for key, t in _decompose(piece, inner, g).items():
            out[key + (q,)] = t
    return out


def components_for(
    x: torch.Tensor, mesh: DeviceMesh, placements: Sequence[Placement], seed: int
) -> list[torch.Tensor]:
    """Per-device components (ascending device id) of the global ``x`` under ``placements``,
    from the reference geometry, with random components on Partial mesh dims whose reduction,
    lowest mesh dim first (PyTorch's order), is exactly ``x``."""
    mesh_shape = tuple(mesh.mesh.shape)
    coords = ref_coords(mesh.mesh)
    partial = [m for m, p in enumerate(placements) if isinstance(p, Partial)]
    dims = [(mesh_shape[m], placements[m].reduce_op) for m in partial]
    values = _decompose(x, dims, torch.Generator().manual_seed(seed))
    out = []
    for device in sorted(coords):
        coord = coords[device]
        value = values[tuple(coord[m] for m in partial)]
        out.append(ref_slice(value, ref_indices(x.shape, mesh_shape, placements, coord)))
    return out


def check_components(
    components: Sequence[torch.Tensor],
    x: torch.Tensor,
    mesh: DeviceMesh,
    placements: Sequence[Placement],
    rounded: bool = False,
) -> None:
    """Components (ascending device id) have the reference shapes and reduce over the Partial
    mesh dims to the reference slices of ``x``; equal, or within float rounding where an
    average was taken (``Partial("avg")`` among ``placements``, or ``rounded``: the components
    come from one)."""
    mesh_shape = tuple(mesh.mesh.shape)
    coords = ref_coords(mesh.mesh)
    assert len(components) == len(coords)
    by_coord = {coords[d]: c for d, c in zip(sorted(coords), components, strict=True)}
    for coord, value in ref_value(by_coord, mesh_shape, placements).items():
        expected = ref_slice(x, ref_indices(x.shape, mesh_shape, placements, coord))
        assert by_coord[coord].shape == expected.shape, (coord, placements, mesh)
        assert by_coord[coord].dtype == x.dtype
        averaged = rounded or any(p == Partial("avg") for p in placements)
        if averaged and value.is_floating_point():
            torch.testing.assert_close(value, expected)  # division rounds by reduction order
        else:
            assert torch.equal(value, expected), (coord, placements, mesh)


# ----- test tiers: ``pytest -m "not slow"`` while developing, everything in CI -----------------

# a test that starts processes (the harness, a subprocess, the launcher or its threads mode),
# directly or through a helper function of its module, is ``slow``
STARTS_PROCESSES = frozenset(
    {"run_in_processes", "subprocess", "Popen", "launch", "launch_threads"}
)
# files slow as a whole: end-to-end programs, and tests that start processes through helpers
# outside their module (two hosts)
WHOLE_FILES = frozenset({
    "test_bench.py",
    "test_demo.py",
    "test_examples.py",
    "test_packaging.py",
    "test_pytorch_programs.py",
    "test_torchtitan_llama.py",
    "test_two_hosts.py",
})


def _process_starters(path: Path) -> set[str]:
    """Names of the functions of a test module (methods as ``Class.name``) that start processes,
    directly or through another function of the module."""
    tree = ast.parse(path.read_text())
    functions: dict[str, ast.AST] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            functions[node.name] = node
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    functions[f"{node.name}.{item.name}"] = item
    uses = {
        name: {n.id for n in ast.walk(f) if isinstance(n, ast.Name)}
        | {n.attr for n in ast.walk(f) if isinstance(n, ast.Attribute)}
        for name, f in functions.items()
    }
    starters = {name for name, used in uses.items() if used & STARTS_PROCESSES}
    grew = True
    while grew:  # through helpers: a function using one that starts processes starts them
        more = {name for name, used in uses.items() if used & starters} - starters
        starters |= more
        grew = bool(more)
    return starters


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    starters: dict[Path, set[str]] = {}
    for item in items:
        path = Path(item.path)
        if path.name in WHOLE_FILES:
            item.add_marker(pytest.mark.slow)
            continue
        if path not in starters:
            starters[path] = _process_starters(path)
        name = item.originalname if isinstance(item, pytest.Function) else item.name
        if item.cls is not None:
            name = f"{item.cls.__name__}.{name}"
        if name in starters[path]:
            item.add_marker(pytest.mark.slow)
