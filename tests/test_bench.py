"""Smoke test of the benchmark suite: ``bench/run_all.py --quick`` on the fastest single-process
benchmarks writes results with the expected keys and sane values, and the report generator
turns a full results file into the tables of docs/performance.md and the plot."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RUN_ALL = ROOT / "bench" / "run_all.py"


def _run_all_module():
    spec = importlib.util.spec_from_file_location("bench_run_all", RUN_ALL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(150)
def test_quick_suite_writes_results(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    proc = subprocess.run(
        [sys.executable, str(RUN_ALL), "--quick", "--no-docs", "--only", "launch,checkpoint",
         "--out", str(tmp_path)],
        capture_output=True, text=True, env=env, timeout=140, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["quick"] is True
    assert {"cpu", "cores", "torch", "python"} <= set(results["machine"])
    bench = results["benchmarks"]
    assert set(bench) == {"launch", "checkpoint"}
    launch = bench["launch"]["results"]
    assert set(launch["median_s"]) == {"shardwise.launch", "torchrun"}
    assert all(0 < s < 60 for s in launch["median_s"].values())
    ckpt = bench["checkpoint"]["results"]
    assert 15 < ckpt["megabytes"] < 25
    labels = [r["label"] for r in ckpt["rows"]]
    assert any("shardwise.checkpoint.save" in x for x in labels)
    assert any("torch.load" in x for x in labels)
    assert all(0 < r["seconds"] < 60 for r in ckpt["rows"])
    # each benchmark's own printed output is kept beside the JSON
    assert "MB/s" in (tmp_path / "checkpoint.txt").read_text()


def _fake_results() -> dict:
    """A results file with every benchmark, shaped as the benchmarks write them."""
    dispatch = {"rows": [
        {"op": "add", "autograd": False, "local": 2.0, "shardwise": 30.0, "torch_dt": 40.0,
         "shardwise_4dev": 45.0, "local_4x": 8.0, "shardwise_cold": 100.0,
         "torch_dt_cold": 300.0},
        {"op": "add", "autograd": True, "local": 3.0, "shardwise": 60.0, "torch_dt": 50.0,
         "shardwise_4dev": 80.0, "local_4x": 12.0},
    ]}
    summary = {"transitions": 20, "shardwise": {"at_bound": 20, "worst_ratio": 1.0,
                                                "mean_ratio": 1.0},
               "dtensor_greedy": {"at_bound": 15, "worst_ratio": 2.0, "mean_ratio": 1.2},
               "shardwise_plan_ms_median": 0.3, "shardwise_plan_ms_max": 0.8,
               "dtensor_greedy_ms_median": 0.1}
    short = {**summary, "transitions": 25, "shardwise": {**summary["shardwise"], "at_bound": 21}}
    planner = {"meshes": {"(4,)": summary, "(2, 2, 2)": summary}, "cached_lookup_us": 0.5,
               "to_partial": {"(4,)": summary, "(2, 2)": short},
               "named": [{"transition": "(P,P,P)->(R,R,R)", "bound": 100, "shardwise": 100,
                          "shardwise_ms": 0.5, "dtensor_greedy": 171, "dtensor_greedy_ms": 0.1,
                          "dtensor_graph": 100, "dtensor_graph_ms": 20.0}]}
    redistribute = {"world_size": 2, "rows": [
        {"transition": "Partial -> Replicate", "size": 1024, "raw_collective": "all_reduce",
         "shardwise_ms": 6.0, "torch_dt_ms": 8.0, "raw_ms": 5.0, "ratio_vs_torch_dt": 0.75,
         "ratio_vs_raw": 1.2}]}
    side = {"step_ms": 10.0, "peak_mb": 2.0}
    training = {"world_size": 2, "dim": 128, "batch": 4, "seq": 32, "heads": 4, "models": {
        "mlp": {"shardwise": {**side, "max_loss_diff_vs_hand": 1e-7},
                "torch_dt": {**side, "step_ms": 12.0, "max_loss_diff_vs_hand": 0.0},
                "hand": {**side, "step_ms": 8.0}, "ratio_time_vs_torch_dt": 10 / 12,
                "ratio_time_vs_hand": 1.25, "ratio_mem_vs_torch_dt": 1.0,
                "ratio_mem_vs_hand": 1.0}}}
    kind = {"step_ms": 10.0, "fwd_bwd_ms": 5.0, "compile_s": 3.0, "max_loss_diff_vs_hand": 0.0}
    compiled = {"world_size": 2, "backend": "aot_eager", "dim": 128, "batch": 4, "seq": 32,
                "heads": 4, "models": {"mlp": {
                    "shardwise": {**kind, "step_ms": 12.0}, "hand": kind, "torch_dt": kind,
                    "ratio_step_vs_hand": 1.2, "ratio_step_vs_torch_dt": 1.2,
                    "ratio_fwd_bwd_vs_hand": 1.0, "ratio_fwd_bwd_vs_torch_dt": 1.0,
                    "full": {"shardwise": {**kind, "step_ms": 9.0, "recompiles": 0},
                             "hand": {**kind, "recompiles": 0},
                             "torch_dt": {**kind, "recompiles": 1},
                             "ratio_step_vs_hand": 0.9, "ratio_step_vs_torch_dt": 0.9}}},
                "load_avg": [5.0, 6.0, 7.0]}
    ok = {"seconds": 1.0, "returncode": 0}
    return {
        "date": "2026-01-01 00:00 UTC", "quick": False, "seconds": 100.0,
        "machine": {"cpu": "test cpu", "cores": 2, "load_average": [1.0, 1.0, 1.0],
                    "platform": "linux", "python": "3.11", "torch": "2.x",
                    "transport": "gloo"},
        "benchmarks": {
            "dispatch": {**ok, "results": dispatch},
            "planner": {**ok, "results": planner},
            "redistribute_2": {**ok, "results": redistribute},
            "training_2": {**ok, "results": training},
            "overlap_2": {**ok, "results": {
                "mib": 2, "layers": 8, "dim": 724, "batch": 64, "cores": 2, "processes": 2,
                "matmul_ms": 5.0, "all_gather_ms": 5.0, "all_gather_cpu_ms": 2.0,
                "sequential_ms": 10.0, "overlapped_ms": 8.0, "ratio": 0.8,
                "raw_all_gather_ms": 4.0, "raw_all_gather_cpu_ms": 1.5, "raw_sequential_ms": 9.0,
                "raw_overlapped_ms": 7.0, "raw_ratio": 7 / 9, "bound_ratio": 0.7}},
            "checkpoint": {**ok, "results": {"megabytes": 20.0, "rows": [
                {"label": "torch.save (plain tensors)", "seconds": 0.5}]}},
            "launch": {**ok, "results": {"nproc": 2, "runs_s": {},
                                         "median_s": {"shardwise.launch": 1.0,
                                                      "torchrun": 3.0}}},
            "rank_threads": {**ok, "results": {"hidden": 256, "batch": 32, "steps": 3, "rows": [
                {"nproc": 2, "threads_ms": 10.0, "processes_ms": 25.0,
                 "local_tensor_mode_ms": 400.0, "threads_cpu_ms": 8.0, "processes_cpu_ms": 20.0,
                 "local_tensor_mode_cpu_ms": 160.0}],
                "simulated_gpt": {"mesh": "2x4", "devices": 8, "max_loss_diff": 1e-7,
                                  "single_ms": 3.0, "embedded_ms": 30.0,
                                  "ratio_vs_n_single": 1.25, "single_cpu_ms": 2.0,
                                  "embedded_cpu_ms": 20.0, "cpu_ratio_vs_n_single": 1.25}}},
            "optimizer_2": {**ok, "results": {"world_size": 2, "dim": 256, "layers": 4, "rows": [
                {"optimizer": "SGD", "foreach": True, "tensors": 16, "shardwise_ms": 0.9,
                 "plain_ms": 0.6, "ratio_vs_plain": 1.5}], "clip": [
                {"foreach": True, "tensors": 16, "collectives": 1, "kinds": ["all_reduce"],
                 "max_bytes": 4, "shardwise_ms": 0.6, "hand_ms": 0.4, "ratio_vs_hand": 1.5}]}},
            "redistribute_4": {"seconds": 300.0, "returncode": "timeout", "error": "..."},
            "compile_2": {**ok, "results": compiled},
        },
    }


def test_report_tables_targets_and_plot(tmp_path: Path) -> None:
    run_all = _run_all_module()
    results = _fake_results()
    doc = tmp_path / "performance.md"
    run_all.write_docs(results, doc)
    text = doc.read_text()
    for heading in ("## Goals: planning and redistribution", "## Per-op dispatch", "## Planner",
                    "## Redistribution, 2 gloo processes", "## Tensor-parallel training step",
                    "## Overlap", "## Checkpoint", "## Launcher", "## One process, many ranks",
                    "## Compiled tensor-parallel step, 2 gloo processes"):
        assert heading in text, heading
    assert "test cpu" in text and "2026-01-01" in text
    assert "| raw gloo async_op=True | 4.00 | 1.50 | 9.00 | 7.00 | 0.78 |" in text
    assert "(matmul + gather wall), is 0.70" in text
    assert "| 2 | 10.00 | 25.00 | 400.00 | 40.00 |" in text  # LocalTensorMode 40x the threads
    assert "redistribute_4" in text  # the benchmark that did not finish is named
    status = {t: s for t, s, _ in run_all.targets(
        {k: v["results"] for k, v in results["benchmarks"].items() if "results" in v})}
    # add with autograd is 60 / 50 = 1.2x DTensor: a gap; (45 - 30 - 3 * 2) / 3 = 3 us per device
    assert status["Warm dispatch <= DTensor on every op, <= 2 us per extra device"] == "gap"
    assert "1.20x" in text and "3.0 us" in text
    assert status["Plans at the lower bound (named transitions and all 1-D/2-D/3-D pairs)"] == \
        "met"
    assert status["Redistribution <= DTensor and within 1.2x of the raw collective"] == "met"
    # Partial targets: their own table rows and target line, 21 of 25 at the bound a gap
    assert status["Explicit redistribution to Partial targets at the lower bound"] == "gap"
    assert "(2, 2): 21/25 at bound" in text and "| (2, 2) to Partial | 25 | 21 |" in text
    assert status["TP MLP and transformer step <= DTensor in time and peak memory"] == "met"
    # the compiled step is 12 / 10 = 1.2x hand-written: a gap, with its reason
    assert status["Compiled TP step within 1.1x of hand-written"] == "gap"
    assert "worst step 1.20x" in text
    # the whole step compiled, optimizer included: 9 / 10, no recompiles of shardwise's
    assert status["Compiled whole step (optimizer included) <= compiled hand-written, "
                  "no recompiles"] == "met"
    assert "| mlp | 9.00 | 10.00 | 10.00 | 0.90 | 0.90 | 0 / 0 / 1 |" in text
    assert "Load average during the run: 5.0, 6.0, 7.0" in text
    groups = run_all.ratios(results)
    assert math.isclose(dict(groups["dispatch (warm, 1 device)"])["add"], 0.75)
    assert dict(groups["TP training, 2 procs"])["mlp time"] == pytest.approx(10 / 12)
    run_all.plot(results, tmp_path / "summary.png")
    assert (tmp_path / "summary.png").read_bytes()[:4] == b"\x89PNG"


def test_issue_22_targets(tmp_path: Path) -> None:
    """Each target of issue 22 is met, a gap with its numbers and reason, or not measured
    when no benchmark of the run records it."""
    run_all = _run_all_module()
    results = _fake_results()
    bench = {k: v["results"] for k, v in results["benchmarks"].items() if "results" in v}
    found = {t: (s, d) for t, s, d in run_all.targets_22(bench, tmp_path)}
    assert len(found) == 11
    status = {t: s for t, (s, _) in found.items()}
    detail = {t: d for t, (_, d) in found.items()}
    eager = next(t for t in found if t.startswith("Eager TP"))
    # the fake training run has the MLP only, on 2 processes: 1.25x hand-written, a gap
    assert status[eager] == "gap" and "time vs hand 1.25x" in detail[eager]
    assert "llama on 2 proc" in detail[eager] and "mlp on 4 proc" in detail[eager]
    dispatch = next(t for t in found if t.startswith("Warm dispatch"))
    assert status[dispatch] == "gap" and "1.20x" in detail[dispatch]
    assert "cat([a, a], 1) not measured" in detail[dispatch]
    per_device = next(t for t in found if t.startswith("Each extra simulated device"))
    assert status[per_device] == "gap" and "add 3.0 us" in detail[per_device]
    raw = next(t for t in found if t.startswith("Redistribution within 1.2x"))
    assert status[raw] == "met"
    partial = next(t for t in found if t.startswith("Partial -> Replicate"))
    assert status[partial] == "met" and "0.75x" in detail[partial]
    clip = next(t for t in found if t.startswith("clip_grad_norm_"))
    assert status[clip] == "met" and "1 all_reduce" in detail[clip]
    opt = next(t for t in found if t.startswith("Optimizer step"))
    assert status[opt] == "gap" and "SGD foreach=True on 2 proc 1.50x" in detail[opt]
    assert "reason:" in detail[opt]
    threads = next(t for t in found if t.startswith("Ranks as threads"))
    # 400 / 10 = 40x LocalTensorMode at N=2, but N=4 and 8 were not measured
    assert status[threads] == "gap" and "N=2 40.00x (CPU 20.00x)" in detail[threads]
    assert "N=[4, 8] not measured" in detail[threads]
    gpt = next(t for t in found if t.startswith("Demo GPT"))
    assert status[gpt] == "met" and "1.25x" in detail[gpt]
    compiled = next(t for t in found if t.startswith("Compiled TP and FSDP"))
    assert status[compiled] == "gap" and "an FSDP x TP model" in detail[compiled]
    gpu = next(t for t in found if t.startswith("bench/gpu_check.sh"))
    assert status[gpu] == "not measured"
    (tmp_path / "machine.json").write_text(json.dumps(
        {"date": "2026-01-01 00:00 UTC", "gpu": "H100", "seconds": 200}))
    assert ("met", "200 s on H100, 2026-01-01 00:00 UTC") in [
        (s, d) for t, s, d in run_all.targets_22(bench, tmp_path) if t == gpu]
    # nothing measured: every target says so
    assert {s for _, s, _ in run_all.targets_22({}, tmp_path / "none")} == {"not measured"}
    doc = tmp_path / "performance.md"
    run_all.write_docs(results, doc)
    text = doc.read_text()
    assert "## Goals: training steps, dispatch, redistribution, optimizer, rank threads" in text
    assert "## Optimizer step, 2 processes" in text
    assert "| foreach=True | 1 all_reduce | 4 | 0.60 | 0.40 | 1.50 |" in text
    assert "| CPU | 2.00 | 20.00 | 1.25 |" in text


def test_compiled_fsdp_tp_and_a_kind_that_failed_to_compile(tmp_path: Path) -> None:
    """bench_compile's FSDP x TP rows reach issue 22's compiled target; a kind recorded as
    failed to compile (an error instead of timings, its ratios None) is named, not a crash."""
    run_all = _run_all_module()
    results = _fake_results()
    compiled = results["benchmarks"]["compile_2"]["results"]
    mlp = compiled["models"]["mlp"]
    compiled["fsdp_tp_mesh"] = [2, 1]
    compiled["models"]["mlp_fsdp_tp"] = {
        **mlp, "torch_dt": {"error": "Unsupported: x"}, "ratio_step_vs_torch_dt": None,
        "ratio_fwd_bwd_vs_torch_dt": None,
        "full": {**mlp["full"], "torch_dt": {"error": "Unsupported: x"},
                 "ratio_step_vs_torch_dt": None}}
    bench = {k: v["results"] for k, v in results["benchmarks"].items() if "results" in v}
    found = {t: (s, d) for t, s, d in run_all.targets_22(bench, tmp_path)}
    target = next(t for t in found if t.startswith("Compiled TP and FSDP"))
    status, detail = found[target]
    # 9 / 10 on both models, no recompiles: only the 1-process run is missing
    assert status == "gap" and "mlp_fsdp_tp 2 proc 0.90x" in detail
    assert "an FSDP x TP model" not in detail and "not measured: 1 proc" in detail
    # torch's failure costs no row of shardwise vs hand; shardwise's own does
    compiled["models"]["mlp_fsdp_tp"]["full"]["shardwise"] = {"error": "Unsupported: y"}
    compiled["models"]["mlp_fsdp_tp"]["full"]["ratio_step_vs_hand"] = None
    found = {t: (s, d) for t, s, d in run_all.targets_22(bench, tmp_path)}
    assert "mlp_fsdp_tp 2 proc (shardwise failed to compile)" in found[target][1]
    assert "an FSDP x TP model" in found[target][1]
    doc = tmp_path / "performance.md"
    run_all.write_docs(results, doc)
    text = doc.read_text()
    assert "| mlp_fsdp_tp | 12.00 | 10.00 | - | 1.20 | - |" in text  # the fwd variant's row
    assert "| mlp_fsdp_tp | - | 10.00 | - | - | - | failed / 0 / failed |" in text
