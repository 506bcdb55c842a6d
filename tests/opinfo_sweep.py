"""Run PyTorch's OpInfo database (``op_db``) on DTensors and compare with single-device torch.

Every OpInfo's sample inputs are distributed on meshes (2,), (3,) and (2, 2) with several
placements per tensor (Replicate, Shard of each dim, Partial), run forward and, when the op is
differentiable, backward; the global values are compared with torch on the full tensors.

    PYTHONPATH=src python tests/opinfo_sweep.py            # the sampled CI run, prints counts
    PYTHONPATH=src python tests/opinfo_sweep.py --full     # every sample, more placements
    PYTHONPATH=src python tests/opinfo_sweep.py --op nn.functional.conv2d -v

``SHARDWISE_OPINFO_FULL=1`` makes the test use the full run too.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import random
import re
import sys
import textwrap
import time
import types
import unittest
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import shardwise as sw
from shardwise import DTensor, Partial, Replicate, Shard
from shardwise.ops import registry
from shardwise.spec import validate_placements

MESH_SHAPES: tuple[tuple[int, ...], ...] = ((2,), (3,), (2, 2))
FULL = os.environ.get("SHARDWISE_OPINFO_FULL", "") not in ("", "0")

# outcome of one OpInfo, worst first
WRONG, UNSUPPORTED, ERROR, PASS, SKIP = "wrong", "unsupported", "error", "pass", "skip"
ORDER = (WRONG, ERROR, UNSUPPORTED, PASS, SKIP)


def op_db() -> list:
    """torch's OpInfo list (its test utilities import ``expecttest``: a stand-in is enough)."""
    if "expecttest" not in sys.modules:
        try:
            import expecttest  # noqa: F401
        except ImportError:
            stub = types.ModuleType("expecttest")
            stub.TestCase = unittest.TestCase
            sys.modules["expecttest"] = stub
    from torch.testing._internal.common_methods_invocations import op_db as db

    return db


def op_id(opinfo: Any) -> str:
    return opinfo.name + (f".{opinfo.variant_test_name}" if opinfo.variant_test_name else "")


def pick_dtype(opinfo: Any) -> torch.dtype | None:
    """float64 when the op supports it on CPU (shard-order rounding stays invisible), else
    float32; None when neither (the op is not testable here)."""
    supported = opinfo.supported_dtypes("cpu")
    for dtype in (torch.float64, torch.float32):
        if dtype in supported:
            return dtype
    return None


@dataclass
class Outcome:
    """What happened to one OpInfo: the worst status over its cases, and the first message."""

    name: str
    status: str = SKIP
    message: str = ""
    cases: int = 0
    seconds: float = 0.0
    counts: collections.Counter = field(default_factory=collections.Counter)

    def add(self, status: str, message: str = "") -> None:
        self.counts[status] += 1
        if status != SKIP:
            self.cases += 1
        if ORDER.index(status) < ORDER.index(self.status):
            self.status, self.message = status, message


def _options(t: torch.Tensor) -> list:
    options: list = [Replicate()] + [Shard(d) for d in range(t.ndim)]
    if t.is_floating_point() or t.is_complex():
        options.append(Partial())
    return options


def _fits(t: torch.Tensor, mesh: sw.DeviceMesh, placements: Sequence) -> bool:
    try:
        validate_placements(t.shape, mesh, placements)
    except sw.errors.InvalidPlacementError:
        return False
    return True


def placement_variants(
    tensors: Sequence[torch.Tensor], mesh: sw.DeviceMesh, n_random: int, seed: int
) -> list[list[tuple]]:
    """Placements for every tensor: first each tensor sharded on its largest dims (one per
    mesh dim), then ``n_random`` seeded random choices from Replicate/Shard/Partial."""
    first = []
    for t in tensors:
        order = sorted(range(t.ndim), key=lambda d: -t.shape[d])
        first.append(tuple(
            Shard(order[m]) if m < len(order) else Replicate() for m in range(mesh.ndim)
        ))
    variants = [first]
    rng = random.Random(seed)
    for _ in range(n_random):
        variant = []
        for t in tensors:
            for _attempt in range(8):
                pick = tuple(rng.choice(_options(t)) for _ in range(mesh.ndim))
                if _fits(t, mesh, pick):
                    break
            else:
                pick = (Replicate(),) * mesh.ndim
            variant.append(pick)
        if variant not in variants:
            variants.append(variant)
    return [[p if _fits(t, mesh, p) else (Replicate(),) * mesh.ndim
             for t, p in zip(tensors, v, strict=True)] for v in variants]


def _call(opinfo: Any, sample: Any, tree: Any, leaves: list) -> Any:
    inp, args, kwargs = pytree.tree_unflatten(leaves, tree)
    return opinfo.op(inp, *args, **kwargs)


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0][:200] if text else ""


def _full(x: Any) -> Any:
    return x.full_tensor() if isinstance(x, DTensor) else x


def _compare(got: Any, expected: Any, atol: float, rtol: float, random_op: bool) -> str:
    """An empty string if ``got`` matches ``expected``, else what differs."""
    got_leaves = [_full(x) for x in pytree.tree_leaves(got)]
    exp_leaves = pytree.tree_leaves(expected)
    if len(got_leaves) != len(exp_leaves):
        return f"{len(got_leaves)} outputs, expected {len(exp_leaves)}"
    for i, (a, e) in enumerate(zip(got_leaves, exp_leaves, strict=True)):
        if isinstance(e, torch.Tensor):
            if not isinstance(a, torch.Tensor):
                return f"output {i}: got {type(a).__name__}, expected a tensor"
            if a.shape != e.shape or a.dtype != e.dtype:
                return f"output {i}: {a.dtype}{list(a.shape)}, expected {e.dtype}{list(e.shape)}"
            if random_op:
                continue
            try:
                torch.testing.assert_close(a, e, atol=atol, rtol=rtol, equal_nan=True)
            except AssertionError as err:
                return f"output {i}: " + str(err).splitlines()[0]
        elif not random_op and a != e and not (a != a and e != e):
            return f"output {i}: {a!r}, expected {e!r}"
    return ""


class _Seeded(TorchDispatchMode):
    """Notes whether any aten op that draws from a generator runs (torch's own tag)."""

    drew = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.drew = self.drew or torch.Tag.nondeterministic_seeded in func.tags
        return func(*args, **(kwargs or {}))


def _is_random(opinfo: Any, tree: Any, leaves: list) -> bool:
    """An op whose value depends on the RNG (dropout, bernoulli...): compared by shape only.
    Seeded inside (OpInfo's ``wrapper_set_seed``) it still draws: a sharded draw is not the
    single-device one (each device draws its own shard)."""
    outs = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        seeded = _Seeded()
        with seeded:
            outs.append(pytree.tree_leaves(_call(opinfo, None, tree, [
                x.detach().clone() if isinstance(x, torch.Tensor) else x for x in leaves
            ])))
        if seeded.drew:
            return True
    for a, b in zip(outs[0], outs[1], strict=True):
        if isinstance(a, torch.Tensor):
            try:
                if a.shape != b.shape or not torch.equal(a.nan_to_num(), b.nan_to_num()):
                    return True
            except (RuntimeError, NotImplementedError):  # no equal/nan_to_num for the dtype
                return False
    return False


def _grad_pairs(got: Any, expected: Any) -> list[tuple[Any, torch.Tensor]]:
    return [
        (g, e)
        for g, e in zip(pytree.tree_leaves(got), pytree.tree_leaves(expected), strict=True)
        if isinstance(e, torch.Tensor) and e.requires_grad and e.is_floating_point()
    ]


def run_case(
    opinfo: Any, sample: Any, mesh_shape: tuple[int, ...], variant: int, n_random: int,
    backward: bool, calls: dict | None = None,
) -> tuple[str, str]:
    """Run one sample on one mesh in every placement variant: (status, message). ``calls``
    records the first call of each aten op the reference run (forward, backward) makes."""
    dtype_tol = {torch.float64: (1e-7, 1e-6), torch.float32: (1e-4, 1e-3)}
    tree_in = (sample.input, sample.args, sample.kwargs)
    leaves, tree = pytree.tree_flatten(tree_in)
    tensor_at = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    if not tensor_at:
        return SKIP, "no tensor argument"
    if any(leaves[i].layout != torch.strided for i in tensor_at):
        return SKIP, "sparse input"
    tensors = [leaves[i] for i in tensor_at]
    atol, rtol = dtype_tol.get(tensors[0].dtype, (1e-4, 1e-3))

    def plain_leaves(grad: bool) -> list:
        out = list(leaves)
        for i in tensor_at:
            t = leaves[i].detach().clone()
            out[i] = t.requires_grad_(grad and leaves[i].requires_grad)
        return out

    ref_leaves = plain_leaves(backward)
    recording = _Recorder(calls) if calls is not None else contextlib.nullcontext()
    try:
        with recording:
            expected = _call(opinfo, sample, tree, ref_leaves)
    except Exception as err:  # the sample is invalid for torch itself
        return SKIP, f"reference raised {type(err).__name__}"
    try:
        random_op = "empty" in opinfo.name or _is_random(opinfo, tree, leaves)
    except Exception as err:
        return SKIP, f"reference raised {type(err).__name__} on a second run"
    pairs_e = _grad_pairs(expected, expected) if backward and not random_op else []
    ref_grads = None
    if pairs_e:
        gen = torch.Generator().manual_seed(1)
        weights = [torch.rand(e.shape, generator=gen, dtype=e.dtype) for _, e in pairs_e]
        loss = sum((e * w).sum() for (_, e), w in zip(pairs_e, weights, strict=True))
        inputs = [ref_leaves[i] for i in tensor_at if ref_leaves[i].requires_grad]
        with recording:
            ref_grads = torch.autograd.grad(loss, inputs, allow_unused=True)

    mesh = sw.init_device_mesh("cpu", mesh_shape)
    variants = placement_variants(tensors, mesh, n_random, seed=variant)
    for placements in variants:
        where = f"mesh {mesh_shape}, placements {[list(p) for p in placements]}"
        dleaves = list(leaves)
        for i, p in zip(tensor_at, placements, strict=True):
            d = sw.distribute_tensor(leaves[i].detach().clone(), mesh, list(p))
            dleaves[i] = d.requires_grad_(bool(ref_grads) and leaves[i].requires_grad)
        try:
            with sw.config.allow_implicit_redistribute():
                got = _call(opinfo, sample, tree, dleaves)
        except sw.errors.UnsupportedOpError as err:
            return UNSUPPORTED, _first_line(err)
        except Exception as err:
            return ERROR, f"{type(err).__name__}: {_first_line(err)} ({where})"
        diff = _compare(got, expected, atol, rtol, random_op)
        if diff:
            return WRONG, f"{diff} ({where})"
        if not ref_grads:
            continue
        pairs = _grad_pairs(got, expected)
        try:
            loss_d = sum((_full(g) * w).sum() for (g, _), w in zip(pairs, weights, strict=True))
            inputs = [dleaves[i] for i in tensor_at if dleaves[i].requires_grad]
            with sw.config.allow_implicit_redistribute():
                grads = torch.autograd.grad(loss_d, inputs, allow_unused=True)
        except sw.errors.UnsupportedOpError as err:
            return UNSUPPORTED, f"backward: {_first_line(err)}"
        except Exception as err:
            return ERROR, f"backward: {type(err).__name__}: {_first_line(err)} ({where})"
        for k, (g, e) in enumerate(zip(grads, ref_grads, strict=True)):
            if e is None:
                continue
            if g is None:
                return WRONG, f"backward: no gradient for input {k} ({where})"
            diff = _compare(g, e, atol * 10, rtol * 10, False)
            if diff:
                return WRONG, f"backward: grad of input {k}: {diff} ({where})"
    return PASS, ""


def run_opinfo(opinfo: Any, *, full: bool = FULL, calls: dict | None = None) -> Outcome:
    """Every case of one OpInfo (sampled unless ``full``); ``calls`` records the aten calls
    of the first sample's reference run (see ``run_case``)."""
    outcome = Outcome(op_id(opinfo))
    start = time.perf_counter()
    dtype = pick_dtype(opinfo)
    if dtype is None:
        outcome.message = "no float32/float64 support on CPU"
        return outcome
    backward = bool(opinfo.supports_autograd)
    n_samples, n_random = (8, 3) if full else (1, 1)
    try:
        samples = list(_first(opinfo.sample_inputs("cpu", dtype, requires_grad=backward),
                              n_samples))
    except Exception as err:
        outcome.message = f"sample_inputs raised {type(err).__name__}"
        return outcome
    for s, sample in enumerate(samples):
        for m, mesh_shape in enumerate(MESH_SHAPES):
            # sampled runs check gradients on one mesh only
            grad = backward and (full or m == s % len(MESH_SHAPES))
            record = calls if s == 0 and m == 0 else None
            with torch.random.fork_rng():
                status, message = run_case(opinfo, sample, mesh_shape, s, n_random, grad, record)
            outcome.add(status, message)
            if status in (WRONG, ERROR, UNSUPPORTED) and not full:
                outcome.seconds = time.perf_counter() - start
                return outcome
    outcome.seconds = time.perf_counter() - start
    return outcome


def _first(it: Iterator, n: int) -> Iterator:
    for i, x in enumerate(it):
        if i >= n:
            return
        yield x


class _Recorder(TorchDispatchMode):
    """Records the first call of every aten op (arguments cloned before the op runs)."""

    def __init__(self, calls: dict) -> None:
        super().__init__()
        self.calls = calls

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in self.calls:
            self.calls[func] = pytree.tree_map_only(
                torch.Tensor, lambda t: t.detach().clone(), (args, kwargs)
            )
        return func(*args, **kwargs)


# Why an OpInfo fails, where the error message alone does not say it.
REASONS = {
    "nn.functional.linear_cross_entropy.chunked_none": "its backward runs torch's chunked "
    "accumulator in Python on the saved tensors, with out= matmuls into plain buffers "
    "(aten.mm.out): a plain out beside DTensor inputs is refused",
    "to_sparse": "sparse DTensors are not supported (distribute_tensor refuses sparse inputs)",
}
XFAIL_FILE = Path(__file__).with_name("opinfo_xfail.py")


def xfail_reason(outcome: Outcome) -> str:
    """One line: the missing rule (``no rule: aten.x``) or why the OpInfo cannot pass."""
    if outcome.name in REASONS:
        return REASONS[outcome.name]
    found = re.search(r"(\S+) has no sharding rule", outcome.message)
    if outcome.status == UNSUPPORTED and found:
        return f"no rule: {found.group(1)}"
    return outcome.message


def write_xfail(failing: Sequence[Outcome]) -> None:
    """Rewrite tests/opinfo_xfail.py: the OpInfos that fail now, with their reasons."""
    lines = [
        '"""OpInfos expected to fail in tests/test_opinfo.py, with the reason (generated by',
        "`python tests/opinfo_sweep.py --write-xfail`; an entry that passes fails the test, so",
        'the list only shrinks). ``no rule: aten.x`` means an op family not written yet."""',
        "",
        "XFAIL: dict[str, str] = {",
    ]
    for o in sorted(failing, key=lambda o: o.name):
        entry = f"    {o.name!r}: {xfail_reason(o)!r},"
        if len(entry) <= 100:
            lines.append(entry)
            continue
        pieces = textwrap.wrap(xfail_reason(o), 80, drop_whitespace=False)
        lines += [f"    {o.name!r}: ("] + [f"        {p!r}" for p in pieces] + ["    ),"]
    lines.append("}")
    XFAIL_FILE.write_text("\n".join(lines) + "\n")


COUNTS_FILE = Path(__file__).parents[1] / "tools" / "opinfo_counts.py"


def write_counts(counts: collections.Counter, mode: str) -> None:
    """Rewrite the OpInfo counts module that ``python tools/ops_table.py`` reports."""
    tested = sum(counts[s] for s in (WRONG, ERROR, UNSUPPORTED, PASS))
    COUNTS_FILE.write_text(
        '"""OpInfo counts for docs/ops.md, written by `python tests/opinfo_sweep.py '
        '--write-counts`."""\n\n'
        f"TORCH_VERSION = {torch.__version__.split('+')[0]!r}\n"
        f"MODE = {mode!r}  # sampled: the CI run; full: SHARDWISE_OPINFO_FULL=1\n"
        f"OPINFOS = {sum(counts.values())}\n"
        f"TESTABLE = {tested}  # with float32 or float64 samples on CPU\n"
        f"PASSED = {counts[PASS]}  # forward in every variant, backward if differentiable\n"
        f"UNSUPPORTED = {counts[UNSUPPORTED]}  # an aten op without a sharding rule\n"
        f"ERRORS = {counts[ERROR]}\n"
        f"WRONG = {counts[WRONG]}\n"
    )


def validate_new(calls: dict, done: set, *, max_per_mesh: int = 2) -> list[str]:
    """Validate the strategies of the ops in ``calls`` not in ``done`` (then added to it) on
    their recorded sample; the failures (sampled, or exhaustive with SHARDWISE_VALIDATE_ALL)."""
    failures = []
    for op, (args, kwargs) in calls.items():
        if op in done:
            continue
        done.add(op)
        reg = registry.registration(op)
        if reg is None or reg.strategy is None:
            continue
        try:
            report = sw.rules.validate_strategy(
                op, args, kwargs, max_per_mesh=max_per_mesh, raise_on_failure=False
            )
        except sw.errors.InvalidArgumentError:  # the recorded call does not run alone (views
            # of views)
            continue
        failures += [f"{op}: {f}" for f in report.failures]
    return failures


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="every sample, more placements")
    parser.add_argument("--op", action="append", help="only OpInfos with this name (repeat)")
    parser.add_argument("-v", "--verbose", action="store_true", help="print every failure")
    parser.add_argument(
        "--write-counts", action="store_true",
        help="rewrite tools/opinfo_counts.py (the counts docs/ops.md reports)",
    )
    parser.add_argument(
        "--write-xfail", action="store_true",
        help="rewrite tests/opinfo_xfail.py from this run's failures (sampled run only)",
    )
    parser.add_argument(
        "--validate", action="store_true",
        help="also force every strategy of the ops the samples reach "
        "(shardwise.rules.validate_strategy)",
    )
    args = parser.parse_args(argv)
    outcomes, done, wrong_strategies = [], set(), []
    for opinfo in op_db():
        if args.op and opinfo.name not in args.op and op_id(opinfo) not in args.op:
            continue
        calls: dict | None = {} if args.validate else None
        with contextlib.redirect_stderr(open(os.devnull, "w")):
            outcomes.append(run_opinfo(opinfo, full=args.full or FULL, calls=calls))
            if calls:
                wrong_strategies += validate_new(calls, done, max_per_mesh=6)
    for line in wrong_strategies:
        print(f"wrong strategy {line}")
    counts = collections.Counter(o.status for o in outcomes)
    for o in outcomes:
        if o.status in (WRONG, ERROR, UNSUPPORTED) and (args.verbose or o.status != UNSUPPORTED):
            print(f"{o.status:12} {o.name}: {o.message}")
    if args.write_xfail:
        write_xfail([o for o in outcomes if o.status in (ERROR, UNSUPPORTED)])
    if args.write_counts:
        write_counts(counts, "full" if args.full or FULL else "sampled")
    slow = sorted(outcomes, key=lambda o: -o.seconds)[:5]
    print("slowest: " + ", ".join(f"{o.name} {o.seconds:.1f}s" for o in slow))
    tested = len(outcomes) - counts[SKIP]
    print(f"{len(outcomes)} OpInfos, {tested} testable: " + ", ".join(
        f"{counts[s]} {s}" for s in ORDER))
    if args.validate:
        print(f"strategies of {len(done)} ops validated: {len(wrong_strategies)} wrong")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
