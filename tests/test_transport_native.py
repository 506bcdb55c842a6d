"""The native collectives (one device per process: gloo's all_gather, all_to_all, broadcast and
all_reduce) give the embedded transport's bits for every dtype, uneven and empty pieces, NaN,
infinities and signed zeros, on meshes whose member order is or is not the rank order; the
header is their only extra message and the cross-process bytes are the ring model's."""

from __future__ import annotations

import torch
import torch.distributed as dist

import shardwise as sw
from mp_harness import run_in_processes
from shardwise import CollectiveMismatchError, comm, runtime
from shardwise.comm import native

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
    """Rank 0 and the others disagree (reduce op, dtype, shape): every rank raises."""
    rank = dist.get_rank()
    first = rank == 0
    tries = {
        "op": lambda: comm.all_reduce(mesh, 0, [torch.ones(4)], "sum" if first else "max"),
        "dtype": lambda: comm.all_gather(
            mesh, 0, [torch.ones(4, dtype=torch.float32 if first else torch.float64)]
        ),
        "shape": lambda: comm.broadcast(mesh, 0, [torch.ones(4 if first else 5)]),
    }
    out = {}
    for name, fn in tries.items():
        try:
            fn()
            out[name] = "ok"
        except CollectiveMismatchError as err:
            out[name] = str(err)
    out["after"] = torch.cat(comm.all_gather(mesh, 0, [torch.full((2,), float(rank))])[0])
    return out


def native_job(order: list[int]) -> dict:
    """Every case on a 1-D mesh of the world's processes, device ids in ``order``: each
    device's result and the bytes counted; then the mismatches."""
    mesh = sw.DeviceMesh("cpu", torch.tensor(order))
    out = {"mismatches": _mismatches(mesh)}
    for case in _cases(len(order)):
        with sw.CommCounter() as counter:
            result = _run(mesh, case)
        out[case[0]] = (
            dict(zip(mesh.local_device_ids, result, strict=True)),
            counter.total_bytes,
            counter.total_cross_process_bytes,
            counter.total_meta_bytes,
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


def _check(order: list[int], per_rank: list[dict]) -> None:
    n = len(order)
    embedded = sw.DeviceMesh("cpu", torch.tensor(order))  # every device in this process
    header = (n - 1) * (8 + 8 * n) * 8
    for result in per_rank:
        faults = result.pop("mismatches")
        assert "all_reduce(sum)" in faults["op"] and "all_reduce(max)" in faults["op"]
        assert "torch.float32" in faults["dtype"] and "torch.float64" in faults["dtype"]
        assert "[4]" in faults["shape"] and "[5]" in faults["shape"]
        assert torch.equal(faults["after"], torch.tensor([float(d) for d in order for _ in "ab"]))
    for case in _cases(n):
        name = case[0]
        want = dict(zip(embedded.local_device_ids, _run(embedded, case), strict=True))
        for got, _, _, meta in (r[name] for r in per_rank):
            for device, value in got.items():
                assert _same(value, want[device]), f"{name}, device {device}"
            assert meta == header, f"{name}: {meta} meta bytes, the native header is {header}"
        counted = sum(r[name][1] for r in per_rank)
        crossed = sum(r[name][2] for r in per_rank)
        assert crossed == counted, f"{name}: {crossed} bytes crossed, ring model {counted}"


def test_native_collectives_two_processes() -> None:
    order = [0, 1]
    _check(order, run_in_processes(native_job, 2, order, timeout=100))


def test_native_collectives_four_processes_out_of_rank_order() -> None:
    order = [2, 0, 3, 1]
    _check(order, run_in_processes(native_job, 4, order, timeout=100))


def _run_counted(mesh: sw.DeviceMesh, case: tuple) -> tuple[dict, int]:
    """The case's result per local device, and how many native operations this process
    waited for."""
    waits = []
    original = native._Native.run

    def counting(self: native._Native, start: object) -> None:
        waits.append(1)
        original(self, start)

    native._Native.run = counting
    try:
        result = _run(mesh, case)
    finally:
        native._Native.run = original
    return dict(zip(mesh.local_device_ids, result, strict=True)), len(waits)


def _large_cases(n: int) -> list:
    """Pieces of 256 KiB and more: their own message, received in place (and the gather of
    the non-forecast pass point to point)."""
    return [
        ("large all_gather", "all_gather", lambda d: _values((128, 600), torch.float32, d)),
        ("large all_gather uneven", "all_gather",
         lambda d: _values((128 - d % 2, 600), torch.float32, d)),
        ("large all_to_all", "all_to_all",
         lambda d: [_values((300, 250), torch.float32, 10 * d + k) for k in range(n)]),
        ("large all_reduce sum", ("all_reduce", "sum"),
         lambda d: _values((280, 300), torch.float32, d)),
        ("large all_reduce max", ("all_reduce", "max"),
         lambda d: _values((280, 300), torch.float32, d)),
        ("large reduce_scatter", ("reduce_scatter", "sum"),
         lambda d: [_values((300, 240), torch.float64, 10 * d + k) for k in range(n)]),
    ]


def forecast_job(order: list[int]) -> dict:
    """The cases repeated, so the headers learn to carry the pieces: two passes to learn,
    one forecast pass, one pass in reverse order (every forecast wrong); then processes that
    diverge where a piece is forecast."""
    mesh = sw.DeviceMesh("cpu", torch.tensor(order))
    cases = _cases(len(order)) + _large_cases(len(order))
    out = {}
    for label, sequence in (("learn", cases), ("confirm", cases), ("forecast", cases),
                            ("reversed", cases[::-1])):
        out[label] = {case[0]: _run_counted(mesh, case) for case in sequence}
    rank = dist.get_rank()
    piece = torch.full((3, 4), float(rank))
    for _ in range(3):
        comm.all_gather(mesh, 0, [piece])
    try:  # rank 0 gathers as forecast, the others reduce the same bytes
        if rank == 0:
            comm.all_gather(mesh, 0, [piece])
        else:
            comm.reduce_scatter(mesh, 0, [[piece] * len(order)], "sum")
        out["diverged"] = "ok"
    except CollectiveMismatchError as err:
        out["diverged"] = str(err)
    out["after"] = torch.cat(comm.all_gather(mesh, 0, [piece])[0])
    # destroy_process_group must free the world's group: a group kept alive to the interpreter's
    # finalization lets gloo's threads release tensors then, and the process aborts at exit
    out["world kept"] = tuple(range(len(order))) in runtime._process_groups.get()
    return out


def _check_forecast(order: list[int], per_rank: list[dict]) -> None:
    n = len(order)
    embedded = sw.DeviceMesh("cpu", torch.tensor(order))
    for result in per_rank:
        assert not result["world kept"]
        assert "all_gather" in result["diverged"] and "reduce_scatter" in result["diverged"]
        want = torch.cat([torch.full((3, 4), float(r)) for r in sorted(range(n),
                                                                        key=order.index)])
        assert torch.equal(result["after"], want)
    for index, case in enumerate(_cases(n) + _large_cases(n)):
        name, kind = case[0], case[1]
        want = dict(zip(embedded.local_device_ids, _run(embedded, case), strict=True))
        for result in per_rank:
            for label in ("learn", "forecast", "reversed"):
                got, waits = result[label][name]
                for device, value in got.items():
                    assert _same(value, want[device]), f"{label} {name}, device {device}"
            learnt, forecast = result["learn"][name][1], result["forecast"][name][1]
            if index == 0:  # it followed another collective in the first pass than later
                continue
            if name == "large all_gather uneven":  # inline, padded: one message each
                assert forecast == 1, f"{name}: {forecast} waits"
            elif kind in ("all_gather", "all_to_all") or kind[0] == "reduce_scatter":
                # header, then data: one operation with the data inline once forecast
                assert (learnt, forecast) == (2, 1), f"{name}: {learnt} then {forecast} waits"
            elif (kind[0] == "all_reduce" and n > 2 and "(0, 3)" not in name
                  and any(f"{dtype} " in name for dtype in BACKEND_INTEGERS)):
                # integers, order-free: the headers, then the backend's all_reduce, forecast
                # or not (as many waits as the chunks inline and their all_gather)
                assert (learnt, forecast) == (2, 2), f"{name}: {learnt} then {forecast} waits"
            elif kind[0] == "all_reduce" and "(0, 3)" not in name:
                # two processes: both components inline; more: the chunks inline, then the
                # all_gather of the reduced chunks
                assert forecast == (1 if n == 2 else learnt - 1), f"{name}: {forecast} waits"


def test_forecast_headers_carry_the_pieces_two_processes() -> None:
    order = [0, 1]
    _check_forecast(order, run_in_processes(forecast_job, 2, order, timeout=150))


def test_forecast_headers_carry_the_pieces_four_processes() -> None:
    order = [2, 0, 3, 1]
    _check_forecast(order, run_in_processes(forecast_job, 4, order, timeout=200))
