"""Validate a sharding strategy: force EVERY strategy it returns, not only the one dispatch
picks, and compare with single-device torch.

For a sample call ``op(*args, **kwargs)`` on plain tensors, on each mesh the strategy is asked
for its candidates from a few current input layouts; each candidate is then run exactly as
declared (inputs placed at its input placements, Partial inputs split adversarially so that a
wrongly linear op shows, uneven shards when the shapes do not divide) and its output must equal
torch's result and carry the declared output placements. ``SHARDWISE_VALIDATE_ALL=1`` (or
``exhaustive=True``) checks every candidate from more layouts instead of a seeded sample.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import settings
from ..dtensor import DTensor, local_of
from ..errors import InvalidArgumentError, InvalidPlacementError, StrategyValidationError
from ..factories import place_tensor
from ..mesh import DeviceMesh, init_device_mesh
from ..op_inputs import allow_implicit_redistribute
from ..placements import Partial, Placement, Replicate, Shard, norm_order
from ..spec import DTensorSpec, make_tensor_meta, validate_placements
from ..torch_compat import pytree
from . import registry
from .registry import OpEntry, OpStrategy, PlacementStrategy

MESH_SHAPES: tuple[tuple[int, ...], ...] = ((2,), (3,), (2, 2))


def exhaustive_by_default() -> bool:
    """True when the on/off variable ``SHARDWISE_VALIDATE_ALL`` is on."""
    return settings.env_flag("SHARDWISE_VALIDATE_ALL")


@dataclass
class ValidationReport:
    """What ``validate_strategy`` checked: how many (mesh, strategy) cases ran, and the
    failures (one line each: mesh, input and output placements, what went wrong)."""

    op: Any
    checked: int = 0
    failures: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures


@contextlib.contextmanager
def forced(op: Any, candidate: PlacementStrategy) -> Iterator[None]:
    """Within the block, ``op``'s strategy returns only ``candidate`` (hooks unchanged)."""
    saved = registry.registration(op)
    registry.set_entry(op, dataclasses.replace(
        saved or OpEntry(), rule=None, strategy=lambda mesh, schema: OpStrategy([candidate])
    ))
    try:
        yield
    finally:
        registry.set_entry(op, saved)


def adversarial_components(
    tensor: torch.Tensor, mesh: DeviceMesh, placements: Sequence[Placement], seed: int
) -> DTensor:
    """A DTensor of global value ``tensor`` whose Partial mesh dims hold random pieces that
    reduce to it (sum: random addends; avg: random offsets of mean zero; max/min: values below
    or above it, one device per element holding it), so a rule that wrongly treats an op as
    linear in a Partial input gives a wrong value. Mixed Partial kinds keep distribute_tensor's
    pieces."""
    placements = validate_placements(tensor.shape, mesh, placements)
    partial_dims = [m for m, p in enumerate(placements) if isinstance(p, Partial)]
    kinds = {placements[m].reduce_op for m in partial_dims}
    if not partial_dims or len(kinds) > 1 or tensor.dtype == torch.bool:
        return place_tensor(tensor, mesh, placements)
    (kind,) = kinds
    if kind == "avg" and not (tensor.is_floating_point() or tensor.is_complex()):
        return place_tensor(tensor, mesh, placements)
    base = [Replicate() if isinstance(p, Partial) else p for p in placements]
    dt = place_tensor(tensor, mesh, base)
    gen = torch.Generator().manual_seed(seed)
    comps = list(local_of(dt).pieces)
    # devices that differ only on Replicate mesh dims must hold the same piece: split once per
    # position on the Shard mesh dims, one part per position on the Partial mesh dims
    shard_dims = [m for m, p in enumerate(placements) if isinstance(p, Shard)]
    n_parts = math.prod(mesh.shape[m] for m in partial_dims)
    splits: dict[tuple, list[torch.Tensor]] = {}
    for k, device in enumerate(mesh.local_device_ids):
        coord = mesh.coordinate_of(device)
        key = tuple(coord[m] for m in shard_dims)
        if key not in splits:
            splits[key] = _split(comps[k], n_parts, kind, gen)
        part = 0
        for m in partial_dims:
            part = part * mesh.shape[m] + coord[m]
        comps[k] = splits[key][part].clone()  # own storage: in-place ops write per device
    return DTensor(comps, DTensorSpec(mesh, tuple(placements), local_of(dt).spec.tensor_meta))


def _noise(like: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    if like.is_floating_point() or like.is_complex():
        scale = like.abs().amax() if like.numel() else torch.tensor(1.0)
        scale = float(scale) if float(scale) > 0 else 1.0
        return (torch.rand(like.shape, generator=gen, dtype=torch.float64) * scale).to(like.dtype)
    return torch.randint(0, 5, like.shape, generator=gen).to(like.dtype)


def _split(piece: torch.Tensor, n: int, kind: str, gen: torch.Generator) -> list[torch.Tensor]:
    noise = [_noise(piece, gen) for _ in range(n)]
    if kind == "sum":
        parts = noise[:-1]
        return [*parts, piece - sum(parts, torch.zeros_like(piece))]
    if kind == "avg":
        mean = sum(noise, torch.zeros_like(piece)) / n
        return [piece + x - mean for x in noise]
    order = norm_order(kind)
    if order is not None and order != math.inf:  # nonnegative pieces whose p-norm is |piece|
        weights = [x.abs() + 0.1 for x in noise]
        scale = sum((w ** order for w in weights), torch.zeros_like(piece)) ** (1 / order)
        return [piece.abs() * w / scale for w in weights]
    keeper = torch.randint(0, n, piece.shape, generator=gen)
    if order is not None:  # inf: one device holds |piece|, the others less
        return [torch.where(keeper == k, piece.abs(), piece.abs() * torch.rand(
            piece.shape, generator=gen, dtype=torch.float64).to(piece.dtype)) for k in range(n)]
    sign = -1 if kind == "max" else 1
    return [torch.where(keeper == k, piece, piece + sign * noise[k]) for k in range(n)]


def _fits(t: torch.Tensor, mesh: DeviceMesh, placements: Sequence[Placement]) -> bool:
    try:
        validate_placements(t.shape, mesh, placements)
    except InvalidPlacementError:
        return False
    return True


def _layouts(
    tensors: Sequence[torch.Tensor], mesh: DeviceMesh, exhaustive: bool, rng: random.Random
) -> list[list[tuple[Placement, ...]]]:
    """Current input layouts to ask the strategy from: all replicated, each tensor sharded on
    its largest dims, and (exhaustive) random mixes with Partial("sum")."""
    rep = (Replicate(),) * mesh.ndim
    layouts = [[rep] * len(tensors)]
    sharded = []
    for t in tensors:
        order = sorted(range(t.ndim), key=lambda d: -t.shape[d])
        p = tuple(Shard(order[m]) if m < len(order) else Replicate() for m in range(mesh.ndim))
        sharded.append(p if _fits(t, mesh, p) else rep)
    layouts.append(sharded)
    for _ in range(6 if exhaustive else 0):
        mix = []
        for t in tensors:
            choices: list[Placement] = [Replicate(), *(Shard(d) for d in range(t.ndim))]
            if t.is_floating_point():
                choices.append(Partial())
            p = tuple(rng.choice(choices) for _ in range(mesh.ndim))
            mix.append(p if _fits(t, mesh, p) else rep)
        layouts.append(mix)
    return layouts


def _candidates(
    op: Any, mesh: DeviceMesh, flat: list, tree: Any, tensor_at: list[int],
    layouts: list[list[tuple[Placement, ...]]],
) -> list[PlacementStrategy]:
    """The strategy's candidates for every layout, deduplicated (by placements)."""
    reg = registry.registration(op)
    found: dict[str, PlacementStrategy] = {}
    for layout in layouts:
        specs = {
            i: OpStrategy([PlacementStrategy(DTensorSpec(mesh, p, make_tensor_meta(flat[i])))])
            for i, p in zip(tensor_at, layout, strict=True)
        }
        conv = [specs.get(i, x) for i, x in enumerate(flat)]
        args, kwargs = pytree.tree_unflatten(conv, tree)
        schema = registry.OpSchema(op, tuple(args), dict(kwargs), reg.schema_info)
        for c in reg.strategy(mesh, schema).strategies:
            found.setdefault(repr(c), c)
    return list(found.values())


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0][:200] if text else ""


def _describe(c: PlacementStrategy) -> str:
    return repr(c).removeprefix("PlacementStrategy")


def _compare(got: Any, expected: Any, atol: float, rtol: float, check_values: bool) -> str:
    got_leaves, exp_leaves = pytree.tree_leaves(got), pytree.tree_leaves(expected)
    if len(got_leaves) != len(exp_leaves):
        return f"{len(got_leaves)} outputs, expected {len(exp_leaves)}"
    for i, (a, e) in enumerate(zip(got_leaves, exp_leaves, strict=True)):
        if isinstance(a, DTensor):
            a = a.full_tensor()
        if not isinstance(e, torch.Tensor):
            if check_values and a != e:
                return f"output {i}: {a!r}, expected {e!r}"
            continue
        if not isinstance(a, torch.Tensor):
            return f"output {i}: {type(a).__name__}, expected a tensor"
        if a.shape != e.shape or a.dtype != e.dtype:
            return f"output {i}: {a.dtype}{list(a.shape)}, expected {e.dtype}{list(e.shape)}"
        if check_values:
            try:
                torch.testing.assert_close(a, e, atol=atol, rtol=rtol, equal_nan=True)
            except AssertionError as err:
                return f"output {i}: " + str(err).strip().splitlines()[0]
    return ""


def _declared(got: Any, candidate: PlacementStrategy) -> str:
    """An empty string if the outputs carry the candidate's declared placements."""
    outs = candidate.output_specs
    declared = [outs] if isinstance(outs, DTensorSpec) else list(outs or [])
    got_list = list(got) if isinstance(got, (tuple, list)) else [got]
    for i, (g, spec) in enumerate(zip(got_list, declared, strict=False)):
        if spec is None or not isinstance(g, DTensor):
            continue
        if tuple(g.placements) != tuple(spec.placements):
            return (
                f"output {i} has placements {list(g.placements)}, "
                f"declared {list(spec.placements)}"
            )
    return ""


# ops whose outputs are uninitialized memory: only their placements can be checked
_UNINITIALIZED = {"empty", "empty_like", "empty_strided", "empty_permuted", "new_empty",
                  "new_empty_strided"}


def _is_random(op: Any, args: tuple, kwargs: dict) -> bool:
    """True when the op's values differ between calls (random or uninitialized output)."""
    if getattr(op, "_schema", None) is not None and (
        op._schema.name.split("::")[-1] in _UNINITIALIZED
    ):
        return True
    results = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        results.append(pytree.tree_leaves(op(*_clone(args), **_clone(kwargs))))
    for a, b in zip(*results, strict=True):
        if isinstance(a, torch.Tensor) and not torch.equal(a.nan_to_num(), b.nan_to_num()):
            return True
    return False


def _clone(tree: Any) -> Any:
    return pytree.tree_map_only(torch.Tensor, lambda t: t.detach().clone(), tree)


def validate_strategy(
    op: Any,
    args: tuple,
    kwargs: dict | None = None,
    *,
    mesh_shapes: Sequence[tuple[int, ...]] = MESH_SHAPES,
    exhaustive: bool | None = None,
    max_per_mesh: int = 6,
    seed: int = 0,
    atol: float = 1e-6,
    rtol: float = 1e-5,
    raise_on_failure: bool = True,
) -> ValidationReport:
    """Check every strategy the registered strategy of ``op`` (an aten op or custom op
    overload) returns for the sample call ``op(*args, **kwargs)`` on plain tensors; raise
    ``StrategyValidationError`` listing the wrong ones (or return them in the report).

    Sampled by default (at most ``max_per_mesh`` candidates per mesh, seeded); exhaustive with
    ``exhaustive=True`` or ``SHARDWISE_VALIDATE_ALL=1``. Use float64 samples: the comparison
    tolerances are tight."""
    kwargs = kwargs or {}
    exhaustive = exhaustive_by_default() if exhaustive is None else exhaustive
    reg = registry.registration(op)
    if reg is None or reg.strategy is None:
        raise InvalidArgumentError(f"{op} has no registered sharding strategy to validate")
    report = ValidationReport(op)
    flat, tree = pytree.tree_flatten((args, kwargs))
    tensor_at = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor)]
    if not tensor_at:
        raise InvalidArgumentError(f"validate_strategy({op}) needs a sample with a tensor")
    try:
        expected = op(*_clone(args), **_clone(kwargs))
    except Exception as err:
        raise InvalidArgumentError(
            f"the sample call of {op} fails on plain tensors: {type(err).__name__}: {err}"
        ) from err
    check_values = not _is_random(op, args, kwargs)
    rng = random.Random(seed)
    for mesh_shape in mesh_shapes:
        mesh = init_device_mesh("cpu", mesh_shape)
        tensors = [flat[i] for i in tensor_at]
        layouts = _layouts(tensors, mesh, exhaustive, rng)
        candidates = _candidates(op, mesh, flat, tree, tensor_at, layouts)
        if not exhaustive and len(candidates) > max_per_mesh:
            candidates = rng.sample(candidates, max_per_mesh)
        for n, candidate in enumerate(candidates):
            problem = _run_candidate(
                op, mesh, flat, tree, tensor_at, candidate, expected, check_values,
                atol, rtol, seed + n,
            )
            report.checked += 1
            if problem:
                report.failures.append(f"mesh {mesh_shape} {_describe(candidate)}: {problem}")
    if report.failures and raise_on_failure:
        raise StrategyValidationError(
            f"{len(report.failures)} of {report.checked} strategies of {op} are wrong:\n  "
            + "\n  ".join(report.failures[:20])
        )
    return report


def _run_candidate(
    op: Any, mesh: DeviceMesh, flat: list, tree: Any, tensor_at: list[int],
    candidate: PlacementStrategy, expected: Any, check_values: bool,
    atol: float, rtol: float, seed: int,
) -> str:
    """Run ``op`` with exactly ``candidate``: '' if right, else what is wrong."""
    ins = candidate.input_specs
    if ins is None or len(ins) != len(tensor_at):
        return f"declares {0 if ins is None else len(ins)} input specs for {len(tensor_at)} inputs"
    held = [i for i, spec in zip(tensor_at, ins, strict=True)
            if any(isinstance(p, Partial) and norm_order(p.reduce_op) is not None
                   for p in spec.placements)]
    if held:  # a pending norm holds |value|: the oracle runs on that
        flat = [f.abs() if i in held else f for i, f in enumerate(flat)]
        plain_args, plain_kwargs = pytree.tree_unflatten(flat, tree)
        expected = op(*plain_args, **plain_kwargs)
    dflat = list(flat)
    for i, spec in zip(tensor_at, ins, strict=True):
        t = flat[i].detach().clone()
        if not (t.is_floating_point() or t.is_complex()) and any(
            isinstance(p, Partial) and p.reduce_op == "avg" for p in spec.placements
        ):
            return ""  # no DTensor of this dtype is a pending mean: the input cannot occur
        if not _fits(t, mesh, spec.placements):
            return f"input placements {list(spec.placements)} do not fit shape {list(t.shape)}"
        dflat[i] = adversarial_components(t, mesh, spec.placements, seed)
    args, kwargs = pytree.tree_unflatten(dflat, tree)
    try:
        with forced(op, candidate), allow_implicit_redistribute():
            got = op(*args, **kwargs)
    except Exception as err:
        return f"raised {type(err).__name__}: {_first_line(err)}"
    wrong = _compare(got, expected, atol, rtol, check_values)
    entry = registry.registration(op)
    if wrong or entry.post is not None:  # a post-patch may finish the op (e.g. reduce)
        return wrong
    return _declared(got, candidate)
