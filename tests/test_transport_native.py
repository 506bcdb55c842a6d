"""The backend path (one device per process): every collective is one (or, in coordinate order,
two) of the process group's own functional collectives and no point-to-point message. In
deterministic mode the results are the embedded transport's bits for every dtype, uneven and
empty pieces, NaN, infinities and signed zeros, on meshes whose member order is or is not the
rank order; by default they are the backend's reduction, within float rounding. The agreement
is the only extra message, and the cross-process bytes are the ring model's."""

from __future__ import annotations

import torch
import torch.distributed as dist

import shardwise as sw
from mp_harness import outcomes, run_in_processes
from shardwise import comm
from shardwise.comm import agreement, board, native, wire
from shardwise.errors import CollectiveMismatchError

GATHER_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.bool,
                 torch.complex64]
REDUCTIONS = [
    (torch.float32, "sum"), (torch.float32, "avg"), (torch.float32, "max"),
    (torch.float32, "min"), (torch.float16, "sum"), (torch.float16, "avg"),
    (torch.float16, "max"), (torch.bfloat16, "sum"), (torch.float64, "avg"),
    (torch.int64, "sum"), (torch.int64, "max"), (torch.int8, "sum"), (torch.uint8, "min"),
    (torch.int32, "max"), (torch.int16, "sum"),
]
REDUCE_SHAPES = [(4, 6), (7, 3), (0, 3), ()]
# integers that gloo and NCCL reduce (not int16): order-free, on the backend's own all_reduce
BACKEND_INTEGERS = (torch.int8, torch.uint8, torch.int32, torch.int64)


def _values(shape: tuple, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Deterministic test values of one device; floats include NaN, -0.0 and inf."""
    gen = torch.Generator().manual_seed(seed)
    t = torch.randn(shape, generator=gen, dtype=torch.float64) * 100
    if dtype.is_floating_point and t.numel() >= 3:
        flat = t.view(-1)
        flat[1] = -0.0
        if seed % 3 == 0:
            flat[0] = float("nan")
        if seed % 3 == 1:
            flat[2] = float("inf")
    if dtype == torch.bool:
        return t > 0
    if dtype.is_complex:
        return torch.complex(t, -t).to(dtype)
    return t.to(dtype)


def _cases(n: int) -> list:
    """(name, collective, per-device argument builder) for a group of ``n`` devices."""
    cases = []
    for dtype in GATHER_DTYPES:
        cases.append((f"all_gather {dtype}", "all_gather",
                      lambda d, dt=dtype: _values((3, 4), dt, d)))
        cases.append((f"all_to_all {dtype}", "all_to_all",
                      lambda d, dt=dtype: [_values((1 + k, 2 + d % 2), dt, 10 * d + k)
                                           for k in range(n)]))
        cases.append((f"broadcast {dtype}", "broadcast",
                      lambda d, dt=dtype: _values((3, 5), dt, d)))
    cases.append(("all_gather uneven", "all_gather",
                  lambda d: _values((d % 3, 4), torch.float32, d)))
    cases.append(("all_gather scalar", "all_gather", lambda d: _values((), torch.float64, d)))
    for dtype, op in REDUCTIONS:
        for shape in REDUCE_SHAPES:
            cases.append((f"all_reduce {op} {dtype} {shape}", ("all_reduce", op),
                          lambda d, dt=dtype, s=shape: _values(s, dt, d)))
        cases.append((f"reduce_scatter {op} {dtype}", ("reduce_scatter", op),
                      lambda d, dt=dtype: [_values((1 + k, 3), dt, 10 * d + k)
                                           for k in range(n)]))
    return cases


def _run(mesh: sw.DeviceMesh, case: tuple) -> list:
    _, kind, build = case
    args = [build(d) for d in mesh.local_device_ids]
    if isinstance(kind, tuple):
        return getattr(comm, kind[0])(mesh, 0, args, kind[1])
    if kind == "broadcast":
        return comm.broadcast(mesh, 0, args, src=1)
    return getattr(comm, kind)(mesh, 0, args)


def _mismatches(mesh: sw.DeviceMesh) -> dict:
    """Rank 0 and the others disagree (reduce op, dtype, shape, a skipped collective): every
    rank raises."""
    rank = dist.get_rank()
    first = rank == 0
    tries = {
        "op": lambda: comm.all_reduce(mesh, 0, [torch.ones(4)], "sum" if first else "max"),
        "dtype": lambda: comm.all_gather(
            mesh, 0, [torch.ones(4, dtype=torch.float32 if first else torch.float64)]
        ),
        "shape": lambda: comm.broadcast(mesh, 0, [torch.ones(4 if first else 5)]),
        # rank 0 skips the second all_reduce and goes on to the next collective
        "skipped": lambda: [comm.all_reduce(mesh, 0, [torch.ones(4)], "sum")
                            for _ in range(1 if first else 2)]
        + ([comm.all_gather(mesh, 0, [torch.ones(2)])] if first else []),
    }
    out: dict = outcomes(tries, CollectiveMismatchError)
    out["after"] = torch.cat(comm.all_gather(mesh, 0, [torch.full((2,), float(rank))])[0])
    return out


class _Counting:
    """Stands in for ``torch.ops._c10d_functional`` in a module: counts each collective."""

    def __init__(self, real: object, counts: dict) -> None:
        self.real, self.counts = real, counts

    def __getattr__(self, name: str) -> object:
        op = getattr(self.real, name)
        if name == "wait_tensor":
            return op

        def counted(*args: object) -> object:
            self.counts[name] = self.counts.get(name, 0) + 1
            return op(*args)

        return counted


def _refuse(*args: object, **kwargs: object) -> None:
    raise AssertionError("a point-to-point message on the backend path")


def native_job(order: list[int]) -> dict:
    """Every case on a 1-D mesh of the world's processes, device ids in ``order``, by default
    and in deterministic mode: each device's result, the bytes counted and the functional
    collectives issued (data and agreement apart); point-to-point messages refused."""
    mesh = sw.DeviceMesh("cpu", torch.tensor(order))
    out = {"mismatches": _mismatches(mesh)}
    data, checks = {}, {}
    native._functional = _Counting(torch.ops._c10d_functional, data)
    gather = agreement._gather

    def counted_gather(*args: object, **kwargs: object) -> object:
        checks["all_gather"] = checks.get("all_gather", 0) + 1
        return gather(*args, **kwargs)

    agreement._gather = counted_gather
    post = board.Board.post

    def counted_post(self: board.Board, word: int) -> int:
        checks["board"] = checks.get("board", 0) + 1
        return post(self, word)

    board.Board.post = counted_post
    wire.post_send, wire.post_receive = _refuse, _refuse
    dist.isend, dist.irecv, dist.send, dist.recv = _refuse, _refuse, _refuse, _refuse
    for ordered in (False, True):
        with sw.config.deterministic(ordered):
            for case in _cases(len(order)):
                data.clear()
                checks.clear()
                with sw.debug.CommCounter() as counter:
                    result = _run(mesh, case)
                out[case[0], ordered] = (
                    dict(zip(mesh.local_device_ids, result, strict=True)),
                    counter.total_bytes,
                    counter.total_cross_process_bytes,
                    dict(data),
                    dict(checks),
                )
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The bits of ``t``, NaNs made one value (torch's own kernels pick a NaN's payload by
    vector width, so it is not part of a value)."""
    t = t.contiguous().reshape(-1)
    if t.is_complex():
        t = torch.view_as_real(t).reshape(-1)
    if t.is_floating_point():
        t = torch.where(torch.isnan(t), torch.full_like(t, float("nan")), t)
    return t.view(torch.uint8)


def _same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))
    return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))


def _close(a: object, b: object) -> bool:
    """Equal up to float rounding (NaN where NaN; exact for integers and data movement)."""
    if isinstance(a, torch.Tensor):
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        if not (a.is_floating_point() or a.is_complex()):
            return torch.equal(a, b)
        x = a.double() if a.is_floating_point() else a.cdouble()
        y = b.double() if b.is_floating_point() else b.cdouble()
        finite = y[torch.isfinite(y)].abs()
        scale = float(finite.max()) if finite.numel() else 1.0
        # the backend adds half types in their own precision, a few of their ulps of the
        # terms' scale (embedded: float32 accumulation)
        tol = 4 * torch.finfo(a.dtype if a.is_floating_point() else torch.float32).eps
        return torch.allclose(x, y, rtol=tol, atol=tol * scale, equal_nan=True)
    return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b, strict=True))


def _expected_calls(kind: object, dtype: torch.dtype, ordered: bool, empty: bool) -> dict:
    """The functional collectives one case issues per process: one backend collective, or,
    in coordinate order, an all_to_all_single (and an all_gather of the reduced chunks)."""
    if isinstance(kind, str):
        name = {"all_gather": "all_gather_into_tensor", "all_to_all": "all_to_all_single",
                "broadcast": "broadcast"}[kind]
        return {name: 1}
    collective, op = kind
    if empty:
        return {}
    backend = not ordered and (
        (op in ("sum", "avg") and dtype not in (torch.int16,))
        or (op in ("max", "min") and dtype in BACKEND_INTEGERS))
    if collective == "all_reduce":
        return {"all_reduce": 1} if backend else {"all_to_all_single": 1,
                                                   "all_gather_into_tensor": 1}
    return {"reduce_scatter_tensor": 1} if backend else {"all_to_all_single": 1}


def _check(order: list[int], per_rank: list[dict]) -> None:
    n = len(order)
    embedded = sw.DeviceMesh("cpu", torch.tensor(order))  # every device in this process
    for result in per_rank:
        faults = result.pop("mismatches")
        assert "all_reduce(sum)" in faults["op"] and "all_reduce(max)" in faults["op"]
        assert "torch.float32" in faults["dtype"] and "torch.float64" in faults["dtype"]
        assert "[4]" in faults["shape"] and "[5]" in faults["shape"]
        assert "all_gather" in faults["skipped"] and "all_reduce(sum)" in faults["skipped"]
        assert torch.equal(faults["after"], torch.tensor([float(d) for d in order for _ in "ab"]))
    for case in _cases(n):
        name, kind = case[0], case[1]
        want = dict(zip(embedded.local_device_ids, _run(embedded, case), strict=True))
        for ordered in (False, True):
            for got, _, _, data, checks in (r[name, ordered] for r in per_rank):
                for device, value in got.items():
                    if ordered:
                        assert _same(value, want[device]), f"{name}, device {device}"
                    else:
                        assert _close(value, want[device]), f"{name}, device {device}"
                empty = "(0, 3)" in name
                dtype = next(v for v in got.values())
                dtype = dtype[0].dtype if isinstance(dtype, list) else dtype.dtype
                assert data == _expected_calls(kind, dtype, ordered, empty), (name, data)
                # one agreement per collective, on the board of these processes of one host
                # (the generic all_gather and all_to_all then gather the shapes no spec gave,
                # as objects, on the side group)
                assert checks == {"board": 1}, (name, checks)
            counted = sum(r[name, ordered][1] for r in per_rank)
            crossed = sum(r[name, ordered][2] for r in per_rank)
            # (uneven pieces travel padded to the largest, as PyTorch pads them: the padding
            # is counted apart, with the agreements)
            assert crossed == counted, f"{name}: {crossed} bytes crossed, ring model {counted}"


def test_native_collectives_two_processes() -> None:
    order = [0, 1]
    _check(order, run_in_processes(native_job, 2, order, timeout=150))


def test_native_collectives_four_processes_out_of_rank_order() -> None:
    order = [2, 0, 3, 1]
    _check(order, run_in_processes(native_job, 4, order, timeout=200))
