"""Run per-rank PyTorch programs as written for torch.distributed.tensor and ported to shardwise.

``python tests/pytorch_programs/harness.py PROGRAM NPROC [--same-seed] [--threads]
[--examples DIR]`` runs one program under ``python -m shardwise.launch --nproc NPROC`` twice: as
written, on ``torch.distributed.tensor``, then ``port.py``'s shardwise version (with
``--threads``: as NPROC rank threads of one process), and prints both runs' losses (every rank,
every step) and how the final parameters and gradients compare. ``record.py`` runs each rank
and reports its losses and final parameters.

The programs (``OURS``) are this folder's own: ``tensor_parallel.py`` (a TP MLP),
``sequence_parallel.py`` (a sequence-parallel MLP block) and ``fsdp_tp.py`` (FSDP2 x TP on
``tiny_llama.py``), written against torch's public API as a PyTorch user would, on CPU. The
torch run of fsdp_tp also needs its ``oracle_env`` (torch has no DTensor rule for the CPU
attention kernel).

``--examples DIR`` runs PyTorch's own examples instead (``examples(DIR)``): DIR is a checkout of
pytorch/examples' ``distributed/tensor_parallelism`` (never committed here: fetch it into a
scratch folder). PROGRAM is then ``tensor_parallel_example``, ``sequence_parallel_example`` or
``fsdp_tp_example``. Both runs get the same CPU substitution (``EXAMPLES_CPU``), the only lines
changed beyond the imports: the examples pick ``torch.accelerator.current_accelerator().type``
as device type and exit unless ``log_utils.verify_min_gpu_count`` finds GPUs; here they run on
CPU over gloo (and fsdp_tp_example for 4 of its 10 iterations: its 32000-word vocabulary makes
each step slow).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
SRC = HERE.parents[1] / "src"

# torch.distributed.tensor has no sharding strategy for the CPU attention kernel
# (aten._scaled_dot_product_flash_attention_for_cpu): the torch run takes SDPA's math backend,
# whose causal mask is a plain tensor added to DTensors, so it also needs implicit replication
# (record.py reads these; the shardwise run keeps the default kernel and its own rules)
_TORCH_ATTENTION = {"PROGRAM_SDPA": "math", "PROGRAM_IMPLICIT_REPLICATION": "1"}


@dataclass(frozen=True)
class Programs:
    """A folder of per-rank programs and what running them here takes."""

    folder: Path
    steps: dict[str, int]  # program -> the loss steps each rank takes
    helpers: tuple[str, ...] = ()  # modules of the folder the programs import
    cpu: dict[str, dict[str, str]] = field(default_factory=dict)  # file -> {line: new line}
    oracle_env: dict[str, dict[str, str]] = field(default_factory=dict)  # torch's run only


OURS = Programs(
    HERE,
    {"tensor_parallel": 10, "sequence_parallel": 10, "fsdp_tp": 4},
    helpers=("tiny_llama.py",),
    oracle_env={"fsdp_tp": _TORCH_ATTENTION},
)

_DEVICE = "device_type = torch.accelerator.current_accelerator().type"
EXAMPLES_CPU: dict[str, dict[str, str]] = {
    "tensor_parallel_example.py": {_DEVICE: 'device_type = "cpu"'},
    "sequence_parallel_example.py": {_DEVICE: 'device_type = "cpu"'},
    "fsdp_tp_example.py": {
        _DEVICE: 'device_type = "cpu"', "num_iterations = 10": "num_iterations = 4"
    },
    "log_utils.py": {"    return has_gpu and gpu_count >= min_gpus": "    return True"},
}


def examples(folder: Path) -> Programs:
    """pytorch/examples' ``distributed/tensor_parallelism`` checked out at ``folder``."""
    return Programs(
        Path(folder).resolve(),
        {"tensor_parallel_example": 10, "sequence_parallel_example": 10, "fsdp_tp_example": 4},
        helpers=("log_utils.py", "llama2_model.py"),
        cpu=EXAMPLES_CPU,
        oracle_env={"fsdp_tp_example": _TORCH_ATTENTION},
    )


@dataclass
class Run:
    variant: str
    returncode: int
    output: str
    losses: dict[int, list[float]] = field(default_factory=dict)  # rank -> per-step loss
    record: Path | None = None  # final parameters and gradients (rank 0 writes them)


def on_cpu(name: str, source: str, programs: Programs = OURS) -> str:
    """The CPU substitution: each line in ``programs.cpu[name]`` replaced, each found once."""
    lines = source.splitlines(keepends=True)
    for old, new in programs.cpu.get(name, {}).items():
        hits = [i for i, line in enumerate(lines) if line.rstrip("\n") == old]
        if len(hits) != 1:
            raise ValueError(f"{name}: expected the line {old!r} once, found it {len(hits)} times")
        lines[hits[0]] = new + "\n"
    return "".join(lines)


def prepare(program: str, variant: str, dest: Path, programs: Programs = OURS) -> tuple[Path, int]:
    """Write ``program`` of ``programs`` and its helpers into ``dest`` for ``variant`` ("torch"
    or "shardwise"); return the program's path and the lines changed beyond imports by the port
    (0 for torch)."""
    sys.path.insert(0, str(HERE))
    try:
        from port import port
    finally:
        sys.path.remove(str(HERE))
    dest.mkdir(parents=True, exist_ok=True)
    beyond_imports = 0
    for name in (f"{program}.py", *programs.helpers):
        source = on_cpu(name, (programs.folder / name).read_text(), programs)
        if variant == "shardwise":
            ported = port(source)
            source = ported.source
            beyond_imports += ported.other_lines_changed
        (dest / name).write_text(source)
    return dest / f"{program}.py", beyond_imports


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def program_env(
    program: str, variant: str, record: Path, same_seed: bool, programs: Programs = OURS
) -> dict[str, str]:
    """The environment record.py runs ``variant`` of ``program`` in (this one, adjusted)."""
    env = dict(os.environ, PROGRAM_RECORD=str(record))
    env["PROGRAM_SEED"] = "same" if same_seed else "per-rank"
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), env.get("PYTHONPATH", "")])
    for name in ("SHARDWISE_IMPLICIT_REDISTRIBUTE", "PROGRAM_SDPA", "PROGRAM_IMPLICIT_REPLICATION"):
        env.pop(name, None)
    if variant == "torch":
        env.update(programs.oracle_env.get(program, {}))
    return env


def run(
    program: str, variant: str, nproc: int, workdir: Path, timeout: float = 600,
    same_seed: bool = False, threads: bool = False, programs: Programs = OURS,
) -> Run:
    """Run one variant of ``program`` under the launcher; parse its per-rank losses.
    ``same_seed``: every rank starts from the same seed (record.py), not its own;
    ``threads``: the ranks are threads of one process (``shardwise.launch --threads``)."""
    path, _ = prepare(program, variant, workdir / variant, programs)
    record = workdir / f"{variant}.pt"
    env = program_env(program, variant, record, same_seed, programs)
    env["PROGRAM_PATH"] = str(path)  # rank threads share sys.argv: record.py reads this
    command = [sys.executable, "-m", "shardwise.launch", "--nproc", str(nproc),
               *(["--threads"] if threads else []), str(HERE / "record.py"), str(path)]
    proc = subprocess.Popen(command, cwd=path.parent, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        output, _ = proc.communicate()
        output += f"\nharness: killed after {timeout} s"
    return Run(variant, proc.returncode, output, parse_losses(output),
               record if record.exists() else None)


def parse_losses(output: str) -> dict[int, list[float]]:
    """Every rank's per-step losses from record.py's ``RANK <rank> LOSS <step> <value>``
    lines (the launcher may put a prefix before them)."""
    out: dict[int, list[float]] = {}
    for line in output.splitlines():
        _, _, rest = line.partition("RANK ")
        fields = rest.split()
        if len(fields) == 4 and fields[1] == "LOSS":
            rank, step, value = int(fields[0]), fields[2], fields[3]
            losses = out.setdefault(rank, [])
            if int(step) != len(losses):
                raise ValueError(f"rank {rank}: loss of step {step} after {len(losses)} steps")
            losses.append(float(value))
    return out


def largest_difference(a: Path, b: Path) -> dict[str, float]:
    """Largest relative difference of the recorded parameters and of the gradients."""
    ra, rb = torch.load(a), torch.load(b)
    out = {}
    for key in ("params", "grads"):
        if len(ra[key]) != len(rb[key]):
            raise ValueError(f"{key}: {len(ra[key])} tensors against {len(rb[key])}")
        worst = 0.0
        for x, y in zip(ra[key], rb[key], strict=True):
            if (x is None) != (y is None):
                return {**out, key: float("inf")}
            if x is None:
                continue
            if x.shape != y.shape:
                raise ValueError(f"{key}: shapes {tuple(x.shape)} and {tuple(y.shape)}")
            scale = x.abs().max().clamp_min(1e-12)
            worst = max(worst, ((x - y).abs().max() / scale).item())
        out[key] = worst
    return out


def main(argv: list[str]) -> int:
    import argparse
    import tempfile

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("program")
    parser.add_argument("nproc", type=int)
    parser.add_argument("--same-seed", action="store_true")
    parser.add_argument("--threads", action="store_true")
    parser.add_argument("--examples", type=Path, metavar="DIR",
                        help="a checkout of pytorch/examples' distributed/tensor_parallelism")
    args = parser.parse_args(argv)
    programs = OURS if args.examples is None else examples(args.examples)
    if args.program not in programs.steps:
        parser.error(f"PROGRAM must be one of {', '.join(programs.steps)}")
    program, nproc = args.program, args.nproc
    with tempfile.TemporaryDirectory() as tmp:  # torch's run in processes, shardwise's as asked
        runs = [run(program, "torch", nproc, Path(tmp), same_seed=args.same_seed,
                    programs=programs),
                run(program, "shardwise", nproc, Path(tmp), same_seed=args.same_seed,
                    threads=args.threads, programs=programs)]
        _, beyond = prepare(program, "shardwise", Path(tmp) / "count", programs)
        print(f"{program} --nproc {nproc}: port changed {beyond} lines beyond imports")
        for r in runs:
            print(f"{r.variant}: exit {r.returncode}")
            for rank, losses in sorted(r.losses.items()):
                print(f"  rank {rank}: " + " ".join(f"{v:.7g}" for v in losses))
            if r.returncode:
                print("\n".join("    " + ln for ln in r.output.splitlines()[-30:]))
        if all(r.returncode == 0 and r.record for r in runs):
            print("final largest relative difference:",
                  largest_difference(runs[0].record, runs[1].record))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
