"""Run PyTorch's own DTensor test files on torch and through shardwise's drop-in switch.

    python tools/run_torch_tests.py PYTORCH_DIR [FILE ...] [--timeout S] [--file-timeout S]
        [--results results.json] [--modes torch,shardwise]

PYTORCH_DIR is a PyTorch checkout (or a scratch copy of its ``test/`` files; this repository holds
none of PyTorch's code). FILEs are paths under it (default: the DTensor, tensor-parallel and FSDP2
files in DEFAULT_FILES that exist there). Each file runs in a fresh pytest process per mode
(the switch is global to a process), one file at a time, with torch's harness (rank processes
forked, see tools/torch_tests_plugin.py), a per-test timeout (pytest-timeout) and a per-file one.
Prints, per file: tests, passed on torch, passed through shardwise, and the tests that differ.
``--results`` keeps each (file, mode) outcome so that a later call reruns only what it names.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_FILES = [
    "test/distributed/tensor/parallel/test_tp_style.py",
    "test/distributed/tensor/parallel/test_parallelize_api.py",
    "test/distributed/tensor/parallel/test_tp_examples.py",
    "test/distributed/tensor/parallel/test_tp_random_state.py",
    "test/distributed/tensor/test_dtensor.py",
    "test/distributed/tensor/test_redistribute.py",
    "test/distributed/tensor/test_api.py",
    "test/distributed/tensor/test_init.py",
    "test/distributed/tensor/test_math_ops.py",
    "test/distributed/tensor/test_pointwise_ops.py",
    "test/distributed/tensor/test_view_ops.py",
    "test/distributed/tensor/test_tensor_ops.py",
    "test/distributed/tensor/test_matrix_ops.py",
    "test/distributed/tensor/test_embedding_ops.py",
    "test/distributed/tensor/test_random_ops.py",
    "test/distributed/tensor/test_experimental_ops.py",
    "test/distributed/tensor/test_utils.py",
    "test/distributed/test_device_mesh.py",
    "test/distributed/_composable/fsdp/test_fully_shard_training.py",
    "test/distributed/_composable/fsdp/test_fully_shard_init.py",
    "test/distributed/_composable/fsdp/test_fully_shard_comm.py",
]
MODES = ("torch", "shardwise")  # and "implicit": the switch with implicit redistribution on
# `pytest -v` prints one line per test as it ends: kept even when the file's run is cut off
RESULT_LINE = re.compile(r"^(\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")


# spawned rank processes (torch's MultiProcContinuousTest) turn the switch on at startup too
SITECUSTOMIZE = """import os
if os.environ.get("SHARDWISE_AS_TORCH") == "1":
    import shardwise  # noqa: F401  (the variable turns the switch on at import)
"""


# torch's MultiProcContinuousTest skips the rest of a class after a failure: those run again
SKIPPED_REST = "skipping rest of tests in Test class"


def run_file(path: Path, mode: str, timeout: int, file_timeout: int, log: Path | None) -> dict:
    """pytest over ``path`` (again over the tests a failure made the harness skip, until none
    is left); returns {test: outcome} and how the run ended."""
    start, tests, ended, out, pending = time.monotonic(), {}, "", "", [path.name]
    with tempfile.TemporaryDirectory() as site:
        (Path(site) / "sitecustomize.py").write_text(SITECUSTOMIZE)
        while pending:
            left = file_timeout - (time.monotonic() - start)
            text, ended = _pytest(path, pending, mode, timeout, max(1, int(left)), site)
            out += text
            ran = _outcomes(text)
            tests.update(ran)
            skipped = [f"{path.name}::{t}" for t, o in ran.items() if o == "SKIPPED"]
            pending = skipped if SKIPPED_REST in text and len(skipped) < len(ran) else []
    if log:
        log.write_text(out)
    tail = "\n".join(out.splitlines()[-15:]) if not tests else ""
    return {
        "tests": tests,
        "ended": ended,
        "seconds": round(time.monotonic() - start),
        "tail": tail,
    }


def _outcomes(text: str) -> dict[str, str]:
    tests = {}
    for line in text.splitlines():
        match = RESULT_LINE.match(line)
        if match:
            tests[match.group(1).split("::", 1)[1]] = match.group(2)
    return tests


def _pytest(
    path: Path, targets: list[str], mode: str, timeout: int, file_timeout: int, site: str
) -> tuple[str, str]:
    """One pytest process over ``targets`` (the file, or test ids in it): output, how it ended."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            [site, str(ROOT / "src"), str(ROOT / "tools"), os.environ.get("PYTHONPATH", "")]
        ),
        "SHARDWISE_AS_TORCH": "0" if mode == "torch" else "1",
        # "implicit": through the switch with PyTorch's implicit redistribution allowed
        "SHARDWISE_IMPLICIT_REDISTRIBUTE": "1" if mode == "implicit" else "0",
        "SHARDWISE_TT_FORK": "1",
        "PYTHONUNBUFFERED": "1",
    }
    plugins = ["-p", "torch_tests_plugin", "-p", "no:cacheprovider", "-p", "no:randomly"]
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        *targets,
        "-v",
        *plugins,
        f"--timeout={timeout}",
        "--rootdir",
        str(path.parent),
    ]
    # a session of its own: past the file's timeout its rank processes go with it
    with subprocess.Popen(
        cmd, cwd=path.parent, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, start_new_session=True,
    ) as proc:
        try:
            out, _ = proc.communicate(timeout=file_timeout)
            return out, f"rc={proc.returncode}"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            return out, f"file timeout {file_timeout}s"


def _passed(run: dict) -> set[str]:
    return {t for t, o in run.get("tests", {}).items() if o == "PASSED"}


def summary(name: str, runs: dict) -> tuple[str, list[str]]:
    """A table row and the differing tests of one file."""
    torch_run, sw_run = runs.get("torch", {}), runs.get("shardwise", {})
    implicit_run = runs.get("implicit")
    on_torch, on_sw = _passed(torch_run), _passed(sw_run)
    total = len(set(torch_run.get("tests", {})) | set(sw_run.get("tests", {})))
    lost, gained = sorted(on_torch - on_sw), sorted(on_sw - on_torch)
    implicit = len(_passed(implicit_run) & on_torch) if implicit_run else "-"
    row = (
        f"| {name} | {total} | {len(on_torch)} | {len(on_sw & on_torch)} | {implicit} "
        f"| {torch_run.get('ended', '-')}, {torch_run.get('seconds', '-')}s "
        f"| {sw_run.get('ended', '-')}, {sw_run.get('seconds', '-')}s |"
    )
    lines = [
        f"  {name}: passes on torch, not through shardwise: {t} "
        f"({sw_run.get('tests', {}).get(t, 'not run')}"
        + (f"; implicit: {implicit_run['tests'].get(t, 'not run')})" if implicit_run else ")")
        for t in lost
    ]
    lines += [f"  {name}: passes through shardwise only: {t}" for t in gained]
    return row, lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("pytorch_dir", type=Path)
    parser.add_argument("files", nargs="*")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per test")
    parser.add_argument("--file-timeout", type=int, default=3600, help="seconds per file run")
    parser.add_argument("--results", type=Path, help="JSON file of outcomes, read and updated")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--logs", type=Path, help="folder for each run's pytest output")
    parser.add_argument("--report", action="store_true", help="print the table from --results")
    args = parser.parse_args(argv)
    results = json.loads(args.results.read_text()) if args.results and args.results.exists() else {}
    files = args.files or [f for f in DEFAULT_FILES if (args.pytorch_dir / f).exists()]
    if not args.report:
        for name in files:
            for mode in args.modes.split(","):
                log = args.logs / f"{Path(name).stem}.{mode}.log" if args.logs else None
                run = run_file(args.pytorch_dir / name, mode, args.timeout, args.file_timeout, log)
                results.setdefault(name, {})[mode] = run
                passed = sum(o == "PASSED" for o in run["tests"].values())
                print(
                    f"{name} [{mode}]: {passed}/{len(run['tests'])} passed, {run['ended']}, "
                    f"{run['seconds']}s",
                    flush=True,
                )
                if run["tail"]:
                    print(run["tail"], flush=True)
                if args.results:
                    args.results.write_text(json.dumps(results, indent=1, sort_keys=True))
    print(
        "| file | tests | pass on torch | of those, pass through shardwise | of those, "
        "with implicit moves | torch run | shardwise run |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    details = []
    for name in files if args.files else sorted(results):
        row, lines = summary(name, results.get(name, {}))
        print(row)
        details += lines
    print("\n".join(details))
    return 0


if __name__ == "__main__":
    sys.exit(main())
