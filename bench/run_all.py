"""Run every benchmark in ``bench/`` and collect the results: ``bench/results/results.json``, the
plot ``bench/results/summary.png`` (ratios against torch.distributed.tensor) and the tables of
``docs/performance.md`` with the performance goals, each met or its remaining gap (or not
measured, when the benchmark that measures it did not run or does not record it yet).

Each benchmark runs in its own subprocess (the multi-process ones through
``python -m shardwise.launch --nproc N``) with ``--json FILE``; its own output is kept in
``bench/results/<name>.txt``.

Run: python bench/run_all.py [--quick] [--no-docs] [--only NAME,NAME] [--out DIR]
     python bench/run_all.py --docs-only   # docs/performance.md again from results.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"

# name -> (nproc or None, script, full args, quick args, timeout s)
BENCHMARKS: dict[str, tuple[int | None, str, list[str], list[str], int]] = {
    "dispatch": (None, "bench_dispatch.py", [], ["--quick"], 300),
    "planner": (None, "bench_planner.py", [], ["--quick"], 600),
    "redistribute_2": (2, "bench_redistribute.py", [], ["--quick"], 300),
    "redistribute_4": (4, "bench_redistribute.py", [], ["--quick"], 500),
    "training_2": (2, "bench_training.py", [], ["--quick"], 300),
    "training_4": (4, "bench_training.py", [], ["--quick"], 300),
    "overlap_2": (2, "bench_overlap.py", [], ["1", "--repeat", "5"], 200),
    "checkpoint": (None, "bench_checkpoint.py", [], ["20"], 200),
    "launch": (None, "bench_launch.py", [], ["--repeat", "1"], 200),
    "rank_threads": (None, "bench_rank_threads.py", [], ["--quick"], 600),
    "optimizer_1": (None, "bench_optimizer.py", [], ["--quick"], 200),
    "optimizer_2": (2, "bench_optimizer.py", [], ["--quick"], 300),
    "compile_1": (1, "bench_compile.py", ["--backend", "aot_eager"],
                  ["--quick", "--backend", "aot_eager"], 400),
    "compile_2": (2, "bench_compile.py", ["--backend", "aot_eager"],
                  ["--quick", "--backend", "aot_eager"], 600),
}


def _command(name: str, quick: bool, json_file: Path) -> list[str]:
    nproc, script, full, fast, _ = BENCHMARKS[name]
    args = [str(BENCH / script), *(fast if quick else full), "--json", str(json_file)]
    if nproc is None:
        return [sys.executable, *args]
    return [sys.executable, "-m", "shardwise.launch", "--nproc", str(nproc), *args]


def run_one(name: str, quick: bool, out: Path) -> dict:
    """Run one benchmark in a subprocess; its JSON, wall time and exit status."""
    json_file = out / f"{name}.json"
    json_file.unlink(missing_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", KINETO_LOG_LEVEL="5")
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT / "src"), env.get("PYTHONPATH", "")) if p
    )
    start = time.perf_counter()
    try:
        proc = subprocess.run(
            _command(name, quick, json_file), capture_output=True, text=True, env=env,
            timeout=BENCHMARKS[name][4], cwd=ROOT,
        )
        rc, text = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        rc, text = "timeout", f"{e.stdout or ''}{e.stderr or ''}"
        text = text.decode() if isinstance(text, bytes) else text
    seconds = time.perf_counter() - start
    (out / f"{name}.txt").write_text(text)
    entry: dict = {"seconds": seconds, "returncode": rc}
    if rc == 0 and json_file.exists():
        entry["results"] = json.loads(json_file.read_text())
    else:
        entry["error"] = text[-2000:]
    return entry


def machine() -> dict:
    """What the numbers were measured on."""
    import torch

    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "load_average": load,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transport": "gloo on 127.0.0.1 (CPU)",
    }


# ----------------------------------------------------------------------------- ratios and plot


def ratios(results: dict) -> dict[str, list[tuple[str, float]]]:
    """Per benchmark, (label, shardwise / torch DTensor) pairs."""
    out: dict[str, list[tuple[str, float]]] = {}
    bench = {k: v.get("results") for k, v in results["benchmarks"].items() if v.get("results")}
    if "dispatch" in bench:
        out["dispatch (warm, 1 device)"] = [
            (f"{r['op']}{' +grad' if r['autograd'] else ''}", r["shardwise"] / r["torch_dt"])
            for r in bench["dispatch"]["rows"]
        ]
    if "planner" in bench:
        out["planner bytes (2x2x2)"] = [
            (r["transition"], r["shardwise"] / r["dtensor_graph"] if r["dtensor_graph"] else 1.0)
            for r in bench["planner"]["named"]
        ]
    for n in (2, 4):
        if f"redistribute_{n}" in bench:
            out[f"redistribute, {n} procs"] = [
                (f"{r['transition']} {r['size']}", r["ratio_vs_torch_dt"])
                for r in bench[f"redistribute_{n}"]["rows"]
            ]
    for n in (2, 4):
        if f"training_{n}" in bench:
            rows = []
            for model, r in bench[f"training_{n}"]["models"].items():
                rows.append((f"{model} time", r["ratio_time_vs_torch_dt"]))
                rows.append((f"{model} memory", r["ratio_mem_vs_torch_dt"]))
            out[f"TP training, {n} procs"] = rows
    return out


def plot(results: dict, path: Path) -> None:
    """Horizontal bars of shardwise / torch DTensor per benchmark (log scale, 1.0 marked)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = ratios(results)
    if not groups:
        return
    heights = [max(len(v), 1) * 0.28 + 0.8 for v in groups.values()]
    fig, axes = plt.subplots(len(groups), 1, figsize=(8, sum(heights)),
                             gridspec_kw={"height_ratios": heights}, squeeze=False)
    for ax, (title, pairs) in zip(axes[:, 0], groups.items(), strict=True):
        labels = [p[0] for p in pairs]
        values = [max(p[1], 1e-3) for p in pairs]
        colors = ["tab:green" if v <= 1.0 else "tab:red" for v in values]
        ax.barh(range(len(values)), values, color=colors)
        ax.set_yticks(range(len(values)), labels, fontsize=7)
        ax.set_xscale("log")
        ax.axvline(1.0, color="black", linewidth=0.8)
        ax.set_title(f"{title}: shardwise / torch DTensor", fontsize=9)
        ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


# ----------------------------------------------------------------------------- docs

# the agreement before each collective across processes, named by several reasons below
_AGREEMENT = ("the agreement (a word posted on the shared-memory board of the processes of "
              "one host, across hosts also exchanged between the hosts' first processes in "
              "log2(hosts) rounds; on CPU it must finish before the "
              "data moves: gloo aborts the process on messages of another size; on an "
              "accelerator it runs beside the data): microseconds once every process is "
              "there, but on CPU each call waits for its slowest process before the data "
              "starts, 0.1-1 ms on this 2-core host")

# Known causes of the remaining gaps (from the profiles in issue 13), quoted beside a target
# the run does not meet; update them when the cause changes.
REASONS = {
    "dispatch": "every op is at most DTensor's time on one device (its C++ fast path is "
                "beaten by one Python frame that calls the op's checked Python binding; ops "
                "on a list of DTensors such as cat([a, a]) take that frame too); the "
                "per-device gap is cat's input moves, not dispatch: its sharded input goes "
                "Shard(0) -> Shard(1), the plan with fewest bytes, by an in-process "
                "all_to_all that joins the components once and cuts them into dense pieces "
                "in one copy (dense as the joined pieces were: layout-reading kernels such "
                "as LU give other numbers on strided views), about 9 us of which most is "
                "fixed (one cat, one copy, the pieces' views, accounting), the replicated "
                "input's cut is reused while unchanged, and each device's cat then reads a "
                "dense and a strided piece (about 1 us more than the local cat); from 4 to "
                "8 devices cat costs about 2 us per device",
    "planner": "every swept pair reaches the bound (an exchange resolves Partials of one "
               "reduce op at one root per block, then forwards); a gap could only come from "
               "sources mixing reduce ops, which must reduce lowest mesh dim first",
    "to_partial": "explicit redistribution spreads a Shard to Partial('sum') at no cost, and "
                  "where another mesh dim still needs data takes one point to point send/recv "
                  "step (each sum group's value on one member) when that moves less, so on "
                  "(4,) and (2, 2) every pair is at the bound; on (2, 2, 2) some pairs from a "
                  "pending sum stay above it, and some move less than geometry's "
                  "lower_bound_bytes (the target group keeping the source's terms pending, "
                  "which that bound does not model)",
    "cold_planning": "A* in Python, guided by the exact lower bound; the slowest are Partial "
                     "sources on 2x2x2 whose exchange at the bound must be shown to beat "
                     "every collective order (45 step prices and 33 bound evaluations for "
                     "(S1,P,P)->(S0,R,S2) against a median of 6 and 5), about 0.5 ms of CPU "
                     "time measured alone on a 2-core host: a max above 1 ms here is "
                     "other load",
    "redistribute": "every transition is one call of the process group's own collective "
                    "(the functional all_gather_into_tensor, all_to_all_single, all_reduce "
                    "or reduce_scatter_tensor PyTorch DTensor issues), received in place; "
                    "beside it a redistribution's Python around the collective, 0.3-0.6 ms "
                    "a call on this host as torch DT's (Shard(0) -> Replicate of 8 x 8 on 2 "
                    "processes, the agreement stubbed out: 0.69-1.02 ms against 0.33-0.42 "
                    "ms for the bare functional all_gather and its wait; torch DT "
                    "0.73-0.90 ms in the same runs) and "
                    + _AGREEMENT
                    + ". At 4096 that is within 1.1x of the raw collective but for noise; "
                    "at 1024 the raw collective takes 1.5-10 ms and that fixed cost and "
                    "the scheduling of 2-4 processes on 2 cores (each call starts after a "
                    "barrier) weigh 1.2x-2x, where torch DT itself takes 1.2x-1.6x of the "
                    "raw collective in the same runs",
    "training": "peak memory equals DTensor's; time per step adds, beside the same "
                "local kernels and collectives, per-op dispatch of the DTensor subclass"
                " and per collective "
                + _AGREEMENT,
    "compile": "on one process the compiled step is within noise of hand-written code; "
               "across processes the graphs hold the functional collectives "
               "(_c10d_functional ops and wait_tensor) as the hand-written step's do, "
               "the agreement is not made inside a graph, and the difference is what "
               "runs outside the graphs (the optimizer update's dispatch on DTensor "
               "parameters) and this host's noise",
    "compile_full": "the optimizer update compiles (one graph over the DTensor "
                    "parameters, gradients and state; no recompiles after the second "
                    "step) and each redistribution of the forward and backward graphs "
                    "lowers to the functional collectives the hand-written step calls; "
                    "the difference is Python outside the graphs and this host's noise",
    # issue 22
    "eager_vs_hand": "the hand-written step is plain PyTorch on the local shards with "
                     "gloo's own collectives called by hand; shardwise adds per op its "
                     "Python dispatch (about 4-8 us on one device: key scan, cached "
                     "decision, wrapper; AdamW's per-parameter loop alone is about 50 "
                     "such ops per step for 4 parameters) and per collective "
                     + _AGREEMENT
                     + ". On a 2-core host gloo's loopback exchange itself swings "
                     "severalfold between runs, so ratios move by +-0.1 between runs. "
                     "FSDP x TP packs each unit's parameters (InterleavedShard ones "
                     "included) into one all_gather and one reduce_scatter per unit, as"
                     " FSDP2 does",
    "eager_missing": "the training benchmark does not run these models yet",
    "dispatch_cat": "cat([a, a], 1) of one Shard(0) tensor moves its input Shard(0) -> "
                    "Shard(1) in process (an all_to_all of n^2 pieces) where DTensor's C++ "
                    "path gathers once",
    "redistribute_raw": "every transition pays a redistribution's fixed cost, its Python "
                        "around the collective (0.3-0.6 ms a call on this host, as torch "
                        "DT's) and "
                        + _AGREEMENT
                        + "; Shard -> Shard also lays out the columns each process sends "
                        "side by side (one copy the raw all_to_all of rows that already lie "
                        "so skips). At 1024 the collectives take 1.5-10 ms and one setting "
                        "moves by 1.5x from run to run here (Partial -> Replicate at 1024 on "
                        "2 processes: 0.89x of torch DT in bench/engine_check.sh's run, "
                        "minutes apart)",
    "clip": "a norm pending over several mesh dims is reduced by one exchange, counted once "
            "per round (the terms reduced at a root, then forwarded)",
    "optimizer": "the foreach paths take DTensors (one dispatch per foreach op for all "
                 "parameters, never one per tensor), so their gap is dispatch's fixed cost per "
                 "op over lists, about 25 us per foreach op over 16 parameter pairs (in a "
                 "profile: torch's C++ entry handing lists of subclasses to Python, the key "
                 "scan and hash of 32 specs, the wrappers of new outputs); foreach=False pays "
                 "the per-op dispatch (about 8 us) on each of the 3 (SGD) to 8 (AdamW) ops per "
                 "parameter, where the plain kernel costs a few us",
    "threads": "rank threads run the per-rank Python program once per rank under one "
               "interpreter lock, and torch releases that lock around every op, so N runnable "
               "rank threads hand it over (a context switch) at nearly every op: the "
               "process's CPU per step grows faster than N, while LocalTensorMode runs the "
               "program once (each op N times) and its CPU per step is nearly flat in N. "
               "shardwise's own collectives between rank threads are handed over in memory "
               "(comm/wire.py), so the floor is the per-rank program itself: the same step "
               "written by hand on plain local shards and run as threads (no shardwise, gloo "
               "collectives; the hand-written column of the table below) is nowhere near 10x "
               "LocalTensorMode at N=2 and slower than it at N=8. 10x would need the N "
               "per-rank passes to cost a tenth of LocalTensorMode's one pass",
    "simulated": "the global view runs each op's kernel once per simulated device from Python "
                 "(dispatch's per-device loop, the view ops' per-device size hooks, in-process "
                 "redistribution of the sequence-parallel activations); the single-device "
                 "step calls each kernel once",
    "compile_22": "see the compiled whole step above: the graphs hold the same "
                  "functional collectives as the hand-written step; FSDP x TP: dynamo "
                  "breaks at the FSDP hooks for all three (the same breaks for "
                  "shardwise as for the hand-written step), which run eagerly: "
                  "shardwise's packed all_gather and reduce_scatter are the backend's "
                  "collectives, each after its agreement, where the hand-written step "
                  "calls them alone",
    "gpu": "no GPU has been available to this project: bench/gpu_check.sh was not run",
}


def _fmt(x: float) -> str:
    return f"{x:.2f}" if abs(x) < 1000 else f"{x:.0f}"


def _table(header: list[str], rows: list[list]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        cells = [_fmt(c) if isinstance(c, float) else "-" if c is None else str(c) for c in row]
        lines.append("| " + " | ".join(cells) + " |")
    return lines + [""]


def _per_kind(row: dict, key: str, fmt: str,
              kinds: tuple[str, ...] = ("shardwise", "hand", "torch_dt")) -> str:
    """``key`` of each kind joined by " / "; "failed" for a kind that did not compile."""
    return " / ".join("failed" if "error" in row[k] else format(row[k][key], fmt)
                      for k in kinds)


def _section_tables(bench: dict) -> list[str]:
    md: list[str] = []
    if "dispatch" in bench:
        md += ["## Per-op dispatch (1-device mesh, 64x64 float32, us, median)", "",
               "Cold: the first call after clearing the sharding caches. torch 2.13's DTensor "
               "also caches in C++, which Python cannot clear, so its cold column is nearer a "
               "warm call than a true first call.", ""]
        md += _table(
            ["op", "autograd", "local", "shardwise", "torch DT", "ratio", "sw cold",
             "DT cold", "us / extra device"],
            [[r["op"], "yes" if r["autograd"] else "no", r["local"], r["shardwise"],
              r["torch_dt"], r["shardwise"] / r["torch_dt"], r.get("shardwise_cold", "-"),
              r.get("torch_dt_cold", "-"),
              (r["shardwise_4dev"] - r["shardwise"] - 3 * r["local"]) / 3]
             for r in bench["dispatch"]["rows"]],
        )
    if "planner" in bench:
        p = bench["planner"]
        md += ["## Planner (bytes received by all devices / lower bound)", ""]
        md += _table(
            ["mesh", "pairs", "sw at bound", "sw worst", "DT greedy at bound", "DT worst",
             "sw plan ms (median)", "sw plan ms (max)", "DT greedy ms"],
            [[m, s["transitions"], s["shardwise"]["at_bound"], s["shardwise"]["worst_ratio"],
              s["dtensor_greedy"]["at_bound"], s["dtensor_greedy"]["worst_ratio"],
              s["shardwise_plan_ms_median"], s["shardwise_plan_ms_max"],
              s["dtensor_greedy_ms_median"]]
             for m, s in [*p["meshes"].items(),
                          *((f"{m} to Partial", s) for m, s in p.get("to_partial", {}).items())]],
        )
        md += _table(
            ["2x2x2 transition", "sw / bound", "DT greedy / bound", "DT graph / bound",
             "sw ms", "DT graph ms"],
            [[r["transition"], _over(r["shardwise"], r["bound"]),
              _over(r["dtensor_greedy"], r["bound"]), _over(r["dtensor_graph"], r["bound"]),
              r["shardwise_ms"], r["dtensor_graph_ms"]] for r in p["named"]],
        )
        md += [f"Cached plan lookup: {p['cached_lookup_us']:.2f} us.", ""]
    for n in (2, 4):
        if f"redistribute_{n}" in bench:
            md += [f"## Redistribution, {n} gloo processes (float32, ms, median, slowest rank)",
                   ""]
            md += _table(
                ["transition", "size", "shardwise", "torch DT", "raw", "vs DT", "vs raw",
                 "raw collective"],
                [[r["transition"], f"{r['size']}x{r['size']}", r["shardwise_ms"],
                  r["torch_dt_ms"], r["raw_ms"], r["ratio_vs_torch_dt"], r["ratio_vs_raw"],
                  r["raw_collective"]] for r in bench[f"redistribute_{n}"]["rows"]],
            )
    for n in (2, 4):
        if f"training_{n}" in bench:
            t = bench[f"training_{n}"]
            md += [f"## Tensor-parallel training step, {n} gloo processes (dim {t['dim']}, "
                   f"batch {t['batch']}x{t['seq']}, AdamW)", "",
                   "Step time: median ms (slowest rank). Peak: MiB per rank, from the profiler's "
                   "CPU allocator events during one step plus the parameters, gradients and "
                   "optimizer state alive before it. Loss diff: largest |loss - hand-written "
                   "loss| over the steps.", ""]
            md += _table(
                ["model", "sw ms", "DT ms", "hand ms", "vs DT", "vs hand", "sw MiB", "DT MiB",
                 "hand MiB", "mem vs DT", "mem vs hand", "loss diff sw", "loss diff DT"],
                [[m, r["shardwise"]["step_ms"], r["torch_dt"]["step_ms"], r["hand"]["step_ms"],
                  r["ratio_time_vs_torch_dt"], r["ratio_time_vs_hand"],
                  r["shardwise"]["peak_mb"], r["torch_dt"]["peak_mb"], r["hand"]["peak_mb"],
                  r["ratio_mem_vs_torch_dt"], r["ratio_mem_vs_hand"],
                  f"{r['shardwise']['max_loss_diff_vs_hand']:.1e}",
                  f"{r['torch_dt']['max_loss_diff_vs_hand']:.1e}"] for m, r in t["models"].items()],
            )
    for n in (1, 2):
        if f"compile_{n}" in bench:
            c = bench[f"compile_{n}"]
            md += [f"## Compiled tensor-parallel step, {n} gloo process{'es' if n > 1 else ''} "
                   f"(torch.compile backend {c['backend']}, fullgraph, dim {c['dim']}, batch "
                   f"{c['batch']}x{c['seq']})", "",
                   "Forward and loss compiled, backward through the compiled graph, AdamW "
                   "eagerly; median ms (slowest rank). fwd+bwd: the compiled part alone. "
                   "Compile s: the first call. The FSDP x TP models (``*_fsdp_tp``, on a "
                   f"(dp, tp) {tuple(c.get('fsdp_tp_mesh', ()))} mesh) compile without "
                   "fullgraph: dynamo breaks at the FSDP hooks, for all three.", ""]
            md += _table(
                ["model", "sw ms", "hand ms", "DT ms", "vs hand", "vs DT", "fwd+bwd vs hand",
                 "fwd+bwd vs DT", "compile s sw / hand / DT", "loss diff sw"],
                [[m, *(r[k].get("step_ms") for k in ("shardwise", "hand", "torch_dt")),
                  r["ratio_step_vs_hand"], r["ratio_step_vs_torch_dt"],
                  r["ratio_fwd_bwd_vs_hand"], r["ratio_fwd_bwd_vs_torch_dt"],
                  _per_kind(r, "compile_s", ".1f"), _per_kind(r, "max_loss_diff_vs_hand", ".1e",
                                                             ("shardwise",))]
                 for m, r in c["models"].items()],
            )
            if all("full" in r for r in c["models"].values()):
                load = ", ".join(f"{x:.1f}" for x in c["load_avg"])
                md += ["", "The whole step compiled as one function (zero_grad, forward, loss, "
                       "backward, AdamW.step(); dynamo breaks at zero_grad, backward and the "
                       "optimizer's own graph_break(), for all three): median ms (slowest "
                       "rank); recompiles: frames dynamo compiled after the two warmup steps. "
                       f"Load average during the run: {load}.", ""]
                md += _table(
                    ["model", "sw ms", "hand ms", "DT ms", "vs hand", "vs DT",
                     "recompiles sw / hand / DT", "compile s sw / hand / DT", "loss diff sw"],
                    [[m, *(f[k].get("step_ms") for k in ("shardwise", "hand", "torch_dt")),
                      f["ratio_step_vs_hand"],
                      f["ratio_step_vs_torch_dt"],
                      _per_kind(f, "recompiles", "d"), _per_kind(f, "compile_s", ".1f"),
                      _per_kind(f, "max_loss_diff_vs_hand", ".1e", ("shardwise",))]
                     for m, f in ((m, r["full"]) for m, r in c["models"].items())],
                )
    if "overlap_2" in bench:
        o = bench["overlap_2"]
        md += ["## Overlap (async_op=True), 2 processes", "",
               f"FSDP-style: {o['layers']} layers, each all_gathers its {o['dim']}x{o['dim']} "
               f"weight (Shard(0) -> Replicate) and multiplies {o['batch']}x{o['dim']} "
               f"activations by it ({o['matmul_ms']:.2f} ms); overlapped, the next layer's "
               f"gather starts before this layer's matmul. ms per layer, slowest process. "
               f"With a matmul on each of the {o['cores']} cores, the collective's CPU time "
               f"cannot hide: the best ratio the cores allow, (matmul + gather CPU) / "
               f"(matmul + gather wall), is {o['bound_ratio']:.2f}.", ""]
        md += _table(["collectives", "all_gather ms", "all_gather CPU ms", "sequential ms",
                      "overlapped ms", "ratio"],
                     [["shardwise async_op=True", o["all_gather_ms"], o["all_gather_cpu_ms"],
                       o["sequential_ms"], o["overlapped_ms"], o["ratio"]],
                      ["raw gloo async_op=True", o["raw_all_gather_ms"],
                       o["raw_all_gather_cpu_ms"], o["raw_sequential_ms"],
                       o["raw_overlapped_ms"], o["raw_ratio"]]])
    if "checkpoint" in bench:
        c = bench["checkpoint"]
        md += [f"## Checkpoint ({c['megabytes']:.0f} MB of float32)", ""]
        md += _table(["operation", "s", "MB/s"],
                     [[r["label"], r["seconds"], c["megabytes"] / r["seconds"]]
                      for r in c["rows"]])
    if "launch" in bench:
        md += ["## Launcher (empty program, wall s, median)", ""]
        md += _table(["launcher", "median s"],
                     [[k, v] for k, v in bench["launch"]["median_s"].items()])
    if "rank_threads" in bench:
        rt = bench["rank_threads"]
        md += ["", "## One process, many ranks (tensor-parallel MLP step, ms, median)", "",
               "Wall: rank 0's median per step. CPU: the CPU time per step of all ranks "
               "(process CPU time, summed over the processes), which other load leaves alone. "
               "Hand-written: the same step on plain local shards with gloo all_reduce, run "
               "as threads (the transport's floor).",
               ""]
        md += _table(
            ["ranks", "as threads", "as processes", "torch LocalTensorMode",
             "LocalTensorMode / threads", "processes / threads", "CPU threads",
             "CPU processes", "CPU LocalTensorMode", "CPU LocalTensorMode / threads",
             "hand-written as threads", "CPU hand-written as threads"],
            [[r["nproc"], r["threads_ms"], r["processes_ms"], r["local_tensor_mode_ms"],
              r["local_tensor_mode_ms"] / r["threads_ms"], r["processes_ms"] / r["threads_ms"],
              r.get("threads_cpu_ms", "-"), r.get("processes_cpu_ms", "-"),
              r.get("local_tensor_mode_cpu_ms", "-"),
              r["local_tensor_mode_cpu_ms"] / r["threads_cpu_ms"]
              if "threads_cpu_ms" in r else "-",
              r.get("hand_threads_ms", "-"), r.get("hand_threads_cpu_ms", "-")]
             for r in rt["rows"]],
        )
        gpt = rt.get("simulated_gpt")
        if gpt:
            md += [f"The demo's GPT training step (global view, AdamW) on {gpt['mesh']} "
                   f"simulated devices in one process against the single-device step, "
                   f"interleaved (ms, median; largest loss difference "
                   f"{gpt['max_loss_diff']:.1e}):", ""]
            md += _table(["", "single device", f"{gpt['devices']} simulated devices",
                          f"/ ({gpt['devices']} x single)"],
                         [["wall", gpt["single_ms"], gpt["embedded_ms"],
                           gpt["ratio_vs_n_single"]],
                          ["CPU", gpt["single_cpu_ms"], gpt["embedded_cpu_ms"],
                           gpt["cpu_ratio_vs_n_single"]]])
    for n in (1, 2):
        if f"optimizer_{n}" in bench:
            o = bench[f"optimizer_{n}"]
            md += [f"## Optimizer step, {n} process{'es' if n > 1 else ''} ({o['layers']} "
                   f"tensor-parallel MLP layers of dim {o['dim']}, ms, median, slowest rank)",
                   "", "DTensor parameters against plain tensors of their local shapes, the "
                   "same optimizer; clip_grad_norm_ over the DTensor gradients against the "
                   "clip by hand (one all_reduce of the local sums of squares).", ""]
            md += _table(["optimizer", "foreach", "tensors", "DTensor", "plain", "ratio"],
                         [[r["optimizer"], "yes" if r["foreach"] else "no", r["tensors"],
                           r["shardwise_ms"], r["plain_ms"], r["ratio_vs_plain"]]
                          for r in o["rows"]])
            if o.get("clip"):
                md += _table(["clip_grad_norm_", "collectives", "largest bytes", "DTensor",
                              "by hand", "ratio"],
                             [[f"foreach={c['foreach']}",
                               f"{c['collectives']} {'/'.join(c['kinds'])}", c["max_bytes"],
                               c["shardwise_ms"], c["hand_ms"], c["ratio_vs_hand"]]
                              for c in o["clip"]])
    return md


def _over(value: float, bound: float) -> float:
    return 1.0 if value == bound else (value / bound if bound else float("inf"))


def targets(bench: dict) -> list[tuple[str, str, str]]:
    """(target, status, detail) per target of issue 13 that the run can judge."""
    out = []
    if "dispatch" in bench:
        rows = bench["dispatch"]["rows"]
        worst = max(rows, key=lambda r: r["shardwise"] / r["torch_dt"])
        per_dev = max((r["shardwise_4dev"] - r["shardwise"] - 3 * r["local"]) / 3
                      for r in rows if not r["autograd"])
        ok = worst["shardwise"] / worst["torch_dt"] <= 1.0 and per_dev <= 2.0
        out.append(("Warm dispatch <= DTensor on every op, <= 2 us per extra device",
                    "met" if ok else "gap",
                    f"worst {worst['op']} {worst['shardwise'] / worst['torch_dt']:.2f}x, "
                    f"extra device up to {per_dev:.1f} us"
                    + ("" if ok else f"; reason: {REASONS['dispatch']}")))
    if "planner" in bench:
        p = bench["planner"]
        named = [_over(r["shardwise"], r["bound"]) for r in p["named"]]
        meshes_ok = all(s["shardwise"]["at_bound"] == s["transitions"]
                        for s in p["meshes"].values())
        ok = max(named) == 1.0 and meshes_ok
        out.append(("Plans at the lower bound (named transitions and all 1-D/2-D/3-D pairs)",
                    "met" if ok else "gap",
                    f"named worst {max(named):.2f}x; "
                    + ", ".join(f"{m}: {s['shardwise']['at_bound']}/{s['transitions']} at bound"
                                for m, s in p["meshes"].items())
                    + ("" if ok else f"; reason: {REASONS['planner']}")))
        to_partial = p.get("to_partial", {})
        if to_partial:
            ok = all(s["shardwise"]["at_bound"] == s["transitions"] for s in to_partial.values())
            out.append(("Explicit redistribution to Partial targets at the lower bound",
                        "met" if ok else "gap",
                        ", ".join(f"{m}: {s['shardwise']['at_bound']}/{s['transitions']} at "
                                  f"bound (DTensor {s['dtensor_greedy']['at_bound']})"
                                  for m, s in to_partial.items())
                        + ("" if ok else f"; reason: {REASONS['to_partial']}")))
        cold = max([r["shardwise_ms"] for r in p["named"]]  # the named ones are 3-D
                   + [s["shardwise_plan_ms_max"] for m, s in p["meshes"].items()
                      if m.count(",") == 2])
        cube = p["meshes"].get("(2, 2, 2)")
        median = (cube["shardwise_plan_ms_median"] if cube
                  else statistics.median(r["shardwise_ms"] for r in p["named"]))
        ok = cold < 1.0 and p["cached_lookup_us"] < 1.0
        out.append(("Cold planning < 1 ms on 3-D meshes, cached lookup < 1 us",
                    "met" if ok else "gap",
                    f"3-D cold median {median:.2f} ms, max {cold:.2f} ms; cached "
                    f"{p['cached_lookup_us']:.2f} us"
                    + ("" if ok else f"; reason: {REASONS['cold_planning']}")))
    rows = [r for n in (2, 4) for r in bench.get(f"redistribute_{n}", {}).get("rows", [])]
    if rows:
        moving = [r for r in rows if r["raw_collective"] != "local slice"]
        worst_dt = max(rows, key=lambda r: r["ratio_vs_torch_dt"])
        worst_raw = max(moving, key=lambda r: r["ratio_vs_raw"])
        ok = worst_dt["ratio_vs_torch_dt"] <= 1.0 and worst_raw["ratio_vs_raw"] <= 1.2
        out.append(("Redistribution <= DTensor and within 1.2x of the raw collective",
                    "met" if ok else "gap",
                    f"worst vs DT {worst_dt['transition']} {worst_dt['size']}: "
                    f"{worst_dt['ratio_vs_torch_dt']:.2f}x; worst vs raw "
                    f"{worst_raw['transition']} {worst_raw['size']}: "
                    f"{worst_raw['ratio_vs_raw']:.2f}x"
                    + ("" if ok else f"; reason: {REASONS['redistribute']}")))
    models = [(n, m, r) for n in (2, 4)  # issue 13's target: the TP MLP and block only
              for m, r in bench.get(f"training_{n}", {}).get("models", {}).items()
              if m in ("mlp", "block")]
    if models:
        t = max(r["ratio_time_vs_torch_dt"] for _, _, r in models)
        mem = max(r["ratio_mem_vs_torch_dt"] for _, _, r in models)
        ok = t <= 1.0 and mem <= 1.0
        out.append(("TP MLP and transformer step <= DTensor in time and peak memory",
                    "met" if ok else "gap",
                    f"worst time {t:.2f}x, worst memory {mem:.2f}x"
                    + ("" if ok else f"; reason: {REASONS['training']}")))
    compiled = [(n, m, r) for n in (1, 2)  # a ratio is None where a kind failed to compile
                for m, r in bench.get(f"compile_{n}", {}).get("models", {}).items()
                if r["ratio_step_vs_hand"] is not None]
    if compiled:
        worst = max(r["ratio_step_vs_hand"] for _, _, r in compiled)
        fwd_bwd = max(r["ratio_fwd_bwd_vs_hand"] for _, _, r in compiled)
        ok = worst <= 1.1
        out.append(("Compiled TP step within 1.1x of hand-written", "met" if ok else "gap",
                    f"worst step {worst:.2f}x, forward+backward {fwd_bwd:.2f}x ("
                    + ", ".join(f"{m} {n} proc {r['ratio_step_vs_hand']:.2f}x"
                                for n, m, r in compiled) + ")"
                    + ("" if ok else f"; reason: {REASONS['compile']}")))
        full = [(n, m, r["full"]) for n, m, r in compiled
                if "full" in r and r["full"]["ratio_step_vs_hand"] is not None]
        if full:
            worst = max(f["ratio_step_vs_hand"] for _, _, f in full)
            recompiles = sum(f["shardwise"]["recompiles"] for _, _, f in full)
            ok = worst <= 1.0 and recompiles == 0
            out.append(("Compiled whole step (optimizer included) <= compiled hand-written, "
                        "no recompiles", "met" if ok else "gap",
                        f"worst {worst:.2f}x, {recompiles} recompiles after warmup ("
                        + ", ".join(f"{m} {n} proc {f['ratio_step_vs_hand']:.2f}x"
                                    for n, m, f in full) + ")"
                        + ("" if ok else f"; reason: {REASONS['compile_full']}")))
    else:
        out.append(("Compiled TP step within 1.1x of hand-written", "not measured",
                    "run bench_compile (compile_1, compile_2)"))
    return out


def _status(ok: bool, reason: str) -> tuple[str, str]:
    """("met", "") or ("gap", "; reason: ...")."""
    return ("met", "") if ok else ("gap", f"; reason: {REASONS[reason]}")


def _not_measured(target: str, what: str) -> tuple[str, str, str]:
    return (target, "not measured", what)


# the models the eager target names, found by name in the training benchmark's models
EAGER_MODELS = ("mlp", "block", "gpt", "llama", "fsdp")


def targets_22(bench: dict, gpu_folder: Path | None = None) -> list[tuple[str, str, str]]:
    """(target, status, detail) per target of issue 22: "met", "gap" with the measured numbers
    and the reason, or "not measured" when no benchmark of this run records it."""
    out: list[tuple[str, str, str]] = []

    # eager TP and FSDP x TP steps against hand-written and DTensor
    target = ("Eager TP and FSDP x TP steps (MLP, block, GPT, Llama block) within 1.05x of "
              "hand-written on 2 and 4 processes, peak memory equal; the same against DTensor")
    runs = {n: bench[f"training_{n}"].get("models", {}) for n in (2, 4)
            if f"training_{n}" in bench}
    if runs:
        worst: dict[str, tuple[float, str]] = {}
        for n, models in runs.items():
            for m, r in models.items():
                for key in ("ratio_time_vs_hand", "ratio_mem_vs_hand", "ratio_time_vs_torch_dt",
                            "ratio_mem_vs_torch_dt"):
                    if key in r and r[key] > worst.get(key, (-1.0, ""))[0]:
                        worst[key] = (r[key], f"{m} {n} proc")
        missing = [f"{k} on {n} proc" for n in (2, 4) for k in EAGER_MODELS
                   if not any(k in m for m in runs.get(n, {}))]
        limits = {"ratio_time_vs_hand": 1.05, "ratio_mem_vs_hand": 1.0,
                  "ratio_time_vs_torch_dt": 1.05, "ratio_mem_vs_torch_dt": 1.0}
        over = [k for k, (v, _) in worst.items() if v > limits[k] + 1e-9]
        absent = [k for k in limits if k not in worst]
        ok = not over and not missing and not absent
        label = {"ratio_time_vs_hand": "time vs hand", "ratio_mem_vs_hand": "memory vs hand",
                 "ratio_time_vs_torch_dt": "time vs DT", "ratio_mem_vs_torch_dt": "memory vs DT"}
        detail = "; ".join(f"worst {label[k]} {v:.2f}x ({where})"
                           for k, (v, where) in worst.items())
        if missing or absent:
            detail += "; not measured: " + ", ".join(missing + [label[k] for k in absent])
        reasons = []
        if over:
            reasons.append(REASONS["eager_vs_hand"])
        if missing:
            reasons.append(REASONS["eager_missing"])
        out.append((target, "met" if ok else "gap",
                    detail + ("" if ok else "; reason: " + "; ".join(reasons))))
    else:
        out.append(_not_measured(target, "run bench_training (training_2, training_4)"))

    # warm dispatch and the per-device cost
    target = ("Warm dispatch <= DTensor on every op on a 1-device mesh, cat([a, a], 1) of one "
              "Shard(0) tensor included")
    per_device_target = "Each extra simulated device <= 2 us per op on every benchmarked op"
    if "dispatch" in bench:
        rows = bench["dispatch"]["rows"]
        worst_row = max(rows, key=lambda r: r["shardwise"] / r["torch_dt"])
        ratio = worst_row["shardwise"] / worst_row["torch_dt"]
        same = [r for r in rows if r["op"] == "cat_same"]
        cat_ratio = max((r["shardwise"] / r["torch_dt"] for r in same), default=0.0)
        ok = ratio <= 1.0 and bool(same)
        status, why = _status(ok, "dispatch_cat" if cat_ratio > 1.0 else "dispatch")
        if ratio <= 1.0 and not same:
            why = ""
        detail = (f"worst {worst_row['op']}{' +grad' if worst_row['autograd'] else ''} "
                  f"{ratio:.2f}x"
                  + "".join(f"; cat([a, a], 1){' +grad' if r['autograd'] else ''} "
                            f"{r['shardwise'] / r['torch_dt']:.2f}x" for r in same)
                  + ("" if same else "; cat([a, a], 1) not measured"))
        out.append((target, status, detail + why))
        per_dev = {r["op"]: r.get("us_per_extra_device",
                                  (r["shardwise_4dev"] - r["shardwise"] - 3 * r["local"]) / 3)
                   for r in rows if not r["autograd"]}
        op, cost = max(per_dev.items(), key=lambda kv: kv[1])
        status, why = _status(cost <= 2.0, "dispatch")
        out.append((per_device_target, status,
                    f"worst {op} {cost:.1f} us, "
                    + ", ".join(f"{k} {v:.1f}" for k, v in per_dev.items()) + why))
    else:
        out.append(_not_measured(target, "run bench_dispatch"))
        out.append(_not_measured(per_device_target, "run bench_dispatch"))

    # redistribution against the raw collective and DTensor
    raw_target = "Redistribution within 1.2x of the raw collective on every transition"
    pr_target = "Partial -> Replicate at or below DTensor at every size"
    rows = [(n, r) for n in (2, 4) for r in bench.get(f"redistribute_{n}", {}).get("rows", [])]
    if rows:
        moving = [(n, r) for n, r in rows if r["raw_collective"] != "local slice"]
        n, w = max(moving, key=lambda nr: nr[1]["ratio_vs_raw"])
        status, why = _status(w["ratio_vs_raw"] <= 1.2, "redistribute_raw")
        out.append((raw_target, status,
                    f"worst {w['transition']} {w['size']} on {n} proc "
                    f"{w['ratio_vs_raw']:.2f}x" + why))
        partial = [(n, r) for n, r in rows if r["transition"] == "Partial -> Replicate"]
        if partial:
            n, w = max(partial, key=lambda nr: nr[1]["ratio_vs_torch_dt"])
            status, why = _status(w["ratio_vs_torch_dt"] <= 1.0, "redistribute_raw")
            out.append((pr_target, status,
                        f"worst {w['size']} on {n} proc {w['ratio_vs_torch_dt']:.2f}x ("
                        + ", ".join(f"{r['size']} {n}p {r['ratio_vs_torch_dt']:.2f}x"
                                    for n, r in partial) + ")" + why))
        else:
            out.append(_not_measured(pr_target, "no Partial -> Replicate row"))
    else:
        out.append(_not_measured(raw_target, "run bench_redistribute (redistribute_2, _4)"))
        out.append(_not_measured(pr_target, "run bench_redistribute (redistribute_2, _4)"))

    # clip_grad_norm_ and the optimizer step
    target = "clip_grad_norm_ over DTensor gradients: one scalar collective per group"
    clips = [(n, c) for n in (2,) for c in bench.get(f"optimizer_{n}", {}).get("clip", [])]
    if clips:
        ok = all(c["collectives"] == 1 and c["kinds"] == ["all_reduce"]
                 and c["max_bytes"] <= 4 * n for n, c in clips)
        status, why = _status(ok, "clip")
        out.append((target, status, ", ".join(
            f"foreach={c['foreach']}: {c['collectives']} {'/'.join(c['kinds'])} of at most "
            f"{c['max_bytes']} bytes on {n} proc ({c['ratio_vs_hand']:.2f}x the clip by hand)"
            for n, c in clips) + why))
    else:
        out.append(_not_measured(target, "run bench_optimizer on 2 processes (optimizer_2)"))
    target = "Optimizer step over DTensor parameters at or below the plain-tensor step"
    rows = [(n, r) for n in (1, 2) for r in bench.get(f"optimizer_{n}", {}).get("rows", [])]
    if rows:
        n, w = max(rows, key=lambda nr: nr[1]["ratio_vs_plain"])
        status, why = _status(w["ratio_vs_plain"] <= 1.0, "optimizer")
        out.append((target, status,
                    f"worst {w['optimizer']} foreach={w['foreach']} on {n} proc "
                    f"{w['ratio_vs_plain']:.2f}x (" + ", ".join(
                        f"{r['optimizer']}{' foreach' if r['foreach'] else ''} {n}p "
                        f"{r['ratio_vs_plain']:.2f}x" for n, r in rows) + ")" + why))
    else:
        out.append(_not_measured(target, "run bench_optimizer (optimizer_1, optimizer_2)"))

    # one process, many ranks
    target = "Ranks as threads 10x faster than torch's LocalTensorMode (N = 2, 4, 8)"
    gpt_target = ("Demo GPT global-view step on 8 simulated devices within 1.5x of 8 "
                  "single-device steps")
    rt = bench.get("rank_threads")
    if rt and rt.get("rows"):
        counts = {r["nproc"] for r in rt["rows"]}
        lead = [(r["nproc"], r["local_tensor_mode_ms"] / r["threads_ms"],
                 r.get("local_tensor_mode_cpu_ms", 0.0) / r["threads_cpu_ms"]
                 if r.get("threads_cpu_ms") else None,
                 r["processes_ms"] / r["threads_ms"]) for r in rt["rows"]]
        missing = sorted({2, 4, 8} - counts)
        ok = not missing and min(x for _, x, _, _ in lead) >= 10.0
        status, why = _status(ok, "threads")
        out.append((target, status, "LocalTensorMode / threads: " + ", ".join(
            f"N={n} {x:.2f}x" + (f" (CPU {c:.2f}x)" if c is not None else "")
            for n, x, c, _ in lead) + "; processes / threads: "
            + ", ".join(f"N={n} {p:.2f}x" for n, _, _, p in lead)
            + (f"; N={missing} not measured" if missing else "") + why))
        gpt = rt.get("simulated_gpt")
        if gpt:
            ok = gpt["devices"] == 8 and gpt["ratio_vs_n_single"] <= 1.5
            status, why = _status(ok, "simulated")
            out.append((gpt_target, status,
                        f"{gpt['mesh']}: {gpt['embedded_ms']:.2f} ms against 8 x "
                        f"{gpt['single_ms']:.2f} ms, {gpt['ratio_vs_n_single']:.2f}x (CPU "
                        f"{gpt['cpu_ratio_vs_n_single']:.2f}x)" + why))
        else:
            out.append(_not_measured(gpt_target, "bench_rank_threads did not record it"))
    else:
        out.append(_not_measured(target, "run bench_rank_threads"))
        out.append(_not_measured(gpt_target, "run bench_rank_threads"))

    # compiled
    target = ("Compiled TP and FSDP x TP step (optimizer included) <= compiled hand-written, "
              "no recompilation, on 1 and 2 processes")
    rows = [(n, m, r["full"]) for n in (1, 2)
            for m, r in bench.get(f"compile_{n}", {}).get("models", {}).items() if "full" in r]
    full = [row for row in rows if row[2]["ratio_step_vs_hand"] is not None]
    if full:
        worst = max(f["ratio_step_vs_hand"] for _, _, f in full)
        recompiles = sum(f["shardwise"]["recompiles"] for _, _, f in full)
        missing = [f"{n} proc" for n in (1, 2) if not any(k == n for k, _, _ in full)]
        if not any("fsdp" in m for _, m, _ in full):
            missing.append("an FSDP x TP model")
        missing += [f"{m} {n} proc ({k} failed to compile)" for n, m, f in rows
                    for k in ("shardwise", "hand") if "error" in f[k]]
        ok = worst <= 1.0 and recompiles == 0 and not missing
        reason = "" if ok else "; reason: " + (REASONS["compile_22"] if worst > 1.0 or recompiles
                                               else "not measured")
        out.append((target, "met" if ok else "gap",
                    f"worst {worst:.2f}x, {recompiles} recompiles (" + ", ".join(
                        f"{m} {n} proc {f['ratio_step_vs_hand']:.2f}x" for n, m, f in full)
                    + ")" + (f"; not measured: {', '.join(missing)}" if missing else "")
                    + reason))
    else:
        out.append(_not_measured(target, "run bench_compile (compile_1, compile_2)"))

    # GPU readiness
    target = "bench/gpu_check.sh runs in under 5 minutes on one CUDA device"
    machine_file = (gpu_folder or BENCH / "results" / "gpu") / "machine.json"
    if machine_file.exists():
        m = json.loads(machine_file.read_text())
        seconds = m.get("seconds")
        if seconds is None:
            out.append((target, "not measured", f"ran {m['date']} on {m['gpu']}; its duration "
                        "was not recorded"))
        else:
            out.append((target, "met" if seconds < 300 else "gap",
                        f"{seconds:.0f} s on {m['gpu']}, {m['date']}"))
    else:
        out.append(_not_measured(target, REASONS["gpu"]))
    return out


def _gpu_section(folder: Path) -> list[str]:
    """The tables of the last ``bench/gpu_check.sh`` run whose JSON files were kept in
    ``folder`` (the suite itself runs on CPUs)."""
    if not (folder / "machine.json").exists():
        return ["## On a GPU", "", "`bench/gpu_check.sh` has not been run on a GPU yet.", ""]
    m = json.loads((folder / "machine.json").read_text())
    md = ["## On a GPU (`bench/gpu_check.sh`)", "",
          f"Run {m['date']} on one {m['gpu']}, torch {m['torch']} (CUDA {m['cuda']}), by "
          "`bench/gpu_check.sh`, whose `tests/test_cuda.py` checks the CUDA paths against plain "
          "PyTorch on the GPU. Not regenerated by this suite.", ""]
    files = {name: folder / f"{name}.json" for name in ("dispatch", "redistribute", "training")}
    if files["dispatch"].exists():
        rows = json.loads(files["dispatch"].read_text())["rows"]
        md += ["Dispatch, world of one (NCCL), CPU time per call in us (median):", ""]
        md += _table(["op", "autograd", "local", "shardwise", "torch DT", "ratio",
                      "us / extra device (4 simulated on the GPU)"],
                     [[r["op"], "yes" if r["autograd"] else "no", r["local"], r["shardwise"],
                       r["torch_dt"], r["shardwise"] / r["torch_dt"],
                       (r["shardwise_4dev"] - r["shardwise"] - 3 * r["local"]) / 3]
                      for r in rows])
    if files["redistribute"].exists():
        r = json.loads(files["redistribute"].read_text())
        md += [f"Redistribution on {r['simulated_devices']} simulated devices sharing the GPU "
               "beside the same moves in plain torch ops (ms, median):", ""]
        md += _table(["transition", "size", "shardwise", "plain ops", "ratio"],
                     [[x["transition"], f"{x['size']}x{x['size']}", x["shardwise_ms"],
                       x["raw_ms"], x["ratio_vs_raw"]] for x in r["rows"]])
    if files["training"].exists():
        t = json.loads(files["training"].read_text())
        md += [f"Tensor-parallel step, {t['world_size']} process (NCCL), dim {t['dim']} "
               "(ms, median; peak MiB from the CUDA allocator):", ""]
        md += _table(["model", "shardwise", "torch DT", "hand", "vs DT", "vs hand",
                      "peak vs DT"],
                     [[name, x["shardwise"]["step_ms"], x["torch_dt"]["step_ms"],
                       x["hand"]["step_ms"], x["ratio_time_vs_torch_dt"],
                       x["ratio_time_vs_hand"], x["ratio_mem_vs_torch_dt"]]
                      for name, x in t["models"].items()])
    return md


def _engine_section(folder: Path) -> list[str]:
    """The engine across processes (``bench/results/engine``, written by
    ``bench/engine_check.sh``): redistribution against the raw backend collective, training
    steps against hand-written and DTensor, and the per-collective model."""
    if not folder.is_dir():
        return []
    md = ["## The engine across processes", "",
          "Measured by `bash bench/engine_check.sh` (gloo on this CPU host, one device per "
          "process); each collective is one call of the process group's own collective after "
          "the agreement (a word posted on the shared-memory board of these processes of one "
          "host).", ""]
    rows = []
    for world in (2, 4):
        f = folder / f"redistribute_{world}.json"
        if f.exists():
            for r in json.loads(f.read_text())["rows"]:
                rows.append([world, r["transition"], r["size"], r["raw_collective"],
                             r["shardwise_ms"], r["raw_ms"], r["torch_dt_ms"], r["ratio_vs_raw"],
                             r["ratio_vs_torch_dt"]])
    checks = [(world, json.loads((folder / f"redistribute_{world}.json").read_text())
               .get("checks")) for world in (2, 4)
              if (folder / f"redistribute_{world}.json").exists()]
    if rows:
        md += ["### Redistribution (ms, median, slowest rank)", ""]
        md += _table(["procs", "transition", "size", "raw", "shardwise", "raw ms", "torch DT",
                      "vs raw", "vs DT"], rows)
        md += ["Copies beside the raw collective: none for Shard(0) -> Replicate (the gathered "
               "buffer is the result), Partial -> Shard(0) (the even row chunks are the "
               "reduce_scatter's input as they lie) and Partial -> Replicate (one clone, as the "
               "raw one); one for Shard(0) -> Shard(1), the columns each process sends laid out "
               "side by side, as the raw one does first (no collective sends strided columns; "
               "what arrives lies as the new shard). The fixed cost beside the raw call is the "
               "agreement: a word posted on the processes' shared-memory board (one host), which "
               "on CPU must finish before the data moves (gloo "
               "aborts on messages of another size); on an accelerator it runs while the data "
               "moves. On this shared 2-core host the times of one setting vary by 2x from run "
               "to run at 1024 (a few ms: scheduling), so the 1024 ratios are noise-bound.", ""]
        checked = [(w, c) for w, c in checks if c]
        if checked:
            md += ["What the divergence checks cost (Shard(0) -> Replicate, ms, median; "
                   "docs/multiprocess.md \"What is checked\"):", ""]
            md += _table(["procs", "size", "default (board)", "on the side group",
                          "debug checks", "board alone", "side-group gather alone"],
                         [[w, c["size"], c["default_ms"], c.get("side_group_ms", "-"),
                           c["debug_ms"], c.get("board_agreement_ms", "-"),
                           c.get("side_group_agreement_ms", c.get("agreement_ms"))]
                          for w, c in checked])
    rows = []
    for world in (2, 4):
        f = folder / f"training_{world}.json"
        if f.exists():
            for name, m in json.loads(f.read_text())["models"].items():
                rows.append([world, name, m["shardwise"]["step_ms"], m["hand"]["step_ms"],
                             m["torch_dt"]["step_ms"], m["ratio_time_vs_hand"],
                             m["ratio_time_vs_torch_dt"]])
    if rows:
        md += ["### Training step (ms, median)", "",
               "`bench_training.py --quick` (dim 128): a small model, where Python's per-op "
               "dispatch is most of a step; the earlier stop's engine gave the same ratios in "
               "this mode on this host (mlp 2.2x of hand, 0.95x of DT, 2 processes).", ""]
        md += _table(["procs", "model", "shardwise", "hand", "torch DT", "vs hand", "vs DT"],
                     rows)
    for steady in (False, True):
        rows = []
        for world in (2, 4):
            f = folder / f"training_1024{'_steady' if steady else ''}_{world}.json"
            if f.exists():
                data = json.loads(f.read_text())
                for name, m in data["models"].items():
                    sw, hand = m["shardwise"], m["hand"]
                    rows.append([world, name, sw["step_ms"], hand["step_ms"],
                                 m["torch_dt"]["step_ms"], m["ratio_time_vs_hand"],
                                 m["ratio_time_vs_torch_dt"], sw.get("cpu_ms", "-"),
                                 hand.get("cpu_ms", "-"), m.get("ratio_cpu_vs_hand", "-"),
                                 f"{sw.get('minor_faults', '-')} / "
                                 f"{hand.get('minor_faults', '-')}"])
        if not rows:
            continue
        if steady:
            md += ["### The same with a steady heap (`--steady-heap`)", "",
                   "glibc's mmap and trim thresholds raised for the whole run (the same for "
                   "the three variants), so no step faults its large tensors in afresh.", ""]
        else:
            md += ["### Training step at a realistic width (ms, median)", "",
                   f"`bench_training.py --quick --dim 1024 --models mlp,llama`: hidden size "
                   f"{data['dim']}, batch {data['batch']}x{data['seq']} tokens (the MLP's inner "
                   "width 4x, the Llama block's SwiGLU as torchtitan's), tensor parallel over "
                   "every process: a step is its matmuls and its collectives, as on a cluster, "
                   "rather than per-op Python. CPU: the process's CPU time per step (its own "
                   "work, not the time it waits descheduled); faults: minor page faults per "
                   "step, shardwise / hand.", ""]
        md += _table(["procs", "model", "shardwise", "hand", "torch DT", "vs hand", "vs DT",
                      "sw CPU", "hand CPU", "CPU vs hand", "faults"], rows)
    if (folder / "training_1024_2.json").exists():
        md += ["Where shardwise's extra time goes (phase by phase and op by op against the "
               "hand-written step): the same local kernels on the same shapes, no extra copy, "
               "collective or redistribution, the same tensor allocations and peak; fewer "
               "collectives than the hand-written Megatron step, in fact (the input gradient "
               "that wq, wk and wv share is reduced once, pending as a partial sum, where the "
               "hand-written step reduces each: 4 all_reduces a Llama block step against 7). "
               "What differs is fixed per step: per-op dispatch of the DTensor subclass (54 "
               "`__torch_dispatch__` calls an mlp step, 32 of them AdamW's per-parameter loop; "
               "150 a Llama block step; torch DT pays the same, its CPU column) and the "
               "agreement before each collective: a word posted on the processes' shared-"
               "memory board, about 1 us of CPU once all are there (the first process to "
               "arrive waits there for the others, time it would otherwise spend waiting "
               "inside the collective; before the board, a gather on a gloo side group, a "
               "dependent round trip of 0.4-4 ms on this host). On this host a process gets "
               "a half to a third of a core, so each ms of CPU costs 2-3 ms of wall, and the "
               "wall ratios of one setting move by about 0.1 from run to run. glibc's heap "
               "adds a random part: by the process's allocation history one variant or "
               "another faults its large tensors in afresh every step (thousands of minor "
               "faults, 2-10 ms of CPU), which the steady-heap table removes for all three.",
               ""]
    f = folder / "model.json"
    if f.exists():
        model = json.loads(f.read_text())
        p = model["params"]
        md += ["### Per collective: point to point against the backend, measured and modelled",
               "",
               "shardwise's engine before the backend path swapped a header with every peer "
               "(read on the host) and moved data point to point; `bench/bench_collective_"
               "model.py` measures both message patterns on gloo at N = 2, 4, 8 and fits "
               "`rounds x alpha + messages x o + bytes x beta` to all of them: "
               f"alpha {p['alpha_us']:.1f} us per dependent round, o {p['o_us']:.2f} us per "
               f"message posted, {1 / max(p['beta_us_per_byte'], 1e-12):.0f} bytes per us. "
               "N = 4 and 8 oversubscribe this host's cores, so the fit is dominated by the "
               "cost of each message (scheduling), not by a network's latency and bandwidth: "
               "the modelled ratios below show how the message counts scale, on this host's "
               "costs.", ""]
        md += _table(["N", "bytes", "collective", "engine", "measured us", "model us"],
                     [[r["n"], r["bytes"], r["collective"], r["engine"], r["us"], r["model_us"]]
                      for r in model["measured"]])
        md += [f"Modelled for large N with that fit (the backend all_reduce as a tree, as "
               f"NCCL's; the point-to-point path with an assumed {model['sync_us']:g} us host "
               f"sync per collective, the header's read on an accelerator). The backend's "
               f"agreement is charged as processes pay it, 8 to a host: a word on the host's "
               f"shared-memory board (no message) and, at N >= 16, ceil(log2 hosts) rounds of "
               f"one 16-byte message each way between the hosts' first processes "
               f"(`comm/host_tree.py`; a gather on the side group, as the measured rows make, "
               f"would be N - 1 dependent steps: 1,023 at N = 1024 against 7). On an "
               f"accelerator the host waits for it beside the device's work, so it costs the "
               f"device nothing while the host stays ahead:", ""]
        md += _table(["N", "bytes", "collective", "point to point ms", "backend ms", "ratio"],
                     [[r["n"], r["bytes"], r["collective"], r["point_to_point_us"] / 1e3,
                       r["backend_us"] / 1e3, r["ratio"]] for r in model["modelled"]])
    return md


def write_docs(results: dict, path: Path) -> None:
    bench = {k: v["results"] for k, v in results["benchmarks"].items() if v.get("results")}
    m = results["machine"]
    load = ", ".join(f"{x:.1f}" for x in m["load_average"]) if m["load_average"] else "n/a"
    md = [
        "# Performance",
        "",
        "Generated by `python bench/run_all.py` (do not edit by hand): every benchmark runs the "
        "same work through shardwise and `torch.distributed.tensor` in the same run, "
        "interleaved; ratios are shardwise / other (below 1.0: shardwise is faster or smaller).",
        "",
        f"- Date: {results['date']}{' (quick mode)' if results['quick'] else ''}",
        f"- Machine: {m['cpu']}, {m['cores']} cores, {m['platform']}; load average at the "
        f"end {load}",
        f"- Python {m['python']}, torch {m['torch']}, {m['transport']}, OMP_NUM_THREADS=1",
        f"- Suite wall time: {results['seconds']:.0f} s",
        "",
    ]
    if m["load_average"] and m["load_average"][0] > m["cores"]:
        md += ["The host was loaded by other work during this run (load average above the "
               "core count): the times are noisy.", ""]
    md += [
        "![ratios against torch DTensor](../bench/results/summary.png)",
        "",
        "## Goals: training steps, dispatch, redistribution, optimizer, rank threads",
        "",
    ]
    md += _table(["target", "status", "measured"], [list(t) for t in targets_22(bench)])
    md += ["## Goals: planning and redistribution", ""]
    md += _table(["target", "status", "measured"], [list(t) for t in targets(bench)])
    failed = [k for k, v in results["benchmarks"].items() if not v.get("results")]
    if failed:
        md += [f"Benchmarks that did not finish: {', '.join(failed)} "
               "(see bench/results/<name>.txt).", ""]
    md += _section_tables(bench)
    md += _engine_section(BENCH / "results" / "engine")
    md += _gpu_section(BENCH / "results" / "gpu")
    path.write_text("\n".join(md).rstrip() + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="each benchmark's quick mode")
    parser.add_argument("--no-docs", action="store_true", help="do not rewrite docs/performance.md")
    parser.add_argument("--only", help="comma-separated benchmark names: " + ", ".join(BENCHMARKS))
    parser.add_argument("--out", help="results folder (default bench/results)")
    parser.add_argument("--docs-only", action="store_true",
                        help="rewrite docs/performance.md from the results folder's "
                        "results.json, running nothing")
    args = parser.parse_args()
    if args.docs_only:
        stored = (Path(args.out) if args.out else BENCH / "results") / "results.json"
        write_docs(json.loads(stored.read_text()), ROOT / "docs" / "performance.md")
        return
    names = args.only.split(",") if args.only else list(BENCHMARKS)
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        parser.error(f"unknown benchmarks {unknown}; known: {', '.join(BENCHMARKS)}")
    out = Path(args.out) if args.out else BENCH / "results"
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    results: dict = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "quick": args.quick,
        "benchmarks": {},
    }
    for name in names:
        entry = run_one(name, args.quick, out)
        results["benchmarks"][name] = entry
        print(f"{name:<16} {entry['seconds']:7.1f} s  "
              f"{'ok' if 'results' in entry else 'FAILED (' + str(entry['returncode']) + ')'}",
              flush=True)
    results["seconds"] = time.perf_counter() - start
    results["machine"] = machine()
    with tempfile.NamedTemporaryFile("w", dir=out, delete=False, suffix=".json") as f:
        json.dump(results, f, indent=1)
    os.chmod(f.name, 0o644)
    os.replace(f.name, out / "results.json")
    plot(results, out / "summary.png")
    if not args.no_docs:
        write_docs(results, ROOT / "docs" / "performance.md")
    bench = {k: v["results"] for k, v in results["benchmarks"].items() if v.get("results")}
    for issue, found in (("22", targets_22(bench)), ("13", targets(bench))):
        for target, status, detail in found:
            print(f"[issue {issue}: {status}] {target}: {detail}")
    print(f"total {results['seconds']:.0f} s; results in {out}")
    sys.exit(0 if all("results" in v for v in results["benchmarks"].values()) else 1)


if __name__ == "__main__":
    main()
