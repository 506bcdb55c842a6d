"""Per-collective time of the two engines shardwise has had, measured on gloo at N = 2, 4, 8
processes and modelled (alpha-beta) for N = 8 ... 1024.

- **point to point** (shardwise before the backend path): a header swapped with every peer
  and read on the host, then the data as point-to-point messages: an all_reduce is an
  all_to_all of the ring chunks and an all_gather of the reduced chunks (2(N - 1) messages
  each way per rank), an all_gather N - 1 messages. The header holds a shape per member, so
  it grows with N.
- **backend** (now): one call of the process group's own collective (``all_reduce``,
  ``all_gather_into_tensor``), its ring (gloo; NCCL adds trees), plus the agreement. The
  measured backend rows gather the agreement's 8-byte word on the gloo side group (a ring of
  N - 1 dependent steps), what rank threads pay; the modelled table charges what processes pay
  (8 per host): the processes of one host post on the shared-memory board
  (``comm/board.py``, no message), and the hosts' first processes exchange in ceil(log2 hosts)
  rounds of one 16-byte message each way (``comm/host_tree.py``).

Run under the launcher at each N (``python -m shardwise.launch --nproc N
bench/bench_collective_model.py --json FILE``), then ``--model FILE ...`` fits
``time = rounds * alpha + messages * o + bytes * beta`` to every measurement (alpha: the
latency of a dependent round, o: the host's cost of posting one message, beta: seconds per byte
received) and prints the modelled table. A host sync per collective (the header read back on
an accelerator) is not measurable on CPU: the model adds ``--sync-us`` (default 20 us, an
assumed GPU pipeline drain) to the point-to-point path only and says so.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import torch
import torch.distributed as dist

SIZES = [64, 64 << 10, 4 << 20]  # bytes of the tensor each rank holds
HEADER_WORDS = 8  # fixed words of the old header, then 8 words per member
_GATHER = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)


def _header_bytes(n: int) -> int:
    return (HEADER_WORDS + 8 * n) * 8


def _p2p(sends: list[tuple[int, torch.Tensor]], receives: list[tuple[int, torch.Tensor]]
         ) -> None:
    works = [dist.irecv(t, src) for src, t in receives] + [dist.isend(t, dst) for dst, t in sends]
    for w in works:
        w.wait()


def _p2p_header(rank: int, n: int) -> None:
    """The old first round: a header to and from every peer, read on the host."""
    peers = [r for r in range(n) if r != rank]
    mine = torch.zeros(_header_bytes(n) // 8, dtype=torch.int64)
    inbox = {p: torch.empty_like(mine) for p in peers}
    _p2p([(p, mine) for p in peers], list(inbox.items()))
    for t in inbox.values():
        t.tolist()


def p2p_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The old path's all_reduce: header, all_to_all of ring chunks, combine, gather."""
    rank, n = dist.get_rank(), dist.get_world_size()
    _p2p_header(rank, n)
    chunks = list(x.chunk(n))
    peers = [r for r in range(n) if r != rank]
    terms = {p: torch.empty_like(chunks[rank]) for p in peers}
    _p2p([(p, chunks[p].contiguous()) for p in peers], list(terms.items()))
    reduced = chunks[rank] + sum(terms.values())
    out = torch.empty_like(x)
    parts = list(out.chunk(n))
    _p2p([(p, reduced) for p in peers], [(p, parts[p]) for p in peers])
    parts[rank].copy_(reduced)
    return out


def p2p_all_gather(x: torch.Tensor) -> torch.Tensor:
    rank, n = dist.get_rank(), dist.get_world_size()
    _p2p_header(rank, n)
    out = torch.empty(n * x.numel(), dtype=x.dtype)
    parts = list(out.chunk(n))
    peers = [r for r in range(n) if r != rank]
    _p2p([(p, x) for p in peers], [(p, parts[p]) for p in peers])
    parts[rank].copy_(x)
    return out


def _agreement() -> None:
    word = torch.zeros(1, dtype=torch.int64)
    out = torch.empty(dist.get_world_size(), dtype=torch.int64)
    _GATHER(out, word)
    bool((out != word).any())


def backend_all_reduce(x: torch.Tensor) -> torch.Tensor:
    _agreement()
    out = x.clone()
    dist.all_reduce(out)
    return out


def backend_all_gather(x: torch.Tensor) -> torch.Tensor:
    _agreement()
    out = torch.empty(dist.get_world_size() * x.numel(), dtype=x.dtype)
    _GATHER(out, x)
    return out


KINDS = {("point to point", "all_reduce"): p2p_all_reduce,
         ("point to point", "all_gather"): p2p_all_gather,
         ("backend", "all_reduce"): backend_all_reduce,
         ("backend", "all_gather"): backend_all_gather}


def measure(repeat: int) -> list[dict]:
    """Median us of each engine's collective at each size (slowest rank's), interleaved."""
    n = dist.get_world_size()
    rows = []
    for size in SIZES:
        x = torch.randn(max(size // 4, n))
        fns = list(KINDS.items())
        for _, fn in fns:
            fn(x)
        samples: list[list[float]] = [[] for _ in fns]
        for _ in range(repeat):
            for (_, fn), mine in zip(fns, samples, strict=True):
                dist.barrier()
                start = time.perf_counter()
                fn(x)
                mine.append(time.perf_counter() - start)
        medians = torch.tensor([statistics.median(s) * 1e6 for s in samples])
        dist.all_reduce(medians, op=dist.ReduceOp.MAX)
        for ((engine, kind), _), us in zip(fns, medians.tolist(), strict=True):
            rows.append({"n": n, "engine": engine, "collective": kind, "bytes": x.numel() * 4,
                         "us": us})
    return rows


PER_HOST = 8


def structure(engine: str, kind: str, n: int, nbytes: int, tree: bool = False
              ) -> tuple[float, float, float]:
    """(dependent rounds, messages posted per rank, bytes received per rank) of one
    collective of a tensor of ``nbytes`` per rank over ``n`` ranks; ``tree``: the backend's
    all_reduce as a tree and the agreement by host boards and the hosts' exchange (else the
    ring all_reduce and the side group's ring gather of one word, as measured)."""
    header = (n - 1) * _header_bytes(n)
    if engine == "point to point":
        if kind == "all_reduce":
            return 3, 6 * (n - 1), header + 2 * (n - 1) / n * nbytes
        return 2, 4 * (n - 1), header + (n - 1) * nbytes
    if tree:
        steps = math.ceil(math.log2(math.ceil(n / PER_HOST)))
        agreement = (steps, 2 * steps, 16 * steps)
    else:
        agreement = (n - 1, 2 * (n - 1), 8 * (n - 1))
    if kind == "all_reduce":
        rounds = 2 * math.log2(n) if tree else 2 * (n - 1)
        data = (rounds, 2 * rounds, 2 * (n - 1) / n * nbytes)
    else:
        data = (n - 1, 2 * (n - 1), (n - 1) * nbytes)
    return tuple(a + b for a, b in zip(agreement, data, strict=True))  # type: ignore[return-value]


def fit(rows: list[dict]) -> dict[str, float]:
    """Least squares of ``us = rounds * alpha + messages * o + bytes * beta`` (relative error
    weighted, non-negative by construction of the data)."""
    a, y = [], []
    for r in rows:
        rounds, messages, nbytes = structure(r["engine"], r["collective"], r["n"], r["bytes"])
        a.append([rounds / r["us"], messages / r["us"], nbytes / r["us"]])
        y.append(1.0)
    solution = torch.linalg.lstsq(torch.tensor(a, dtype=torch.float64),
                                  torch.tensor(y, dtype=torch.float64)).solution.clamp(min=0)
    alpha, o, beta = solution.tolist()
    return {"alpha_us": alpha, "o_us": o, "beta_us_per_byte": beta}


def model(params: dict[str, float], engine: str, kind: str, n: int, nbytes: int,
          sync_us: float, tree: bool) -> float:
    rounds, messages, received = structure(engine, kind, n, nbytes, tree)
    us = rounds * params["alpha_us"] + messages * params["o_us"] + received * params[
        "beta_us_per_byte"]
    return us + (sync_us if engine == "point to point" else 0.0)


def table(rows: list[dict], sync_us: float) -> dict:
    params = fit(rows)
    measured = [
        {**r, "model_us": model(params, r["engine"], r["collective"], r["n"], r["bytes"], 0.0,
                                False)} for r in rows]
    modelled = []
    for n in (8, 16, 64, 256, 1024):
        for nbytes in (64 << 10, 64 << 20):
            for kind in ("all_reduce", "all_gather"):
                old = model(params, "point to point", kind, n, nbytes, sync_us, False)
                new = model(params, "backend", kind, n, nbytes, 0.0, True)
                modelled.append({"n": n, "bytes": nbytes, "collective": kind,
                                 "point_to_point_us": old, "backend_us": new,
                                 "ratio": old / new})
    return {"params": params, "sync_us": sync_us, "measured": measured, "modelled": modelled}


def _print(result: dict) -> None:
    p = result["params"]
    print(f"fit: alpha {p['alpha_us']:.1f} us/round, o {p['o_us']:.2f} us/message, "
          f"1/beta {1 / max(p['beta_us_per_byte'], 1e-12) / 1e3:.0f} MB/s")
    print(f"{'N':>4} {'bytes':>9} {'collective':>11} {'engine':>15} {'measured':>10} "
          f"{'model':>10}")
    for r in result["measured"]:
        print(f"{r['n']:>4} {r['bytes']:>9} {r['collective']:>11} {r['engine']:>15} "
              f"{r['us']:>8.0f}us {r['model_us']:>8.0f}us")
    print(f"\nmodelled (point to point adds a {result['sync_us']:g} us host sync; backend "
          f"all_reduce as a tree, the agreement by the host tree, {PER_HOST} per host):")
    print(f"{'N':>5} {'bytes':>9} {'collective':>11} {'p2p':>12} {'backend':>12} {'ratio':>7}")
    for r in result["modelled"]:
        print(f"{r['n']:>5} {r['bytes']:>9} {r['collective']:>11} "
              f"{r['point_to_point_us'] / 1e3:>10.2f}ms {r['backend_us'] / 1e3:>10.2f}ms "
              f"{r['ratio']:>6.1f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the measurements (or the model) here")
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--model", nargs="+", help="fit and model from these measurement files")
    parser.add_argument("--sync-us", type=float, default=20.0)
    args = parser.parse_args()
    if args.model:
        rows = [r for f in args.model for r in json.load(open(f))["rows"]]
        result = table(rows, args.sync_us)
        _print(result)
        if args.json:
            json.dump(result, open(args.json, "w"), indent=1)
        return
    dist.init_process_group("gloo")
    rows = measure(5 if args.quick else args.repeat)
    if dist.get_rank() == 0:
        for r in rows:
            print(f"N={r['n']} {r['engine']:>15} {r['collective']:>10} {r['bytes']:>8} B "
                  f"{r['us']:>9.0f} us")
        if args.json:
            json.dump({"rows": rows}, open(args.json, "w"), indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
