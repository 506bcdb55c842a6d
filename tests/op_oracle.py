"""The op oracle: run an op on DTensors under many input placements and compare the global
result (and the gradients) with single-device PyTorch on the full tensors."""

from __future__ import annotations

import itertools
import os
import random
from collections.abc import Callable, Sequence

import torch
import torch.utils._pytree as pytree

import shardwise as sw
from shardwise import DTensor, InterleavedShard, Partial, RaggedShard, Replicate, Shard
from shardwise.spec import validate_placements

MESH_SHAPES: list[tuple[int, ...]] = [(2,), (3,), (4,), (2, 2)]


def ragged_sizes(length: int, n: int) -> tuple[int, ...]:
    """Uneven extents of ``length`` over ``n`` devices: thirds on two, else an empty first
    piece and the rest growing quadratically."""
    if n == 1:
        return (length,)
    if n == 2:
        return (length // 3, length - length // 3)
    k = n - 1
    cuts = [0, 0] + [length * i * i // (k * k) for i in range(1, n)]
    return tuple(b - a for a, b in zip(cuts[:-1], cuts[1:], strict=True))


def placement_options(
    t: torch.Tensor,
    *,
    partial: bool = True,
    interleaved: bool = False,
    ragged: bool = False,
    mesh_size: int = 2,
) -> list:
    """Placements one mesh dim may give ``t``: Replicate, Shard on every dim, Partial(sum)
    (``interleaved``/``ragged``: also InterleavedShard(d, 2) / RaggedShard(d, sizes))."""
    options: list = [Replicate()]
    options += [Shard(d) for d in range(t.ndim)]
    if partial and (t.is_floating_point() or t.is_complex()):
        options.append(Partial())
    if interleaved:
        options += [InterleavedShard(d, 2) for d in range(t.ndim) if t.shape[d] % 2 == 0]
    if ragged:
        options += [RaggedShard(d, ragged_sizes(t.shape[d], mesh_size)) for d in range(t.ndim)]
    return options


def placement_cases(
    mesh_shape: tuple[int, ...],
    tensors: Sequence[torch.Tensor],
    *,
    partial: bool = True,
    interleaved: bool = False,
    ragged: bool = False,
    max_cases: int = 24,
    seed: int = 0,
) -> list[list[tuple]]:
    """Input placement combinations: all of them when few, else a seeded random subset that
    always includes the all-Replicate case. ``SHARDWISE_ORACLE_CASES=0`` in the environment
    runs every combination (N > 0: at most N)."""
    max_cases = int(os.environ.get("SHARDWISE_ORACLE_CASES", max_cases)) or 10**9
    mesh = sw.init_device_mesh("cpu", mesh_shape)
    per_input = []
    for t in tensors:
        opts = placement_options(
            t, partial=partial, interleaved=interleaved, ragged=ragged,
            mesh_size=mesh_shape[0] if mesh_shape else 1,
        )
        combos = itertools.product(opts, repeat=len(mesh_shape))
        per_input.append([c for c in combos if _valid(t, mesh, c)])
    everything = list(itertools.product(*per_input))
    if len(everything) <= max_cases:
        return [list(c) for c in everything]
    rng = random.Random(seed)
    picked = [everything[0]] + rng.sample(everything[1:], max_cases - 1)
    return [list(c) for c in picked]


def _valid(t: torch.Tensor, mesh: sw.DeviceMesh, placements: tuple) -> bool:
    """Whether the placements fit ``t`` (an interleave must divide at its nesting level)."""
    try:
        validate_placements(t.shape, mesh, placements)
    except sw.errors.InvalidPlacementError:
        return False
    return True


def _full(x):
    return x.full_tensor() if isinstance(x, DTensor) else x


def _assert_close(actual, expected, atol: float, rtol: float, what: str) -> None:
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), f"{what}: got {type(actual)}"
        assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
        assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
        if expected.is_floating_point() or expected.is_complex():
            torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol, msg=what)
        else:
            assert torch.equal(actual, expected), f"{what}: {actual} != {expected}"
    else:
        assert actual == expected, f"{what}: {actual} != {expected}"


def check_op(
    fn: Callable,
    tensors: Sequence[torch.Tensor],
    mesh_shape: tuple[int, ...],
    placements: Sequence[tuple],
    *,
    grad: bool = True,
    atol: float = 1e-5,
    rtol: float = 1e-4,
) -> None:
    """``fn`` on DTensors placed by ``placements`` equals ``fn`` on the tensors, and so do the
    gradients of a random weighting of the float outputs."""
    mesh = sw.init_device_mesh("cpu", mesh_shape)
    wants_grad = [grad and t.is_floating_point() for t in tensors]
    plain = [t.detach().clone().requires_grad_(g) for t, g in zip(tensors, wants_grad, strict=True)]
    dts = []
    for t, p, g in zip(tensors, placements, wants_grad, strict=True):
        d = sw.distribute_tensor(t.detach().clone(), mesh, list(p))
        dts.append(d.requires_grad_(g))
    with sw.config.allow_implicit_redistribute():
        got = fn(*dts)
    expected = fn(*plain)
    what = f"placements {[list(p) for p in placements]} on mesh {mesh_shape}"
    got_flat = [_full(x) for x in pytree.tree_leaves(got)]
    exp_flat = pytree.tree_leaves(expected)
    assert len(got_flat) == len(exp_flat), what
    for a, e in zip(got_flat, exp_flat, strict=True):
        _assert_close(a, e, atol, rtol, what)
    if not any(wants_grad):
        return
    gen = torch.Generator().manual_seed(1)
    got_leaves = pytree.tree_leaves(got)
    pairs = [
        (g, e)
        for g, e in zip(got_leaves, exp_flat, strict=True)
        if isinstance(e, torch.Tensor) and e.requires_grad and e.is_floating_point()
    ]
    if not pairs:
        return
    loss_d, loss_e = 0, 0
    for g, e in pairs:
        w = torch.rand(e.shape, generator=gen, dtype=e.dtype)
        loss_d = loss_d + (_full(g) * w).sum()
        loss_e = loss_e + (e * w).sum()
    with sw.config.allow_implicit_redistribute():
        loss_d.backward()
    loss_e.backward()
    for i, (d, t) in enumerate(zip(dts, plain, strict=True)):
        if t.grad is None:
            continue
        assert d.grad is not None, f"input {i} got no gradient ({what})"
        _assert_close(_full(d.grad), t.grad, atol, rtol, f"grad of input {i} ({what})")


def run_oracle(
    fn: Callable,
    tensors: Sequence[torch.Tensor],
    *,
    mesh_shapes: Sequence[tuple[int, ...]] = MESH_SHAPES,
    partial: bool = True,
    interleaved: bool = False,
    ragged: bool = False,
    grad: bool = True,
    max_cases: int = 24,
    atol: float = 1e-5,
    rtol: float = 1e-4,
) -> int:
    """Check ``fn`` over placement cases on every mesh; returns the number of cases run."""
    count = 0
    for mesh_shape in mesh_shapes:
        cases = placement_cases(
            mesh_shape, tensors, partial=partial, interleaved=interleaved, ragged=ragged,
            max_cases=max_cases,
        )
        for case in cases:
            check_op(fn, tensors, mesh_shape, case, grad=grad, atol=atol, rtol=rtol)
            count += 1
    return count
